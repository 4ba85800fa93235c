"""What the Pipe benchmarks share: timing in rounds, training steps, the machine, the JSON line.

The benchmarks run on machines that other jobs share, so every candidate of a
comparison runs once per round, in turn, and the figures are medians over the
rounds: candidates see the same load, and a median follows neither one
disturbed round nor one lucky round (a best time would hide contention).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import threading
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
from torch import Tensor, nn

import pipeline

__all__ = [
    "Run",
    "call_step",
    "check_gradients",
    "explicit_step",
    "machine",
    "median_ratio",
    "median_times",
    "plain_step",
    "print_json",
    "round_times",
    "thread_scaling",
    "torchgpipe_or_none",
]


def round_times(
    candidates: dict[str, Callable[[], object]], rounds: int, warmup: int = 1
) -> dict[str, list[float]]:
    """The wall time in seconds of each candidate in each of ``rounds`` rounds.

    Every candidate runs once per round; the order turns by one each round,
    so that no candidate always follows the same neighbour. Compare
    candidates round by round (the load a round sees is shared) and take
    medians. Example: ``statistics.median(round_times({"a": f}, rounds=5)["a"])``.
    """
    names = list(candidates)
    for _ in range(warmup):
        for run in candidates.values():
            run()
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        turn = r % len(names)
        for name in names[turn:] + names[:turn]:
            start = time.perf_counter()
            candidates[name]()
            times[name].append(time.perf_counter() - start)
    return times


def median_times(times: dict[str, list[float]]) -> dict[str, float]:
    """Each candidate's median over the rounds of ``round_times``."""
    return {name: statistics.median(ts) for name, ts in times.items()}


def median_ratio(times: dict[str, list[float]], numerator: str, denominator: str) -> float:
    """The median over rounds of ``numerator``'s time / ``denominator``'s in the same round.

    Pairing the rounds cancels what changes slowly (the machine's load).
    Example: ``median_ratio(round_times(runs, 5), "plain", "pipe")``, a speedup.
    """
    ratios = [a / b for a, b in zip(times[numerator], times[denominator], strict=True)]
    return statistics.median(ratios)


def thread_scaling(work: Callable[[], object], rounds: int) -> float:
    """How much faster two threads do ``work`` twice than one thread does.

    It is what the machine gives two CPU partitions right now: 2.0 on two
    idle cores, less when other jobs hold them. Example:
    ``thread_scaling(lambda: block(x), rounds=3)``.
    """

    def one_thread() -> None:
        work()
        work()

    def two_threads() -> None:
        threads = [threading.Thread(target=work) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    times = round_times({"one": one_thread, "two": two_threads}, rounds)
    return median_ratio(times, "one", "two")


def machine() -> dict[str, Any]:
    """The machine and its load when the benchmark starts.

    Example: ``machine()["nproc"]``.
    """
    return {
        "nproc": os.cpu_count(),
        "cpu": _cpu_model(),
        "load_average": [round(load, 2) for load in os.getloadavg()],
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def torchgpipe_or_none() -> ModuleType | None:
    """The torchgpipe module to compare against, or None (saying so) when it is missing.

    Example: ``gpipe = torchgpipe_or_none()``.
    """
    try:
        import torchgpipe  # type: ignore[import-not-found]
    except ImportError:
        print("torchgpipe is not installed: skipping the torchgpipe comparison")
        return None
    module: ModuleType = torchgpipe
    return module


def start_single_threaded() -> tuple[dict[str, Any], ModuleType | None]:
    """Set one intra-op thread and seed 0; print the machine; find torchgpipe.

    Example: ``info, torchgpipe = start_single_threaded()``.
    """
    torch.set_num_threads(1)
    torch.manual_seed(0)
    info = machine()
    print(f"machine: {info}")
    return info, torchgpipe_or_none()


def print_json(result: dict[str, Any]) -> None:
    """Print ``result`` as the benchmark's last line, one JSON object.

    Example: ``print_json({"benchmark": "overhead", "forward_us": 40.0})``.
    """
    print(json.dumps(result))


Run = Callable[[], object]


def sum_loss(output: Tensor, _: Tensor) -> Tensor:
    return output.sum()


def plain_step(model: nn.Module, x: Tensor, chunks: int) -> Run:
    """The plain model's step on ``x``'s micro-batches, one after another."""

    def run() -> None:
        model.zero_grad(set_to_none=True)
        for piece in x.chunk(chunks):
            model(piece).sum().backward()

    return run


def call_step(module: nn.Module, x: Tensor) -> Run:
    """``module(x).sum().backward()``: ``pipe(x)``, torchgpipe's ``GPipe(x)``."""

    def run() -> None:
        module.zero_grad(set_to_none=True)
        module(x).sum().backward()

    return run


def explicit_step(pipe: pipeline.Pipe, x: Tensor, schedule: str) -> Run:
    """``pipe.step`` of the outputs' sum (the loss ``call_step`` takes)."""

    def run() -> None:
        pipe.zero_grad(set_to_none=True)
        pipe.step(x, x, sum_loss, schedule=schedule, loss_reduction="sum")

    return run


def check_gradients(runs: dict[str, tuple[Run, nn.Module]]) -> None:
    """Every candidate's step leaves the plain model's gradients (``runs["plain"]``)."""
    run, plain = runs["plain"]
    run()
    expected = [p.grad for p in plain.parameters()]
    for name, (run, module) in runs.items():
        run()
        for found, grad in zip(module.parameters(), expected, strict=True):
            assert found.grad is not None and grad is not None, name
            torch.testing.assert_close(found.grad, grad, msg=name)
