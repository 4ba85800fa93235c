"""The library's own cost per action on these devices, measured with a pipe of tiny layers.

An action of ``pipe.step`` costs more than its layers: the hand-off to its
worker thread, the mail, the leaves, the timing. On an idle machine that is
tens of microseconds (docs/benchmarks.md, "Pipe overhead"); on a loaded one
a worker waiting for its next action can wait for a core for milliseconds.
So it is measured where the plan will run: a Pipe of one tiny Linear per
device runs 1F1B steps of ``chunks`` micro-batches, and the median step
time over the programs' length in actions (played with each action costing
1) is the seconds per action.

Planned for processes (``distributed_action_overhead``), the pipe is a
``DistributedPipe`` of one tiny Linear per process, and the seconds per
action are those that, with its messages costing what the measured link
says (``links.py``), play its programs in its measured step time: what the
transport adds per message beyond the link's latency (its envelope, its
listener thread), and the step's own agreement, count per action.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from pipeline.base import PipeBase
from pipeline.pipe import Pipe
from pipeline.plan.agreement import largest
from pipeline.plan.links import CutSeconds, Link
from pipeline.plan.timing import StageCosts, matching, predicted_seconds
from pipeline.step.reports import DistributedStepReport, StepReport
from pipeline.step.schedules import OneFOneB
from pipeline.step.simulate import play

__all__ = ["action_overhead", "distributed_action_overhead"]


def action_overhead(devices: list[torch.device], chunks: int, repeats: int) -> float:
    """Seconds per action of ``pipe.step`` on ``devices`` beyond its layers' compute."""
    stages = len(devices)
    seconds = _tiny_steps(
        lambda model: Pipe(model, [1] * stages, devices=devices, chunks=chunks, checkpoint="never"),
        stages,
        chunks,
        repeats,
        reported=False,
    )
    _, end = play(OneFOneB().programs(chunks, stages), stages, lambda action: 1.0)
    return seconds / max(end.values())


def distributed_action_overhead(
    group: dist.ProcessGroup, device: torch.device, link: Link, chunks: int, repeats: int
) -> float:
    """Seconds per action of a ``DistributedPipe`` step over ``group``, beyond compute and link.

    A collective, the same on every rank: the largest of the ranks' median
    step times (``last_step.duration``) is played, with each message
    costing ``link``'s time for its bytes, by bisection on the seconds per
    action.
    """
    from pipeline.distributed import DistributedPipe  # it imports pipeline, which imports this

    stages = dist.get_world_size(group)
    seconds = largest(
        group,
        _tiny_steps(
            lambda model: DistributedPipe(
                model, [1] * stages, group=group, device=device, chunks=chunks, checkpoint="never"
            ),
            stages,
            chunks,
            repeats,
            reported=True,
        ),
    )
    programs = OneFOneB().programs(chunks, stages)
    # Each message holds one row of one float32: an activation, or its gradient.
    message = link.seconds(4)
    cuts = CutSeconds((message,) * (stages - 1), (message,) * (stages - 1))

    def played(per_action: float) -> float:
        none = StageCosts(0.0, 0.0, 0.0, 0.0)
        return predicted_seconds(programs, [none] * stages, set(), per_action, None, cuts)

    return matching(played, seconds, 0.0, seconds)  # 0: the link alone takes the step's time


def _tiny_steps(
    build: Callable[[nn.Sequential], PipeBase],
    stages: int,
    chunks: int,
    repeats: int,
    reported: bool,
) -> float:
    """The median seconds of 1F1B steps of a pipe of one Linear(1, 1) per stage; one warms up.

    ``reported``: as its ``last_step.duration`` says (a DistributedPipe's
    process, from its first action's start to its last one's end, what
    ``Plan.check`` measures); else around the call.
    """
    times = []
    # The caller's generators are left as they were: the layers' initialisation draws.
    with torch.random.fork_rng(devices=[]):
        pipe = build(nn.Sequential(*[nn.Linear(1, 1) for _ in range(stages)]))
        x = torch.zeros(chunks, 1)
        try:
            for run in range(repeats + 1):
                start = time.perf_counter()
                pipe.step(x, x, nn.functional.mse_loss, schedule="1f1b")
                seconds = time.perf_counter() - start
                report: StepReport | DistributedStepReport | None = getattr(pipe, "last_step", None)
                if reported and report is not None:
                    seconds = report.duration
                if run:
                    times.append(seconds)
        finally:
            pipe.close()
    return statistics.median(times)
