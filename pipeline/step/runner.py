"""Runner: one training step of an explicit schedule, each worker running its program.

The caller's thread hands each worker its whole program (``schedules.py``,
checked by ``simulate.validate``) and waits. A worker runs its actions in
order through the stages it owns (``stage.py``); stages exchange values by
mail (``mail.py``), so the order between workers comes from the data,
as the programs promise. After a stage's last backward (or weight-gradient)
action, the partition backward hooks are called with its index, on the
worker: DataParallel starts that partition's all-reduces while others still
compute.

The first action to fail aborts the transport, so every worker stops at its
next wait or action; the caller re-raises that failure, with a note naming
the action. A Ctrl-C (any exception) in the caller aborts them too, and is
re-raised once every worker has answered: the action a worker is in runs to
its end first, so none writes into ``.grad`` after the step has raised.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from functools import partial

import torch
from torch import Tensor

from pipeline.arguments import CheckpointMode, LossReduction
from pipeline.runtime import rng
from pipeline.runtime.microbatch import Batch
from pipeline.runtime.partitions import Hook, PartitionRuntime
from pipeline.runtime.recompute import checkpoint_stop
from pipeline.runtime.stream import current_stream
from pipeline.runtime.threadstate import ThreadState
from pipeline.runtime.worker import Failure, Replies, Worker, add_note
from pipeline.skip.layout import SkipLayout
from pipeline.step.actions import Program
from pipeline.step.mail import AbortedError, LocalTransport, Transport
from pipeline.step.stage import LossFn, StageRun, StepContext

__all__ = ["StepRun", "checkpointed_tasks", "loss_scales"]


class StepRun:
    """The state of one ``Pipe.step``: stages, transport, losses."""

    def __init__(
        self,
        runtime: PartitionRuntime,
        skip_layout: SkipLayout,
        batches: list[Batch],
        targets: list[Batch],
        loss_fn: LossFn,
        scales: list[float],
        checkpointed: set[tuple[int, int]],
        hooks: list[Hook],
        keep_outputs: bool,
        *,
        transport: Transport | None = None,
        stages: Iterable[int] | None = None,
    ) -> None:
        """The step's ``StepContext``, and a ``StageRun`` per stage run here.

        ``transport`` and ``stages`` (the stages this process runs) default
        to every stage of ``runtime`` in this process.
        """
        self.context = StepContext(
            runtime=runtime,
            skip_layout=skip_layout,
            transport=transport if transport is not None else LocalTransport(runtime.devices),
            state=ThreadState.capture(),
            compute_streams=[current_stream(d) for d in runtime.devices],
            seeds=rng.BaseSeed(),
            batches=batches,
            targets=targets,
            loss_fn=loss_fn,
            scales=scales,
            checkpointed=checkpointed,
            hooks=hooks,
            keep_outputs=keep_outputs,
        )
        self.transport = self.context.transport
        local = range(len(runtime)) if stages is None else stages
        self.stage_runs = {j: StageRun(self.context, j) for j in local}

    def run(self, programs: list[Program], workers: list[Worker]) -> None:
        """Run each program on its worker thread; re-raise the first failure.

        An interrupt aborts the transport and is re-raised once every worker
        has answered (``Replies.collect``).
        """
        replies = Replies()
        for w, program in enumerate(programs):
            workers[w].submit(partial(self._work, program), replies)
        results = replies.collect(len(programs), interrupted=self.transport.abort)
        failures = [result.exception for result in results if isinstance(result, Failure)]
        if failures:
            raise next((f for f in failures if not isinstance(f, AbortedError)), failures[0])

    def run_here(self, program: Program) -> None:
        """Run ``program`` on this thread (a process that runs one worker's stages)."""
        try:
            self._work(program)
        except KeyboardInterrupt:
            self.transport.abort()
            raise

    def _work(self, program: Program) -> None:
        for action in program:
            self.transport.check()
            try:
                self.stage_runs[action.stage].act(action)
            except BaseException as exception:
                if not isinstance(exception, AbortedError):
                    add_note(exception, f"(raised in action {action} of the schedule)")
                self.transport.abort(exception)
                raise

    def loss(self) -> Tensor:
        """The step's loss: the sum of the micro-batches' scaled losses (last stage only)."""
        last = self.stage_runs[self.context.stages - 1]
        return torch.stack([last.losses[i] for i in range(self.context.m)]).sum()

    @property
    def outputs(self) -> list[Batch]:
        """The micro-batches' outputs, detached, in order (last stage, keep_outputs only)."""
        last = self.stage_runs[self.context.stages - 1]
        return [last.outputs[i] for i in range(self.context.m)]

    @property
    def peak_in_flight(self) -> dict[int, int]:
        """Per stage run here, the most micro-batches it held at once."""
        return {j: stage.peak_in_flight for j, stage in self.stage_runs.items()}


def loss_scales(rows: list[int], reduction: LossReduction) -> list[float]:
    """What each micro-batch's loss is multiplied by, so the step's gradient is the batch's.

    ``'mean'``: a micro-batch of r rows out of R counts r / R (uneven splits
    included); ``'sum'``: each counts once.

    >>> loss_scales([3, 3, 3, 1], "mean")
    [0.3, 0.3, 0.3, 0.1]
    >>> loss_scales([3, 1], "sum")
    [1.0, 1.0]
    """
    total = sum(rows)
    return [r / total if reduction == "mean" else 1.0 for r in rows]


def checkpointed_tasks(
    programs: list[Program], m: int, mode: CheckpointMode, training: bool
) -> set[tuple[int, int]]:
    """The (micro-batch, partition) tasks whose forward drops its activations.

    ``'except_last'`` spares the last micro-batch in the ``pipe(x)`` path
    because its backward starts right after its forward, so recomputing it
    would only delay it. In a program, that holds for every forward directly
    followed by its own backward (each one on the last partition with
    1F1B): those are spared.
    """
    stop = checkpoint_stop(mode, m, training)
    tasks = {
        (a.microbatch, a.stage)
        for program in programs
        for a in program
        if a.kind == "F" and a.microbatch < stop
    }
    if mode != "except_last":
        return tasks
    for program in programs:
        for action, after in itertools.pairwise(program):
            task = (action.microbatch, action.stage)
            if (
                action.kind == "F"
                and after.kind in ("B", "I")
                and task == (after.microbatch, after.stage)
            ):
                tasks.discard(task)
    return tasks
