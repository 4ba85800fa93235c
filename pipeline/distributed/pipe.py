"""DistributedPipe: a pipeline whose stages are processes on a torch.distributed process group.

The same ``nn.Sequential`` and ``balance`` as ``pipeline.Pipe``, and the same
``step(input, target, loss_fn, schedule=...)``, but stage ``s`` runs in the
process of group rank ``s % size`` (one stage per process, or ``v`` of them
with the interleaved schedule), which keeps only the layers of its own
stages: a model built on the ``meta`` device is materialised stage by stage,
so no process ever holds the whole model. Each process runs its part of the
schedule's programs on its own thread (``pipeline/step/stage.py``, as ``Pipe.step`` does),
exchanging activations, gradients and skip tensors with the others by
point-to-point sends (``p2p.py``). What it shares with ``Pipe`` is in
``pipeline/base.py``; materialisation in ``meta.py``, tied weights in
``ties.py``.

Weights tied across stages (an embedding and the output head) live in each
process that uses them, made equal at construction and kept equal by
summing each step's gradients of them over those processes, as Megatron's
embedding group does. The processes compare the arguments that must agree
(``stage_arguments.py``) when the pipe is built, and each step's before it
runs, so that a mismatch or a refusal raises on every process.

Wrapped in ``pipeline.DataParallel`` (over the replicas of the same stage),
each stage's gradients are averaged across replicas as soon as its last
backward ends: a pp x dp grid in one ``torchrun`` job.
"""

from __future__ import annotations

import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from pipeline.arguments import CallStyle, CheckpointMode, LossReduction, PipeArguments
from pipeline.base import PipeBase
from pipeline.calls import EvaluateCall, MicroBatches, StepCall, redocumented
from pipeline.distributed.groups import give_back, message_groups, retire
from pipeline.distributed.meta import Init, materialized, meta_resets
from pipeline.distributed.p2p import DONE_KEYS, END_KEYS, ROUTER_KEYS, P2PTransport, PeerError
from pipeline.distributed.sharded import (
    check_sharding,
    described,
    local_ties,
    sharding_groups,
    sharding_kind,
    share_first_replicas_buffers,
    told_over,
    unit_layout,
)
from pipeline.distributed.stage_arguments import check_alone, disagreement
from pipeline.distributed.ties import TiedWeights, ties_across
from pipeline.distributed.wire_format import DEFAULT_MAX_MESSAGE_BYTES
from pipeline.runtime.agreement import (
    camps,
    fingerprint,
    gather_rows,
    ranks_text,
    refusal_entry,
    refusal_heard,
)
from pipeline.runtime.buffers import shared_buffers
from pipeline.runtime.lazy import instance_of
from pipeline.runtime.microbatch import Batch, Value, gather
from pipeline.runtime.partitions import starts_in_place
from pipeline.runtime.process_group import collective_device, resolve_group
from pipeline.runtime.router_loss import ASKED, RouterTally, asked
from pipeline.skip.layout import SkipLayout, inspect_skip_layout
from pipeline.step.actions import Program
from pipeline.step.cache import described_by_repr, programs_of
from pipeline.step.losses import LossDivisor
from pipeline.step.mail import Message
from pipeline.step.reports import DistributedStepReport
from pipeline.step.runner import StepRun, forward_programs
from pipeline.step.schedules import Schedule, forwards_in_order, resolve_schedule
from pipeline.step.sharded import resharded_after
from pipeline.step.simulate import ProgramError, Simulation

__all__ = ["DistributedPipe"]

# Long enough for a slow step; a stalled or dead peer fails the others after it.
DEFAULT_TIMEOUT_S = 300.0
_SHARDED_SCALER = "torch.distributed.fsdp.sharded_grad_scaler"
# The dtypes an evaluation's loss can travel in, by their place here (the same in every
# process). The last stage sums its micro-batches' losses, so a count (of correct
# predictions) or a flag arrives as int64.
_LOSS_DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64,
    torch.complex128, torch.int64,
]  # fmt: skip
# A loss travels as its bytes, room for the widest (complex128), then its dtype's place
# plus one: summed over the ranks with the others' zeros, the bytes come back unchanged.
_LOSS_BYTES = 16


class DistributedPipe(PipeBase):
    """One process's stages of a pipeline over the processes of ``group``.

    Every process of ``group`` builds it with the same module and balance,
    and every process of the job builds its own at the same point (each
    pipeline makes process groups of its own, which is collective)::

        dist.init_process_group("gloo")       # torchrun sets the environment
        pipe = DistributedPipe(model, balance=[3, 3], chunks=8)
        loss = pipe.step(x, y, F.cross_entropy, schedule="1f1b")  # every process
        optimizer.step()                       # over pipe.parameters(): this stage's

    Args:
        module: the whole ``nn.Sequential`` (on the ``meta`` device, or any),
            or a model split by ``pipeline.split`` (keeping the model's names
            for what its stages' pieces use). This process keeps the layers
            of its stages, moved to ``device``; tensors on ``meta`` get
            storage there and their modules' ``reset_parameters`` (children
            first), or ``init``; a module holding tensors on ``meta`` with no
            reset is refused.
        balance: layers per stage; ``len(balance)`` must be a multiple of the
            group's size (stage ``s`` runs in group rank ``s % size``).
        group: the processes of one pipeline (default: the default group).
        device: this process's device (default: the current CUDA device with
            NCCL, else the CPU).
        chunks, checkpoint, deferred_batch_norm, call_style: as ``Pipe``'s.
        timeout: seconds an action waits for a message before it fails,
            naming the peer (a stalled or dead process).
        max_message_bytes: the most bytes of tensors one message between
            processes may hold (an activation, a gradient, a skip); a peer
            announcing more is refused before anything is allocated, and so
            is a larger message before it is sent.
        init: gives a module on ``meta`` its values, called with each module
            of this process's stages that holds tensors on ``meta`` once they
            have storage, children first, instead of its ``reset_parameters``
            (``model._init_weights`` for a transformers model).
    """

    _NAME = "DistributedPipe"
    _EVALUATE = "call pipe.evaluate(x) (or pipe.evaluate(x, y, loss_fn)) on every process"

    def __init__(
        self,
        module: nn.Sequential,
        balance: Sequence[int] | None = None,
        *,
        group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
        chunks: int = 1,
        checkpoint: CheckpointMode = "except_last",
        deferred_batch_norm: bool = False,
        call_style: CallStyle = "tuple",
        timeout: float = DEFAULT_TIMEOUT_S,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        init: Init | None = None,
    ) -> None:
        super().__init__()
        self.group = resolve_group(group)
        self.size = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        arguments, refusal = self._checked_alone(
            module,
            balance,
            chunks,
            checkpoint,
            call_style,
            deferred_batch_norm,
            device,
            timeout,
            max_message_bytes,
            init,
        )
        pipelines = self._agree_to_build(module, arguments, refusal)
        assert arguments is not None, "built with no refusal and no disagreement"
        self._adopt_arguments(arguments)
        self._build_stages(module, arguments.deferred_batch_norm, init, pipelines)
        self._connect(pipelines, timeout, max_message_bytes)
        self.last_step: DistributedStepReport | None = None

    def _checked_alone(
        self,
        module: nn.Sequential,
        balance: Sequence[int] | None,
        chunks: int,
        checkpoint: CheckpointMode,
        call_style: CallStyle,
        deferred_batch_norm: bool,
        device: torch.device | str | None,
        timeout: float,
        max_message_bytes: int,
        init: Init | None,
    ) -> tuple[PipeArguments | None, Exception | None]:
        """The arguments as far as this process can check them alone, or its refusal.

        The refusal is raised only after the comparison (``_agree_to_build``),
        in which the others would otherwise wait.
        """
        try:
            arguments = check_alone(
                module, balance, chunks, checkpoint, call_style, deferred_batch_norm, self.size
            )
            if not timeout > 0:
                raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
            if type(max_message_bytes) is not int or max_message_bytes <= 0:
                raise ValueError(
                    f"max_message_bytes must be a positive int, got {max_message_bytes!r}"
                )
            self.device = (
                torch.device(device) if device is not None else collective_device(self.group)
            )
            if init is not None and not callable(init):
                raise TypeError(f"init must be callable(module), got {init!r}")
            meta_resets(module, init)  # every process refuses a model it could not materialise
        except Exception as error:
            return None, error
        return arguments, None

    def _agree_to_build(
        self,
        module: nn.Sequential,
        arguments: PipeArguments | None,
        refusal: Exception | None,
    ) -> list[list[int]]:
        """Every pipeline of the job, once every process of the job agrees to build.

        Every process of the job raises, or none does, before anything is
        built: this one's ``refusal`` (what it checked alone), a disagreement
        of the arguments, or another pipeline's refusal.
        """
        # Every process compares, a refusing one too: the others wait for it.
        disagreed = disagreement(module, arguments, self.group)
        problem = refusal or disagreed
        tied = arguments is not None and ties_across(module, arguments.balance, self.size)
        pipelines, stopped, tied_somewhere = _every_pipeline(
            self.group, refused=problem is not None, tied=tied
        )
        if problem is not None:
            raise problem
        if stopped:
            raise ValueError(
                f"the pipeline of (global) ranks {stopped} refused its arguments (its processes' "
                "errors say why); no pipeline of the job was built"
            )
        if tied_somewhere and len({len(p) for p in pipelines}) > 1:
            raise ValueError(
                f"the job's pipelines have several sizes ({pipelines}) and one of them has "
                "weights tied across its processes, whose groups are made over the whole job "
                "for pipelines alike; build pipelines of one size, or keep each tied weight's "
                "uses in one process"
            )
        return pipelines

    def _build_stages(
        self,
        module: nn.Sequential,
        deferred_batch_norm: bool,
        init: Init | None,
        pipelines: list[list[int]],
    ) -> None:
        """This process's stages, materialised on its device, tied weights made equal."""
        n = len(self.balance)
        self.owner = [s % self.size for s in range(n)]
        self.local_stages = [s for s in range(n) if self.owner[s] == self.rank]
        # The whole model's keys: what a strict load_state_dict may be given.
        self._model_keys = frozenset(module.state_dict(keep_vars=True))
        every = self._partition(module, deferred_batch_norm)
        self._partition_names = [list(p._modules) for p in every]
        self.skip_layout = inspect_skip_layout(every, [self.device] * n)
        self._ties = TiedWeights(every, self.owner)
        # A step's stages signalled after its end (tied weights, weights the caller reaches).
        self._late_stages: list[int] = []
        self.partitions = self._materialized(every, init, module)
        self._register_names(module, [self.partitions[s] for s in self.local_stages])
        self._ties_here = local_ties(self.partitions, self.local_stages)
        # A step or evaluation that failed midway with stages sharded across pipelines.
        self._stranded: BaseException | None = None
        self._start_runtime([self.device] * n)
        # Every stage's, other processes' too: a skip sent into a stage that copies
        # its input is refused by its sender (skip/tracker.py).
        self._runtime.protect_inputs = [starts_in_place(p) for p in every]
        # Buffers that stages of other processes hold too: each process holds a copy.
        self._runtime.shared_buffers = {
            s: names for s, names in shared_buffers(every).items() if s in self.local_stages
        }
        self._ties.resolve(self.partitions, self.local_stages, pipelines, self.rank)
        self._ties.synchronize()

    def _materialized(
        self, every: list[nn.Sequential], init: Init | None, module: nn.Module
    ) -> list[nn.Sequential]:
        """This process's stages on its device, materialised if on ``meta``; a failure there
        (storage that no reset wrote into, an init raising) heard by every process of the
        job, which would otherwise wait for this one in the next collective."""
        failure: BaseException | None = None
        stages: list[nn.Sequential] = []
        try:
            stages = [
                materialized(p, self.device, init, module)
                if self.owner[s] == self.rank
                else nn.Sequential()
                for s, p in enumerate(every)
            ]
        except BaseException as error:  # an init of the user's may raise anything, ^C too
            failure = error
        # Every process of the job builds its pipeline at once (``_every_pipeline``): a
        # failure here is heard by all, other pipelines of a grid too.
        failed = (
            failure if isinstance(failure, Exception | None) else RuntimeError(described(failure))
        )
        heard = told_over([_job()], failed, "this job")
        if failure is not None:
            raise failure
        if heard is not None:
            raise heard
        return stages

    def _connect(self, pipelines: list[list[int]], timeout: float, max_message_bytes: int) -> None:
        """The transport to this process's peers, closed with the pipe."""
        self._transport = P2PTransport(
            self.group,
            message_groups(pipelines),
            self.owner,
            _peers(self.local_stages, self.owner, self.skip_layout),
            [self.device] * len(self.balance),
            timeout,
            max_message_bytes,
        )
        self._finalizer = weakref.finalize(self, _closed, self._transport, self._ties)

    # Training

    step = redocumented(
        PipeBase.step,
        """Run a training step over every process; see ``Pipe.step``.

        Every process of the group calls it. ``input`` (and ``kwargs``, the
        first layer's keyword arguments) is needed only where stage 0 runs
        and ``target`` only where the last stage runs (pass ``None``
        elsewhere). Each process's gradients accumulate into its own
        parameters' ``.grad``; the loss is returned on every process, on its
        device (and the output, with ``return_outputs``, where the last stage
        runs, ``None`` elsewhere). ``loss_divisor`` is used where the last
        stage runs; give it on every process. A ``grad_scaler`` must be a
        ``ShardedGradScaler`` over a group holding the pipeline's processes,
        so that an inf found by one stage skips the optimizer step on all.
        """,
    )

    def _train(self, call: StepCall) -> Tensor | tuple[Tensor, Value | None]:
        started = time.perf_counter()
        self._refuse_if_stranded()
        last = len(self.balance) - 1 in self.local_stages
        chosen, reduction, micro_batches, router = self._agreed_step(call)
        programs, simulation = self._programs(chosen, len(micro_batches.rows))
        self._refuse_reordered_forwards(chosen, programs)
        self.last_step = None  # a step that fails midway reports nothing, not the last one's
        reached, late = self._reached_by_the_caller(micro_batches, self.local_stages)
        self._late_stages = sorted({*self._ties.stages, *late})
        run = self._step_run(
            call,
            reduction,
            programs,
            micro_batches,
            [self._stage_done],
            [self.local_stages],
            transport=self._transport,
            stages=self.local_stages,
            at_end=[*self._ties.parameters(), *reached],
            router=router,
        )
        self._run_step(run, programs[self.rank], micro_batches)
        share_first_replicas_buffers(self.partitions, self.local_stages)
        loss = run.with_router_loss(run.loss().to(self.device))
        self.last_step = DistributedStepReport(
            chosen,
            simulation,
            self._measured(run, programs),
            rank=self.rank,
            received=self._transport.received(),
            call_duration=time.perf_counter() - started,
        )
        if not call.return_outputs:
            return loss
        return loss, gather(run.outputs, micro_batches.rows) if last else None

    def _told_to_other_pipelines(self, refusal: Exception | None) -> Exception | None:
        """``refusal``, or one heard from the pipelines that shard this process's stages with
        it, or replicate them (``DataParallel`` over this pipe): else they would wait for
        it in their collectives, or meet its next call's."""
        layout = unit_layout(self.partitions, self.local_stages)
        groups = sharding_groups(self.partitions, self.local_stages)
        refusal = told_over(groups, refusal, layout=layout)
        replicas = "another pipeline that replicates these stages (DataParallel)"
        return told_over(self._replica_groups(), refusal, replicas)

    def _run_step(self, run: StepRun, program: Program, micro_batches: MicroBatches) -> None:
        """Run this process's ``program`` of the step, its end agreed with the others; then
        the completion hooks of the stages final only at the end (``_late_stages``)."""
        with (
            self._stranding_on_failure(),
            self._one_pass(micro_batches.batches),
            run.holding_hooks(),
            run.routing(),
        ):
            self._transport.begin_step()
            try:
                run.run_here(program)
                self._transport.end_step()
                if self._ties.found:  # no process enters the tied sums if one failed
                    self._step_ended(DONE_KEYS)
                run.finish(self._ties.sum_over_holders)
                self._step_ended(END_KEYS)
            except BaseException as error:
                self._transport.abort(error)  # the others, at the step's end, stop waiting
                raise
        for j in self._late_stages:
            for hook in self._completion_hooks.values():
                hook(j)

    def _programs(self, schedule: Schedule, m: int) -> tuple[list[Program], Simulation]:
        """The schedule's programs, each to run in the process of its number: refused, on
        every process alike, if one holds an action of a stage that lives elsewhere."""
        programs, simulation = super()._programs(schedule, m)
        for rank, program in enumerate(programs):
            for action in program:
                if self.owner[action.stage] != rank:
                    raise ProgramError(
                        f"{schedule!r}: program {rank} holds {action}, of stage "
                        f"{action.stage}, which runs in process {self.owner[action.stage]} "
                        f"(stage s in process s % {self.size}): a DistributedPipe runs "
                        "program r in process r; give each program its process's stages"
                    )
        return programs, simulation

    def _step_ended(self, keys: tuple[str, str]) -> None:
        """Every process's step ends together: if one failed, every one raises.

        A process whose stages were done before a peer's later action failed
        (stage 0's last backward, a hook there) would otherwise return as if
        the step were whole, and its optimizer step would go on alone. The
        step's own messages carry it, as the router loss's sum, bounded by the
        pipe's timeout: a collective would wait the group's, which stage 0's
        last backwards may outlast; a failed process's abort ends the wait.
        With weights tied across processes, the actions' end is agreed so too
        before their sums' all-reduce, which no failure could interrupt.
        """
        try:
            self._summed_over_ranks(torch.zeros(1), keys)
            self._transport.end_step()  # its own sends too: none is left in flight
        except Exception as error:
            raise PeerError(
                f"this step failed in another process of the pipeline after this process's "
                f"stages were done ({error}): the step is not whole, so skip the optimizer "
                "step here too, as there"
            ) from error

    def _agreed_step(
        self, call: StepCall
    ) -> tuple[Schedule, LossReduction, MicroBatches, RouterTally | None]:
        """The step's schedule, reduction, micro-batches and router loss, once all agree."""
        first, last = 0 in self.local_stages, len(self.balance) - 1 in self.local_stages
        # A refusal is raised only after the agreement, which the other
        # processes would otherwise wait in until their group's timeout.
        refusal: Exception | None = None
        chosen: Schedule | None = None
        batches: list[Batch] = []
        targets: list[Batch] = []
        reduction: LossReduction | None = None
        choice: str | None = None
        router: RouterTally | None = None
        try:
            chosen, reduction = self._check_step(call)
            choice = self._step_choice(chosen, reduction, call)
            batches = self._scatter(self._input_of(call.input, call.kwargs), "input", needed=first)
            targets = self._scatter(call.target, "target", needed=last)
            self._check_token_loss(batches, reduction, call.loss_divisor)
            self._refuse_rows_across(batches, call.return_outputs)
            router = self._router_here(call, batches, chosen)
            choice += _router_choice(router)
        except Exception as error:
            refusal = error
            if isinstance(error, PeerError) and self._transport.alone():
                raise  # no process is left to agree with
        # The programs for the agreed micro-batch count are checked within the agreement:
        # a pipeline whose replicas' batches split otherwise refuses before they run.
        programs = None if chosen is None else lambda rows: self._programs(chosen, len(rows))
        rows = self._agree(batches, targets, choice, refusal, programs=programs)
        assert chosen is not None and reduction is not None, "else every process raised"
        return chosen, reduction, MicroBatches(batches, targets, rows), router

    def _refuse_reordered_forwards(self, schedule: Schedule, programs: list[Program]) -> None:
        """``_refuse_reordered_updates`` for this process's stages, on the step's programs,
        heard by every process of the pipeline (one more agreement, for a schedule of one's
        own only: the other pipelines of a grid, whose schedules may be built-in, are not
        asked; running the same programs on the same model, they refuse alike)."""
        if forwards_in_order(schedule):
            return  # nothing to check, so nothing to agree on
        refusal: Exception | None = None
        try:
            self._refuse_reordered_updates(schedule, programs, self.local_stages)
        except ProgramError as error:
            refusal = error
        _, refusal = self._gathered([refusal_entry(refusal)], refusal, "this step's programs")
        if refusal is not None:
            raise refusal

    def _gathered(
        self, row: list[int], refusal: Exception | None, what: str
    ) -> tuple[list[list[int]], Exception | None]:
        """Every process's ``row``, its first entry ``refusal_entry(refusal)``, and what
        every process raises where one refused ``what`` (``refusal_heard``): its own error
        there, one of its kind saying why elsewhere."""
        try:
            rows = gather_rows(row, self.group)
            refusal = refusal_heard(
                refusal,
                rows,
                self.group,
                f"of the pipeline refused {what}",
                "no process ran anything",
            )
        except RuntimeError as error:
            raise self._transport.explain("the step's agreement", error) from error
        return rows, refusal

    def _router_here(
        self, call: StepCall | EvaluateCall, batches: list[Batch], schedule: Schedule | None
    ) -> RouterTally | None:
        """The router loss's tally in this process (``router_loss.py``), or None without one.

        It weighs each token by the input's attention mask where the
        routers run, so every process needs the input then, not stage 0's alone.
        """
        if asked(self._router_loss) is None:
            return None
        if not batches:
            if call.input is None and call.kwargs is None:
                raise ValueError(
                    f"{ASKED}, which weighs each token by the step's attention mask in every "
                    f"process running routers: "
                    f"pass the same input and kwargs on every process (rank {self.rank} got "
                    "none)"
                )
            input = self._input_of(call.input, call.kwargs)
            batches = self._micro_batches(input, self.device, "input")
        programs = None if schedule is None else self._programs(schedule, len(batches))[0]
        return self._router_tally(call, batches, programs, reduce=self._summed_over_ranks)

    def _summed_over_ranks(self, partial: Tensor, keys: tuple[str, str] = ROUTER_KEYS) -> Tensor:
        """``partial`` summed over the group's processes: up the ranks, then the sum down.

        The step's messages, not a collective: a process that fails mid-step
        aborts the transport, and the others stop waiting instead of hanging
        in a collective until the group's timeout. Stage ``r`` runs on rank
        ``r`` below the group's size (``_output_passed_down``), so ranks
        ``r - 1`` and ``r + 1`` are this one's neighbours. Every process
        calls it at the same points of a step, with the same ``keys``: its
        partial goes up once the ranks below have sent theirs, and it waits
        for the sum from above.
        """
        r, top, up, down = self.rank, self.size - 1, (keys[0],), (keys[1],)
        total = partial
        if r > 0:
            total = total + self._transport.receive(up, r - 1, r).leaves[0].to(total)
        if r < top:
            self._transport.send(up, Message([total]), r, r + 1, 0)
            total = self._transport.receive(down, r + 1, r).leaves[0].to(total)
        if r > 0:
            self._transport.send(down, Message([total]), r, r - 1, 0)
        return total

    def _step_choice(self, chosen: Schedule, reduction: LossReduction, call: StepCall) -> str:
        """What every process must agree on of a step's arguments (``_agree``)."""
        choice = f"{self._schedule_name(chosen)} {_loss_choice(reduction, call.loss_divisor)}"
        choice += f", grad_scaler {_scaler_state(call.grad_scaler)}"
        return choice + f", {sharding_kind(self.partitions, self.local_stages)}"

    def _placement(self) -> str:
        return f"stages={self.local_stages} of rank {self.rank}/{self.size}, device='{self.device}'"

    def _counted_parameters(self) -> Iterator[nn.Parameter]:
        """This process's parameters, less the tied ones whose first holder is another process."""
        elsewhere = {id(p) for p in self._ties.counted_elsewhere(self.rank)}
        return (p for p in self.parameters() if id(p) not in elsewhere)

    def _norm_group(self) -> dist.ProcessGroup:
        return self.group

    def _norm_device(self) -> torch.device:
        return self.device

    def _check_open(self) -> None:
        """Refuse a step or an evaluation once this pipe or a peer's side of it is gone."""
        super()._check_open()
        self._transport.check_peers()

    @contextmanager
    def _stranding_on_failure(self) -> Iterator[None]:
        """Around a call's work: a failure with stages sharded across pipelines strands the
        pipe (``sharded.py``): the other pipelines' collectives may wait for this one's."""
        try:
            yield
        except BaseException as error:
            if sharding_groups(self.partitions, self.local_stages):
                self._stranded = error
            raise

    def _refuse_if_stranded(self) -> None:
        """Refuse, before any collective, a call after one that stranded the pipe."""
        if self._stranded is not None:
            raise RuntimeError(
                "an earlier step or evaluation of this DistributedPipe failed midway, with its "
                "stages sharded (FSDP2, tensor parallelism) with other pipelines' processes: "
                "their collectives may still wait for this process's, and a new call's would "
                "meet them and compute with them, silently wrong; end the job and resume it "
                f"from a checkpoint (the failure: {type(self._stranded).__name__}: "
                f"{self._stranded})"
            )

    def _check_step(self, call: StepCall) -> tuple[Schedule, LossReduction]:
        """The step's schedule and reduction, once this process's own arguments pass.

        (As far as this process can tell: the agreement compares them.)
        """
        self._check_open()
        reduction = self._check_step_arguments(call)
        self._check_scaler_agrees(call.grad_scaler)
        self._check_sharding()
        chosen = resolve_schedule(call.schedule)
        workers = chosen.workers(len(self.balance))
        if workers != self.size:
            raise ValueError(
                f"{chosen!r} runs {len(self.balance)} stages on {workers} workers, but the "
                f"group has {self.size} processes: use a schedule with one worker per process"
            )
        return chosen, reduction

    def _check_sharding(self, training: bool = True) -> None:
        """Refuse stages sharded (FSDP2, tensor parallel) in a way a step (``training``) or an
        evaluation would get wrong."""
        stages, tied, here = self.local_stages, self._ties.parameters(), self._ties_here
        check_sharding(self, self.partitions, stages, tied, here, training)

    def _check_scaler_agrees(self, grad_scaler: torch.amp.GradScaler | None) -> None:
        """Refuse a GradScaler that would let some stages step and others skip."""
        if grad_scaler is None or not grad_scaler.is_enabled():
            return
        if instance_of(grad_scaler, _SHARDED_SCALER, "ShardedGradScaler"):
            # None is the default group (torch's default argument, read before it existed).
            group = getattr(grad_scaler, "process_group", None) or dist.group.WORLD
            missing = set(dist.get_process_group_ranks(self.group)) - set(
                dist.get_process_group_ranks(group)
            )
            if not missing:
                return
            problem = f"its process group lacks the pipeline's (global) ranks {sorted(missing)}"
        else:
            problem = f"a {type(grad_scaler).__name__} decides on each process alone"
        raise ValueError(
            f"grad_scaler: {problem}. Each process holds only some stages' gradients, so "
            "an inf found in one stage must skip the optimizer step on every process: use "
            "torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler(device, "
            "process_group=...) with a group holding every process of the pipeline (the "
            "default, the whole job, does)"
        )

    def _scatter(self, value: Value | None, what: str, needed: bool) -> list[Batch]:
        if not needed:
            return []
        if value is None:
            raise ValueError(
                f"this process runs stage {0 if what == 'input' else len(self.balance) - 1}, "
                f"so its step() needs the {what}; pass it here (other processes may pass None)"
            )
        return self._micro_batches(value, self.device, what)

    def _schedule_name(self, schedule: Schedule) -> str:
        """What the processes compare of their schedules (``_agree``).

        A built-in schedule's repr; for a schedule of one's own also its
        programs, as two instances of one class print alike whatever they hold.
        """
        if described_by_repr(schedule):
            return repr(schedule)
        programs = programs_of(schedule, self.chunks, len(self.balance))
        text = "\n".join(" ".join(map(str, program)) for program in programs)
        return f"{schedule!r} (programs for {self.chunks} micro-batches: #{fingerprint(text):x})"

    def _agree(
        self,
        batches: list[Batch],
        targets: list[Batch],
        choice: str | None,
        refusal: Exception | None,
        with_target: bool = True,
        programs: Callable[[list[int]], object] | None = None,
    ) -> list[int]:
        """The micro-batches' sizes, as stage 0's process split them, known to every process.

        Before any work: if a process refused its arguments, every process
        raises (that one its own error, the others one of its kind where it
        is the library's own, saying why); so does every process if they chose
        different schedules, if the target and the input split differently,
        or if ``programs`` refuses the sizes (every process of the pipeline
        alike: the schedule's programs for their count); with sharded stages
        or replicas, so do the other pipelines' processes that shard or
        replicate them (``sharded.py``, ``DataParallel``).
        """
        if choice is not None:
            choice += f", {self.chunks} chunks"
        row = self._agreement_row(batches, targets, choice, refusal)
        rows, refusal = self._gathered(row, refusal, "this step's arguments")
        agreed: list[int] = []
        try:
            agreed = self._agreed(rows, refusal, choice, with_target)
            if programs is not None:
                programs(agreed)
        except Exception as error:
            refusal = error
        else:
            refusal = None
        refusal = self._told_to_other_pipelines(refusal)
        if refusal is not None:
            raise refusal
        return agreed

    def _agreed(
        self,
        rows: list[list[int]],
        refusal: Exception | None,
        choice: str | None,
        with_target: bool,
    ) -> list[int]:
        """The micro-batches' sizes from every process's row, or what refuses the call."""
        if refusal is not None:
            raise refusal
        choices = camps([theirs[1] for theirs in rows])
        if len(choices) > 1:
            raise ValueError(
                "the processes of the pipeline chose different schedules, loss arguments, "
                "grad scalers (enabled, their scale) or chunks (pipe.chunks) for this call, or "
                f"shard their stages differently: {ranks_text(choices)} chose "
                f"differently (this process, rank {self.rank}: {choice}); every process must "
                "pass the same ones, and with FSDP2, shard every stage"
            )
        self._ties.check_trained_alike([theirs[8:] for theirs in rows])
        input_rows = _micro_batch_sizes(rows[self.owner[0]][2:5])
        target_rows = _micro_batch_sizes(rows[self.owner[-1]][5:8])
        if with_target and input_rows != target_rows:
            raise ValueError(
                f"the target splits into micro-batches of {target_rows} rows but the input into "
                f"{input_rows}: give the target the input's batch size (dim 0)"
            )
        return input_rows

    def _agreement_row(
        self,
        batches: list[Batch],
        targets: list[Batch],
        choice: str | None,
        refusal: Exception | None,
    ) -> list[int]:
        """This process's row of ``_agree``: refused, its choice's hash, both splits' sizes,
        then whether it trains each tied parameter."""
        # Every process's row has 8 entries and one per tied parameter, the ties
        # the whole model's: the rows cannot differ in length, which would make
        # gloo abort a process, even where the processes' chunks differ.
        row = [refusal_entry(refusal), 0 if choice is None else fingerprint(choice)]
        for scattered in (batches, targets):
            row += _split_summary([b.rows() for b in scattered])
        return row + self._ties.training_states()

    def _stage_done(self, j: int) -> None:
        # A stage with tied weights is final only once their gradients are
        # summed over the processes that hold them, after the step; one with
        # weights the caller's graph reaches too, once that is walked.
        if j not in self._late_stages:
            for hook in self._completion_hooks.values():
                hook(j)

    def _loss_everywhere(self, total: Tensor | None) -> Tensor:
        """An evaluation's loss, from the last stage's process to the others, in its dtype.

        Summed over the ranks by the step's messages (``_summed_over_ranks``),
        the others giving nothing: every process also hears that every other
        ended its actions, and a failure in one ends the others' wait for it,
        where a broadcast kept them until the failed process exited.
        """
        message = torch.zeros(_LOSS_BYTES + 1, dtype=torch.uint8)
        if total is not None:
            message[: total.element_size()] = _loss_bytes(total)
            message[_LOSS_BYTES] = _LOSS_DTYPES.index(total.dtype) + 1
        summed = self._summed_over_ranks(message, END_KEYS)
        dtype = _LOSS_DTYPES[int(summed[_LOSS_BYTES]) - 1]
        value = summed[: dtype.itemsize].view(dtype).reshape(())
        return value.to(self.device, copy=True)

    # Evaluation

    evaluate = redocumented(
        PipeBase.evaluate,
        """The plain model's outputs or loss in ``eval()`` under no_grad; see ``Pipe.evaluate``.

        Every process of the group calls it, with the same ``loss_fn`` (or
        none), reduction and ``return_outputs``. ``input`` (and ``kwargs``,
        the first layer's keyword arguments) is needed only where stage 0
        runs and ``target`` only where the last stage runs.
        The loss comes back on every process, and so does the output
        (without a ``loss_fn``, or with ``return_outputs=True``): each
        micro-batch's output travels from the last stage's process to the
        others as the stages' messages do.
        """,
    )

    def _evaluate(self, call: EvaluateCall) -> Any:
        self._refuse_if_stranded()
        last = len(self.balance) - 1 in self.local_stages
        wants_outputs = call.return_outputs or call.loss_fn is None
        reduction, micro_batches, router = self._agreed_evaluation(call)
        programs = forward_programs(len(micro_batches.rows), len(self.balance), self.size)
        local = [self.partitions[s] for s in self.local_stages]
        watching = self._runtime.watching(micro_batches.batches)
        with self._stranding_on_failure(), self._evaluating(), resharded_after(local), watching:
            run = self._evaluation_run(
                call,
                reduction,
                micro_batches,
                wants_outputs and last,
                [self.local_stages],
                transport=self._transport,
                stages=self.local_stages,
                router=router,
            )
            self._transport.begin_step()
            try:
                with run.routing():
                    run.run_here(programs[self.rank])
                if router is not None:
                    router.close()  # while the step's messages go
                outputs = (
                    self._outputs_everywhere(run, micro_batches.rows) if wants_outputs else None
                )
                wanted = last and call.loss_fn is not None
                total = self._loss_everywhere(run.loss() if wanted else None)
                self._transport.end_step()
            except BaseException as error:
                self._transport.abort(error)  # the others, waiting for the loss, stop waiting
                raise
        if call.loss_fn is None:
            return outputs
        loss = run.with_router_loss(total)
        return (loss, outputs) if call.return_outputs else loss

    def _agreed_evaluation(
        self, call: EvaluateCall
    ) -> tuple[LossReduction | None, MicroBatches, RouterTally | None]:
        """The evaluation's reduction, micro-batches and router loss, once every process agrees."""
        first, last = 0 in self.local_stages, len(self.balance) - 1 in self.local_stages
        with_loss = call.loss_fn is not None
        refusal: Exception | None = None
        batches: list[Batch] = []
        targets: list[Batch] = []
        reduction: LossReduction | None = None
        router: RouterTally | None = None
        try:
            reduction = self._check_evaluate_arguments(call)
            self._check_sharding(training=False)
            batches = self._scatter(self._input_of(call.input, call.kwargs), "input", needed=first)
            targets = self._scatter(call.target, "target", needed=last and with_loss)
            self._check_token_loss(batches, reduction, call.loss_divisor)
            self._refuse_rows_across(batches, call.loss_fn is None or call.return_outputs)
            router = self._router_here(call, batches, None)
        except Exception as error:
            refusal = error
            if isinstance(error, PeerError) and self._transport.alone():
                raise  # no process is left to agree with
        choice = "evaluate the loss" if with_loss else "evaluate the outputs"
        choice += f" ({_loss_choice(reduction, call.loss_divisor)}), outputs "
        choice += str(call.return_outputs or not with_loss) + _router_choice(router)
        rows = self._agree(batches, targets, choice, refusal, with_target=with_loss)
        return reduction, MicroBatches(batches, targets, rows), router

    def _outputs_everywhere(self, run: StepRun, rows: list[int]) -> Value:
        """The model's output on every process, passed down the ranks from the last stage's.

        Stage ``r`` runs on rank ``r`` for ``r`` below the group's size, and
        the last stage on the last rank, so ranks ``r + 1`` and ``r`` are
        neighbours: each micro-batch's output is a message from one to the
        next, under the step's transport (never pickled).
        """
        try:
            return gather([self._output_passed_down(run, i) for i in range(len(rows))], rows)
        except BaseException as error:
            # A process that cannot send (an output the wire format refuses)
            # tells the others, which would otherwise wait for it.
            self._transport.abort(error)
            raise

    def _output_passed_down(self, run: StepRun, i: int) -> Batch:
        """Micro-batch ``i``'s output: taken from rank ``r + 1``, given to rank ``r - 1``."""
        r = self.rank
        if r == self.size - 1:
            batch = run.outputs[i]
        else:
            message = self._transport.receive(("output", i), r + 1, r)
            batch = Batch.of(message.leaves, message.spec)
        if r > 0:
            outgoing = Message(batch.leaves, batch.spec, [False] * len(batch.leaves))
            self._transport.send(("output", i), outgoing, r, r - 1, i)
        return batch

    # Module protocol

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Refused: this process holds only some stages; ``step`` and ``evaluate`` run them all."""
        raise RuntimeError(
            "a DistributedPipe holds only this process's stages, so it cannot be called like "
            "the model: train with pipe.step(input, target, loss_fn) on every process; to "
            "evaluate or predict, call pipe.evaluate(input) (the outputs) or "
            "pipe.evaluate(input, target, loss_fn) (the loss) on every process"
        )

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        """Load this process's layers from a whole model's state dict (the other stages' keys
        are skipped).

        ``strict``, as torch's: every key of this process's layers is required,
        and a key that the whole model lacks (a deeper model's) is refused,
        before anything is loaded. With ``strict=False`` torch's result names
        them: ``missing_keys`` this process's, ``unexpected_keys`` the keys of
        no process (alike on every process); another process's keys are
        neither.
        """
        unexpected = [k for k in state_dict if k not in self._model_keys]
        if strict and unexpected:
            raise RuntimeError(
                f"Error(s) in loading state_dict for {type(self).__name__}: Unexpected key(s) "
                f"in state_dict: {', '.join(repr(k) for k in unexpected)} (the whole model "
                "has no such key: a state dict of another model; pass strict=False to skip them)"
            )
        own = self.state_dict(keep_vars=True)
        mine = OrderedDict((k, v) for k, v in state_dict.items() if k in own)
        for names in self._tied_names():
            # The plain model loads each name into its one tensor: the last one stays.
            given = [name for name in names if name in state_dict]
            for name in (n for n in names if n in own and given):
                mine[name] = state_dict[given[-1]]
        metadata = getattr(state_dict, "_metadata", None)
        if metadata is not None:
            mine._metadata = metadata  # type: ignore[attr-defined]  # the layers' versions
        if not any(m._load_state_dict_pre_hooks for m in self.modules()):  # they may rename
            _refuse_partial_load(type(self).__name__, own, mine, strict)
        result = super().load_state_dict(mine, strict=strict, assign=assign)
        # torch's saw this process's keys alone; another process's are neither missing nor
        # unexpected here, the keys of no process are unexpected (on every process).
        result.unexpected_keys[:0] = unexpected
        return result

    def close(self) -> None:
        """Stop this pipe's listeners, give back its process groups (docs/distributed_pipe.md).

        Never waits for a peer to close in turn: it waits a few seconds at
        most for each peer's answer to its stop, after which no message can
        travel on the pipe's groups, and destroys them (with gloo, each
        process alone). Garbage collection closes a pipe too; its groups are
        then destroyed at the next ``close()`` or construction in this process.
        """
        super().close()
        self._transport.wait_for_listeners()
        give_back()

    @property
    def partition_names(self) -> list[list[str]]:
        return [list(names) for names in self._partition_names]

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError(
            "a DistributedPipe cannot be copied or pickled: it holds this process's stages "
            "and the pipeline's process groups; save its state_dict (or save_checkpoint) and "
            "build another from the model"
        )

    def _tied_names(self) -> list[tuple[str, ...]]:
        """Every name of each weight tied across processes: the plain model's, in its order."""
        return self._ties.names()

    def __iter__(self) -> Iterator[nn.Module]:
        for s in self.local_stages:
            yield from self.partitions[s]


def _closed(transport: P2PTransport, ties: TiedWeights) -> None:
    """Close the pipe's transport and retire its groups (a finalizer: destroys nothing)."""
    transport.close()
    retire(ties)


def _loss_bytes(total: Tensor) -> Tensor:
    """An evaluation's loss as bytes to send, refusing a dtype with no place to travel in."""
    if total.dtype not in _LOSS_DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in _LOSS_DTYPES)
        raise TypeError(
            f"loss_fn returned a loss of dtype {total.dtype}, which DistributedPipe.evaluate "
            f"cannot send to the other processes; it sends {names}: return the loss in one "
            "of them (loss.double(), for one)"
        )
    return total.detach().reshape(1).view(torch.uint8).cpu()


def _loss_choice(reduction: LossReduction | None, divisor: LossDivisor | None) -> str:
    """What every process must agree on of a call's loss arguments: ``mean, loss_divisor none``."""
    return f"{reduction}, loss_divisor {_given(divisor)}"


def _given(value: Any) -> str:
    return "none" if value is None else "given"


def _scaler_state(scaler: Any) -> str:
    """What every process's grad scaler must agree on: enabled, and its scale.

    The last stage scales the loss by its scale and every process unscales
    by its own: scales that differ (a state loaded on one process) give
    gradients off by their ratio; one process disabled waits in the others'
    reduction of infs.
    """
    if scaler is None:
        return "none"
    if not scaler.is_enabled():
        return "disabled"
    return f"scale {float(scaler.get_scale())!r}"


def _split_summary(sizes: list[int]) -> list[int]:
    """``[count, first, last]`` of micro-batches' sizes, which ``scatter`` makes (as
    ``Tensor.chunk``) all equal but the last.

    >>> _split_summary([3, 3, 3, 1]), _split_summary([])
    ([4, 3, 1], [0, 0, 0])
    """
    summary = [len(sizes), sizes[0], sizes[-1]] if sizes else [0, 0, 0]
    assert _micro_batch_sizes(summary) == sizes, f"a split not as Tensor.chunk's: {sizes}"
    return summary


def _micro_batch_sizes(summary: list[int]) -> list[int]:
    """The micro-batches' sizes of a ``_split_summary``."""
    count, first, last = summary
    return [first] * (count - 1) + [last] if count else []


def _refuse_partial_load(
    name: str, own: Mapping[str, Any], given: Mapping[str, Any], strict: bool
) -> None:
    """Refuse a load giving a key of this process's another shape, or (``strict``) missing
    one, before anything is loaded (torch's loads the rest first, then raises)."""
    missing = [k for k in own if k not in given and not _filled_in(k, given)] if strict else []
    shapes = [
        f"{k!r}: {tuple(v.shape)} given, {tuple(own[k].shape)} here"
        for k, v in given.items()
        if isinstance(v, Tensor) and isinstance(own[k], Tensor) and v.shape != own[k].shape
    ]
    if missing or shapes:
        found = (
            [f"Missing key(s) in state_dict: {', '.join(map(repr, missing))}"] if missing else []
        )
        found += [f"size mismatch for {', '.join(shapes)}"] if shapes else []
        raise RuntimeError(
            f"Error(s) in loading state_dict for {name}: {'; '.join(found)} (nothing was "
            "loaded in this process; pass strict=False to load what matches)"
        )


def _filled_in(key: str, given: Mapping[str, Any]) -> bool:
    """Whether torch's load fills ``key`` in itself: a BatchNorm's ``num_batches_tracked``,
    missing from a state dict of a version before it (or of no version)."""
    if not key.endswith("num_batches_tracked"):
        return False
    versions = getattr(given, "_metadata", None) or {}
    version = versions.get(key.rpartition(".")[0], {}).get("version")
    return version is None or version < 2


def _job() -> dist.ProcessGroup:
    """The whole job's group, in which every process builds its pipeline at once."""
    job = dist.group.WORLD
    assert job is not None, "a DistributedPipe is built in an initialised process group"
    return job


def _every_pipeline(
    group: dist.ProcessGroup, refused: bool, tied: bool
) -> tuple[list[list[int]], list[int] | None, bool]:
    """The global ranks of every pipeline (a process group like ``group``) in the job.

    A collective over the whole job: every process builds its pipeline
    together. Also the global ranks of a pipeline that ``refused`` to be
    built (a process of it says so), or None: then none is built.
    """
    device = collective_device(group)
    ranks = dist.get_process_group_ranks(group)
    world = dist.get_world_size()
    # One length for every process's row, whatever the size of its pipeline: gloo aborts
    # a process given rows of several lengths.
    row = [int(refused), int(tied), len(ranks), *ranks, *[-1] * (world - len(ranks))]
    mine = torch.tensor(row, dtype=torch.int64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine)
    rows = [[int(v) for v in t.tolist()] for t in gathered]
    pipelines = {tuple(r[3 : 3 + r[2]]) for r in rows}
    stopped = next((r[3 : 3 + r[2]] for r in rows if r[0]), None)
    return [list(p) for p in sorted(pipelines)], stopped, any(r[1] for r in rows)


def _router_choice(router: RouterTally | None) -> str:
    """What the processes compare of their router losses (``_agree``): on or off, its settings."""
    return "" if router is None else f", router loss {router.settings}"


def _peers(local: list[int], owner: list[int], layout: SkipLayout) -> set[int]:
    """The processes this one exchanges messages with: neighbours, and skip partners."""
    n = len(owner)
    peers = {owner[t] for s in local for t in (s - 1, s + 1) if 0 <= t < n}
    for route in layout.routes():
        if owner[route.source] in {owner[s] for s in local}:
            peers.add(owner[route.target])
        if owner[route.target] in {owner[s] for s in local}:
            peers.add(owner[route.source])
    return peers
