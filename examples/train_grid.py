"""A pp x dp grid: the GPT example's stages in separate processes, its pipelines replicated.

Run: torchrun --nproc_per_node=4 examples/train_grid.py [--pp 2] [--steps 60]

The processes form a ``DeviceMesh`` of dp x pp: each row is one pipeline
(a ``DistributedPipe`` over the mesh's "pp" group, one stage per process),
each column holds the replicas of one stage (``DataParallel`` over the
"dp" group averages their gradients as soon as the stage's last backward
ends). The model is built on the ``meta`` device, balanced by parameter
size, and each process materialises only its own stage. The token
embedding is tied to the head in the last stage: its gradients are summed
over the two stages, so the copies stay equal. Every replica trains on its
own windows of the text; at the end the script checks that the replicas of
every stage hold identical weights, as do the two copies of the tied
embedding, and that the loss has fallen.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time

import torch
import torch.distributed as dist
from gpt import Corpus, add_model_arguments, build_model, language_model_loss, load_text
from torch.distributed.device_mesh import init_device_mesh
from train_dp import max_difference_from_rank0

from balance import balance_by_params
from pipeline import DataParallel
from pipeline.distributed import DistributedPipe, init_process_group_from_env


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pp", type=int, default=2, help="stages per pipeline")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=16, help="sequences per replica per step")
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b", "zb-h1"])
    add_model_arguments(parser, context=32)
    parser.add_argument("--log-every", type=int, default=10)
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    env = init_process_group_from_env()
    if env.world_size % args.pp:
        raise SystemExit(f"{env.world_size} processes do not split into pipelines of {args.pp}")
    dp = env.world_size // args.pp
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    mesh = init_device_mesh(device_type, (dp, args.pp), mesh_dim_names=("dp", "pp"))
    replica = mesh.get_local_rank("dp")

    corpus = Corpus(load_text(), args.context, seed=replica)
    with torch.device("meta"):
        model = build_model(len(corpus.chars), args)
    balance = balance_by_params(args.pp, model)
    torch.manual_seed(0)
    pipe = DistributedPipe(
        model,
        balance,
        group=mesh.get_group("pp"),
        chunks=args.chunks,
        checkpoint=args.checkpoint,
    )
    trainer = DataParallel(pipe, process_group=mesh.get_group("dp"))
    optimizer = torch.optim.AdamW(trainer.parameters(), lr=args.lr)
    if env.rank == 0:
        print(
            f"GPT: {args.layers} blocks of width {args.width}; {dp} replicas x {args.pp} stages, "
            f"balance {balance} (balance_by_params, on meta); chunks {args.chunks}; "
            f"schedule {args.schedule}",
            flush=True,
        )

    losses: list[float] = []
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        x, y = corpus.batch(args.batch)
        optimizer.zero_grad(set_to_none=True)
        loss = trainer.step(x, y, language_model_loss, schedule=args.schedule)
        optimizer.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=mesh.get_group("dp"))
        losses.append(float(mean) / dp)
        if env.rank == 0 and (step % args.log_every == 0 or step == args.steps):
            rate = step * args.batch * dp * args.context / (time.perf_counter() - start)
            print(f"step {step:4d}/{args.steps}  loss {losses[-1]:.4f}  {rate:,.0f} tokens/s")

    replicas_apart = max_difference_from_rank0(pipe, mesh.get_group("dp"))
    tied_apart = embedding_copies_apart(pipe, (len(corpus.chars), args.width))
    window = max(len(losses) // 10, 1)
    first, last = sum(losses[:window]) / window, sum(losses[-window:]) / window
    if env.rank == 0:
        print(f"max weight difference between replicas: {replicas_apart:.3g}")
        print(f"max difference between the tied embedding's copies: {tied_apart:.3g}")
        print(f"loss {'fell' if last < first else 'did NOT fall'} from {first:.3f} to {last:.3f}")
    pipe.close()
    # Drop what holds the process groups first (see train_dp.py).
    del trainer, optimizer, pipe, mesh
    gc.collect()
    dist.destroy_process_group()
    return 0 if replicas_apart == 0.0 and tied_apart == 0.0 and last < first else 1


def embedding_copies_apart(pipe: DistributedPipe, shape: tuple[int, int]) -> float:
    """The largest difference, over every pipeline, between stage 0's token embedding and the
    head's copy in the last stage."""
    first, last = 0, len(pipe.balance) - 1
    reference = torch.zeros(shape, device=pipe.device)
    if first in pipe.local_stages:
        reference.copy_(pipe.partitions[first][0].token.weight.detach())
    dist.broadcast(reference, group=pipe.group, group_src=pipe.owner[first])
    apart = torch.zeros((), device=pipe.device)
    if last in pipe.local_stages:
        apart = (pipe.partitions[last][-1].embedding.weight.detach() - reference).abs().max()
    dist.all_reduce(apart, op=dist.ReduceOp.MAX)
    return float(apart)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
