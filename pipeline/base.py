"""What Pipe and DistributedPipe share: arguments, the partitioning, programs, hooks, steps.

Both cut an ``nn.Sequential`` into ``len(balance)`` partitions of consecutive
layers (``pipeline/runtime/layers.py``: a split model's pieces too),
registered under the plain model's names, and both run ``step`` on the
engine of ``pipeline/step/``. ``Pipe`` (``pipe.py``) runs every partition in
this process; ``DistributedPipe`` (``distributed/pipe.py``) only this
process's stages.
"""

from __future__ import annotations

import itertools
import weakref
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from typing import Any, ClassVar, Literal, overload

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from pipeline.arguments import (
    CallStyle,
    CheckpointMode,
    LossReduction,
    PipeArguments,
    check_checkpoint,
    check_chunks,
)
from pipeline.calls import EvaluateCall, MicroBatches, StepCall, check_flags
from pipeline.runtime.batchnorm import DeferredBatchNorm, deferred_norms, statistics_of_one_pass
from pipeline.runtime.buffers import refuse_lazy, updating_layer
from pipeline.runtime.evaluation import evaluating, evaluation_seed
from pipeline.runtime.grad_norm import clip_grad_norm
from pipeline.runtime.layers import named_layers, register_names
from pipeline.runtime.lazy import instance_of
from pipeline.runtime.microbatch import Arguments, Batch, Value, check_input, scatter, to_device
from pipeline.runtime.module_hooks import call_hook_kinds
from pipeline.runtime.partitions import (
    Hook,
    KeywordSequential,
    PartitionRuntime,
    PositionalSequential,
)
from pipeline.runtime.recompute import checkpoint_stop
from pipeline.runtime.router_loss import RouterLossSource, RouterTally, step_tally
from pipeline.runtime.unseen import refuse_cached_parametrizations
from pipeline.skip.layout import SkipLayout
from pipeline.step.actions import Program, backward_before_forward, forwards_out_of_order
from pipeline.step.cache import ProgramCache
from pipeline.step.gradients import caller_reached
from pipeline.step.held_hooks import check_supported
from pipeline.step.losses import (
    LossDivisor,
    check_divisor,
    check_grad_scaler,
    loss_scales,
    resolve_reduction,
)
from pipeline.step.mail import Transport
from pipeline.step.reports import Measured
from pipeline.step.runner import StepRun, checkpointed_tasks
from pipeline.step.schedules import Schedule, forwards_in_order
from pipeline.step.simulate import ProgramError, Simulation
from pipeline.step.token_loss import TokenLoss

__all__ = ["PipeBase"]


class PipeBase(nn.Module, ABC):
    """The common part of ``Pipe`` and ``DistributedPipe``; not built on its own.

    A subclass's ``__init__`` calls, in order: ``_adopt_arguments``,
    ``_split``, ``_register_names`` (for the layers it keeps) and
    ``_start_runtime``; it sets ``partitions``, ``skip_layout`` and ``_finalizer``.
    ``step`` and ``evaluate`` hold the public signatures (``pipeline/calls.py``)
    and hand their call to the subclass's ``_train`` and ``_evaluate``.
    """

    # The class as errors name it, and how to evaluate instead of stepping.
    _NAME: ClassVar[str] = "PipeBase"
    _EVALUATE: ClassVar[str] = ""

    balance: list[int]
    call_style: CallStyle
    partitions: list[nn.Sequential]
    skip_layout: SkipLayout
    _runtime: PartitionRuntime
    _finalizer: weakref.finalize
    _converts_batch_norm: bool
    _completion_hooks: OrderedDict[int, Hook]
    _validated: ProgramCache
    _token_loss: TokenLoss | None
    _router_loss: RouterLossSource | None

    def _adopt_arguments(self, arguments: PipeArguments) -> None:
        """Keep the arguments every pipe has (the checkpoint mode through its property)."""
        self.balance = arguments.balance
        self.chunks = arguments.chunks
        self.checkpoint = arguments.checkpoint
        self.call_style = arguments.call_style

    def extra_repr(self) -> str:
        """The pipeline's shape above its layers: ``print(pipe)`` shows how it runs."""
        return (
            f"balance={self.balance}, {self._placement()}, chunks={self.chunks}, "
            f"checkpoint={self.checkpoint!r}"
        )

    @abstractmethod
    def _placement(self) -> str:
        """Where the partitions run, for ``extra_repr``."""

    @property
    def chunks(self) -> int:
        """Micro-batches per mini-batch; set between calls, checked as at construction."""
        return self._chunks

    @chunks.setter
    def chunks(self, chunks: Any) -> None:
        self._chunks = check_chunks(chunks)

    @property
    def checkpoint(self) -> CheckpointMode:
        """Which micro-batches are checkpointed: ``'always'``, ``'except_last'`` or ``'never'``."""
        return self._checkpoint

    @checkpoint.setter
    def checkpoint(self, mode: Any) -> None:
        self._checkpoint = check_checkpoint(mode)

    def _partition(self, module: nn.Sequential, deferred_batch_norm: bool) -> list[nn.Sequential]:
        """The module's layers as ``len(balance)`` partitions, BatchNorm converted if asked."""
        self._converts_batch_norm = deferred_batch_norm
        if deferred_batch_norm:
            _refuse_nested_pipes(module)
            DeferredBatchNorm.convert(module)
        layers = list(named_layers(module).items())
        self._token_loss = TokenLoss.of(module, layers[0][1] if layers else None)
        self._router_loss = getattr(module, "router_loss", None)
        self._rows_across: tuple[str, ...] = getattr(module, "rows_across", ())
        sequential = PositionalSequential if self.call_style == "positional" else KeywordSequential
        bounds = [sum(self.balance[:j]) for j in range(len(self.balance) + 1)]
        return [sequential(OrderedDict(layers[a:b])) for a, b in itertools.pairwise(bounds)]

    def _register_names(
        self, module: nn.Sequential, held: Iterable[nn.Sequential] | None = None
    ) -> None:
        """The plain model's names on this pipe, so that ``state_dict()`` keys equal its keys.

        Every name of ``module``, or only the layers of the ``held``
        partitions (a ``DistributedPipe``'s own stages).
        """
        names = None if held is None else [name for p in held for name in p._modules]
        register_names(self, module, names)

    def _start_runtime(self, devices: list[torch.device]) -> None:
        """What running the partitions needs, and fresh step state (hooks, programs).

        Called at construction and, for a ``Pipe``, after a copy.
        """
        self._runtime = PartitionRuntime(
            self.partitions, devices, positional=self.call_style == "positional"
        )
        self._completion_hooks = OrderedDict()
        self._validated = ProgramCache()
        self._evaluations = 0
        self._registered = _registered(self)
        # A wrapper's checks, what it does once they pass, and the replicas it tells a
        # refusal over (``checked_before_step``).
        self._step_checks: list[
            tuple[Callable[[], None], Callable[[], None] | None, dist.ProcessGroup | None]
        ] = []

    # Inputs

    def _first_call(self, args: tuple[Value, ...], kwargs: Mapping[str, Value]) -> Value:
        """The first layer's call with keywords, as one value that scatters into micro-batches.

        An ``Arguments``: the first layer gets ``(*args_i, **kwargs_i)``, each
        tensor split along dim 0, every other value given to each micro-batch.
        """
        bad = [key for key in kwargs if not isinstance(key, str)]
        if bad:
            raise TypeError(f"keyword argument names must be strings, got {bad!r}")
        return Arguments(args, kwargs)

    def _input_of(self, input: Value | None, kwargs: Mapping[str, Value] | None) -> Value:
        """The first layer's call for ``step(input, ..., kwargs=...)`` and ``evaluate``.

        ``input`` is what ``step`` takes without keywords (in the
        ``'positional'`` style a tuple holds the positional arguments); with
        ``kwargs``, ``None`` means no positional argument: the first layer
        gets only the keywords.
        """
        if kwargs is not None and not isinstance(kwargs, Mapping):
            raise TypeError(
                f"kwargs must be a dict of the first layer's keyword arguments, got "
                f"{type(kwargs).__name__}"
            )
        if not kwargs:
            return input
        if input is None:
            return self._first_call((), kwargs)
        if self.call_style == "positional" and type(input) is tuple:
            return self._first_call(input, kwargs)
        return self._first_call((input,), kwargs)

    def _micro_batches(self, input: Value, device: torch.device, name: str) -> list[Batch]:
        """``input`` (``name``: the input, the target) checked, on ``device``, in micro-batches."""
        check_input(input, name)
        return scatter(to_device(input, device), self.chunks, name)

    # Steps

    def step(
        self,
        input: Value,
        target: Value,
        loss_fn: Callable[[Value, Value], torch.Tensor],
        *,
        kwargs: Mapping[str, Value] | None = None,
        schedule: str | Schedule = "1f1b",
        loss_reduction: LossReduction | None = None,
        loss_divisor: LossDivisor | None = None,
        return_outputs: bool = False,
        grad_scaler: torch.amp.GradScaler | None = None,
        measure_memory: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, Value]:
        """Run a training step, forward and backward, as the explicit ``schedule``.

        Equivalent to ``loss = loss_fn(model(input, **kwargs), target);
        loss.backward()`` on the plain model: the gradients accumulate into
        ``.grad`` (zero them as usual), each tensor's once per step, so its
        hooks are called as one backward calls them (docs/schedules.md,
        "Gradients and hooks"), and the loss is returned, detached, on the last device. The
        backward runs on the workers too, so that it overlaps across
        partitions, in the order ``schedule`` gives: ``"gpipe"``, ``"1f1b"``
        (the default: each partition holds at most as many micro-batches as
        there are partitions after it), ``"interleaved"``, ``"zb-h1"``,
        ``"zb-h1-peak"``, or a
        ``pipeline.schedules.Schedule`` (``Programs([...])`` for programs of
        your own, in torch's notation: ``"0F0 0F1 0B0 0B1"``).

        ``loss_fn(output, target)`` gets one micro-batch's output and target
        (scattered like the input) and returns its loss, reduced over the
        micro-batch. With ``loss_reduction="mean"`` each micro-batch's loss
        counts by its share of the rows, so the result is the mean over the
        mini-batch even when the last micro-batch is smaller; with ``"sum"``
        the losses are added, and with ``"sum"`` and ``loss_divisor=N`` the
        sum is divided by ``N``: a mean over what you count in the batch,
        such as the tokens ``ignore_index`` leaves. A loss module
        (``nn.MSELoss(reduction="sum")``) gives its own reduction, the
        default; ``"mean"`` otherwise. ``return_outputs=True`` also returns
        the model's output (detached)::

            loss = pipe.step(x, y, nn.functional.cross_entropy, schedule="1f1b")
            optimizer.step()

        ``input`` is what ``pipe(input)`` takes; ``kwargs``, a dict, holds
        the first layer's keyword arguments, split like the input (tensors
        along dim 0, other values given to every micro-batch): ``pipe.step(ids,
        y, loss_fn, kwargs={"attention_mask": mask})`` is the step of
        ``model(ids, attention_mask=mask)``. With ``kwargs``, ``input=None``
        calls the first layer with the keywords alone.

        With ``grad_scaler`` (a ``torch.amp.GradScaler``), each micro-batch's
        backward starts from its scaled loss, as ``scaler.scale(loss).backward()``
        does, and the unscaled loss is returned; then call
        ``scaler.step(optimizer)`` and ``scaler.update()`` as usual.
        ``measure_memory=True`` measures each partition's peak activation
        memory into ``pipe.last_step`` (it costs a few microseconds per saved
        tensor).

        Interrupted (Ctrl-C, any exception in the caller), ``step`` raises once
        the workers have ended the action they were in: after that, nothing
        writes into ``.grad``, the parameters or the buffers. The gradients
        may hold part of the interrupted step's, as after an interrupted
        ``loss.backward()``: zero them before the next step.
        """
        return self._train(
            StepCall(
                input,
                target,
                loss_fn,
                kwargs,
                schedule,
                loss_reduction,
                loss_divisor,
                return_outputs,
                grad_scaler,
                measure_memory,
            )
        )

    @abstractmethod
    def _train(self, call: StepCall) -> torch.Tensor | tuple[torch.Tensor, Value]:
        """Run ``step``'s call: checked, then its programs here."""

    @overload
    def evaluate(self, input: Value, *, kwargs: Mapping[str, Value] | None = None) -> Value: ...

    @overload
    def evaluate(
        self,
        input: Value,
        target: Value,
        loss_fn: Callable[[Value, Value], torch.Tensor],
        *,
        kwargs: Mapping[str, Value] | None = None,
        loss_reduction: LossReduction | None = None,
        loss_divisor: LossDivisor | None = None,
        return_outputs: Literal[False] = False,
    ) -> torch.Tensor: ...

    @overload
    def evaluate(
        self,
        input: Value,
        target: Value,
        loss_fn: Callable[[Value, Value], torch.Tensor],
        *,
        kwargs: Mapping[str, Value] | None = None,
        loss_reduction: LossReduction | None = None,
        loss_divisor: LossDivisor | None = None,
        return_outputs: Literal[True],
    ) -> tuple[torch.Tensor, Value]: ...

    def evaluate(
        self,
        input: Value,
        target: Value | None = None,
        loss_fn: Callable[[Value, Value], torch.Tensor] | None = None,
        *,
        kwargs: Mapping[str, Value] | None = None,
        loss_reduction: LossReduction | None = None,
        loss_divisor: LossDivisor | None = None,
        return_outputs: bool = False,
    ) -> Any:
        """The plain model's outputs, or loss, in ``eval()`` mode under ``torch.no_grad()``.

        ``pipe.evaluate(x)`` returns the output, on the last device;
        ``pipe.evaluate(x, y, loss_fn)`` the loss, weighed over the
        micro-batches as ``step`` weighs it (``loss_reduction``,
        ``loss_divisor``), and with ``return_outputs=True`` the loss and the
        output. The micro-batches overlap across partitions, forward only::

            val_loss = pipe.evaluate(x, y, nn.functional.cross_entropy)

        ``kwargs`` are the first layer's keyword arguments, as ``step`` takes them.

        It leaves the pipe as it found it: every submodule's train/eval mode
        (mixed modes too), ``.grad``, running statistics, and the default
        random generators (a layer that draws even in eval mode draws fresh
        numbers on each call, reproducible under ``torch.manual_seed``).
        """
        return self._evaluate(
            EvaluateCall(
                input, target, loss_fn, kwargs, loss_reduction, loss_divisor, return_outputs
            )
        )

    @abstractmethod
    def _evaluate(self, call: EvaluateCall) -> Any:
        """Run ``evaluate``'s call: checked, then its forward programs here."""

    def _check_open(self) -> None:
        if not self._finalizer.alive:
            raise RuntimeError(
                f"this {self._NAME} is closed; create a new {self._NAME} to run it again"
            )
        self._check_registered_kept()

    def _check_registered_kept(self) -> None:
        """Refuse a layer, parameter or buffer set on the pipe since it was built: its
        partitions still run what they were built with, and would ignore it."""
        now = _registered(self)
        changed = sorted(
            name
            for name in now.keys() | self._registered.keys()
            if now.get(name) != self._registered.get(name)
        )
        if changed:
            raise RuntimeError(
                f"this {self._NAME}'s {', '.join(map(repr, changed))} changed after it was built "
                "(replaced, added or removed: setattr, add_module, register_parameter, delattr): "
                "its partitions still run the layers they were built with, and would ignore the "
                f"change; build a new {self._NAME} from the changed model, or change a layer's "
                "tensors in place (with torch.no_grad(): layer.weight.copy_(new))"
            )

    @contextmanager
    def checked_before_step(
        self,
        check: Callable[[], None],
        ready: Callable[[], None] | None = None,
        replicas: dist.ProcessGroup | None = None,
    ) -> Iterator[None]:
        """Within the block, each ``step`` runs ``check`` among its own checks, before any
        work, and ``ready`` (if given) once they all passed, as its work begins.

        For a wrapper's checks (``DataParallel``'s): a ``DistributedPipe``
        runs them inside the step's agreement, so that a refusal in one
        process fails every process of the pipeline at once, where one raised
        before the step would leave the others waiting for it; and tells its
        refusal over ``replicas`` (the replicas of this process's stages), so
        that the other pipelines of a grid refuse too, where they would wait
        for this one in their collectives. What the wrapper changes for the
        step (``DataParallel`` broadcasts rank 0's buffers) is ``ready``: a
        refused step changes nothing.
        """
        entry = (check, ready, replicas)
        self._step_checks.append(entry)
        try:
            yield
        finally:
            self._step_checks.remove(entry)

    def _replica_groups(self) -> list[dist.ProcessGroup]:
        """The groups of the replicas of this process's stages that a wrapper steps over."""
        return [group for _, _, group in self._step_checks if group is not None]

    def _refuse_own_hooks(self, what: str) -> None:
        """Refuse ``step`` or ``evaluate`` of a pipe with hooks of its own: they run around
        its forward, which neither calls."""
        # fully_shard on the pipe itself hooks it too: the sharding check says why not.
        kinds = (
            []
            if instance_of(self, "torch.distributed.fsdp", "FSDPModule")
            else call_hook_kinds(self)
        )
        if kinds:
            raise ValueError(
                f"this {self._NAME} has {' and '.join(kinds)} registered on itself, which run "
                f"around its own forward, but {self._NAME}.{what} runs its layers without "
                "calling it, so they would not run: register them on the layers (or the "
                "model's modules), or remove them first"
            )

    def _check_step_arguments(self, call: StepCall) -> LossReduction:
        """Refuse, before any work, a step that cannot compute the plain model's gradients.

        Returns the reduction the step weighs its micro-batches' losses by.
        """
        check_flags(return_outputs=call.return_outputs, measure_memory=call.measure_memory)
        if not torch.is_grad_enabled() or torch.is_inference_mode_enabled():
            raise RuntimeError(
                f"{self._NAME}.step computes gradients, but grad mode is off here "
                f"(torch.no_grad() or inference mode); {self._EVALUATE}"
            )
        self._refuse_own_hooks("step")
        for check, _, _ in self._step_checks:
            check()
        deferred_norms(self, self._converts_batch_norm)  # within a DistributedPipe's agreement
        self._refuse_lazy_where_recomputed()
        refuse_cached_parametrizations(self, f"{self._NAME}.step")
        reduction = self._check_loss(call.loss_fn, call.loss_reduction, call.loss_divisor)
        check_grad_scaler(call.grad_scaler, self._runtime.devices[-1])
        check_supported()
        return reduction

    def _check_loss(self, loss_fn: Any, loss_reduction: Any, loss_divisor: Any) -> LossReduction:
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable(output, target), got {loss_fn!r}")
        reduction = resolve_reduction(loss_fn, loss_reduction)
        check_divisor(loss_divisor, reduction)
        return reduction

    def _check_evaluate_arguments(self, call: EvaluateCall) -> LossReduction | None:
        """Refuse, before any work, an evaluation whose loss arguments do not fit together.

        Returns the reduction of its loss, or None without a ``loss_fn``.
        """
        check_flags(return_outputs=call.return_outputs)
        self._check_open()
        self._refuse_own_hooks("evaluate")
        if call.loss_fn is not None:
            return self._check_loss(call.loss_fn, call.loss_reduction, call.loss_divisor)
        given = [
            name
            for name, value in (
                ("a target", call.target),
                ("loss_reduction", call.loss_reduction),
                ("loss_divisor", call.loss_divisor),
            )
            if value is not None
        ]
        if given:
            raise TypeError(
                f"{self._NAME}.evaluate got {' and '.join(given)} but no loss_fn: pass "
                "evaluate(input, target, loss_fn) for the loss, or evaluate(input) for the "
                "outputs"
            )
        return None

    def _check_token_loss(
        self, batches: list[Batch], reduction: LossReduction | None, divisor: Any
    ) -> None:
        """Refuse, before any work, a split transformers model's ``out.loss`` weighed wrongly.

        ``batches``: the first layer's micro-batches (none where this process
        does not run stage 0); ``reduction``: None for an evaluation without a loss.
        """
        if self._token_loss is not None and reduction is not None:
            self._token_loss.check(batches, reduction, divisor)

    def _refuse_rows_across(self, batches: list[Batch], gathered: bool) -> None:
        """Refuse, before any work, to gather over several micro-batches a split model's
        outputs that mix the rows of the batch (``SplitModel.rows_across``)."""
        if not (gathered and self._rows_across and len(batches) > 1):
            return
        raise ValueError(
            f"the split model's outputs at {', '.join(self._rows_across)} hold the batch's "
            "size past their first dimension (every row against every row, as CLIP's "
            f"similarities): each of the {len(batches)} micro-batches would give its own rows "
            "against its own rows alone; split a model that returns what is computed row by "
            "row (the embeddings) and compute the rest after the pipe (docs/split.md, "
            "'Outputs that mix the rows of the batch'), or use chunks=1"
        )

    def _router_tally(
        self,
        call: StepCall | EvaluateCall,
        batches: list[Batch],
        programs: list[Program] | None,
        reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> RouterTally | None:
        """The router loss of a step (``programs``) or an evaluation, checked; None without one.

        ``batches``: the first layer's micro-batches (``runtime/router_loss.py``).
        """
        grad_scaler = call.grad_scaler if isinstance(call, StepCall) else None
        early = None if programs is None else backward_before_forward(programs)
        return step_tally(
            self._router_loss,
            [batch.value for batch in batches],
            {module for partition in self.partitions for module in partition.modules()},
            early_backward=None if early is None else str(early),
            loss_fn=call.loss_fn,
            grad_scaler=grad_scaler,
            divisor=call.loss_divisor,
            reduce=reduce,
            stepping=programs is not None,
        )

    def _programs(self, schedule: Schedule, m: int) -> tuple[list[Program], Simulation]:
        """The schedule's programs for ``m`` micro-batches, validated once (``step/cache.py``)."""
        return self._validated.programs(schedule, m, len(self.balance))

    def _refuse_reordered_updates(
        self, schedule: Schedule, programs: list[Program], stages: Iterable[int]
    ) -> None:
        """Refuse programs that run a stage's forwards out of micro-batch order where a layer
        of it updates state in each forward: the plain model updates it in that order.
        A built-in schedule's never do: nothing is scanned, at every step."""
        if forwards_in_order(schedule):
            return
        for j in stages:
            found = forwards_out_of_order(programs, j)
            layer = updating_layer(self.partitions[j]) if found is not None else None
            if found is not None and layer is not None:
                raise ProgramError(
                    f"{schedule!r}: stage {j} runs the forward of micro-batch {found[1]} "
                    f"before that of micro-batch {found[0]}, and its layer {layer[0]!r} "
                    f"updates its {layer[1]} in each training forward, in the order the "
                    "forwards run, where the plain model takes the micro-batches in order (as "
                    "under gradient accumulation), so they would differ: run each stage's "
                    "forwards in micro-batch order (its backwards may come in any order), or "
                    "use deferred_batch_norm=True for BatchNorm"
                )

    def _reached_by_the_caller(
        self, micro_batches: MicroBatches, stages: Iterable[int]
    ) -> tuple[list[torch.Tensor], list[int]]:
        """The pipe's parameters that the caller's graph behind the input or the target
        reaches too (an embedding outside, tied to the head inside), and which of
        ``stages`` hold them: accumulated once, at the step's end, with the caller's part
        (``at_end``), so those stages are final, and signalled, only then."""
        batches = [*micro_batches.batches, *micro_batches.targets]
        reached = caller_reached(self.parameters(), batches)
        if not reached:
            return [], []
        late = [j for j in stages if reached & {id(p) for p in self.partitions[j].parameters()}]
        return [p for p in self.parameters() if id(p) in reached], late

    def _step_run(
        self,
        call: StepCall,
        loss_reduction: LossReduction,
        programs: list[Program],
        micro_batches: MicroBatches,
        hooks: list[Hook],
        stages_by_worker: list[list[int]],
        *,
        transport: Transport | None = None,
        stages: Iterable[int] | None = None,
        at_end: Iterable[torch.Tensor] = (),
        router: RouterTally | None = None,
    ) -> StepRun:
        """One step's run: this pipe's partitions and skips, loss scales, checkpointed tasks.

        ``stages_by_worker[w]`` lists the stages worker ``w`` runs: which generators
        each thread owns follows (``pipeline/runtime/ownership.py``).
        """
        for _, ready, _ in self._step_checks:
            if ready is not None:
                ready()
        if call.grad_scaler is not None:
            # Its scale is made on first use: here, on the loss's device, not by a worker.
            call.grad_scaler.scale(torch.zeros((), device=self._runtime.devices[-1]))
        m = len(micro_batches.rows)
        return StepRun(
            self._runtime,
            self.skip_layout,
            micro_batches.batches,
            micro_batches.targets,
            call.loss_fn,
            loss_scales(micro_batches.rows, loss_reduction, call.loss_divisor),
            checkpointed_tasks(programs, m, self.checkpoint, self.training),
            hooks,
            call.return_outputs,
            self._runtime.randomness(stages_by_worker),
            any(a.kind == "W" for program in programs for a in program),
            transport=transport,
            stages=stages,
            grad_scaler=call.grad_scaler,
            measure_memory=call.measure_memory,
            at_end=at_end,
            router=router,
        )

    def _evaluation_run(
        self,
        call: EvaluateCall,
        loss_reduction: LossReduction | None,
        micro_batches: MicroBatches,
        keep_outputs: bool,
        stages_by_worker: list[list[int]],
        *,
        transport: Transport | None = None,
        stages: Iterable[int] | None = None,
        router: RouterTally | None = None,
    ) -> StepRun:
        """An evaluation's run: forwards only, the loss weighed as a step weighs it.

        ``stages_by_worker`` as for ``_step_run``.
        """
        return StepRun(
            self._runtime,
            self.skip_layout,
            micro_batches.batches,
            micro_batches.targets,
            call.loss_fn,
            loss_scales(micro_batches.rows, loss_reduction or "mean", call.loss_divisor),
            set(),
            [],
            keep_outputs,
            self._runtime.randomness(stages_by_worker),
            False,
            transport=transport,
            stages=stages,
            forward_only=True,
            router=router,
        )

    def _evaluating(self) -> AbstractContextManager[None]:
        """Around an evaluation: eval mode, no grad, generators as they were (``evaluation.py``)."""
        self._evaluations += 1
        return evaluating(self, self._runtime.devices, evaluation_seed(self._evaluations))

    @staticmethod
    def _measured(
        run: StepRun, programs: list[Program], worker_of_program: list[int] | None = None
    ) -> Measured:
        """What a report measures of ``run``'s stages here.

        ``worker_of_program[k]``: the thread that ran ``programs[k]``; by
        default a worker per program (a process each, for a DistributedPipe).
        """
        return Measured(
            run.timed, programs, run.peak_in_flight, run.peak_activation_bytes, worker_of_program
        )

    def _refuse_lazy_where_recomputed(self) -> None:
        if checkpoint_stop(self.checkpoint, self.chunks, self.training):
            refuse_lazy(self.partitions)

    @contextmanager
    def _one_pass(self, batches: list[Batch]) -> Iterator[None]:
        """Around one pass over ``batches``: DeferredBatchNorm statistics committed once, at
        its end; a write into a tensor every micro-batch holds refused.

        The pipe defers every DeferredBatchNorm it holds as the pass starts:
        converted by it or by the caller, before it was built or after.
        """
        norms = deferred_norms(self, self._converts_batch_norm)
        self._runtime.deferred_batch_norm = bool(norms)
        with statistics_of_one_pass(norms), self._runtime.watching(batches):
            yield

    # Gradients

    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """Clip the gradients by the norm of the whole model's, as the plain model would be.

        Equal to ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)``
        on the plain model, with the same arguments and return value (the
        norm before clipping), bit for bit with float32 and float64
        gradients; with bfloat16 and float16 ones, the total is taken in
        float64 and returned in float32, and the clipped gradients are
        within about a unit in the last place of torch's (docs/guide.md,
        "Gradient clipping"). Call it after the backward or ``step``, every
        process of a ``DistributedPipe`` alike: the norm counts every stage
        of the pipeline (a weight tied across processes once, a DTensor
        gradient sharded by FSDP2 or tensor parallelism whole), where
        torch's function in one process sees that process's stages only.
        With a ``GradScaler``, unscale first (``scaler.unscale_(optimizer)``)::

            loss = pipe.step(x, y, loss_fn)
            pipe.clip_grad_norm_(1.0)
            optimizer.step()
        """
        return clip_grad_norm(
            self.parameters(),
            self._counted_parameters(),
            max_norm,
            norm_type,
            error_if_nonfinite,
            self._norm_group(),
            self._norm_device(),
        )

    def _counted_parameters(self) -> Iterable[nn.Parameter]:
        """Each parameter whose gradient the pipeline's norm counts, once."""
        return self.parameters()

    def _norm_group(self) -> dist.ProcessGroup | None:
        """The processes whose gradients make up the norm (None: this one alone)."""
        return None

    @abstractmethod
    def _norm_device(self) -> torch.device:
        """The device the pipeline's gradient norm is computed on."""

    # Hooks and threads

    @property
    def partition_names(self) -> list[list[str]]:
        """Each partition's layer names (the plain model's), every stage's for a
        ``DistributedPipe`` too, whose other stages are empty here."""
        return [list(p._modules) for p in self.partitions]

    def register_partition_backward_hook(self, hook: Hook) -> RemovableHandle:
        """Call ``hook(j)`` in backward once partition ``j``'s gradients are final.

        A gradient hook on a parameter fires once per micro-batch; this one
        fires once per backward (or step), when every micro-batch has been
        back-propagated through partition ``j``, so that gradients can be
        communicated while earlier partitions are still in backward. It runs
        on an autograd engine thread with ``pipe(x)``, on the thread running
        the partition with ``step``. With ``pipe(x)``, a partition is
        signalled only when its inputs require grad: partition 0 when the
        input does, a later one unless everything before it is frozen
        (otherwise its end is the end of backward). A partition sharing a parameter with another is
        signalled once both have ended (with ``step``, on the worker of the
        one that ended last: in ZB-H1 the last partition can end after the
        first). A ``DistributedPipe`` signals only this process's
        stages, once per step; a stage holding weights tied across processes
        once their gradients are summed::

            pipe.register_partition_backward_hook(lambda j: print(f"partition {j} done"))
        """
        handle = RemovableHandle(self._completion_hooks)
        self._completion_hooks[handle.id] = hook
        return handle

    def close(self) -> None:
        """Stop this pipe's threads now (its workers, or its listeners to the peers).

        Garbage collection does it otherwise.
        """
        self._finalizer()


def _registered(module: nn.Module) -> dict[str, int]:
    """The children and parameters registered on ``module`` itself, by identity, and its
    buffers, by name (``.to()`` replaces them: a split model's checks say what follows)."""
    held = [*module._modules.items(), *module._parameters.items()]
    return {name: id(value) for name, value in held} | dict.fromkeys(module._buffers, 0)


def _refuse_nested_pipes(module: nn.Module) -> None:
    """Refuse a pipe among ``module``'s layers when their BatchNorm statistics are deferred:
    it runs its own micro-batches, each of them updating them (or committing them)."""
    for name, child in module.named_modules():
        if isinstance(child, PipeBase):
            raise ValueError(
                f"the layer {name!r} is a {type(child).__name__} of its own: its micro-batches "
                "within each of this pipe's would update its BatchNorm statistics, which "
                "deferred_batch_norm=True promises to update once per mini-batch; give this "
                "pipe its layers, not a pipe of them, or pass deferred_batch_norm=False"
            )
