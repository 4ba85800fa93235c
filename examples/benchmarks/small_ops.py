"""Benchmark: a training step of many small ops in 4 partitions, against the plain model.

The model is 4 partitions of ``--blocks`` blocks of [LayerNorm(64),
Linear(64, 64)] each (32 by default: 64 small ops per partition), trained
on ``--chunks`` micro-batches of ``--rows`` rows, with one intra-op thread.
Each op computes for microseconds, so what the pipeline does per op (a
dispatch mode, autograd edges) and per task shows. A training step
(zero_grad, forward, backward of the outputs' sum) is timed for the plain
model on the same micro-batches one after another, ``pipe(x)`` and
``Pipe.step`` (``gpipe``, ``1f1b``), with each of ``threads="device"`` and
``threads="partition"`` where the Pipe has that option (a Pipe without it
runs its default). Every candidate runs once per round, in turn; the figures
are medians over rounds, and each ratio to the plain model is the median of
the rounds' ratios. Gradients are checked against the plain model's first.

To compare two versions of the library, run this script (the same file)
with ``PYTHONPATH`` naming each tree in turn; it prints the tree it loaded.
The last line is JSON.

Run: python examples/benchmarks/small_ops.py [--rounds 30] [--blocks 32]
"""

from __future__ import annotations

import argparse
import copy
import inspect
import statistics
import time

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

PARTITIONS = 4
WIDTH = 64


def small_ops_model(blocks: int) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(PARTITIONS * blocks):
        layers += [nn.LayerNorm(WIDTH), nn.Linear(WIDTH, WIDTH)]
    return nn.Sequential(*layers)


def thread_layouts() -> list[str | None]:
    """The ``threads`` options this version of Pipe has (None: it has no such option)."""
    if "threads" in inspect.signature(pipeline.Pipe).parameters:
        return ["device", "partition"]
    return [None]


def candidates(model: nn.Sequential, x: Tensor, chunks: int) -> dict[str, tuple[Run, nn.Module]]:
    """Each candidate's training step, and the module it trains (a copy of ``model``)."""
    balance = [len(model) // PARTITIONS] * PARTITIONS
    runs: dict[str, tuple[Run, nn.Module]] = {"plain": (plain_step(model, x, chunks), model)}
    for threads in thread_layouts():
        options = {} if threads is None else {"threads": threads}
        suffix = "" if threads is None else f" threads={threads}"
        pipe = pipeline.Pipe(copy.deepcopy(model), balance, devices=["cpu"] * PARTITIONS,
                             chunks=chunks, checkpoint="never", **options)  # fmt: skip
        runs[f"pipe(x){suffix}"] = (call_step(pipe, x), pipe)
        for schedule in ("gpipe", "1f1b"):
            runs[f"Pipe.step {schedule}{suffix}"] = (explicit_step(pipe, x, schedule), pipe)
    return runs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=30, help="timed rounds; medians count")
    parser.add_argument("--blocks", type=int, default=32, help="blocks per partition")
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--rows", type=int, default=8, help="rows per micro-batch")
    args = parser.parse_args(argv)
    info, _ = start_single_threaded()
    print(f"pipeline loaded from {pipeline.__file__}")

    model = small_ops_model(args.blocks)
    x = torch.randn(args.chunks * args.rows, WIDTH)
    runs = candidates(model, x, args.chunks)
    check_gradients(runs)
    start = time.perf_counter()
    times = round_times({name: run for name, (run, _) in runs.items()}, args.rounds, warmup=2)
    print(f"timed {args.rounds} interleaved rounds in {time.perf_counter() - start:.1f} s")
    plain = times["plain"]
    found: dict[str, dict[str, float]] = {}
    for name, ts in times.items():
        ratios = [t / p for t, p in zip(ts, plain, strict=True)]
        found[name] = {
            "step_ms": statistics.median(ts) * 1e3,
            "over_plain": statistics.median(ratios),
        }
        print(
            f"  {name:32s} {found[name]['step_ms']:8.2f} ms  "
            f"{found[name]['over_plain']:.2f}x plain's"
        )
    print_json(
        {
            "benchmark": "small_ops",
            "machine": info,
            "pipeline": pipeline.__file__,
            "blocks_per_partition": args.blocks,
            "chunks": args.chunks,
            "rows": args.rows,
            "rounds": args.rounds,
            "candidates": found,
        }
    )


if __name__ == "__main__":
    main()
