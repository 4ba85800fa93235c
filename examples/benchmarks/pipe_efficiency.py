"""Benchmark: Pipe throughput against the plain model, 8 compute-heavy blocks on 2 CPU partitions.

The model is 8 blocks of Linear(1024, 1024) + ReLU, split 4 + 4 over two
partitions on the CPU, each with its own worker thread; torch runs one
intra-op thread (the setting is process-wide), so the two partitions can
overlap on two cores. Every micro-batch has ``--rows`` rows; a step has
``chunks`` of them. For each ``chunks`` the Pipe's throughput is divided by
the plain model's, measured in the same run:

- on the whole batch (what a user had before),
- on the same micro-batches one after another (what the pipeline adds;
  splitting a batch alone changes the speed of each matrix product),

for forward only (no_grad) and forward + backward with checkpoint ``never``
and ``except_last``. GPipe's bound for the speedup over the micro-batches is
2m/(m+1). Then, at 8 chunks: what tracing with ``pipeline.trace()`` adds to
a step, what the RNG rule costs (Dropout in every block), and what two
threads get from this machine now (2.0 on two idle cores). The last line is
JSON.

Every candidate runs once per round, in turn, after a warm-up round: times
are medians over the rounds, and each ratio is the median of the rounds'
ratios.

Run: python examples/benchmarks/pipe_efficiency.py [--rows 256] [--chunks 1 2 4 8 16] [--rounds 5]
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
from pipe_common import (
    Run,
    median_ratio,
    print_json,
    round_times,
    start_single_threaded,
    thread_scaling,
)
from torch import nn

import pipeline
from pipeline.arguments import CheckpointMode

WIDTH = 1024
BLOCKS = 8
TRACED_CHUNKS = 8


def blocks(dropout: float = 0.0) -> nn.Sequential:
    layers: list[nn.Module] = []
    for _ in range(BLOCKS):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
        if dropout:
            layers.append(nn.Dropout(dropout))
    return nn.Sequential(*layers)


def forward_only(model: Callable[[torch.Tensor], Any], x: torch.Tensor) -> Run:
    def run() -> None:
        with torch.no_grad():
            model(x)

    return run


def forward_backward(model: Callable[[torch.Tensor], Any], x: torch.Tensor) -> Run:
    def run() -> None:
        model(x).sum().backward()

    return run


def micro_batches(model: nn.Module, x: torch.Tensor, chunks: int, *, backward: bool) -> Run:
    """The plain model on the Pipe's micro-batches, one after another."""
    pieces = x.chunk(chunks)

    def run() -> None:
        if backward:
            for piece in pieces:
                model(piece).sum().backward()
        else:
            with torch.no_grad():
                torch.cat([model(piece) for piece in pieces])

    return run


def halves(model: nn.Sequential) -> list[int]:
    """A balance of 4 blocks per partition."""
    return [len(model) // 2, len(model) - len(model) // 2]


def pipe(model: nn.Sequential, chunks: int, checkpoint: CheckpointMode) -> pipeline.Pipe:
    return pipeline.Pipe(
        copy.deepcopy(model),
        balance=halves(model),
        devices=["cpu", "cpu"],
        chunks=chunks,
        checkpoint=checkpoint,
    )


def gpipe(torchgpipe: ModuleType, model: nn.Sequential, chunks: int) -> nn.Module:
    gpipe_module: nn.Module = torchgpipe.GPipe(
        copy.deepcopy(model),
        balance=halves(model),
        devices=["cpu", "cpu"],
        chunks=chunks,
        checkpoint="never",
    )
    return gpipe_module


def measure(
    chunks: int, rows: int, rounds: int, torchgpipe: ModuleType | None
) -> dict[str, list[float]]:
    """Every candidate's time in each round, for one ``chunks``."""
    model = blocks()
    x = torch.randn(rows * chunks, WIDTH)
    never, except_last = pipe(model, chunks, "never"), pipe(model, chunks, "except_last")
    candidates: dict[str, Run] = {
        "forward whole": forward_only(model, x),
        "forward micro": micro_batches(model, x, chunks, backward=False),
        "forward pipe": forward_only(never, x),
        "train whole": forward_backward(model, x),
        "train micro": micro_batches(model, x, chunks, backward=True),
        "train pipe never": forward_backward(never, x),
        "train pipe except_last": forward_backward(except_last, x),
    }
    if torchgpipe is not None:
        theirs = gpipe(torchgpipe, model, chunks)
        candidates["forward torchgpipe"] = forward_only(theirs, x)
        candidates["train torchgpipe"] = forward_backward(theirs, x)
    return round_times(candidates, rounds)


def speedups(times: dict[str, list[float]], chunks: int) -> dict[str, float]:
    """Throughput of each pipeline over the plain model's, on the whole batch and micro-batches.

    Keys such as ``train_pipe_never_vs_micro``; a time ratio, since the work is the same.
    """
    result = {"chunks": chunks, "bound": 2 * chunks / (chunks + 1)}
    for name in times:
        mode, _, who = name.partition(" ")
        if who.startswith(("pipe", "torchgpipe")):
            key = name.replace(" ", "_")
            result[f"{key}_vs_whole"] = median_ratio(times, f"{mode} whole", name)
            result[f"{key}_vs_micro"] = median_ratio(times, f"{mode} micro", name)
    result["forward_share_of_bound"] = result["forward_pipe_vs_micro"] / result["bound"]
    return result


def tracing_cost(rows: int, rounds: int) -> dict[str, float]:
    """What ``pipeline.trace()`` adds to a step, forward only and forward + backward."""
    model = blocks()
    x = torch.randn(rows * TRACED_CHUNKS, WIDTH)
    never = pipe(model, TRACED_CHUNKS, "never")

    def traced(run: Run) -> Run:
        def traced_run() -> None:
            with pipeline.trace():
                run()

        return traced_run

    forward, train = forward_only(never, x), forward_backward(never, x)
    times = round_times(
        {
            "forward": forward,
            "forward traced": traced(forward),
            "train": train,
            "train traced": traced(train),
        },
        2 * rounds,  # the difference is small: more rounds than elsewhere
    )
    return {
        "forward": median_ratio(times, "forward traced", "forward") - 1,
        "forward + backward": median_ratio(times, "train traced", "train") - 1,
    }


def dropout_cost(rows: int, rounds: int) -> dict[str, float]:
    """Speedup over the micro-batches in training with and without Dropout in every block.

    Each random op runs under the CPU generator's lock while it draws (see
    pipeline/runtime/rng.py); the rest of the two partitions overlaps.
    """
    result = {}
    for label, dropout in (("without dropout", 0.0), ("with dropout", 0.1)):
        model = blocks(dropout)
        x = torch.randn(rows * TRACED_CHUNKS, WIDTH)
        times = round_times(
            {
                "micro": micro_batches(model, x, TRACED_CHUNKS, backward=True),
                "pipe": forward_backward(pipe(model, TRACED_CHUNKS, "never"), x),
            },
            rounds,
        )
        result[label] = median_ratio(times, "micro", "pipe")
    return result


def print_table(rows: list[dict[str, float]]) -> None:
    print("throughput of the Pipe / throughput of the plain model, on the whole batch and on")
    print("the same micro-batches one after another (higher is better; bound = 2m/(m+1))")
    print("        |          forward only         | train, never  | train, except_last")
    print("chunks  | bound  /whole  /micro  %bound | /whole /micro | /whole /micro")
    for row in rows:
        print(
            f"{int(row['chunks']):6d}  | {row['bound']:5.2f}  {row['forward_pipe_vs_whole']:6.2f}  "
            f"{row['forward_pipe_vs_micro']:6.2f}  {row['forward_share_of_bound']:6.0%} | "
            f"{row['train_pipe_never_vs_whole']:6.2f} {row['train_pipe_never_vs_micro']:6.2f} | "
            f"{row['train_pipe_except_last_vs_whole']:6.2f} "
            f"{row['train_pipe_except_last_vs_micro']:6.2f}"
        )
    if "forward_torchgpipe_vs_micro" in rows[0]:
        print("torchgpipe, same model: chunks, forward /micro, train never /micro")
        for row in rows:
            print(
                f"{int(row['chunks']):6d}  {row['forward_torchgpipe_vs_micro']:6.2f}  "
                f"{row['train_torchgpipe_vs_micro']:6.2f}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=256, help="rows per micro-batch")
    parser.add_argument("--chunks", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument(
        "--rounds", type=int, default=5, help="timed rounds after a warm-up; medians count"
    )
    args = parser.parse_args()
    info, torchgpipe = start_single_threaded()

    rows = [speedups(measure(m, args.rows, args.rounds, torchgpipe), m) for m in args.chunks]
    print_table(rows)
    block = blocks()[:2]
    sample = torch.randn(args.rows, WIDTH)
    scaling = thread_scaling(forward_only(block, sample), args.rounds * 3)
    print(f"two threads on this machine now: {scaling:.2f}x one thread (2.00 on two idle cores)")
    tracing = tracing_cost(args.rows, args.rounds)
    print(
        f"pipeline.trace() adds {tracing['forward']:+.1%} to a forward step and "
        f"{tracing['forward + backward']:+.1%} to a training step ({TRACED_CHUNKS} chunks)"
    )
    dropout = dropout_cost(args.rows, args.rounds)
    print(
        f"training speedup over the micro-batches at {TRACED_CHUNKS} chunks: "
        f"{dropout['without dropout']:.2f}x without dropout, "
        f"{dropout['with dropout']:.2f}x with Dropout in every block"
    )
    print_json(
        {
            "benchmark": "pipe_efficiency",
            "machine": info,
            "rows_per_microbatch": args.rows,
            "speedups": rows,
            "thread_scaling": scaling,
            "tracing_overhead": tracing,
            "dropout_speedup": dropout,
            "torchgpipe": torchgpipe is not None,
        }
    )


if __name__ == "__main__":
    main()
