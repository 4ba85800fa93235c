"""Benchmark: stages in processes, DistributedPipe against torch.distributed.pipelining.

P processes on gloo (``torchrun --nproc_per_node=P``, P = 2 or 4), one
intra-op thread each, share one model: 8 blocks of Linear(W, W) + ReLU
(W = ``--width``, 1024 by default), cut in P equal stages, micro-batches of
``--rows`` rows, MSE loss. For each m of ``--chunks``, one training step
(forward, loss, backward) is timed, both libraries in the same processes:

- the plain model on the same micro-batches one after another, in process 0
  (the baseline of the speedups);
- the single-process ``Pipe.step`` (``gpipe``, ``1f1b``) over P CPU
  partitions, in process 0, with ``threads="device"`` (one thread) and
  ``threads="partition"`` (a thread each);
- ``DistributedPipe.step`` with ``gpipe``, ``1f1b``, ``zb-h1`` and
  ``ZeroBubbleH1(memory="peak")`` (every stage at 1F1B's peak, as torch's
  zero-bubble schedule holds);
- torch's ``PipelineStage`` with ``ScheduleGPipe``, ``Schedule1F1B`` and, beside
  ``zb-h1``, its zero-bubble ``ScheduleInterleavedZeroBubble`` (one stage per
  process);

every candidate once per round, in turn, the order turning each round (a
step of P processes takes as long as the slowest). The figures are medians
over rounds, and each ratio is the median of the rounds' ratios. The
pipelines run without checkpointing (torch's schedules have none);
``DistributedPipe`` with ``except_last`` is reported beside them. Before
timing, each pipeline's gradients are checked against the plain model's.
Beside each time, the minor page faults of a step (``getrusage``, the most
of any process, median over rounds): memory the allocator gave back and
the step touches again. The default allocator. The last line is JSON.

Run: torchrun --nproc_per_node=2 examples/benchmarks/stage_processes.py [--chunks 4 8 16]
"""

from __future__ import annotations

import argparse
import gc
import resource
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from pipe_common import machine, print_json
from torch import Tensor, nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleavedZeroBubble,
)

from pipeline import Pipe
from pipeline.distributed import DistributedPipe, init_process_group_from_env
from pipeline.schedules import Schedule, ZeroBubbleH1

Step = Callable[[], object]
MODES = ("never", "except_last")
BLOCKS = 8
# (schedule, torch's schedule class): the pairs compared.
PAIRS = (
    ("gpipe", "ScheduleGPipe"),
    ("1f1b", "Schedule1F1B"),
    ("zb-h1", "ScheduleInterleavedZeroBubble"),
)
# DistributedPipe's candidates without checkpointing: label -> schedule.
OURS: dict[str, str | Schedule] = {
    "gpipe": "gpipe",
    "1f1b": "1f1b",
    "zb-h1": "zb-h1",
    "zb-h1 peak": ZeroBubbleH1(memory="peak"),
}
KINDS: dict[str, Any] = {
    "ScheduleGPipe": ScheduleGPipe,
    "Schedule1F1B": Schedule1F1B,
    "ScheduleInterleavedZeroBubble": ScheduleInterleavedZeroBubble,
}


def mlp(width: int, activation: type[nn.Module] = nn.ReLU) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(BLOCKS):
        layers += [nn.Linear(width, width), activation()]
    return nn.Sequential(*layers)


def plain_step(model: nn.Sequential, x: Tensor, y: Tensor, m: int) -> Step:
    """The plain model on the m micro-batches in turn, gradients of the batch's mean loss."""

    def run() -> None:
        model.zero_grad(set_to_none=True)
        for xi, yi in zip(x.chunk(m), y.chunk(m), strict=True):
            (F.mse_loss(model(xi), yi) / m).backward()

    return run


def ours(model: nn.Module, x: Tensor, y: Tensor, schedule: str | Schedule) -> Step:
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
    """This process's stage of ``model``, under the whole model's names, for torch's stage."""
    size = len(model) // dist.get_world_size()
    rank = dist.get_rank()
    return model[size * rank : size * (rank + 1)]


def max_grad_difference(module: nn.Module, plain: nn.Sequential) -> float:
    """Largest difference of ``module``'s gradients from the plain model's (this process).

    Every candidate names its parameters as the whole model does.
    """
    reference = dict(plain.named_parameters())
    worst = torch.zeros(())
    for name, param in module.named_parameters():
        expected = reference[name].grad
        assert param.grad is not None and expected is not None, name
        worst = torch.maximum(worst, (param.grad - expected).abs().max())
    return float(worst)


def timed(
    candidates: dict[str, tuple[Step, bool]], rounds: int
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Seconds per step of each candidate in each round, and its minor page faults (the
    most of any process); ``(step, everywhere)``: False runs on rank 0 only.

    The order turns by one each round (the same on every rank), so that no
    candidate always follows the same neighbour. Round 0 warms up.
    """
    names = list(candidates)
    times: dict[str, list[float]] = {name: [] for name in names}
    faults: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(rounds + 1):
        for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
            step, everywhere = candidates[name]
            dist.barrier()
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            start = time.perf_counter()
            if everywhere or dist.get_rank() == 0:
                step()
            seconds = time.perf_counter() - start
            touched = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
            took = torch.tensor([seconds, float(touched)])
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            if round_:
                times[name].append(float(took[0]))
                faults[name].append(float(took[1]))
    return times, faults


def median_ratio(numerators: list[float], denominators: list[float]) -> float:
    """The median of the rounds' ratios."""
    return round(statistics.median(a / b for a, b in zip(numerators, denominators, strict=True)), 3)


def measure(m: int, args: argparse.Namespace) -> dict[str, Any]:
    """Every candidate at ``m`` micro-batches, built, checked and timed in these processes."""
    world, width = dist.get_world_size(), args.width
    balance = [2 * BLOCKS // world] * world
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(args.rows * m, width, generator=gen)
    y = torch.randn(args.rows * m, width, generator=gen)
    plain = mlp(width)
    plain_step(plain, x, y, m)()
    candidates: dict[str, tuple[Step, bool]] = {
        "plain micro-batches": (plain_step(mlp(width), x, y, m), False)
    }
    checked: dict[str, tuple[nn.Module, bool]] = {}
    locals_ = []
    for threads in ("device", "partition"):
        local = Pipe(mlp(width), balance, devices=["cpu"] * world, chunks=m, checkpoint="never",
                     threads=threads)  # type: ignore[arg-type]  # fmt: skip
        locals_.append(local)
        for schedule, _ in PAIRS:
            name = f"Pipe.step {schedule} (1 process, threads={threads})"
            candidates[name] = (ours(local, x, y, schedule), False)
            checked[name] = (local, False)
    pipes = [DistributedPipe(mlp(width), balance, chunks=m, checkpoint=mode) for mode in MODES]
    for pipe, mode in zip(pipes, MODES, strict=True):
        for label, schedule in OURS.items() if mode == "never" else [("1f1b", "1f1b")]:
            name = f"DistributedPipe {label}" + ("" if mode == "never" else f" {mode}")
            candidates[name] = (ours(pipe, x, y, schedule), True)
            checked[name] = (pipe, True)
    for _, label in PAIRS:
        part = local_part(mlp(width))
        stage = PipelineStage(part, dist.get_rank(), world, torch.device("cpu"))
        # torch's zero-bubble schedule takes a list of this process's stages.
        stages: Any = [stage] if label == "ScheduleInterleavedZeroBubble" else stage
        schedule = KINDS[label](stages, n_microbatches=m, loss_fn=F.mse_loss)
        candidates[f"torch {label}"] = (torchs(stage, part, schedule, x, y), True)
        checked[f"torch {label}"] = (part, True)

    differences = {}
    for name, (module, everywhere) in checked.items():
        worst = torch.zeros(())
        if everywhere or dist.get_rank() == 0:
            candidates[name][0]()
            worst = torch.tensor(max_grad_difference(module, plain))
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        differences[name] = float(worst)
    times, faults = timed(candidates, args.rounds)
    baseline = times["plain micro-batches"]
    result: dict[str, Any] = {
        "chunks": m,
        "ms": {k: round(statistics.median(v) * 1e3, 2) for k, v in times.items()},
        "page_faults": {k: statistics.median(v) for k, v in faults.items()},
        "speedup_vs_plain": {k: median_ratio(baseline, v) for k, v in times.items()},
        "max_grad_difference_from_plain": differences,
        "ours_over_torch_throughput": {
            f"DistributedPipe {schedule}": median_ratio(
                times[f"torch {label}"], times[f"DistributedPipe {schedule}"]
            )
            for schedule, label in PAIRS
        },
    }
    # The zero-bubble program whose later stages hold 1F1B's peak, as torch's does.
    result["ours_over_torch_throughput"]["DistributedPipe zb-h1 peak"] = median_ratio(
        times["torch ScheduleInterleavedZeroBubble"], times["DistributedPipe zb-h1 peak"]
    )
    for threads in ("device", "partition"):
        name = f"Pipe.step 1f1b (1 process, threads={threads})"
        result["ours_over_torch_throughput"][name] = median_ratio(
            times["torch Schedule1F1B"], times[name]
        )
    for pipe in pipes:
        pipe.close()
    for local in locals_:
        local.close()
    del candidates, checked, pipes, locals_
    gc.collect()
    return result


def report(result: dict[str, Any], rows: int, world: int) -> None:
    m = result["chunks"]
    print(f"{m} micro-batches of {rows} rows, {world} stage processes (gloo), 1 thread each")
    for name, ms in result["ms"].items():
        difference = result["max_grad_difference_from_plain"].get(name)
        checked = "" if difference is None else f"  grads within {difference:.1e}"
        speedup = result["speedup_vs_plain"][name]
        faults = result["page_faults"][name]
        print(f"  {name:46s} {ms:8.1f} ms  {speedup:5.2f}x plain  {faults:7.0f} faults{checked}")
    for name, ratio in result["ours_over_torch_throughput"].items():
        print(f"  {name}: {ratio:.3f}x the throughput of torch's")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--chunks", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--rows", type=int, default=64, help="rows per micro-batch")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args(argv)
    env = init_process_group_from_env("gloo")
    if env.world_size not in (2, 4):
        raise SystemExit("run it with torchrun --nproc_per_node=2 (or 4)")
    torch.set_num_threads(1)
    info = machine()
    if env.rank == 0:
        print(f"machine: {info}")
    results = []
    for m in args.chunks:
        results.append(measure(m, args))
        if env.rank == 0:
            report(results[-1], args.rows, env.world_size)
    if env.rank == 0:
        print_json(
            {
                "benchmark": "stage_processes",
                "machine": info,
                "processes": env.world_size,
                "rows": args.rows,
                "width": args.width,
                "rounds": args.rounds,
                "results": results,
            }
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
