"""Benchmark: the framework's cost per (micro-batch, partition) task, on a tiny model.

The model is 16 Linear(32, 32) layers in 4 partitions of 4, run on 32
micro-batches of 4 rows, with one intra-op thread: each task computes for
microseconds, so what the Pipe adds (scheduling, hand-offs between threads,
autograd edges) dominates. The overhead per task is

    (time of the Pipe - time of the plain model on the same micro-batches) / (m * n)

for forward (no_grad), and for backward (the Pipe's backward time minus the
plain model's, over m * n). For scale, the round trip of an empty task to a
``pipeline.runtime.worker.Worker`` thread and back: the hand-off every task pays.
Then what the trace wrappers cost per task when no trace runs (calls of a
no-op partition, wrapped and not), what a Pipe call's profiler check costs
when no profiler runs, and what a running trace adds per task.
The last line is JSON.

Run: python examples/benchmarks/overhead.py [--rounds 100]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable
from functools import partial
from types import ModuleType

import torch
from pipe_common import best_times, print_json, start_single_threaded
from torch import nn

import pipeline
from pipeline.runtime.worker import Replies, Worker, stop_workers
from pipeline.trace.profiling import warn_if_workers_unseen
from pipeline.trace.recording import span, traced

LAYERS = 16
PARTITIONS = 4
CHUNKS = 32
ROWS = 4
WIDTH = 32

Run = Callable[[], object]


def tiny_model() -> nn.Sequential:
    return nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)))


def runs(model: nn.Module, x: torch.Tensor, micro: bool) -> tuple[Run, Run]:
    """A forward-only and a forward + backward run of ``model``, whole or by micro-batch."""
    pieces = x.chunk(CHUNKS) if micro else (x,)

    def forward() -> None:
        with torch.no_grad():
            torch.cat([model(piece) for piece in pieces])

    def train() -> None:
        for piece in pieces:
            model(piece).sum().backward()

    return forward, train


def per_task_overhead(times: dict[str, float], who: str) -> dict[str, float]:
    """Microseconds per task that ``who`` adds to the plain model on micro-batches."""
    tasks = CHUNKS * PARTITIONS
    forward = times[f"{who} forward"] - times["micro forward"]
    backward = (times[f"{who} train"] - times[f"{who} forward"]) - (
        times["micro train"] - times["micro forward"]
    )
    return {"forward_us": forward / tasks * 1e6, "backward_us": backward / tasks * 1e6}


def handoff_round_trip(calls: int = 2000) -> float:
    """Median microseconds to run an empty task on a worker thread and get its answer."""
    worker = Worker("handoff-probe")
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        replies = Replies()
        worker.submit(int, replies)
        replies.collect(1)
        times.append(time.perf_counter() - start)
    stop_workers([worker])
    return statistics.median(times) * 1e6


def untraced_wrapper_cost(calls: int = 200_000) -> float:
    """Microseconds the trace wrappers add to a task when nothing traces or profiles."""

    def partition_call(x: torch.Tensor) -> torch.Tensor:
        return x

    x = torch.zeros(1)

    def plain() -> None:
        for _ in range(calls):
            partition_call(x)

    def wrapped() -> None:
        for _ in range(calls):
            traced(partial(partition_call), 0, 0)(x)
            with span("copy", 0, 1):
                pass

    def partial_only() -> None:
        # The driver built this partial before tracing existed; only the rest is new.
        for _ in range(calls):
            partial(partition_call)(x)

    times = best_times({"plain": plain, "wrapped": wrapped, "partial": partial_only}, rounds=5)
    return (times["wrapped"] - times["partial"]) / calls * 1e6


def unprofiled_check_cost(calls: int = 200_000) -> float:
    """Microseconds a Pipe call's profiler check adds when no profiler runs.

    The check (``warn_if_workers_unseen``) against an empty function called alike.
    """

    def empty(stacklevel: int = 1) -> None:
        return None

    def loop(check: Callable[..., None]) -> Run:
        def calls_of() -> None:
            for _ in range(calls):
                check(stacklevel=2)

        return calls_of

    times = best_times({"empty": loop(empty), "check": loop(warn_if_workers_unseen)}, rounds=5)
    return (times["check"] - times["empty"]) / calls * 1e6


def traced_cost(pipe: pipeline.Pipe, x: torch.Tensor, rounds: int) -> float:
    """Microseconds per task that a running ``pipeline.trace()`` adds to a training step."""

    def train() -> None:
        pipe(x).sum().backward()

    def traced_train() -> None:
        with pipeline.trace():
            train()

    times = best_times({"off": train, "on": traced_train}, rounds)
    return (times["on"] - times["off"]) / (CHUNKS * PARTITIONS) * 1e6


def gpipe(torchgpipe: ModuleType, model: nn.Sequential) -> nn.Module:
    module: nn.Module = torchgpipe.GPipe(
        copy.deepcopy(model),
        balance=[LAYERS // PARTITIONS] * PARTITIONS,
        devices=["cpu"] * PARTITIONS,
        chunks=CHUNKS,
        checkpoint="never",
    )
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=100, help="timed rounds; the best counts")
    args = parser.parse_args()
    info, torchgpipe = start_single_threaded()

    model = tiny_model()
    x = torch.randn(CHUNKS * ROWS, WIDTH)
    pipe = pipeline.Pipe(
        copy.deepcopy(model),
        balance=[LAYERS // PARTITIONS] * PARTITIONS,
        chunks=CHUNKS,
        checkpoint="never",
    )
    candidates: dict[str, Run] = {}
    for who, module, micro in (("micro", model, True), ("pipe", pipe, False)):
        candidates[f"{who} forward"], candidates[f"{who} train"] = runs(module, x, micro)
    if torchgpipe is not None:
        candidates["torchgpipe forward"], candidates["torchgpipe train"] = runs(
            gpipe(torchgpipe, model), x, micro=False
        )
    start = time.perf_counter()
    times = best_times(candidates, args.rounds, warmup=3)
    print(f"timed {args.rounds} rounds in {time.perf_counter() - start:.1f} s")
    for name, seconds in times.items():
        print(f"  {name:20s} {seconds * 1e3:8.2f} ms per step")

    overhead = {"pipe": per_task_overhead(times, "pipe")}
    if torchgpipe is not None:
        overhead["torchgpipe"] = per_task_overhead(times, "torchgpipe")
    tasks = f"{CHUNKS} micro-batches x {PARTITIONS} partitions"
    for who, cost in overhead.items():
        print(
            f"{who} overhead per task ({tasks}): forward {cost['forward_us']:.1f} us, "
            f"backward {cost['backward_us']:.1f} us"
        )
    handoff = handoff_round_trip()
    print(f"an empty task's round trip to a worker thread: {handoff:.1f} us (median)")
    off = untraced_wrapper_cost()
    check = unprofiled_check_cost()
    on = traced_cost(pipe, x, args.rounds)
    print(f"trace wrappers with no trace running: {off:.2f} us per task")
    print(f"a Pipe call's profiler check with no profiler running: {check * 1e3:.0f} ns")
    print(f"a running pipeline.trace() adds {on:.1f} us per task (forward + backward)")
    print_json(
        {
            "benchmark": "overhead",
            "machine": info,
            "tasks": {"microbatches": CHUNKS, "partitions": PARTITIONS},
            "step_ms": {name: seconds * 1e3 for name, seconds in times.items()},
            "overhead_per_task": overhead,
            "handoff_round_trip_us": handoff,
            "untraced_wrapper_us": off,
            "unprofiled_check_us": check,
            "traced_us_per_task": on,
            "torchgpipe": torchgpipe is not None,
        }
    )


if __name__ == "__main__":
    main()
