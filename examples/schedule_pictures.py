"""The schedules as pictures: GPipe, 1F1B and ZB-H1 measured on a real step, drawn as SVG.

A model of 8 blocks of Linear + GELU over ``--partitions`` CPU partitions
(one intra-op thread each, so that partitions overlap on separate cores), one
training step of each schedule at ``--chunks`` micro-batches, traced after a
warm-up step, and drawn by ``Trace.save_svg``: one row per partition, forward
in blue, backward in red, input and weight gradients (ZB-H1) in orange and
green, waits for a message in grey. The figures in README.md and
docs/schedules.md were made by:

    python examples/schedule_pictures.py --out docs/images

It prints each schedule's step time and its partitions' idle shares.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import pipeline

SCHEDULES = ("gpipe", "1f1b", "zb-h1")


def model(width: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(8)))


def draw(schedule: str, args: argparse.Namespace) -> str:
    """Trace one step of ``schedule`` after a warm-up, save its picture, return a summary line."""
    balance = [8 // args.partitions] * args.partitions
    pipe = pipeline.Pipe(
        model(args.width),
        balance,
        devices=["cpu"] * args.partitions,
        chunks=args.chunks,
        checkpoint="never",
    )
    x = torch.randn(args.chunks * args.rows, args.width)
    y = torch.randn(args.chunks * args.rows, args.width)
    pipe.step(x, y, F.mse_loss, schedule=schedule)  # warm-up: threads, allocator
    with pipeline.trace() as t:
        pipe.step(x, y, F.mse_loss, schedule=schedule)
    pipe.close()
    path = args.out / f"{schedule}.svg"
    title = (
        f"{schedule}: {args.partitions} partitions, {args.chunks} micro-batches of "
        f"{args.rows} x {args.width}, measured on CPU"
    )
    t.save_svg(path, title=title)
    report = t.summary()
    idle = ", ".join(f"{p.idle_fraction:.0%}" for p in report.partitions)
    return f"{schedule}: {report.window * 1e3:.1f} ms, idle {idle}; wrote {path}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("."), help="folder for the SVG files")
    parser.add_argument("--partitions", type=int, default=2, help="CPU partitions (divides 8)")
    parser.add_argument("--chunks", type=int, default=4, help="micro-batches per step")
    parser.add_argument("--rows", type=int, default=64, help="rows per micro-batch")
    parser.add_argument("--width", type=int, default=512, help="the Linear layers' width")
    args = parser.parse_args()
    if 8 % args.partitions:
        parser.error(f"--partitions must divide the 8 blocks, got {args.partitions}")
    args.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    for schedule in SCHEDULES:
        print(draw(schedule, args))


if __name__ == "__main__":
    main()
