"""How much slower the model's work runs on CPU when the pipe's workers all run at once.

Layers are profiled one at a time, on one thread (``profile.py``). A Pipe
over CPU partitions runs a worker thread per partition, and those threads
share the machine's cores with each other and with whatever else runs
there: on a 2-core machine that other jobs load, each thread can run two or
three times slower than alone. And they share the interpreter: a forward
under the seeding mode (``pipeline/runtime/rng.py``) sends every op through
Python, holding the GIL, where a backward runs in autograd's engine
without it; so two threads' forwards wait for each other where their
backwards do not. The factors measured here, the time a thread takes for
forward passes, then for backward passes, while ``workers`` threads run
them at once, over the time each takes alone (at least 1), slow CPU stages'
forwards and backwards in the time model (``timing.py``). They are the
load of the moment they are measured; docs/plan.md says what that leaves
out.

Planned for processes in a group, each stage is a process of its own, and
what slows its layers there is measured in a DistributedPipe instead
(``pace.py``).
"""

from __future__ import annotations

import copy
import math
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pipeline.plan.profile import call_layer, task_forward

__all__ = ["NO_CONTENTION", "Contention", "cpu_contention"]

LossFn = Callable[[Any, Any], torch.Tensor]


@dataclass(frozen=True)
class Contention:
    """How much slower a stage's forward and its backward run while every worker computes."""

    forward: float = 1.0
    backward: float = 1.0

    def __mul__(self, other: Contention) -> Contention:
        """Both slowdowns at once."""
        return Contention(self.forward * other.forward, self.backward * other.backward)

    def __str__(self) -> str:
        if self.forward == self.backward:
            return f"x{self.forward:.2f}"
        return f"x{self.forward:.2f} forward, x{self.backward:.2f} backward"


NO_CONTENTION = Contention()  # a core per worker and no lock


def cpu_contention(
    model: nn.Sequential,
    sample: Any,
    target: Any,
    loss_fn: LossFn,
    workers: int,
    repeats: int,
    seeded: bool = False,
) -> Contention:
    """How much longer forward and backward passes take while ``workers`` threads each run
    them (each >= 1).

    Each thread times its own forward passes, then its own backward passes,
    each phase started together at a barrier, so that starting threads is
    not counted; the passes are repeated for about 20 ms so that a small
    model is timed over more than the clock's noise. ``seeded``: each
    forward runs under the mode that seeds random ops, as the pipe's tasks
    will.
    """
    if workers < 2:
        return NO_CONTENTION
    forward = _forward_passes(model, sample, target, loss_fn, workers, seeded)
    with torch.random.fork_rng(devices=[]), torch.enable_grad():
        passes = _passes(lambda k: forward(k).backward())
        alone = [_phases(forward, [0], passes) for _ in range(repeats)]
        together = [_phases(forward, list(range(workers)), passes) for _ in range(repeats)]
    ratios = []
    for phase in range(2):
        single = statistics.median(a[0][phase] for a in alone)
        shared = statistics.median(statistics.median(t[phase] for t in run) for run in together)
        ratios.append(max(1.0, shared / single) if single > 0 else 1.0)
    return Contention(*ratios)


def _forward_passes(
    model: nn.Sequential,
    sample: Any,
    target: Any,
    loss_fn: LossFn,
    workers: int,
    seeded: bool = False,
) -> Callable[[int], torch.Tensor]:
    """Worker ``k``'s forward pass of its own copy of ``model`` and the loss, for each of
    ``workers``: the loss, whose backward is the pass's backward."""
    copies = [copy.deepcopy(model).train() for _ in range(workers)]

    def forward(k: int) -> torch.Tensor:
        value = sample
        with task_forward(seeded):
            for index, layer in enumerate(copies[k]):
                value = call_layer(copies[k], index, layer, value)
            return loss_fn(value, target)

    return forward


def _passes(work: Callable[[int], None]) -> int:
    """How many passes take about 20 ms, so that a small model is timed over the clock's noise."""
    once = min(_seconds(work, 0, 1) for _ in range(2))  # the first one warms up
    return max(1, math.ceil(0.02 / max(once, 1e-6)))


def _phases(
    forward: Callable[[int], torch.Tensor], workers: list[int], passes: int
) -> list[tuple[float, float]]:
    """Each worker's seconds for ``passes`` forwards, then for their backwards, each phase
    started by all of ``workers`` at one barrier."""
    barrier = threading.Barrier(len(workers))
    seconds = [(0.0, 0.0)] * len(workers)
    errors: list[BaseException] = []

    def run(slot: int, k: int) -> None:
        try:
            barrier.wait()
            start = time.perf_counter()
            losses = [forward(k) for _ in range(passes)]
            middle = time.perf_counter()
            barrier.wait()
            again = time.perf_counter()
            for loss in losses:
                loss.backward()
            seconds[slot] = (middle - start, time.perf_counter() - again)
        except threading.BrokenBarrierError:
            pass  # another worker failed: its error is raised
        except BaseException as error:
            errors.append(error)
            barrier.abort()  # no worker waits at the barrier for this one

    threads = [threading.Thread(target=run, args=(s, k)) for s, k in enumerate(workers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return seconds


def _seconds(work: Callable[[int], None], k: int, passes: int) -> float:
    start = time.perf_counter()
    for _ in range(passes):
        work(k)
    return time.perf_counter() - start
