"""Benchmark: activation memory per stage process, DistributedPipe against torch pipelining.

The model of ``stage_processes.py`` with GELU (8 x [Linear(W, W), GELU], W
= ``--width``), cut in 2 stages, one per gloo process, batch ``--batch``,
MSE loss, ``checkpoint="never"``; interleaved cuts it in 4 stages, 2 per
process (stage ``s`` on rank ``s % 2``, ours ``Interleaved1F1B(virtual=2)``
beside torch's ``ScheduleInterleaved1F1B``). Each (library, schedule, m) runs in 2
fresh processes of its own, so that nothing of one configuration is in
another's memory. Two figures per rank, for the second step (the first one
warms up; gradients are zeroed in place, so ``.grad`` is there before):

- *saved*: the peak bytes autograd holds saved for backward during the
  step, each storage once (``ActivationMeter``: ``last_step`` with
  ``measure_memory=True`` for ours, the meter around torch's step for
  torch's; ours interleaved too, under one meter around the step, so that
  the rank's two stages are counted together as torch's are), parameters
  and the caller's input and target left out;
- *total*: the step's peak RSS above the RSS before the pipeline was built
  (parameters, gradients, what the library keeps between steps, and what
  the step adds: activations, mail, transient buffers), with an allocator
  that gives freed memory back (the children run with
  ``MALLOC_MMAP_THRESHOLD_=65536 MALLOC_TRIM_THRESHOLD_=1048576
  MALLOC_ARENA_MAX=1``), the peak reset just before the step
  (``/proc/self/clear_refs``); *kept*, its part there before the step starts
  (the model is the same in both libraries, so what differs is what each
  keeps between steps: torch's stages keep their receive buffers).

The *bound* is one micro-batch's saved bytes through the rank's stage in the
plain model (measured the same way) times the micro-batches the schedule
holds there: m for GPipe, min(stages - rank, m) for 1F1B and ZB-H1 (torch's
zero-bubble is ``ScheduleInterleavedZeroBubble`` with one stage per rank);
interleaved, the sum over the rank's two stages of each one's micro-batch
times the micro-batches our program holds there at most
(``simulate.validate``'s ``peak_in_flight``; a bound, as the two peaks need
not coincide).
Linux only. The last line is JSON.

Run: python examples/benchmarks/stage_memory.py [--chunks 8 16]
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from pipe_common import machine, print_json
from stage_processes import local_part, mlp, torchs
from torch import Tensor, nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
)

from pipeline.distributed import DistributedPipe
from pipeline.step.activations import ActivationMeter
from pipeline.step.schedules import Interleaved1F1B
from pipeline.step.simulate import validate

WORLD = 2
ALLOCATOR = {
    "MALLOC_MMAP_THRESHOLD_": "65536",
    "MALLOC_TRIM_THRESHOLD_": "1048576",
    "MALLOC_ARENA_MAX": "1",
}
# (our schedule, torch's schedule class) compared.
SCHEDULES = (
    ("gpipe", ScheduleGPipe),
    ("1f1b", Schedule1F1B),
    ("zb-h1", ScheduleInterleavedZeroBubble),
    ("interleaved", ScheduleInterleaved1F1B),
)
VIRTUAL = 2  # stages per rank, interleaved
MiB = 2**20


def rss_kib(field: str) -> int:
    """``VmRSS`` or ``VmHWM`` (the peak since the last reset) of this process, in KiB."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")


def held(schedule: str, m: int, stage: int) -> int:
    """Micro-batches the schedule holds at most on ``stage``."""
    if schedule == "interleaved":
        programs = Interleaved1F1B(VIRTUAL).programs(m, VIRTUAL * WORLD)
        return validate(programs, m, VIRTUAL * WORLD).peak_in_flight[stage]
    return m if schedule == "gpipe" else min(WORLD - stage, m)


def stage_indices(schedule: str) -> list[int]:
    """This rank's stages: one, or ``VIRTUAL`` interleaved (stage ``s`` on rank ``s % WORLD``)."""
    rank = dist.get_rank()
    return list(range(rank, VIRTUAL * WORLD, WORLD)) if schedule == "interleaved" else [rank]


def stage_part(model: nn.Sequential, schedule: str, stage: int) -> nn.Sequential:
    """Stage ``stage`` of ``model``, under the whole model's names, for torch's stage."""
    if schedule != "interleaved":
        return local_part(model)
    size = len(model) // (VIRTUAL * WORLD)
    return model[size * stage : size * (stage + 1)]


def one_micro_batch(part: nn.Module, x: Tensor, y: Tensor, first: bool, last: bool) -> int:
    """Saved bytes of one micro-batch through ``part`` (and the loss on the last stage)."""
    meter = ActivationMeter([*part.parameters(), x, y])
    # Stages after the first receive their input: a tensor of the step's own.
    inputs = x if first else x.detach().clone().requires_grad_()
    with meter.hooks():
        output = part(inputs)
        loss = F.mse_loss(output, y) if last else output.sum()
    del output, loss
    return meter.peak


def ours(
    args: argparse.Namespace, schedule: str, m: int, x: Tensor, y: Tensor
) -> Callable[[], int]:
    """Our step, built: a call runs it and returns this rank's peak saved bytes."""
    stages = VIRTUAL * WORLD if schedule == "interleaved" else WORLD
    model = mlp(args.width, nn.GELU)
    balance = [len(model) // stages] * stages
    pipe = DistributedPipe(model, balance, chunks=m, checkpoint="never")

    def run() -> int:
        pipe.zero_grad(set_to_none=False)
        if schedule == "interleaved":
            # The rank's stages together, under one meter, as torch's are counted.
            meter = ActivationMeter([*pipe.parameters(), x, y])
            with meter.hooks():
                pipe.step(x, y, F.mse_loss, schedule=schedule)
            return meter.peak
        pipe.step(x, y, F.mse_loss, schedule=schedule, measure_memory=True)
        report = pipe.last_step
        assert report is not None
        return max(p.peak_activation_bytes or 0 for p in report.partitions)

    return run


def torch_pipelining(
    args: argparse.Namespace, schedule: str, kind: Any, m: int, x: Tensor, y: Tensor
) -> Callable[[], int]:
    """torch's step, built: a call runs it under the meter and returns the peak saved bytes."""
    model = mlp(args.width, nn.GELU)
    indices = stage_indices(schedule)
    count = VIRTUAL * WORLD if schedule == "interleaved" else WORLD
    parts = [stage_part(model, schedule, s) for s in indices]
    built = [
        PipelineStage(p, s, count, torch.device("cpu")) for p, s in zip(parts, indices, strict=True)
    ]
    part = nn.ModuleList(parts)
    stages: Any = (
        built if kind in (ScheduleInterleavedZeroBubble, ScheduleInterleaved1F1B) else built[0]
    )
    step = torchs(built[0], part, kind(stages, n_microbatches=m, loss_fn=F.mse_loss), x, y)

    def run() -> int:
        part.zero_grad(set_to_none=False)
        meter = ActivationMeter([*part.parameters(), x, y])
        with meter.hooks():
            step()
        return meter.peak

    return run


def child(rank: int, port: int, library: str, index: int, m: int, args: Any, queue: Any) -> None:
    """One rank of one configuration: its figures, put in ``queue``."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch, args.width, generator=gen)
    y = torch.randn(args.batch, args.width, generator=gen)
    schedule, kind = SCHEDULES[index]
    start = rss_kib("VmRSS")
    run = (
        ours(args, schedule, m, x, y)
        if library == "ours"
        else torch_pipelining(args, schedule, kind, m, x, y)
    )
    run()  # warm-up: gradients allocated, torch's shapes exchanged
    dist.barrier()
    before = rss_kib("VmRSS")
    reset_peak_rss()
    saved = run()
    total = (rss_kib("VmHWM") - start) * 1024
    kept = (before - start) * 1024
    dist.barrier()
    rows = args.batch // m
    model = mlp(args.width, nn.GELU)
    count = VIRTUAL * WORLD if schedule == "interleaved" else WORLD
    bound = sum(
        one_micro_batch(stage_part(model, schedule, s), x[:rows], y[:rows], s == 0, s == count - 1)
        * held(schedule, m, s)
        for s in stage_indices(schedule)
    )
    queue.put((rank, {"saved": saved, "total": total, "kept": kept, "bound": bound}))
    dist.destroy_process_group()


def configuration(
    library: str, index: int, m: int, args: argparse.Namespace
) -> list[dict[str, int]]:
    """Both ranks' figures of one configuration, from 2 fresh processes."""
    context = mp.get_context("spawn")
    queue = context.Queue()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    processes = [
        context.Process(target=child, args=(rank, port, library, index, m, args, queue))
        for rank in range(WORLD)
    ]
    for process in processes:
        process.start()
    figures = dict(queue.get(timeout=600) for _ in processes)
    for process in processes:
        process.join(timeout=60)
        if process.exitcode != 0:
            raise RuntimeError(f"{library} {SCHEDULES[index][0]} m={m}: a process failed")
    return [figures[rank] for rank in range(WORLD)]


def row(schedule: str, m: int, mine: list[dict[str, int]], theirs: list[dict[str, int]]) -> str:
    """A table row: bound, saved, kept, total per rank (rank 0 / rank 1), ours beside torch's."""

    def mib(figures: list[dict[str, int]], key: str, digits: int) -> str:
        return " / ".join(f"{f[key] / MiB:.{digits}f}" for f in figures)

    ratios = " / ".join(
        f"{a['total'] / max(b['total'], 1):.2f}" for a, b in zip(mine, theirs, strict=True)
    )
    cells = [
        f"{schedule}, {m}",
        mib(mine, "bound", 2),
        mib(mine, "saved", 2),
        mib(theirs, "saved", 2),
        mib(mine, "kept", 1),
        mib(theirs, "kept", 1),
        mib(mine, "total", 1),
        mib(theirs, "total", 1),
        ratios,
    ]
    return "| " + " | ".join(cells) + " |"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--chunks", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--width", type=int, default=1024)
    args = parser.parse_args(argv)
    if not sys.platform.startswith("linux"):
        raise SystemExit("reads /proc/self: Linux only")
    os.environ.update(ALLOCATOR)  # for the children, which read it as they start
    print(f"machine: {machine()}")
    print(
        "| schedule, m | bound (MiB, rank 0 / 1) | ours saved | torch saved "
        "| ours kept | torch kept | ours total | torch total | ours / torch total |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    results = []
    for m in args.chunks:
        for index, (schedule, kind) in enumerate(SCHEDULES):
            mine = configuration("ours", index, m, args)
            theirs = configuration("torch", index, m, args)
            print(row(schedule, m, mine, theirs), flush=True)
            results.append({"schedule": schedule, "torch": kind.__name__, "chunks": m,
                            "ours": mine, "torch_figures": theirs})  # fmt: skip
    print_json({"benchmark": "stage_memory", "batch": args.batch, "width": args.width,
                "results": results})  # fmt: skip


if __name__ == "__main__":
    main()
