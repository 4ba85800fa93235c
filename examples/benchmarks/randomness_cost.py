"""Benchmark: what seeding every random op costs: transformer stack, dropout, 2 CPU partitions.

Every task of a Pipe runs under a dispatch mode that seeds each random op
(dropout, attention dropout...) on its own, under its generator's lock, so
that recomputation replays the forward's draws exactly (pipeline/runtime/rng.py).
This measures, for a stack of ``nn.TransformerEncoderLayer(dropout=0.1)``
split over two CPU partitions with one intra-op thread each, at ``--chunks``
micro-batches, in training (forward + backward):

- the plain model on the same micro-batches one after another (baseline);
- the Pipe as it is;
- the Pipe with the seeding switched off (timing only: its recomputed masks
  would be wrong), which isolates what the mechanism costs;
- the same three without dropout (``dropout=0``), where only the dispatch
  mode's pass-through of every op remains.

The last line is JSON.

Every candidate runs once per round, in turn, after a warm-up round: times
are medians over the rounds, and each ratio is the median of the rounds'
ratios.

Run: python examples/benchmarks/randomness_cost.py [--chunks 8] [--rows 16] [--rounds 5]
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator
from unittest import mock

import torch
from pipe_common import (
    Run,
    median_ratio,
    median_times,
    print_json,
    round_times,
    start_single_threaded,
)
from torch import nn

import pipeline
from pipeline.runtime.rng import TaskRandomness

WIDTH, HEADS, SEQUENCE, LAYERS = 256, 4, 64, 8


def transformer(dropout: float) -> nn.Sequential:
    return nn.Sequential(
        *(
            nn.TransformerEncoderLayer(WIDTH, HEADS, 4 * WIDTH, dropout=dropout, batch_first=True)
            for _ in range(LAYERS)
        )
    )


def micro_batches(model: nn.Module, x: torch.Tensor, chunks: int) -> Run:
    def run() -> None:
        for piece in x.chunk(chunks):
            model(piece).square().mean().backward()

    return run


def pipe_step(pipe: pipeline.Pipe, x: torch.Tensor) -> Run:
    def run() -> None:
        pipe(x).square().mean().backward()  # type: ignore[union-attr]

    return run


@contextlib.contextmanager
def _unseeded(self: TaskRandomness) -> Iterator[None]:
    yield


def without_seeding(run: Run) -> Run:
    """``run`` with every task's random ops left unseeded (for timing only)."""

    def unseeded() -> None:
        with (
            mock.patch.object(TaskRandomness, "drawing", _unseeded),
            mock.patch.object(TaskRandomness, "replaying", _unseeded),
        ):
            run()

    return unseeded


def measure(dropout: float, chunks: int, rows: int, rounds: int) -> dict[str, float]:
    model = transformer(dropout)
    x = torch.randn(rows * chunks, SEQUENCE, WIDTH)
    result: dict[str, float] = {}
    for checkpoint in ("never", "except_last"):
        pipe = pipeline.Pipe(
            model,
            [LAYERS // 2, LAYERS // 2],
            devices=["cpu", "cpu"],
            chunks=chunks,
            checkpoint=checkpoint,  # type: ignore[arg-type]
        )
        seeded = pipe_step(pipe, x)
        times = round_times(
            {
                "micro": micro_batches(model, x, chunks),
                "seeded": seeded,
                "unseeded": without_seeding(seeded),
            },
            rounds,
        )
        pipe.close()
        result[f"{checkpoint}_speedup_seeded"] = median_ratio(times, "micro", "seeded")
        result[f"{checkpoint}_speedup_unseeded"] = median_ratio(times, "micro", "unseeded")
        result[f"{checkpoint}_seeding_cost"] = median_ratio(times, "seeded", "unseeded") - 1
        result[f"{checkpoint}_step_ms"] = median_times(times)["seeded"] * 1e3
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--rows", type=int, default=16, help="sequences per micro-batch")
    parser.add_argument(
        "--rounds", type=int, default=5, help="timed rounds after a warm-up; medians count"
    )
    args = parser.parse_args()
    info, _ = start_single_threaded()
    results = {
        label: measure(dropout, args.chunks, args.rows, args.rounds)
        for label, dropout in (("dropout 0.1", 0.1), ("no dropout", 0.0))
    }
    print(
        f"{LAYERS} x TransformerEncoderLayer({WIDTH}), 2 CPU partitions, {args.chunks} chunks "
        f"of {args.rows} x {SEQUENCE} tokens; training step"
    )
    print("               | checkpoint | speedup over micro-batches | seeding costs | step ms")
    print("               |            |   seeded     unseeded      |               |")
    for label, result in results.items():
        for checkpoint in ("never", "except_last"):
            print(
                f"{label:14s} | {checkpoint:10s} | "
                f"{result[f'{checkpoint}_speedup_seeded']:6.2f}x    "
                f"{result[f'{checkpoint}_speedup_unseeded']:6.2f}x       | "
                f"{result[f'{checkpoint}_seeding_cost']:+12.1%}  | "
                f"{result[f'{checkpoint}_step_ms']:7.0f}"
            )
    print_json(
        {
            "benchmark": "randomness_cost",
            "machine": info,
            "chunks": args.chunks,
            "rows_per_microbatch": args.rows,
            "results": results,
        }
    )


if __name__ == "__main__":
    main()
