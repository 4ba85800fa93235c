"""Data parallelism over pipelines: two replicas of a two-partition Pipe, trained together.

Run: torchrun --nproc_per_node=2 examples/train_dp.py [--steps 300]

Each process builds the same classifier (an MLP), cuts it into a Pipe of two
CPU partitions, and wraps that in pipeline.DataParallel. Every process trains
on its own stream of generated data (labels from a fixed random "teacher"),
and DataParallel averages the gradients, so the replicas take identical steps.
At the end the script checks that all replicas hold identical weights.
"""

from __future__ import annotations

import argparse
import gc
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pipeline import DataParallel, Pipe
from pipeline.distributed import init_process_group_from_env


def build_model(features: int, width: int, classes: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(features, width),
        nn.ReLU(),
        nn.Linear(width, width),
        nn.ReLU(),
        nn.Linear(width, width),
        nn.ReLU(),
        nn.Linear(width, classes),
    )


def make_batch(
    teacher: torch.Tensor, rows: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and the teacher's labels; each rank's generator gives it different data."""
    x = torch.randn(rows, teacher.shape[0], generator=generator)
    return x, (x @ teacher).argmax(dim=1)


def max_difference_from_rank0(model: nn.Module, group: dist.ProcessGroup | None = None) -> float:
    """The largest absolute weight difference between any replica and the first of its group.

    ``group`` holds the replicas of ``model`` (default: every process); the
    result is the largest over every group, on every process.
    """
    worst = torch.zeros((), device=next(model.parameters()).device)
    for param in model.parameters():
        reference = param.detach().clone()
        dist.broadcast(reference, group=group, group_src=0)
        worst = torch.maximum(worst, (param.detach() - reference).abs().max())
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return worst.item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=256, help="rows per replica per step")
    parser.add_argument("--chunks", type=int, default=4, help="micro-batches per step")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args()

    env = init_process_group_from_env()
    features, classes = 32, 8
    teacher = torch.randn(features, classes, generator=torch.Generator().manual_seed(0))
    data = torch.Generator().manual_seed(1 + env.rank)
    # Different initial weights per rank on purpose: DataParallel starts every
    # replica from rank 0's.
    torch.manual_seed(100 + env.rank)
    pipe = Pipe(
        build_model(features, args.width, classes),
        balance=[4, 3],
        devices=["cpu", "cpu"],
        chunks=args.chunks,
    )
    model = DataParallel(pipe)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        x, labels = make_batch(teacher, args.batch, data)
        optimizer.zero_grad()
        logits = model(x)
        loss = F.cross_entropy(logits, labels)
        loss.backward()
        optimizer.step()
        if step % 50 == 0 or step == args.steps:
            stats = torch.stack([loss.detach(), (logits.argmax(1) == labels).float().mean()])
            dist.all_reduce(stats)
            stats /= env.world_size
            rate = step * args.batch * env.world_size / (time.perf_counter() - start)
            if env.rank == 0:
                print(
                    f"step {step:4d}  loss {stats[0]:.4f}  accuracy {stats[1]:.3f}  "
                    f"{rate:,.0f} samples/s over {env.world_size} replicas"
                )

    difference = max_difference_from_rank0(model)
    if env.rank == 0:
        print(f"max weight difference between replicas: {difference:.3g}")
    # Drop everything that holds the process group first, so that destroying
    # it joins gloo's threads now: joined during interpreter shutdown, a
    # thread still releasing a collective's tensors aborts the process.
    del model, optimizer, pipe
    gc.collect()
    dist.destroy_process_group()
    if difference != 0.0:
        raise SystemExit("replicas diverged")


if __name__ == "__main__":
    main()
