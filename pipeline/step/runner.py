"""Runner: one training step of an explicit schedule, each worker running its programs.

The caller's thread hands each worker its whole programs (``schedules.py``,
checked by ``simulate.validate``) and waits. A worker running one program
runs its actions in order through the stages it owns (``stage.py``). A
thread running several programs (stages sharing it, ``threads='device'``)
runs their actions in an order that validating them gave
(``Simulation.thread_order``): where it runs every stage, one where each
action's mail is there when it starts; beside other threads, the order in
which the actions started in the play. An evaluation's programs, not
validated, run whichever next action has its mail there (``_in_turn``).
Either way the thread never waits for an action that cannot come. Stages
exchange values by mail
(``mail.py``), so the order between programs comes from the data, as the
programs promise. After a stage's last backward (or weight-gradient)
action, its parameters get their gradients (``gradients.py``) and the
partition backward hooks are called with its index, on the worker:
DataParallel starts that partition's all-reduces while others still
compute. What waits for the step's end (the caller's graph, tensors no
partition registers) is accumulated by ``finish``, once every worker is
done.

The first action to fail aborts the transport, so every worker stops at its
next wait or action; the caller re-raises that failure, with a note naming
the action. A Ctrl-C (any exception) in the caller aborts them too, and is
re-raised once every worker has answered: the action a worker is in runs to
its end first, so none writes into ``.grad`` after the step has raised.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial

import torch
import torch._functorch.config
from torch import Tensor

from pipeline.arguments import CheckpointMode
from pipeline.runtime import rng
from pipeline.runtime.microbatch import Batch
from pipeline.runtime.partitions import Hook, PartitionRuntime
from pipeline.runtime.recompute import checkpoint_stop
from pipeline.runtime.rng import PartitionRandomness
from pipeline.runtime.router_loss import RouterTally
from pipeline.runtime.stream import current_stream
from pipeline.runtime.threadstate import ThreadState
from pipeline.runtime.worker import Failure, Replies, Worker, add_note
from pipeline.skip.layout import SkipLayout
from pipeline.step.actions import Action, Program
from pipeline.step.gradients import GradientSums, StepGradients
from pipeline.step.losses import LossFn, Scale
from pipeline.step.mail import AbortedError, LocalTransport, Transport, describe
from pipeline.step.reports import Timed
from pipeline.step.simulate import Simulation
from pipeline.step.stage import StageRun, StepContext

__all__ = ["StepRun", "checkpointed_tasks", "forward_programs", "programs_by_worker"]


class StepRun:
    """The state of one ``Pipe.step`` (or evaluation): stages, transport, losses."""

    def __init__(
        self,
        runtime: PartitionRuntime,
        skip_layout: SkipLayout,
        batches: list[Batch],
        targets: list[Batch],
        loss_fn: LossFn | None,
        scales: list[Scale],
        checkpointed: set[tuple[int, int]],
        hooks: list[Hook],
        keep_outputs: bool,
        randomness: list[PartitionRandomness],
        backward_in_two: bool,
        *,
        transport: Transport | None = None,
        stages: Iterable[int] | None = None,
        grad_scaler: torch.amp.GradScaler | None = None,
        forward_only: bool = False,
        measure_memory: bool = False,
        at_end: Iterable[Tensor] = (),
        router: RouterTally | None = None,
    ) -> None:
        """The step's ``StepContext``, and a ``StageRun`` per stage run here.

        ``randomness[j]``: how stage ``j``'s tasks draw. ``backward_in_two``:
        the programs split backward into I and W. ``transport`` and
        ``stages`` (the stages this process runs) default to every stage of
        ``runtime`` in this process; the other options are ``StepContext``'s.
        The gradients of the tensors ``at_end`` are left to the caller
        (``finish``).
        """
        local = list(range(len(runtime)) if stages is None else stages)
        state = ThreadState.capture()
        if backward_in_two:
            # A compiled node on the input path without weights of its own
            # runs in I with the graph kept for W (one with weights makes I a
            # whole backward: backward_in_two.py): AOTAutograd must not donate
            # its saved buffers to that call.
            # Set in the step's context only: it reaches the graphs compiled
            # in this step, and the caller keeps its own setting.
            state.context.run(setattr, torch._functorch.config, "donated_buffer", False)
        self.context = StepContext(
            runtime=runtime,
            skip_layout=skip_layout,
            transport=transport if transport is not None else LocalTransport(runtime.devices),
            state=state,
            compute_streams=[current_stream(d) for d in runtime.devices],
            seeds=rng.BaseSeed(),
            randomness=randomness,
            batches=batches,
            targets=targets,
            loss_fn=loss_fn,
            scales=scales,
            checkpointed=checkpointed,
            hooks=hooks,
            keep_outputs=keep_outputs,
            gradients=StepGradients(runtime.partitions, local, at_end),
            grad_scaler=grad_scaler,
            forward_only=forward_only,
            measure_memory=measure_memory,
            loss_travels=not forward_only and len(local) < len(runtime),
            router=router,
        )
        self.transport = self.context.transport
        self.stage_runs = {j: StageRun(self.context, j) for j in local}

    def run(
        self,
        programs: list[Program],
        workers: list[Worker],
        by_worker: dict[int, list[int]],
        simulation: Simulation | None = None,
    ) -> None:
        """Run ``programs[k]`` for each ``k`` in ``by_worker[w]`` on ``workers[w]``.

        ``simulation``: ``validate``'s, for a step's programs, which orders
        the actions of a thread running several (``Simulation.thread_order``);
        an evaluation's run ``_in_turn``. Re-raises the first failure. An
        interrupt aborts the transport and is re-raised once every worker has
        answered (``Replies.collect``).
        """
        replies = Replies()
        for w, indices in by_worker.items():
            mine = [programs[k] for k in indices]
            if len(mine) == 1:
                work = partial(self._work, mine[0])
            elif simulation is not None:
                order = simulation.thread_order(mine, alone=len(by_worker) == 1)
                work = partial(self._work, order)
            else:
                work = partial(self._in_turn, mine)
            workers[w].submit(partial(self.context.state.run, self._on_thread, work), replies)
        results = replies.collect(len(by_worker), interrupted=self.transport.abort)
        failures = [result.exception for result in results if isinstance(result, Failure)]
        if failures:
            raise next((f for f in failures if not isinstance(f, AbortedError)), failures[0])

    def run_here(self, program: Program) -> None:
        """Run ``program`` on this thread (a process that runs one worker's stages)."""
        state = self.context.state
        try:
            with state.autocast_off():
                state.run(self._on_thread, partial(self._work, program))
        except KeyboardInterrupt:
            self.transport.abort()
            raise

    def finish(self, combine: Callable[[GradientSums], None] | None = None) -> None:
        """After a step that ran to its end: what waits for the end reaches ``.grad``.

        That is the gradients of leaves no partition registers, of the
        caller's graph (stage 0's input), and of the ``at_end`` tensors,
        which ``combine`` may change first (sum them over processes).
        """
        rest = self.context.gradients.at_end()
        if combine is not None:
            combine(rest)
        self.context.gradients.accumulate(rest)

    @contextmanager
    def holding_hooks(self) -> Iterator[None]:
        """Around the step: the hooks held back meanwhile are all given back at its end.

        A step that failed or was interrupted accumulates nothing more, but
        leaves no hook held. FSDP2 units reduce once, at their stage's end
        (``StepGradients.holding``).
        """
        with self.context.gradients.holding():
            yield

    @contextmanager
    def routing(self) -> Iterator[None]:
        """Around the step: the router loss's hooks on its routers, if the model has one."""
        router = self.context.router
        if router is None:
            yield
            return
        with router.running():
            yield

    def with_router_loss(self, loss: Tensor) -> Tensor:
        """``loss`` plus the router loss of the whole batch, if any (closing it: see routing)."""
        router = self.context.router
        return loss if router is None else loss + router.loss().to(loss)

    def _on_thread(self, work: Callable[[], None]) -> None:
        """Do ``work`` in the caller's grad mode, with no autograd device threads.

        Entered once for all the actions of the thread (grad mode is on in a
        step, off in an evaluation; each forward applies the rest of the
        caller's state). Without device threads a CUDA stage's backward runs
        on this thread, never on a device thread that another stage could
        block.
        """
        grad_enabled = self.context.state.grad_enabled
        with torch.set_grad_enabled(grad_enabled), torch.autograd.set_multithreading_enabled(False):
            work()

    def _work(self, program: Sequence[Action]) -> None:
        for action in program:
            self._act(action)

    def _in_turn(self, programs: list[Program]) -> None:
        """Run several programs on this thread: any one's next action whose mail is there.

        An evaluation's forward programs (a step's follow their validated
        order). Each program's actions run in its order, and this cannot
        deadlock: a forward needs only the previous stage's forward of its
        micro-batch, and every thread runs its stages in increasing order
        (``forward_programs``). A skip's mail is sent before the activation
        that leads to its receiver, so it is there too.
        """
        transport = self.transport
        assert isinstance(transport, LocalTransport), "programs share threads in one process"
        last = self.context.stages - 1
        positions = [0] * len(programs)
        left = sum(len(program) for program in programs)
        while left:
            waiting: list[Hashable] = []
            before = left
            for k, program in enumerate(programs):
                while positions[k] < len(program):
                    action = program[positions[k]]
                    needed = _mail_needed(action, last)
                    if needed is not None and not transport.has(needed):
                        waiting.append(needed)
                        break
                    self._act(action)
                    positions[k] += 1
                    left -= 1
            if left == before:  # nothing could run: wait for mail
                transport.wait_for_any(waiting, ", ".join(map(describe, waiting)))

    def _act(self, action: Action) -> None:
        self.transport.check()
        try:
            self.stage_runs[action.stage].act(action)
        except BaseException as exception:
            if not isinstance(exception, AbortedError):
                add_note(exception, f"(raised in action {action} of the schedule)")
            self.transport.abort(exception)
            raise

    def loss(self) -> Tensor:
        """The step's loss: the sum of the micro-batches' scaled losses.

        Where the last stage runs in another process, as it sent it down with
        the input gradients (a step's, not an evaluation's).
        """
        last = self.stage_runs.get(self.context.stages - 1)
        if last is not None:
            return last.summed_loss()
        received = {j: s.step_loss for j, s in self.stage_runs.items()}
        assert all(x is not None for x in received.values()), f"the loss came down: {received}"
        return next(x for x in received.values() if x is not None)

    @property
    def outputs(self) -> list[Batch]:
        """The micro-batches' outputs, detached, in order (last stage, keep_outputs only)."""
        last = self.stage_runs[self.context.stages - 1]
        return [last.outputs[i] for i in range(self.context.m)]

    @property
    def peak_in_flight(self) -> dict[int, int]:
        """Per stage run here, the most micro-batches it held at once."""
        return {j: stage.peak_in_flight for j, stage in self.stage_runs.items()}

    @property
    def timed(self) -> list[Timed]:
        """Every action run here, as its stage timed it."""
        return [t for stage in self.stage_runs.values() for t in stage.timed]

    @property
    def peak_activation_bytes(self) -> dict[int, int | None]:
        """Per stage run here, the peak bytes saved for backward (None unless measured)."""
        return {
            j: None if stage.meter is None else stage.meter.peak
            for j, stage in self.stage_runs.items()
        }


def programs_by_worker(programs: list[Program], thread_of: list[int]) -> dict[int, list[int]]:
    """Which programs each worker runs: a program runs on the thread of its stages.

    ``thread_of[j]`` is stage ``j``'s worker. A program whose stages have
    different workers (an interleaved schedule over partitions of their own
    threads) makes their workers one: the lowest runs the programs of all.

    >>> from pipeline.step.actions import parse_program
    >>> programs_by_worker([parse_program("0F0 0B0"), parse_program("1F0 1B0")], [0, 0])
    {0: [0, 1]}
    """
    root = list(range(max(thread_of, default=-1) + 1))

    def find(w: int) -> int:
        while root[w] != w:
            w = root[w]
        return w

    for program in programs:
        workers = sorted({find(thread_of[a.stage]) for a in program})
        for w in workers[1:]:
            root[w] = workers[0]
    by_worker: dict[int, list[int]] = {}
    for k, program in enumerate(programs):
        if program:
            by_worker.setdefault(find(thread_of[program[0].stage]), []).append(k)
    return by_worker


def _mail_needed(action: Action, last: int) -> tuple[str, int, int] | None:
    """The mail ``action`` starts with: an activation, a gradient, or none."""
    s, i = action.stage, action.microbatch
    if action.kind == "F":
        return ("act", s, i) if s > 0 else None
    if action.kind in ("B", "I"):
        return ("grad", s, i) if s < last else None
    return None


def forward_programs(m: int, stages: int, workers: int) -> list[Program]:
    """An evaluation's programs: each worker's stages in order, each over every micro-batch.

    Stage ``s`` runs on worker ``s % workers``, as in a step. A forward
    waits only for the previous stage's forward of its micro-batch, and
    every worker runs its stages in increasing order, so the programs cannot
    deadlock; stages on different workers overlap, micro-batch after
    micro-batch, as ``pipe(x)``'s forward does.

    >>> [" ".join(map(str, p)) for p in forward_programs(2, 4, 2)]
    ['0F0 0F1 2F0 2F1', '1F0 1F1 3F0 3F1']
    """
    return [
        [Action(s, "F", i) for s in range(w, stages, workers) for i in range(m)]
        for w in range(workers)
    ]


def checkpointed_tasks(
    programs: list[Program], m: int, mode: CheckpointMode, training: bool
) -> set[tuple[int, int]]:
    """The (micro-batch, partition) tasks whose forward drops its activations.

    ``'except_last'`` spares the last micro-batch, as the ``pipe(x)`` path
    does, because its backward starts right after its forward there, so
    recomputing it would only delay it. In a program, that holds for every
    forward directly followed by its own backward too (each one on the last
    partition with 1F1B): those are spared as well.
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
