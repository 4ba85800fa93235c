"""How much slower the model's work runs on CPU when the pipe's workers all run at once.

Layers are profiled one at a time, on one thread (``profile.py``). A Pipe
over CPU partitions runs a worker thread per partition, and those threads
share the machine's cores with each other and with whatever else runs
there: on a 2-core machine that other jobs load, each thread can run two or
three times slower than alone. The factor measured here, the time a thread
takes for forward and backward passes of the model while ``workers``
threads run them at once over the time it takes alone (at least 1), slows
CPU stages in the time model (``timing.py``). It is the
load of the moment it is measured; docs/plan.md says what that leaves out.

Planned for processes (``process_contention``), the workers are the
processes of the group: each times its passes alone, in turn while the
others wait, then all at once, and the largest ratio of the ranks is
every rank's factor.
"""

from __future__ import annotations

import copy
import math
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipeline.plan.agreement import largest
from pipeline.plan.profile import call_layer

__all__ = ["cpu_contention", "process_contention"]

LossFn = Callable[[Any, Any], torch.Tensor]


def cpu_contention(
    model: nn.Sequential,
    sample: Any,
    target: Any,
    loss_fn: LossFn,
    workers: int,
    repeats: int,
) -> float:
    """How much longer a training pass takes while ``workers`` threads each run one (>= 1).

    Each thread times its own passes, started together at a barrier, so
    that starting threads is not counted; the passes are repeated for about
    20 ms so that a small model is timed over more than the clock's noise.
    """
    if workers < 2:
        return 1.0
    work = _training_passes(model, sample, target, loss_fn, workers)
    with torch.random.fork_rng(devices=[]), torch.enable_grad():
        passes = _passes(work)
        alone = statistics.median(_seconds(work, 0, passes) for _ in range(repeats))
        together = statistics.median(
            statistics.median(_concurrent(work, workers, passes)) for _ in range(repeats)
        )
    return max(1.0, together / alone) if alone > 0 else 1.0


def process_contention(
    group: dist.ProcessGroup,
    model: nn.Sequential,
    sample: Any,
    target: Any,
    loss_fn: LossFn,
    repeats: int,
) -> float:
    """How much longer a training pass takes while every process of ``group`` runs one (>= 1).

    A collective, the same on every rank. Each rank times ``repeats``
    batches of passes alone, in turn, the others waiting at a barrier, then
    with all ranks at once, started at a barrier.
    """
    work = _training_passes(model, sample, target, loss_fn, 1)
    me, size = dist.get_rank(group), dist.get_world_size(group)
    with torch.random.fork_rng(devices=[]), torch.enable_grad():
        passes = _passes(work)
        alone: list[float] = []
        for turn in range(size):
            dist.barrier(group=group)
            if turn == me:
                alone = [_seconds(work, 0, passes) for _ in range(repeats)]
        together = []
        for _ in range(repeats):
            dist.barrier(group=group)
            together.append(_seconds(work, 0, passes))
    mine = statistics.median(together) / statistics.median(alone) if min(alone) > 0 else 1.0
    return max(1.0, largest(group, mine))


def _training_passes(
    model: nn.Sequential, sample: Any, target: Any, loss_fn: LossFn, workers: int
) -> Callable[[int], None]:
    """A forward and backward of worker ``k``'s own copy of ``model``, for each of ``workers``."""
    copies = [copy.deepcopy(model).train() for _ in range(workers)]

    def work(k: int) -> None:
        value = sample
        for index, layer in enumerate(copies[k]):
            value = call_layer(copies[k], index, layer, value)
        loss_fn(value, target).backward()

    return work


def _passes(work: Callable[[int], None]) -> int:
    """How many passes take about 20 ms, so that a small model is timed over the clock's noise."""
    once = min(_seconds(work, 0, 1) for _ in range(2))  # the first one warms up
    return max(1, math.ceil(0.02 / max(once, 1e-6)))


def _concurrent(work: Callable[[int], None], workers: int, passes: int) -> list[float]:
    """Each thread's seconds for ``passes`` of ``work``, all started at one barrier."""
    barrier = threading.Barrier(workers)
    seconds = [0.0] * workers

    def run(k: int) -> None:
        barrier.wait()
        seconds[k] = _seconds(work, k, passes)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(workers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return seconds


def _seconds(work: Callable[[int], None], k: int, passes: int) -> float:
    start = time.perf_counter()
    for _ in range(passes):
        work(k)
    return time.perf_counter() - start
