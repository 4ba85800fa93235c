"""How much slower the model's work runs on CPU when the pipe's workers all run at once.

Layers are profiled one at a time, on one thread (``profile.py``). A Pipe
over CPU partitions runs a worker thread per partition, and those threads
share the machine's cores with each other and with whatever else runs
there: on a 2-core machine that other jobs load, each thread can run two or
three times slower than alone. The factor measured here, the median wall
time of ``workers`` threads each running one forward and backward of the
model at once over the median time of one thread alone (at least 1),
scales every CPU stage's cost in the time model (``timing.py``). It is the
load of the moment it is measured; docs/plan.md says what that leaves out.
"""

from __future__ import annotations

import copy
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from pipeline.runtime.microbatch import Arguments

__all__ = ["cpu_contention"]


def cpu_contention(
    model: nn.Sequential,
    sample: Any,
    target: Any,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    workers: int,
    repeats: int,
) -> float:
    """Wall time of ``workers`` concurrent training passes over that of one pass alone (>= 1)."""
    if workers < 2:
        return 1.0
    copies = [copy.deepcopy(model).train() for _ in range(workers)]

    def work(k: int) -> None:
        output = sample.call(copies[k]) if isinstance(sample, Arguments) else copies[k](sample)
        loss_fn(output, target).backward()

    def together() -> None:
        threads = [threading.Thread(target=work, args=(k,)) for k in range(workers)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    with torch.random.fork_rng(devices=[]), torch.enable_grad():
        work(0)  # warm-up
        alone = statistics.median(_seconds(lambda: work(0)) for _ in range(repeats))
        both = statistics.median(_seconds(together) for _ in range(repeats))
    return max(1.0, both / alone) if alone > 0 else 1.0


def _seconds(function: Callable[[], None]) -> float:
    start = time.perf_counter()
    function()
    return time.perf_counter() - start
