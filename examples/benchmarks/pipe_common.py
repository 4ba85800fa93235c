"""What the Pipe benchmarks share: timing in rounds, the machine, torchgpipe, the JSON line.

The benchmarks run on machines that other jobs share, so every candidate of a
comparison runs once per round, in turn, and keeps its best time: candidates
see the same load, and the best of a few rounds is the least disturbed.
"""

from __future__ import annotations

import json
import os
import platform
import threading
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

__all__ = [
    "best_times",
    "machine",
    "print_json",
    "round_times",
    "thread_scaling",
    "torchgpipe_or_none",
]


def best_times(
    candidates: dict[str, Callable[[], object]], rounds: int, warmup: int = 1
) -> dict[str, float]:
    """The best wall time in seconds of each candidate over ``rounds`` rounds.

    Example: ``best_times({"a": f, "b": g}, rounds=3)["a"]``.
    """
    for _ in range(warmup):
        for run in candidates.values():
            run()
    best = dict.fromkeys(candidates, float("inf"))
    for _ in range(rounds):
        for name, run in candidates.items():
            start = time.perf_counter()
            run()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


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

    times = best_times({"one": one_thread, "two": two_threads}, rounds)
    return times["one"] / times["two"]


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
