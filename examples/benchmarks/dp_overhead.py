"""Benchmark: step time of pipeline.DataParallel against torch's DDP and a naive all-reduce.

Run: python examples/benchmarks/dp_overhead.py [--layers 16 --width 1024 --batch 64]

Starts two processes (gloo on 127.0.0.1), gives each the same model, and
times forward + backward + gradient averaging per iteration for three ways of
averaging, interleaved iteration by iteration so that all three see the same
machine load: DataParallel, DistributedDataParallel with the same bucket sizes, and
one blocking all-reduce per parameter after backward. It first checks that all
three produce the same gradients. Rank 0 prints a table and a final JSON line.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import socket
import statistics
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from pipeline import DataParallel

WORLD_SIZE = 2
MODES = ("DataParallel", "DDP", "naive")


def build_model(layers: int, width: int) -> nn.Sequential:
    torch.manual_seed(0)
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*blocks)


class NaiveAllReduce(nn.Module):
    """Backward first, then one blocking all-reduce per parameter: no buckets, no overlap."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)

    def average_gradients(self) -> None:
        for param in self.module.parameters():
            assert param.grad is not None
            dist.all_reduce(param.grad)
            param.grad.div_(WORLD_SIZE)


def wrap(mode: str, model: nn.Module, bucket_cap_mb: float) -> nn.Module:
    if mode == "DataParallel":
        return DataParallel(model, bucket_cap_mb=bucket_cap_mb)
    if mode == "DDP":
        return DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
    return NaiveAllReduce(model)


def step_fn(wrapped: nn.Module, x: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        wrapped.zero_grad()
        wrapped(x).square().mean().backward()
        if isinstance(wrapped, NaiveAllReduce):
            wrapped.average_gradients()

    return step


def time_iteration(step: Callable[[], None]) -> float:
    """Seconds for one step on the slowest rank (the barriers line the ranks up)."""
    dist.barrier()
    start = time.perf_counter()
    step()
    dist.barrier()
    return time.perf_counter() - start


def max_grad_difference(a: nn.Module, b: nn.Module) -> float:
    diffs = [
        (pa.grad - pb.grad).abs().max().item()
        for pa, pb in zip(a.parameters(), b.parameters(), strict=True)
        if pa.grad is not None and pb.grad is not None
    ]
    return max(diffs)


def worker(rank: int, port: int, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD_SIZE,
        timeout=timedelta(minutes=2),
    )
    base = build_model(args.layers, args.width)
    models = {mode: copy.deepcopy(base) for mode in MODES}
    wrapped = {mode: wrap(mode, models[mode], args.bucket_cap_mb) for mode in MODES}
    torch.manual_seed(1 + rank)
    x = torch.randn(args.batch, args.width)
    steps = {mode: step_fn(wrapped[mode], x) for mode in MODES}

    for step in steps.values():
        step()  # also builds DataParallel's and DDP's buckets in ready order
    for step in steps.values():
        step()
    mismatch = {mode: max_grad_difference(models[mode], models["DDP"]) for mode in MODES}

    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    for _ in range(args.iterations):
        for mode in MODES:
            times[mode].append(time_iteration(steps[mode]))
    dist.destroy_process_group()
    if rank == 0:
        report(args, base, times, mismatch)


def report(
    args: argparse.Namespace,
    model: nn.Module,
    times: dict[str, list[float]],
    mismatch: dict[str, float],
) -> None:
    median = {mode: statistics.median(t) for mode, t in times.items()}
    params = sum(p.numel() for p in model.parameters())
    print(
        f"{params / 1e6:.1f}M parameters in {args.layers} layers, batch {args.batch} per rank, "
        f"{WORLD_SIZE} processes, gloo, bucket_cap_mb={args.bucket_cap_mb}"
    )
    print(f"{'mode':<14}{'ms/iter (median)':>18}{'min':>10}{'p90':>10}{'max |grad - DDP|':>20}")
    for mode in MODES:
        t = sorted(times[mode])
        p90 = t[int(0.9 * (len(t) - 1))]
        print(
            f"{mode:<14}{median[mode] * 1e3:>18.1f}{t[0] * 1e3:>10.1f}{p90 * 1e3:>10.1f}"
            f"{mismatch[mode]:>20.2e}"
        )
    ratio_ddp = median["DataParallel"] / median["DDP"]
    ratio_naive = median["DataParallel"] / median["naive"]
    print(f"DataParallel / DDP   = {ratio_ddp:.3f} median (time ratio, lower is faster)")
    print(f"DataParallel / naive = {ratio_naive:.3f} median")
    grads_match = all(m <= 1e-5 for m in mismatch.values())
    print(
        json.dumps(
            {
                "benchmark": "dp_overhead",
                "parameters": params,
                "layers": args.layers,
                "batch_per_rank": args.batch,
                "world_size": WORLD_SIZE,
                "ms_per_iter": {mode: round(median[mode] * 1e3, 2) for mode in MODES},
                "dp_over_ddp": round(ratio_ddp, 4),
                "dp_over_naive": round(ratio_naive, 4),
                "grads_match": grads_match,
            }
        )
    )
    if not grads_match:
        raise SystemExit("gradients differ between the three modes")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=64, help="rows per rank")
    parser.add_argument("--bucket-cap-mb", type=float, default=25)
    parser.add_argument("--iterations", type=int, default=40, help="timed steps per mode")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(worker, args=(free_port(), args), nprocs=WORLD_SIZE, join=True)


if __name__ == "__main__":
    main()
