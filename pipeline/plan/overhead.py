"""The library's own cost per action on these devices, measured with a pipe of tiny layers.

An action of ``pipe.step`` costs more than its layers: the hand-off to its
worker thread, the mail, the leaves, the timing. On an idle machine that is
tens of microseconds (docs/benchmarks.md, "Pipe overhead"); on a loaded one
a worker waiting for its next action can wait for a core for milliseconds.
So it is measured where the plan will run: a Pipe of one tiny Linear per
device runs 1F1B steps of ``chunks`` micro-batches, and the median step
time over the programs' length in actions (played with each action costing
1) is the seconds per action.
"""

from __future__ import annotations

import statistics
import time

import torch
from torch import nn

from pipeline.pipe import Pipe
from pipeline.step.schedules import OneFOneB
from pipeline.step.simulate import play

__all__ = ["action_overhead"]


def action_overhead(devices: list[torch.device], chunks: int, repeats: int) -> float:
    """Seconds per action of ``pipe.step`` on ``devices`` beyond its layers' compute."""
    stages = len(devices)
    times = []
    # The caller's generators are left as they were: the layers' initialisation draws.
    with torch.random.fork_rng(devices=[]):
        model = nn.Sequential(*[nn.Linear(1, 1) for _ in range(stages)])
        pipe = Pipe(model, [1] * stages, devices=devices, chunks=chunks, checkpoint="never")
        x = torch.zeros(chunks, 1)
        try:
            for run in range(repeats + 1):
                start = time.perf_counter()
                pipe.step(x, x, nn.functional.mse_loss, schedule="1f1b")
                if run:  # the first one warms up
                    times.append(time.perf_counter() - start)
        finally:
            pipe.close()
    _, end = play(OneFOneB().programs(chunks, stages), stages, lambda action: 1.0)
    return statistics.median(times) / max(end.values())
