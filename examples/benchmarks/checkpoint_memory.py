"""Benchmark: peak memory of a training step for each checkpoint mode, against the plain model.

The model is 8 blocks of Linear(1024, 1024) + ReLU in 2 partitions, trained
on one batch of ``--rows`` rows split into ``--chunks`` micro-batches, by
``pipe(x)`` then ``backward()`` (``pipe``; ``pipe-one-thread`` with
``threads="device"``, torchgpipe's layout on one device), by ``pipe.step`` with 1F1B
(``step``), and by torchgpipe where it is installed. Each
configuration runs in a fresh Python process, so that nothing another one
allocated is counted; there a first step allocates what stays (gradients,
per-thread buffers) and the second is measured:

- on CUDA, ``torch.cuda.max_memory_allocated`` during the step, minus the
  memory allocated before it;
- on the CPU, the growth of the process's peak resident memory during the
  step (``VmHWM`` in /proc/self/status, reset before the step; ``ru_maxrss``
  where it cannot be reset), with glibc told to return large blocks to the
  system at once so that freed activations leave the resident set.

The worker threads do not see autograd's saved-tensor hooks (they are
thread-local), so counting saved activations with them would miss the
partitions; process memory counts everything. The last line is JSON.

Run: python examples/benchmarks/checkpoint_memory.py [--rows 4096] [--chunks 8]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import resource
import subprocess
import sys
from typing import Any

import torch
from pipe_common import machine, print_json, torchgpipe_or_none
from torch import nn

import pipeline
from pipeline.arguments import CheckpointMode

WIDTH = 1024
BLOCKS = 8
MODES: tuple[CheckpointMode, ...] = ("never", "except_last", "always")
CONFIGURATIONS = ["plain"] + [
    f"{backend} {mode}"
    for backend in ("pipe", "pipe-one-thread", "step", "torchgpipe")
    for mode in MODES
]
# glibc serves blocks above this size with mmap and unmaps them when freed.
MALLOC_ENV = {
    "MALLOC_MMAP_THRESHOLD_": str(1 << 16),
    "MALLOC_TRIM_THRESHOLD_": str(1 << 16),
    "MALLOC_ARENA_MAX": "1",
}


def blocks() -> nn.Sequential:
    layers: list[nn.Module] = []
    for _ in range(BLOCKS):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    return nn.Sequential(*layers)


def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def build(configuration: str, chunks: int) -> nn.Module:
    """The model of ``configuration``: ``plain``, or a backend and a checkpoint mode."""
    model = blocks()
    if configuration == "plain":
        return model.to(device())
    backend, name = configuration.split()
    mode = next(m for m in MODES if m == name)
    halves = [len(model) // 2, len(model) - len(model) // 2]
    if backend == "torchgpipe":
        torchgpipe = torchgpipe_or_none()
        assert torchgpipe is not None, "the parent runs torchgpipe only where it is installed"
        gpipe: nn.Module = torchgpipe.GPipe(
            model, balance=halves, devices=[device()] * 2, chunks=chunks, checkpoint=mode
        )
        return gpipe
    return pipeline.Pipe(
        model,
        balance=halves,
        devices=[device()] * 2,
        chunks=chunks,
        checkpoint=mode,
        threads="device" if backend == "pipe-one-thread" else "auto",
    )


def peak_rss_kib() -> int:
    """The process's peak resident memory so far, in KiB."""
    try:
        with open("/proc/self/status") as status:
            found = re.search(r"VmHWM:\s+(\d+) kB", status.read())
        if found:
            return int(found.group(1))
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def reset_peak_rss() -> None:
    # Writing 5 to clear_refs resets VmHWM (Linux 4.0+); elsewhere the peak
    # stays that of the whole process, which the baseline then absorbs.
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
    except OSError:
        pass


def step_peak_bytes(configuration: str, rows: int, chunks: int) -> int:
    """Memory a training step needs beyond what was allocated before it.

    A first step is run and not measured: it allocates what stays (each
    thread's BLAS buffers, the allocator's pools). Then the gradients are set
    to None, as ``optimizer.zero_grad()`` does, so the measured step counts
    what a training step adds: activations, and the gradients themselves.
    """
    torch.manual_seed(0)
    model = build(configuration, chunks)
    x = torch.randn(rows, WIDTH, device=device())
    train_step(configuration, model, x)
    model.zero_grad(set_to_none=True)
    gc.collect()
    if device() == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        train_step(configuration, model, x)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    reset_peak_rss()
    before = peak_rss_kib()
    train_step(configuration, model, x)
    return (peak_rss_kib() - before) * 1024


def train_step(configuration: str, model: nn.Module, x: torch.Tensor) -> None:
    """Forward and backward of ``x.sum()``: by ``Pipe.step`` for the ``step`` configurations."""
    if configuration.startswith("step"):
        assert isinstance(model, pipeline.Pipe)
        target = torch.zeros(len(x), 1, device=device())
        model.step(x, target, lambda output, _: output.sum(), loss_reduction="sum")
    else:
        model(x).sum().backward()


def run_child(configuration: str, rows: int, chunks: int) -> int:
    """Measure ``configuration`` in a fresh process; its answer is its last line."""
    command = [sys.executable, __file__, "--child", configuration]
    command += ["--rows", str(rows), "--chunks", str(chunks)]
    env = {**os.environ, **MALLOC_ENV}
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    answer: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return int(answer["peak_bytes"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=4096, help="rows in the batch")
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--child", choices=CONFIGURATIONS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.child:
        print(json.dumps({"peak_bytes": step_peak_bytes(args.child, args.rows, args.chunks)}))
        return

    info = machine()
    print(f"machine: {info}")
    configurations = [c for c in CONFIGURATIONS if not c.startswith("torchgpipe")]
    if torchgpipe_or_none() is not None:
        configurations += [c for c in CONFIGURATIONS if c.startswith("torchgpipe")]
    activation = args.rows * WIDTH * 4
    print(
        f"one training step, {args.rows} rows x {WIDTH} wide in {args.chunks} micro-batches on "
        f"{device()}; one activation of the batch is {activation / 2**20:.0f} MiB"
    )
    peaks = {c: run_child(c, args.rows, args.chunks) for c in configurations}
    for configuration, peak in peaks.items():
        label = "plain model" if configuration == "plain" else configuration.replace(" ", ", ")
        print(
            f"  {label:26s} {peak / 2**20:8.1f} MiB  "
            f"({peak / peaks['plain']:.2f} of the plain model's)"
        )
    print_json(
        {
            "benchmark": "checkpoint_memory",
            "machine": info,
            "device": device(),
            "rows": args.rows,
            "chunks": args.chunks,
            "peak_mib": {c: round(p / 2**20, 1) for c, p in peaks.items()},
            "relative_to_plain": {c: p / peaks["plain"] for c, p in peaks.items()},
        }
    )


if __name__ == "__main__":
    main()
