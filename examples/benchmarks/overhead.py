"""Benchmark: the framework's cost per (micro-batch, partition) task, on a tiny model.

The model is 16 Linear(32, 32) layers in 4 partitions of 4, run on 32
micro-batches of 4 rows, ``checkpoint="never"``, with one intra-op thread:
each task computes for microseconds, so what a pipeline adds (scheduling,
hand-offs between threads, autograd edges) dominates. A training step
(zero_grad, forward, backward of the sum of the outputs) is timed for:

- the plain model on the same micro-batches one after another (the baseline);
- torchgpipe 0.0.7's ``GPipe(x)``, which runs every CPU partition on one thread;
- ``pipe(x)``, ``Pipe.step`` with ``gpipe`` and with ``1f1b``, each with
  ``threads="device"`` (one thread for the CPU's partitions: torchgpipe's
  layout, the like-for-like comparison) and ``threads="partition"`` (a thread
  per partition, the CPU's default: partitions overlap on a multi-core host,
  and pay a hand-off between threads per task).

Every candidate runs once per round, in turn. The overhead per task of a
round is (candidate's step - plain model's step) / (m * n); the figures are
medians over rounds, and the ratio to torchgpipe is the median of the
rounds' ratios. Before timing, every candidate's gradients are checked
against the plain model's. Then, for scale, the round trip of an empty task
to a worker thread, what the trace wrappers cost per task when no trace
runs, what a Pipe call's profiler check costs when no profiler runs, and
what a running trace adds. The last line is JSON.

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
from pipe_common import (
    Run,
    call_step,
    check_gradients,
    explicit_step,
    plain_step,
    print_json,
    round_times,
    start_single_threaded,
)
from torch import Tensor, nn

import pipeline
from pipeline.runtime.worker import Replies, Worker, stop_workers
from pipeline.trace.profiling import warn_if_workers_unseen
from pipeline.trace.recording import span, traced

LAYERS = 16
PARTITIONS = 4
CHUNKS = 32
ROWS = 4
WIDTH = 32
TASKS = CHUNKS * PARTITIONS
THREADS = ("device", "partition")


def tiny_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)))


def candidates(
    model: nn.Sequential, x: Tensor, torchgpipe: ModuleType | None
) -> dict[str, tuple[Run, nn.Module]]:
    """Each candidate's training step, and the module it trains (a copy of ``model``)."""
    balance = [LAYERS // PARTITIONS] * PARTITIONS
    runs: dict[str, tuple[Run, nn.Module]] = {"plain": (plain_step(model, x, CHUNKS), model)}
    if torchgpipe is not None:
        gpipe = torchgpipe.GPipe(copy.deepcopy(model), balance, devices=["cpu"] * PARTITIONS,
                                 chunks=CHUNKS, checkpoint="never")  # fmt: skip
        runs["torchgpipe"] = (call_step(gpipe, x), gpipe)
    for threads in THREADS:
        pipe = pipeline.Pipe(copy.deepcopy(model), balance, devices=["cpu"] * PARTITIONS,
                             chunks=CHUNKS, checkpoint="never", threads=threads)  # fmt: skip
        runs[f"pipe(x) threads={threads}"] = (call_step(pipe, x), pipe)
        for schedule in ("gpipe", "1f1b"):
            step = explicit_step(pipe, x, schedule)
            runs[f"Pipe.step {schedule} threads={threads}"] = (step, pipe)
    return runs


def overheads(times: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    """Per candidate: median step (ms), overhead per task (us), ratio to torchgpipe's (medians)."""
    plain = times["plain"]
    per_round = {
        name: [(t - p) / TASKS * 1e6 for t, p in zip(ts, plain, strict=True)]
        for name, ts in times.items()
        if name != "plain"
    }
    result: dict[str, dict[str, float]] = {}
    for name, ts in times.items():
        row = {"step_ms": statistics.median(ts) * 1e3}
        if name in per_round:
            row["overhead_us_per_task"] = statistics.median(per_round[name])
            if "torchgpipe" in per_round:
                ratios = [
                    ours / theirs
                    for ours, theirs in zip(per_round[name], per_round["torchgpipe"], strict=True)
                ]
                row["over_torchgpipe"] = statistics.median(ratios)
        result[name] = row
    return result


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


def untraced_wrapper_cost(calls: int = 20_000, rounds: int = 5) -> float:
    """Microseconds the trace wrappers add to a task when nothing traces or profiles."""

    def partition_call(x: Tensor) -> Tensor:
        return x

    x = torch.zeros(1)

    def wrapped() -> None:
        for _ in range(calls):
            traced(partial(partition_call), 0, 0)(x)
            with span("copy", 0, 1):
                pass

    def partial_only() -> None:
        # The driver builds this partial anyway; only the rest is the trace's.
        for _ in range(calls):
            partial(partition_call)(x)

    times = round_times({"wrapped": wrapped, "partial": partial_only}, rounds)
    differences = [w - p for w, p in zip(times["wrapped"], times["partial"], strict=True)]
    return statistics.median(differences) / calls * 1e6


def unprofiled_check_cost(calls: int = 200_000, rounds: int = 5) -> float:
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

    times = round_times({"empty": loop(empty), "check": loop(warn_if_workers_unseen)}, rounds)
    differences = [c - e for c, e in zip(times["check"], times["empty"], strict=True)]
    return statistics.median(differences) / calls * 1e6


def traced_cost(run: Run, rounds: int) -> float:
    """Microseconds per task that a running ``pipeline.trace()`` adds to a training step."""

    def traced_run() -> None:
        with pipeline.trace():
            run()

    times = round_times({"off": run, "on": traced_run}, rounds)
    differences = [on - off for on, off in zip(times["on"], times["off"], strict=True)]
    return statistics.median(differences) / TASKS * 1e6


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=100, help="timed rounds; medians count")
    args = parser.parse_args(argv)
    info, torchgpipe = start_single_threaded()

    model = tiny_model()
    x = torch.randn(CHUNKS * ROWS, WIDTH)
    runs = candidates(model, x, torchgpipe)
    check_gradients(runs)
    start = time.perf_counter()
    times = round_times({name: run for name, (run, _) in runs.items()}, args.rounds, warmup=3)
    print(f"timed {args.rounds} interleaved rounds in {time.perf_counter() - start:.1f} s")
    found = overheads(times)
    print(f"{CHUNKS} micro-batches x {PARTITIONS} partitions, medians over rounds:")
    for name, row in found.items():
        line = f"  {name:34s} step {row['step_ms']:7.2f} ms"
        if "overhead_us_per_task" in row:
            line += f"  overhead {row['overhead_us_per_task']:7.1f} us per task"
        if "over_torchgpipe" in row and name != "torchgpipe":
            line += f"  {row['over_torchgpipe']:.2f}x torchgpipe's"
        print(line)
    handoff = handoff_round_trip()
    print(f"an empty task's round trip to a worker thread: {handoff:.1f} us (median)")
    off = untraced_wrapper_cost()
    check = unprofiled_check_cost()
    on = traced_cost(runs["pipe(x) threads=partition"][0], args.rounds)
    print(f"trace wrappers with no trace running: {off:.2f} us per task")
    print(f"a Pipe call's profiler check with no profiler running: {check * 1e3:.0f} ns")
    print(f"a running pipeline.trace() adds {on:.1f} us per task (pipe(x), forward + backward)")
    print_json(
        {
            "benchmark": "overhead",
            "machine": info,
            "tasks": {"microbatches": CHUNKS, "partitions": PARTITIONS},
            "rounds": args.rounds,
            "candidates": found,
            "handoff_round_trip_us": handoff,
            "untraced_wrapper_us": off,
            "unprofiled_check_us": check,
            "traced_us_per_task": on,
            "torchgpipe": torchgpipe is not None,
        }
    )


if __name__ == "__main__":
    main()
