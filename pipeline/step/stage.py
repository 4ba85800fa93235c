"""Stage: one stage's actions in an explicit schedule, and what it keeps between them.

A stage runs its partition on detached inputs, so that each of its actions
works on an autograd graph of its own, on the stage's worker:

- ``F``: take micro-batch ``i`` (the scattered input on stage 0, else the
  previous stage's output from the mailbox), make its tensors leaves that
  require grad, run the partition, and mail the output (detached) to the
  next stage; the last stage computes the micro-batch's loss instead. Once
  mailed, an output is kept as the autograd edge its backward starts from,
  not as a tensor: its storage goes as soon as the receiver (or the wire) is
  done with it, as Megatron's ``deallocate_pipeline_outputs`` frees it, and
  whatever the graph saved of it stays. A checkpointed forward records its
  graph, so that each output it mails says whether it needs a gradient as
  in the plain model, but keeps none of what that graph would save: only
  its inputs.
- ``B``: recompute if checkpointed (same random draws, same buffers, same
  autocast), run backward from the outputs with the gradients the next stage
  mailed back (from the loss on the last stage, scaled by the step's
  GradScaler if any), and mail the gradients of the inputs back. The
  weights' gradients accumulate into ``.grad`` at once, or, where a weight
  has hooks, are summed: it then gets its step's sum once, when the stage
  has ended (``gradients.py``); on stage 0
  the inputs' gradients continue into the caller's graph at the step's end
  (the input may require grad). ``I`` and ``W`` do the same in two halves
  (``backward_in_two.py``).

An evaluation runs the ``F`` actions alone (``forward_only``), without grad:
a stage keeps nothing of a micro-batch once its forward is done.

Each action is timed (``reports.py``): its start and end, the time it waited
for mail (reported to ``pipeline.trace()`` as a ``wait`` inside the action)
and the time its backward recomputed.

A skip between partitions is an extra boundary value of its micro-batch: the
stashing stage mails it to the popping stage, which makes it a leaf and
mails its gradient back; the stashing stage's backward starts from its
outputs and its outgoing skips together. Stages in between never see it.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Hashable, Iterable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any, cast

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge, get_gradient_edge
from torch.utils._pytree import tree_flatten, tree_unflatten

from pipeline.runtime.aliases import noted_leaves, skip_aliases
from pipeline.runtime.microbatch import Batch, check_gatherable, check_rows, refuse_attributes_in
from pipeline.runtime.partitions import Hook, PartitionRuntime, protected
from pipeline.runtime.recompute import Recomputation
from pipeline.runtime.rng import BaseSeed, PartitionRandomness, TaskRandomness
from pipeline.runtime.router_loss import RouterTally, check_loss
from pipeline.runtime.stream import Stream, use_stream
from pipeline.runtime.threadstate import ThreadState
from pipeline.skip.carrier import Carrier
from pipeline.skip.layout import SkipLayout
from pipeline.skip.tracker import (
    SkipKey,
    SkipTracker,
    StashMark,
    refuse_returned_into_a_copy,
    refuse_written_after_pop,
    refuse_written_after_stash,
    refuse_written_shared,
    use_tracker,
    version_of,
)
from pipeline.step.actions import Action
from pipeline.step.activations import ActivationMeter
from pipeline.step.backward_in_two import WeightWork, backward_input
from pipeline.step.gradients import Root, StepGradients, backward_to_leaves
from pipeline.step.losses import LossFn, Scale, scaled
from pipeline.step.mail import Message, Transport
from pipeline.step.reports import Timed
from pipeline.trace.event import Kind as EventKind
from pipeline.trace.recording import span

__all__ = ["LossFn", "StageRun", "StepContext"]


@dataclass(frozen=True)
class StepContext:
    """What the stages of one step share, built by the runner: all that a stage reads.

    ``batches`` feed stage 0 and ``targets`` the last stage (empty where those
    run in another process); ``scales[i]`` weighs micro-batch ``i``'s loss
    (``loss_fn`` is None in an evaluation without loss); ``checkpointed``
    holds the (micro-batch, stage) tasks whose forward drops its activations;
    ``hooks`` are called with ``j`` on stage ``j``'s worker once its gradients
    are final, one call at a time (``hooks_lock``); ``gradients`` sums the
    leaves' gradients until then (``gradients.py``). ``grad_scaler`` scales
    each loss that backward starts from; ``forward_only`` runs an evaluation;
    ``measure_memory`` gives each stage an ``ActivationMeter``;
    ``randomness[j]`` says how stage ``j``'s tasks draw. ``loss_travels``:
    some stages run in other processes, so the step's loss goes down to
    them with the input gradients (``StageRun.step_loss``). ``router``: the
    model's router loss over the whole batch, whose totals each process
    meets at its first backward action (``runtime/router_loss.py``).
    """

    runtime: PartitionRuntime
    skip_layout: SkipLayout
    transport: Transport
    seeds: BaseSeed
    randomness: list[PartitionRandomness]
    state: ThreadState
    compute_streams: list[Stream]
    batches: list[Batch]
    targets: list[Batch]
    loss_fn: LossFn | None
    scales: list[Scale]
    checkpointed: set[tuple[int, int]]
    hooks: list[Hook]
    keep_outputs: bool
    gradients: StepGradients
    grad_scaler: torch.amp.GradScaler | None = None
    forward_only: bool = False
    measure_memory: bool = False
    loss_travels: bool = False
    router: RouterTally | None = None
    hooks_lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def stages(self) -> int:
        return len(self.runtime)

    @property
    def m(self) -> int:
        return len(self.scales)


@dataclass(slots=True)
class _Stashed:
    """What a stage keeps of micro-batch ``i`` from its forward to its backward."""

    i: int
    inputs: Batch
    randomness: TaskRandomness
    checkpointed: bool
    # What the inputs came from: the caller's tensors on stage 0 (the input's
    # gradient continues there), else the message (kept alive until backward).
    sources: list[Any]
    # Where backward starts: the outputs and the outgoing skips, as ``_root`` keeps them.
    outputs: list[Root | None] = field(default_factory=list)
    loss: Tensor | None = None
    skips_in: dict[SkipKey, Tensor] = field(default_factory=dict)
    popped: dict[SkipKey, int] = field(default_factory=dict)  # each skip's version, popped
    skips_out: dict[SkipKey, Root | None] = field(default_factory=dict)
    recomputation: Recomputation | None = None
    weight_work: WeightWork | None = None
    # The last stage's target, its tensors that need a gradient leaves of the stage's
    # graph as its inputs are (the caller's graph, behind them, is walked once, at the
    # step's end); and what they came from.
    target: Batch | None = None
    target_leaves: list[Tensor] = field(default_factory=list)
    target_sources: list[Tensor] = field(default_factory=list)


class StageRun:
    """Stage ``j``'s actions in one step."""

    def __init__(self, context: StepContext, j: int) -> None:
        self.context = context
        self.j = j
        self.last = j == context.stages - 1
        self.device = context.runtime.devices[j]
        self.stash: dict[int, _Stashed] = {}
        # The last stage's scaled losses, detached.
        self.losses: dict[int, Tensor] = {}
        # Its outputs, detached, with keep_outputs.
        self.outputs: dict[int, Batch] = {}
        # The step's loss, as the last stage summed it, once this stage knows it.
        self.step_loss: Tensor | None = None
        self.peak_in_flight = 0
        self.done = 0
        self._backwards = 0
        # Each action as it ran; and, within the action running now, its waits
        # and recomputation (a stage's actions run one at a time, on one thread).
        self.timed: list[Timed] = []
        self._waited = self._recomputed = 0.0
        self.meter = ActivationMeter(self._not_kept()) if context.measure_memory else None
        # Its thread holds grad mode and no autograd device threads for all
        # its actions (``StepRun``), so an action on the CPU, with nothing
        # else of the caller's state to apply, enters nothing.
        self._plain = context.state.only_grad_mode(self.device)

    def _not_kept(self) -> list[Tensor]:
        """What the meter leaves out: the parameters and buffers, the caller's input and target.

        Buffers are the model's state, as parameters are: one storage for
        every micro-batch (BatchNorm saves its running statistics). Stage 0's
        micro-batches (the last stage's targets) are views of what the caller
        holds anyway: the step keeps no copy of it, and a layer saving one
        would otherwise count the whole batch's storage.
        """
        context = self.context
        caller = [x for batch in (*context.batches, *context.targets) for x in batch.leaves]
        partition = context.runtime.partitions[self.j]
        state = [*partition.parameters(), *partition.buffers()]
        return [*state, *(x for x in caller if isinstance(x, Tensor))]

    def act(self, action: Action) -> None:
        """Run ``action`` (one of this stage's) on its micro-batch, timed."""
        self._waited = self._recomputed = 0.0
        start = time.perf_counter()
        self._act(action)
        self.timed.append(Timed(action, start, time.perf_counter(), self._waited, self._recomputed))

    def _act(self, action: Action) -> None:
        i = action.microbatch
        if action.kind == "F":
            with span("forward", i, self.j), self._forward_context():
                self.forward(i)
            return
        # The micro-batch's graph is let go inside the span: the trace's action
        # ends where the report's does.
        if action.kind == "W":
            with span("weight_grad", i, self.j), self._backward_context():
                work = self.stash[i].weight_work
                assert work is not None, "validate() puts every W after its I"
                self.context.gradients.add(self.j, *work.run(self.context.gradients.hold))
                self._release(i)
        else:
            kind: EventKind = "backward" if action.kind == "B" else "input_grad"
            with span(kind, i, self.j), self._backward_context():
                if self.context.router is not None and self.context.router.to_meet:
                    self._meet_router_totals(i)
                self.backward(i, inputs_only=action.kind == "I")
                if action.kind == "B":
                    self._release(i)

    # Forward

    def forward(self, i: int) -> None:
        inputs, sources = self._inputs(i)
        context = self.context
        checkpointed = (i, self.j) in context.checkpointed
        if checkpointed:
            _refuse_nested(self.j, inputs)
        randomness = TaskRandomness(
            context.seeds, i, self.j, context.randomness[self.j], checkpointed
        )
        stashed = _Stashed(i, inputs, randomness, checkpointed, sources)
        if not context.forward_only:
            self.stash[i] = stashed
            self.peak_in_flight = max(self.peak_in_flight, len(self.stash))
        with randomness.drawing(), _nothing_saved() if checkpointed else _NOTHING:
            if checkpointed:
                output = self._checkpointed_forward(stashed)
            else:
                output = self._call(i, stashed, recomputing=False)
            if self.last:
                if self.context.loss_fn is not None:
                    self._stash_target(i, stashed)
                    stashed.loss = self._loss(stashed, output)
                self._keep_result(i, stashed.loss, output)
        if not self.last:
            self._send_output(i, stashed, output)
            # A checkpointed graph saved nothing: the backward recomputes one that does.
            stashed.outputs = [] if checkpointed else [_root(x) for x in output.leaves]
        stashed.skips_out = {key: _root(x) for key, x in stashed.skips_out.items()}
        if checkpointed:
            stashed.loss = None

    def _inputs(self, i: int) -> tuple[Batch, list[Any]]:
        """Micro-batch ``i`` as leaves of this stage's graph; and what they came from."""
        if self.j == 0:
            batch = self.context.batches[i]
            leaves = [_leaf(x) if _needs_grad(x) else x for x in batch.leaves]
            return Batch.of(leaves, batch.spec), list(batch.leaves)
        message = self._receive(("act", self.j, i), self.j - 1, i)
        if message.sharing:
            # Received apart from another process: a write into one is refused (aliases.py).
            self.context.runtime.note_sharing(self.j - 1, message.sharing)
        leaves = [
            _leaf(x) if wanted else x
            for x, wanted in zip(message.leaves, message.differentiable, strict=True)
        ]
        return Batch.of(leaves, message.spec), message.leaves

    def _checkpointed_forward(self, stashed: _Stashed) -> Batch:
        context = self.context
        stashed.recomputation = Recomputation(
            stashed.randomness,
            context.runtime.buffers[self.j],
            context.state,
            self.device,
            context.compute_streams[self.j],
            lock=None,
        )
        with stashed.recomputation.checkpointed(stashed.inputs):
            output = self._call(-1, stashed, recomputing=False)
        for key, version in stashed.popped.items():
            refuse_written_after_pop(key, stashed.skips_in[key], version, self.j)
        return output

    def _call(self, i: int, stashed: _Stashed, recomputing: bool) -> Batch:
        """Run the partition on the stashed inputs, with this task's skips installed."""
        runtime = self.context.runtime
        # Views, so that a layer may write into an input that needs no gradient as
        # into any non-leaf tensor. One that needs a gradient is a leaf of this
        # stage's graph, which no op may write into: a first layer that declares it
        # writes into its input gets a copy (``protected``, ``runtime/partitions.py``),
        # as do a checkpointed task's (the recomputation starts from what it saw)
        # and the first stage's (the caller's input stays as it was).
        inputs = Batch.of([_view(x) for x in stashed.inputs.leaves], stashed.inputs.spec)
        if runtime.protect_inputs[self.j]:
            inputs = protected(inputs)
        function = partial(runtime.call, self.j)
        if not self.context.skip_layout:
            output = inputs.call(function)
        else:
            tracker = _StageTracker(self, stashed, recomputing)
            with use_tracker(tracker):
                output = inputs.call(function)
            tracker.finish(output, inputs)
        if not any(True for _ in output.tensor_indices()):
            raise TypeError(
                f"partition {self.j} returned {type(output.value).__name__}, which holds no "
                "tensor; a partition must return a tensor, or tuples, lists or dicts holding "
                "tensors"
            )
        return output

    def _stash_target(self, i: int, stashed: _Stashed) -> None:
        """Micro-batch ``i``'s target, as leaves where it needs a gradient: a target with
        a history (``tanh(a)``) would have each micro-batch's backward walk, and free,
        the caller's graph behind it."""
        target = self.context.targets[i]
        if self.context.forward_only or not any(map(_needs_grad, target.leaves)):
            stashed.target = target
            return
        stashed.target_sources = [x for x in target.leaves if _needs_grad(x)]
        stashed.target_leaves = [_leaf(x) for x in stashed.target_sources]
        found = iter(stashed.target_leaves)
        leaves = [next(found) if _needs_grad(x) else x for x in target.leaves]
        stashed.target = Batch.of(leaves, target.spec)

    def _loss(self, stashed: _Stashed, output: Batch) -> Tensor:
        """The micro-batch's loss, scaled by its share of the mini-batch's loss."""
        context = self.context
        assert context.loss_fn is not None and stashed.target is not None, "with a loss_fn"
        loss = context.loss_fn(output.value, stashed.target.value)
        if not isinstance(loss, Tensor) or loss.dim() != 0:
            shape = f" of shape {tuple(loss.shape)}" if isinstance(loss, Tensor) else ""
            raise TypeError(
                f"loss_fn returned {type(loss).__name__}{shape}; it must return a scalar "
                "tensor, the loss of one micro-batch (reduced with 'mean' or 'sum')"
            )
        if not (context.forward_only or loss.requires_grad):
            raise RuntimeError(
                "loss_fn returned a loss that needs no grad (detached, made from a number, "
                "or from an output that needs none: every parameter frozen): step cannot "
                "compute gradients from it; return the loss as computed from the "
                "micro-batch's output, or use pipe.evaluate(...) for a loss alone"
            )
        if context.router is not None:
            check_loss(output.value, loss)
        return scaled(loss, context.scales[stashed.i])

    def _send_output(self, i: int, stashed: _Stashed, output: Batch) -> None:
        _refuse_hidden_gradients(self.j, output.leaves)
        differentiable = [_needs_grad(x) for x in output.leaves]
        # The groups seen so far that this output's leaves reach: an earlier step's
        # output may have had more of them.
        count = len(output.leaves)
        sharing = [g for g in self.context.runtime.sharing(self.j) if max(g) < count]
        message = Message(
            [_detached(x) for x in output.leaves], output.spec, differentiable, sharing=sharing
        )
        self._send(("act", self.j + 1, i), message, self.j + 1, i)

    # Backward

    def backward(self, i: int, inputs_only: bool) -> None:
        stashed = self.stash[i]
        if stashed.checkpointed:
            start = time.perf_counter()
            with span("recompute", i, self.j), self._metered():
                self._recompute(i, stashed)
            self._recomputed += time.perf_counter() - start
        roots, grads = self._roots(i, stashed)
        inputs = [x for x in stashed.inputs.leaves if _needs_grad(x)]
        # A skip that needs no gradient (integer labels) gets None back, not a target.
        skips = [key for key, leaf in stashed.skips_in.items() if _needs_grad(leaf)]
        target = stashed.target_leaves
        targets = inputs + [stashed.skips_in[key] for key in skips] + target
        halves = backward_input(roots, grads, targets) if inputs_only else None
        if halves is not None:
            found, stashed.weight_work = halves
        else:
            parameters = self.context.runtime.partitions[self.j].parameters()  # read if needed
            gradients = self.context.gradients
            found, leaves, leaf_grads = backward_to_leaves(
                roots, grads, targets, gradients.hold, parameters, gradients.summed
            )
            if leaves:
                self.context.gradients.add(self.j, leaves, leaf_grads)
            if inputs_only:
                stashed.weight_work = WeightWork()
        skip_grads = dict(zip(skips, found[len(inputs) : len(inputs) + len(skips)], strict=True))
        if target:
            self.context.gradients.to_caller(stashed.target_sources, found[-len(target) :])
        for key in stashed.skips_in:
            source = self.context.skip_layout.route(key).source
            message = Message([skip_grads.get(key)])
            self._send(self._skip_mail("skip-grad", key, i), message, source, i)
        self._send_input_grads(i, stashed, found[: len(inputs)])
        stashed.outputs, stashed.loss, stashed.skips_out = [], None, {}

    def _recompute(self, i: int, stashed: _Stashed) -> None:
        assert stashed.recomputation is not None, "a checkpointed forward made it"
        with stashed.recomputation.replaying():
            output = self._call(i, stashed, recomputing=True)
            stashed.outputs = [_root(x) for x in output.leaves]
            if self.last:
                stashed.loss = self._loss(stashed, output)

    def _roots(self, i: int, stashed: _Stashed) -> tuple[list[Root], list[Tensor | None]]:
        """What this stage's backward starts from: the loss, or outputs and outgoing skips."""
        if self.last:
            assert stashed.loss is not None
            scaler = self.context.grad_scaler
            return [stashed.loss if scaler is None else scaler.scale(stashed.loss)], [None]
        grads = self._gradients(self._receive(("grad", self.j, i), self.j + 1, i))
        pairs = list(zip(stashed.outputs, grads, strict=True))
        for key, root in stashed.skips_out.items():
            popping = self.context.skip_layout.route(key).target
            received = self._receive(self._skip_mail("skip-grad", key, i), popping, i)
            pairs.append((_root(root), received.leaves[0]))
        kept = [(o, g) for o, g in pairs if o is not None and g is not None]
        return [o for o, _ in kept], [g for _, g in kept]

    def _send_input_grads(self, i: int, stashed: _Stashed, grads: list[Tensor | None]) -> None:
        self._backwards += 1
        if self.j > 0:
            found = iter(grads)
            message = [next(found) if _needs_grad(x) else None for x in stashed.inputs.leaves]
            self._send(("grad", self.j - 1, i), self._with_loss(message), self.j - 1, i)
            return
        # Stage 0: the gradient continues into the caller's graph, once, at the step's end.
        sources = [x for x in stashed.sources if _needs_grad(x)]
        self.context.gradients.to_caller(sources, grads)

    def _with_loss(self, grads: list[Tensor | None]) -> Message:
        """Input gradients to send down; with the step's loss if they are this stage's last
        and it must travel (``StepContext.loss_travels``).

        The stage below takes them in its last backward at the latest: the
        loss reaches every stage without a message or a collective of its own.
        It rides in the message's description, as a number and a dtype.
        """
        if not (self.context.loss_travels and self._backwards == self.context.m):
            return Message(grads)
        if self.last:
            self.step_loss = self.summed_loss()
        assert self.step_loss is not None, "the stage above sent it with its last gradients"
        leaves, spec = tree_flatten((grads, (self.step_loss.item(), self.step_loss.dtype)))
        return Message(leaves, spec)

    def _gradients(self, message: Message) -> list[Any]:
        """A message of output gradients from the stage above, and the loss if it came."""
        if message.spec is None:
            return message.leaves
        grads, (value, dtype) = tree_unflatten(message.leaves, message.spec)
        self.step_loss = torch.tensor(value, dtype=dtype, device=self.device)
        return list(grads)

    def summed_loss(self) -> Tensor:
        """The step's loss: the sum of the micro-batches' scaled losses (the last stage)."""
        return torch.stack([self.losses[i] for i in range(self.context.m)]).sum()

    def _release(self, i: int) -> None:
        """Micro-batch ``i`` is fully back-propagated through this stage."""
        del self.stash[i]
        self.done += 1
        if self.done == self.context.m:
            self._finished()

    def _keep_result(self, i: int, loss: Tensor | None, output: Batch) -> None:
        """Micro-batch ``i``'s scaled loss (detached), and its output if the caller wants it."""
        if loss is not None:
            self.losses[i] = loss.detach()
        if self.context.keep_outputs:
            check_rows(output.leaves)
            refuse_attributes_in(output.value, "the last partition's output", "the output given")
            self.outputs[i] = Batch.of(
                [x.detach() if isinstance(x, Tensor) else x for x in output.leaves], output.spec
            )
            # Refused before the stages' ends: against the first micro-batch's as each
            # comes (before any backward in GPipe), then all of them together.
            if i > 0 and 0 in self.outputs:  # which counts rows, only all of them tell
                check_gatherable([self.outputs[0], self.outputs[i]])
            if len(self.outputs) == self.context.m:
                rows = [t.rows() for t in self.context.targets] or None
                check_gatherable([self.outputs[k] for k in range(self.context.m)], rows)

    def _finished(self) -> None:
        """This stage ended: accumulate what is final, call the hooks of the partitions final now.

        A partition sharing a parameter with a later-ending one is final, and
        its hooks called (on this worker), only when that one ends.
        """
        with self._backward_context():
            finished = self.context.gradients.stage_done(self.j)
        with self.context.hooks_lock:
            for j in finished:
                for hook in self.context.hooks:
                    hook(j)

    # Mail

    def _send(self, key: Hashable, message: Message, stage: int, i: int) -> None:
        self.context.transport.send(key, message, self.j, stage, i)

    def _receive(self, key: Hashable, stage: int, i: int) -> Message:
        """The message under ``key`` from ``stage``; the wait counts as waiting, not compute."""
        start = time.perf_counter()
        with span("wait", i, self.j):
            message = self.context.transport.receive(key, stage, self.j)
        self._waited += time.perf_counter() - start
        return message

    def _meet_router_totals(self, i: int) -> None:
        """The router loss's totals from every process, before a backward: a wait, like mail's."""
        router = self.context.router
        assert router is not None
        start = time.perf_counter()
        with span("wait", i, self.j):
            router.close()
        self._waited += time.perf_counter() - start

    def _skip_mail(self, kind: str, key: SkipKey, i: int) -> tuple[str, int, int]:
        """The mail key of a skip (or its gradient), meaningful in every process."""
        return kind, self.context.skip_layout.number(key), i

    # Contexts

    def _metered(self) -> AbstractContextManager[None]:
        """Tensors saved for backward counted by the stage's meter, if memory is measured."""
        return self.meter.hooks() if self.meter is not None else contextlib.nullcontext()

    def _forward_context(self) -> AbstractContextManager[object]:
        """The caller's state, the stage's stream and the meter, where any is needed."""
        return _NOTHING if self._plain and self.meter is None else self._forward_entered()

    def _backward_context(self) -> AbstractContextManager[object]:
        return _NOTHING if self._plain else self._backward_entered()

    @contextmanager
    def _forward_entered(self) -> Iterator[None]:
        with (
            self.context.state.applied(self.device),
            use_stream(self.context.compute_streams[self.j]),
            self._metered(),
        ):
            yield

    @contextmanager
    def _backward_entered(self) -> Iterator[None]:
        # Backward runs outside the caller's autocast, as loss.backward()
        # usually does.
        with ExitStack() as stack:
            stack.enter_context(use_stream(self.context.compute_streams[self.j]))
            if self.device.type == "cuda":
                stack.enter_context(torch.cuda.device(self.device))
            yield


class _StageTracker(SkipTracker):
    """The skips of one task of an explicit schedule: those leaving the partition go by mail."""

    def __init__(self, stage: StageRun, stashed: _Stashed, recomputing: bool) -> None:
        super().__init__()
        self.stage = stage
        self.stashed = stashed
        self.recomputing = recomputing
        # The skips to send once the partition's forward has ended, as stashed.
        self.sent: list[tuple[SkipKey, Tensor, StashMark, int]] = []
        # The popped skips that shared memory with their partition's output, at their pop.
        self.shared: list[tuple[SkipKey, Tensor, int]] = []

    def save(self, output: Carrier, key: SkipKey, tensor: Tensor) -> None:
        route = self.stage.context.skip_layout.route(key)
        if not route.crosses_partitions:
            super().save(output, key, tensor)
            return
        if self.stashed.checkpointed == self.recomputing:
            self.stashed.skips_out[key] = tensor  # the tensor whose graph backward starts from
        if not self.recomputing:
            self.sent.append((key, tensor, StashMark(tensor), route.target))

    def finish(self, output: Batch, inputs: Batch) -> None:
        """After the partition's forward: refuse a write into a popped skip that shares
        memory with another path (``runtime/aliases.py``), and a skip written in place
        since its stash, in the partition or, being what it returns, by the next
        partition's first layer (on a copy); note the output's leaves sharing memory with
        a skip; then send the skips, each saying whether it shares memory with another.

        Where every message stays in one memory (one device, one process), a write shows
        on every path, as in the plain model: nothing is noted there.
        """
        for key, tensor, version in self.shared:
            refuse_written_shared(key, tensor, version, self.stage.j)
        if self.recomputing:
            return
        runtime = self.stage.context.runtime
        j = self.stage.j
        for key, tensor, mark, _ in self.sent:
            refuse_written_after_stash(key, tensor, mark)
            if j + 1 < len(runtime.protect_inputs) and runtime.protect_inputs[j + 1]:
                refuse_returned_into_a_copy(key, tensor, output.leaves, j)
        aliased: list[int] = []
        if self.stage.context.transport.apart:
            shared = [t for _, t, _ in self.shared]
            shared += noted_leaves(inputs.value, runtime.sharing(j - 1)) if j else []
            skips = [tensor for _, tensor, _, _ in self.sent]
            shown, aliased = skip_aliases(output.leaves, skips, shared)
            runtime.note_sharing(j, [frozenset({k}) for k in shown])
        i = self.stashed.i
        for q, (key, tensor, _, target) in enumerate(self.sent):
            sharing = [frozenset({0})] if q in aliased else []
            message = Message([_detached(tensor)], None, [_needs_grad(tensor)], sharing=sharing)
            self.stage._send(self.stage._skip_mail("skip", key, i), message, target, i)

    def load(self, input: Carrier, key: SkipKey) -> Tensor:
        route = self.stage.context.skip_layout.route(key)
        if not route.crosses_partitions:
            return super().load(input, key)
        if self.recomputing:
            return cast(Tensor, _view(self.stashed.skips_in[key]))
        i = self.stashed.i
        message = self.stage._receive(self.stage._skip_mail("skip", key, i), route.source, i)
        tensor = message.leaves[0]
        leaf = _leaf(tensor) if message.differentiable[0] else tensor
        self.stashed.skips_in[key] = leaf
        self.stashed.popped[key] = version_of(leaf)
        if message.sharing:
            self.shared.append((key, leaf, version_of(leaf)))
        self.stashed.sources.append(tensor)
        return cast(Tensor, _view(leaf))


_NOTHING = contextlib.nullcontext()


def _root(x: Any) -> Root | None:
    """Where a backward from ``x`` starts (None if it needs no gradient): a leaf, or its edge.

    The edge (``grad_fn``, output number) holds the graph but not ``x``'s
    storage, which its owner may then free.
    """
    if isinstance(x, GradientEdge):
        return x
    if not _needs_grad(x):
        return None
    return x if x.grad_fn is None else get_gradient_edge(x)


def _refuse_hidden_gradients(j: int, leaves: list[Any]) -> None:
    """Refuse an object of another class holding a tensor with a history that requires
    grad, between stages: passed as it is, its tensor would keep the graph of this stage,
    which the next stage's backward would walk, outside the step's order (``pipe(x)``'s
    one graph takes it; a stage's, which starts from leaves, cannot). A parameter held
    so (a leaf) passes: its gradient accumulates wherever it is reached."""
    for leaf in leaves:
        if isinstance(leaf, Tensor | int | float | str | bytes | None):
            continue
        found = _hidden_history(leaf, depth=3)
        if found is not None:
            raise TypeError(
                f"partition {j} returned a {type(leaf).__name__} object holding a tensor "
                f"computed with grad ({found}); Pipe.step passes objects of other classes as "
                "they are, so the next partition's backward would reach into this one's "
                "graph: register the class with torch.utils._pytree (register_dataclass) so "
                "that its tensors are sent as tensors, or return the tensor itself"
            )


def _hidden_history(value: Any, depth: int) -> str | None:
    """Where inside ``value`` (its attributes, slots, and the lists, tuples and dicts
    they hold, ``depth`` levels down) a tensor with a history that requires grad is."""
    if isinstance(value, Tensor):
        return "" if value.requires_grad and value.grad_fn is not None else None
    if depth == 0:
        return None
    if isinstance(value, list | tuple):
        items: Iterable[tuple[Any, Any]] = enumerate(value)
    elif isinstance(value, dict):
        items = value.items()
    else:
        names = [*getattr(value, "__dict__", {})]
        names += [n for c in type(value).__mro__ for n in getattr(c, "__slots__", ())]
        items = ((n, getattr(value, n, None)) for n in names if isinstance(n, str))
    for key, item in items:
        where = _hidden_history(item, depth - 1)
        if where is not None:
            return (
                f"[{key!r}]{where}" if isinstance(value, list | tuple | dict) else f".{key}{where}"
            )
    return None


def _leaf(x: Tensor) -> Tensor:
    return x.detach().requires_grad_()


def _view(x: Any) -> Any:
    return x.view_as(x) if _needs_grad(x) else x


def _needs_grad(x: Any) -> bool:
    return isinstance(x, Tensor) and x.requires_grad


def _nothing_saved() -> AbstractContextManager[None]:
    """A checkpointed forward: its graph is recorded, so that each output says whether it
    needs a gradient as in the plain model, but none of what it would save is kept."""
    return torch.autograd.graph.saved_tensors_hooks(_drop, _never_unpacked)


def _drop(tensor: Tensor) -> None:
    return None


def _never_unpacked(packed: None) -> Tensor:
    raise RuntimeError("a checkpointed forward's graph is never backpropagated")


def _detached(x: Any) -> Any:
    return x.detach() if isinstance(x, Tensor) else x


def _refuse_nested(j: int, inputs: Batch) -> None:
    """Refuse a checkpointed task whose input holds a nested (ragged) tensor: recomputed, it
    gets a new ragged size, which the gradient mailed back for it does not match (torch's
    error in the backward, after other ``.grad`` were written)."""
    if any(isinstance(x, Tensor) and x.is_nested for x in inputs.leaves):
        raise ValueError(
            f"stage {j} is given a nested (ragged) tensor in a checkpointed micro-batch: "
            "recomputed, it would get a new ragged size that its gradient does not match; "
            "use checkpoint='never' for such a stage's micro-batches, or pad the tensor"
        )
