"""Benchmark: stages in two processes, DistributedPipe against torch.distributed.pipelining.

Two processes on gloo (``torchrun --nproc_per_node=2``), one intra-op thread
each, share one model: 8 blocks of Linear(1024, 1024) + ReLU, cut 4 + 4,
``--chunks`` micro-batches of ``--rows`` rows, MSE loss. One training step
(forward, loss, backward) is timed as:

- the plain model on the same micro-batches one after another, in process 0
  (the baseline of the speedups);
- the single-process ``Pipe.step`` (``gpipe``, ``1f1b``) over two CPU
  partitions on two threads, in process 0;
- ``DistributedPipe.step`` with ``gpipe``, ``1f1b`` and ``zb-h1``;
- torch's ``PipelineStage`` with ``ScheduleGPipe`` and ``Schedule1F1B``;

every candidate once per round, in turn, keeping its best time (a step of
two processes takes as long as the slower one). The pipelines run without
checkpointing (torch's schedules have none); ``DistributedPipe`` with
``except_last`` is reported beside them. Before timing, each pipeline's
gradients are checked against the plain model's. The last line is JSON.

Run: torchrun --nproc_per_node=2 examples/benchmarks/stage_processes.py [--chunks 8]
"""

from __future__ import annotations

import argparse
import gc
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from pipe_common import machine, print_json
from torch import Tensor, nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from pipeline import Pipe
from pipeline.distributed import DistributedPipe, init_process_group_from_env

Step = Callable[[], object]
MODES = ("never", "except_last")


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(8):
        layers += [nn.Linear(1024, 1024), nn.ReLU()]
    return nn.Sequential(*layers)


def plain_step(model: nn.Sequential, x: Tensor, y: Tensor, m: int) -> Step:
    """The plain model on the m micro-batches in turn, gradients of the batch's mean loss."""

    def run() -> None:
        model.zero_grad(set_to_none=True)
        for xi, yi in zip(x.chunk(m), y.chunk(m), strict=True):
            (F.mse_loss(model(xi), yi) / m).backward()

    return run


def ours(model: nn.Module, x: Tensor, y: Tensor, schedule: str) -> Step:
    def run() -> None:
        model.zero_grad(set_to_none=True)
        model.step(x, y, F.mse_loss, schedule=schedule)  # type: ignore[operator]

    return run


def torchs(stage: PipelineStage, module: nn.Module, schedule: Any, x: Tensor, y: Tensor) -> Step:
    rank, last = dist.get_rank(), dist.get_world_size() - 1

    def run() -> None:
        module.zero_grad(set_to_none=True)
        if rank == 0:
            schedule.step(x)
        elif rank == last:
            schedule.step(target=y, losses=[])
        else:
            schedule.step()

    return run


def local_part(model: nn.Sequential) -> nn.Sequential:
    """This process's half of ``model``, under the whole model's names, for torch's stage."""
    half = len(model) // 2
    rank = dist.get_rank()
    return model[half * rank : half * (rank + 1)]


def max_grad_difference(module: nn.Module, plain: nn.Sequential) -> float:
    """Largest difference of ``module``'s gradients from the plain model's, over every rank.

    Every candidate names its parameters as the whole model does.
    """
    reference = dict(plain.named_parameters())
    worst = torch.zeros(())
    for name, param in module.named_parameters():
        expected = reference[name].grad
        assert param.grad is not None and expected is not None, name
        worst = torch.maximum(worst, (param.grad - expected).abs().max())
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return float(worst)


def timed(candidates: dict[str, tuple[Step, bool]], rounds: int) -> dict[str, float]:
    """Best seconds per step of each candidate; ``(step, everywhere)``: False runs on rank 0.

    The order turns by one each round (the same on every rank), so that no
    candidate always follows the same neighbour.
    """
    names = list(candidates)
    best = dict.fromkeys(names, float("inf"))
    for round_ in range(rounds + 1):  # round 0 warms up
        for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
            step, everywhere = candidates[name]
            dist.barrier()
            start = time.perf_counter()
            if everywhere or dist.get_rank() == 0:
                step()
            took = torch.tensor(time.perf_counter() - start)
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            if round_:
                best[name] = min(best[name], float(took))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--rows", type=int, default=64, help="rows per micro-batch")
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    env = init_process_group_from_env("gloo")
    if env.world_size != 2:
        raise SystemExit("run it with torchrun --nproc_per_node=2")
    torch.set_num_threads(1)
    m = args.chunks
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(args.rows * m, 1024, generator=gen)
    y = torch.randn(args.rows * m, 1024, generator=gen)
    if env.rank == 0:
        print(f"machine: {machine()}")

    plain = mlp()
    plain_step(plain, x, y, m)()
    candidates: dict[str, tuple[Step, bool]] = {
        "plain micro-batches": (plain_step(mlp(), x, y, m), False)
    }
    checked: dict[str, nn.Module] = {}
    local = Pipe(mlp(), [8, 8], devices=["cpu", "cpu"], chunks=m, checkpoint="never")
    for schedule in ("gpipe", "1f1b"):
        candidates[f"Pipe.step {schedule} (threads)"] = (ours(local, x, y, schedule), False)
    pipes = [DistributedPipe(mlp(), [8, 8], chunks=m, checkpoint=mode) for mode in MODES]
    for pipe, mode in zip(pipes, MODES, strict=True):
        for schedule in ("gpipe", "1f1b", "zb-h1") if mode == "never" else ("1f1b",):
            name = f"DistributedPipe {schedule}" + ("" if mode == "never" else f" {mode}")
            candidates[name] = (ours(pipe, x, y, schedule), True)
            checked[name] = pipe
    for label, kind in (("ScheduleGPipe", ScheduleGPipe), ("Schedule1F1B", Schedule1F1B)):
        part = local_part(mlp())
        stage = PipelineStage(part, env.rank, env.world_size, torch.device("cpu"))
        schedule = kind(stage, n_microbatches=m, loss_fn=F.mse_loss)
        candidates[f"torch {label}"] = (torchs(stage, part, schedule, x, y), True)
        checked[f"torch {label}"] = part

    differences = {}
    for name, module in checked.items():
        candidates[name][0]()
        differences[name] = max_grad_difference(module, plain)
    if env.rank == 0:
        for schedule in ("gpipe", "1f1b"):
            ours(local, x, y, schedule)()
            worst = max((a.grad - b.grad).abs().max().item() for a, b in
                        zip(local.parameters(), plain.parameters(), strict=True))  # fmt: skip
            differences[f"Pipe.step {schedule} (threads)"] = worst
    best = timed(candidates, args.rounds)
    baseline = best["plain micro-batches"]
    result: dict[str, Any] = {
        "benchmark": "stage_processes",
        "chunks": m,
        "rows": args.rows,
        "ms": {k: round(v * 1e3, 2) for k, v in best.items()},
        "speedup_vs_plain": {k: round(baseline / v, 3) for k, v in best.items()},
        "max_grad_difference_from_plain": differences,
        "torch_over_ours": {
            schedule: round(best[f"torch {label}"] / best[f"DistributedPipe {schedule}"], 3)
            for schedule, label in (("gpipe", "ScheduleGPipe"), ("1f1b", "Schedule1F1B"))
        },
    }
    if env.rank == 0:
        print(f"{m} micro-batches of {args.rows} rows, 2 stage processes (gloo), 1 thread each")
        for name, seconds in best.items():
            difference = differences.get(name)
            checked_line = "" if difference is None else f"  grads within {difference:.1e}"
            print(
                f"  {name:34s} {seconds * 1e3:8.1f} ms  {baseline / seconds:5.2f}x plain"
                + checked_line
            )
        for schedule, ratio in result["torch_over_ours"].items():
            print(f"  {schedule}: torch's step takes {ratio:.3f}x DistributedPipe's")
        print_json(result)
    for pipe in pipes:
        pipe.close()
    del candidates, pipes, local
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
