"""The planner's memory model: what one stage holds at its peak, term by term.

For stage ``j`` (layers ``first..stop``) under a schedule, with
micro-batches of one size, walking every stage's actions in the order one
thread would run them (``Simulation.one_thread_order``, the play's order;
docs/plan.md writes the terms down):

- **activations**: the bytes autograd saved for backward, each storage once
  (``profile.Saved``): a task that is not checkpointed holds them from its
  forward to the end of its backward (to its ``W`` under zero-bubble: ``I``
  keeps the graph, but for what the loss alone saved, which ``W`` does
  not need); a checkpointed one holds none until its backward
  recomputes them, then holds them until it ends. ``StageMemory.activations``
  is their peak alone, taken where tensors are saved (a forward, a
  recomputation, which saves copies of the buffers its layers change, such
  as BatchNorm's running statistics), as the step's meter takes it
  (``pipeline/step/activations.py``): the figure is that meter's, exactly;
- what the stage keeps **outside autograd**, beside them:

  - **inputs**: its received input, from its forward to its backward: all
    of it for a checkpointed task, else what its layers did not save
    already; nothing on stage 0, whose micro-batches are views of the
    caller's batch. Its outputs are nothing: once mailed, a stage keeps
    only their autograd edge (``pipeline/step/stage.py``);
  - **mail**: an activation from stage ``j - 1``'s forward until stage
    ``j``'s forward takes it, and a gradient from stage ``j + 1``'s
    backward (or ``I``) until stage ``j``'s has used it; likewise a skip
    popped on stage ``j`` from its stashing stage's forward (then held as
    an input), and a skip's gradient from its popping stage's backward.
    Which stages those are comes from the cut (``stage_of``: ``search.py``
    walks every cut where that moves the figures); without it, the
    neighbours are taken;
  - **recorded**: under zero-bubble, the gradients ``I`` records for ``W``
    (the outputs' gradient on stage 0), from ``I`` to ``W``;

  ``StageMemory.held`` is the peak of all of these with the activations,
  sampled after each action and at each saved tensor, and ``inputs``,
  ``mail``, ``recorded`` (and ``saved``, the activations then) are what
  makes that peak up;
- **parameters** (and buffers), **gradients** (``.grad`` of the trainable
  ones, kept between steps) and **optimizer** state
  (``optimizer_bytes_per_param`` per trainable element: 8 for AdamW in
  float32), each parameter or buffer on the stage of the first layer that
  holds it; with stages in processes, once in each process holding it (a
  tied weight: each holds a copy).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torch import Tensor, nn

from pipeline.plan.profile import Saved
from pipeline.step.actions import Action

__all__ = [
    "HeldPeaks",
    "LayerParameters",
    "MicroBatchBytes",
    "StageMemory",
    "TensorBytes",
    "by_layer",
    "held_peaks",
    "layer_parameters",
    "stage_memory",
]


@dataclass(frozen=True)
class TensorBytes:
    """One parameter's (or buffer's) terms: its bytes held, of its gradients (trained
    ones), of its optimizer state; with sharded stages, its bytes gathered whole."""

    nbytes: int
    trained: int
    optimizer: int
    gathered: int = 0


@dataclass(frozen=True)
class LayerParameters:
    """The parameters and buffers of the layers: ``tensors[k]``'s terms, each tensor once;
    ``held[i]`` the numbers of those layer ``i`` holds (a tied weight: in several), and
    ``first[i]`` the terms of those it holds first.

    In one process a tensor is one, held by the stage of its first holder;
    stages in processes of their own each hold a copy of it
    (docs/distributed_pipe.md, "Tied weights").
    """

    tensors: tuple[TensorBytes, ...]
    held: tuple[frozenset[int], ...]
    first: tuple[TensorBytes, ...]

    @property
    def nbytes(self) -> tuple[int, ...]:
        return tuple(t.nbytes for t in self.first)

    @property
    def trained_bytes(self) -> tuple[int, ...]:
        return tuple(t.trained for t in self.first)

    @property
    def optimizer(self) -> tuple[int, ...]:
        return tuple(t.optimizer for t in self.first)

    @property
    def gathered(self) -> tuple[int, ...]:
        return tuple(t.gathered for t in self.first)

    def stage(self, first: int, stop: int, counted: frozenset[int] | None = None) -> TensorBytes:
        """The terms of the stage of layers ``first..stop``: of the tensors whose first
        holder it holds; or, a stage in a process of its own (``counted``: the tensors
        its process's earlier stages hold), of every tensor it holds but those."""
        if counted is None:
            return _summed(self.first[first:stop])
        return _summed([self.tensors[k] for k in self.holds(first, stop) - counted])

    @property
    def tied(self) -> bool:
        """Whether a tensor is held by several layers (a tied weight)."""
        return sum(map(len, self.held)) > len(self.tensors)

    def holds(self, first: int, stop: int) -> frozenset[int]:
        """The numbers of the tensors layers ``first..stop`` hold."""
        return frozenset().union(*self.held[first:stop])


def _summed(parts: Sequence[TensorBytes]) -> TensorBytes:
    return TensorBytes(
        sum(t.nbytes for t in parts),
        sum(t.trained for t in parts),
        sum(t.optimizer for t in parts),
        sum(t.gathered for t in parts),
    )


def by_layer(model: nn.Sequential, terms: Callable[[Tensor], TensorBytes]) -> LayerParameters:
    """Each layer's parameters and buffers, each tensor numbered once, with its ``terms``."""
    numbers: dict[int, int] = {}
    tensors: list[TensorBytes] = []
    held: list[frozenset[int]] = []
    first: list[TensorBytes] = []
    for layer in model:
        fresh = [t for t in [*layer.parameters(), *layer.buffers()] if id(t) not in numbers]
        for tensor in fresh:
            numbers[id(tensor)] = len(tensors)
            tensors.append(terms(tensor))
        first.append(_summed(tensors[len(tensors) - len(fresh) :]))
        held.append(frozenset(numbers[id(t)] for t in [*layer.parameters(), *layer.buffers()]))
    return LayerParameters(tuple(tensors), tuple(held), tuple(first))


@dataclass(frozen=True)
class StageMemory:
    """One stage's predicted peak, in bytes, by term.

    ``activations`` is the peak of the saved bytes alone (what
    ``pipe.last_step`` measures with ``measure_memory=True``); ``held`` the
    peak of what the step keeps (saved and outside autograd together), made
    of ``saved``, ``inputs``, ``mail`` and ``recorded`` at that peak.
    """

    activations: int
    saved: int
    inputs: int
    mail: int
    recorded: int
    parameters: int
    gradients: int
    optimizer: int
    gathered: int = 0

    @property
    def held(self) -> int:
        return self.saved + self.inputs + self.mail + self.recorded

    @property
    def total(self) -> int:
        return self.held + self.parameters + self.gathered + self.gradients + self.optimizer


@dataclass(frozen=True)
class MicroBatchBytes:
    """What one micro-batch puts on a stage, by what holds it.

    ``saved`` by autograd; ``received`` its input, whole (0 on stage 0);
    ``unsaved`` the part of that its layers do not save; ``grad`` the
    gradient mailed back to it (0 on the last stage); ``recorded`` what
    zero-bubble's ``I`` keeps for ``W``; ``released`` the saved bytes ``I``
    lets go (what lies above the stage's topmost anchor, the loss's
    included, where ``I`` starts from the stage's received input:
    ``Saved.released_bytes``); ``replayed`` the buffer copies a
    recomputation saves beside ``saved`` (``Saved.replayed_bytes``), of
    which ``I`` lets ``replayed_released`` go.
    """

    saved: int
    received: int
    unsaved: int
    grad: int
    recorded: int
    released: int = 0
    replayed: int = 0
    replayed_released: int = 0
    # Mail from other stages than the neighbours' activation and gradient: skips, as
    # (stashing stage, bytes) arriving at its forward, and their gradients, as (popping
    # stage, bytes) arriving at its backward (or I). ``received`` holds the skips too.
    skips_in: tuple[tuple[int, int], ...] = ()
    skip_grads: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class HeldPeaks:
    """``activations``: the peak saved bytes alone; the rest: the joint peak, by term."""

    activations: int
    saved: int
    inputs: int
    mail: int
    recorded: int


def layer_parameters(model: nn.Sequential, optimizer_bytes_per_param: int) -> LayerParameters:
    """Each layer's parameter and buffer bytes, whole (a buffer has no gradient or state)."""

    def terms(tensor: Tensor) -> TensorBytes:
        nbytes = tensor.numel() * tensor.element_size()
        if not (isinstance(tensor, nn.Parameter) and tensor.requires_grad):
            return TensorBytes(nbytes, 0, 0)
        return TensorBytes(nbytes, nbytes, tensor.numel() * optimizer_bytes_per_param)

    return by_layer(model, terms)


# The terms one micro-batch holds on a stage, by index in ``_Held``.
SAVED, INPUTS, MAIL, RECORDED = range(4)


class _Held:
    """What each micro-batch holds on one stage, term by term, and the sums over them.

    The sums are kept as the terms change: a search samples them after every
    action of every cut it weighs.
    """

    def __init__(self) -> None:
        self._by_microbatch: dict[int, list[int]] = {}
        self.sums = [0, 0, 0, 0]

    def set(self, i: int, term: int, value: int) -> None:
        terms = self._by_microbatch.setdefault(i, [0, 0, 0, 0])
        self.sums[term] += value - terms[term]
        terms[term] = value

    def add(self, i: int, term: int, value: int) -> None:
        if value:
            self._by_microbatch.setdefault(i, [0, 0, 0, 0])[term] += value
            self.sums[term] += value

    def drop(self, i: int) -> None:
        for term, value in enumerate(self._by_microbatch.pop(i, ())):
            self.sums[term] -= value


def _bytes_by_stage(mail: tuple[tuple[int, int], ...]) -> dict[int, int]:
    by_stage: dict[int, int] = {}
    for stage, nbytes in mail:
        by_stage[stage] = by_stage.get(stage, 0) + nbytes
    return by_stage


def held_peaks(
    order: Sequence[Action], stage: int, checkpointed: set[tuple[int, int]], one: MicroBatchBytes
) -> HeldPeaks:
    """The peaks of ``stage`` along ``order`` (every stage's actions), each micro-batch ``one``.

    >>> from pipeline.step.actions import parse_program
    >>> one = MicroBatchBytes(saved=10, received=0, unsaved=0, grad=4, recorded=0)
    >>> held_peaks(parse_program("0F0 0F1 0B0 0B1"), 0, set(), one).activations
    20
    >>> order = parse_program("0F0 1F0 0F1 1F1 1B1 1B0 0B1 0B0")
    >>> held_peaks(order, 0, set(), one)  # 1B1 mails a gradient back while 0 holds both
    HeldPeaks(activations=20, saved=20, inputs=0, mail=8, recorded=0)
    """
    held = _Held()
    peak_saved = 0
    peak = HeldPeaks(0, 0, 0, 0, 0)

    def sample() -> None:
        nonlocal peak_saved, peak
        sums = held.sums
        peak_saved = max(peak_saved, sums[SAVED])
        if sum(sums) > peak.saved + peak.inputs + peak.mail + peak.recorded:
            peak = HeldPeaks(0, *sums)

    mailed = one.received - sum(b for _, b in one.skips_in)
    skips_from = _bytes_by_stage(one.skips_in)
    skip_grads_from = _bytes_by_stage(one.skip_grads)
    for action in order:
        i, kind = action.microbatch, action.kind
        if action.stage != stage and kind == "F":
            held.add(i, MAIL, skips_from.get(action.stage, 0))
        elif action.stage != stage and kind in ("B", "I"):
            held.add(i, MAIL, skip_grads_from.get(action.stage, 0))
        if action.stage == stage - 1 and kind == "F":
            held.add(i, MAIL, mailed)  # the activation, mailed
        elif action.stage == stage + 1 and kind in ("B", "I"):
            held.add(i, MAIL, one.grad)  # the gradient, mailed back
        elif action.stage == stage:
            task = (i, stage) in checkpointed
            if kind == "F":
                # The mailed activation becomes the input, and what the layers save of it.
                held.set(i, SAVED, 0 if task else one.saved)
                held.set(i, INPUTS, one.received if task else one.unsaved)
                held.set(i, MAIL, 0)
            elif kind in ("B", "I") and task:
                # Recomputed (on copies of the buffers it changes), its gradient still mailed.
                held.set(i, SAVED, one.saved + one.replayed)
                held.set(i, INPUTS, one.unsaved)
            sample()
            if kind in ("B", "I"):
                held.set(i, MAIL, 0)
            if kind == "I":
                held.add(i, SAVED, -(one.released + (one.replayed_released if task else 0)))
                held.set(i, RECORDED, one.recorded)
            if kind in ("B", "W"):
                held.drop(i)
        sample()
    return HeldPeaks(peak_saved, peak.saved, peak.inputs, peak.mail, peak.recorded)


def stage_memory(
    order: Sequence[Action],
    stage: int,
    checkpointed: set[tuple[int, int]],
    saved: Saved,
    parameters: LayerParameters,
    first: int,
    stop: int,
    stage_of: Callable[[int], int] | None = None,
    counted: frozenset[int] | None = None,
) -> StageMemory:
    """The peak of ``stage``, of layers ``first..stop``, along ``order`` (every stage's actions).

    ``stage_of(layer)``: the stage holding a layer, where the cut is known
    (else a skip comes from, and goes to, the neighbouring stage);
    ``counted``: for a stage in a process of its own, the parameters its
    process's earlier stages hold (``LayerParameters.stage``).
    """
    terms = parameters.stage(first, stop, counted)
    last = stop == len(saved.outputs)
    main = set(saved.outputs[first - 1]) if first else set()
    skips_in = tuple(
        (
            stage - 1 if stage_of is None else stage_of(skip.stashed_by),
            sum(saved.storages[k] for k in set(skip.storages) - main),
        )
        for skip in saved.skips_into(first, stop)
    )
    skip_grads = tuple(
        (stage + 1 if stage_of is None else stage_of(skip.popped_by), skip.grad)
        for skip in saved.skips_out_of(first, stop)
    )
    one = MicroBatchBytes(
        saved=saved.saved_bytes(first, stop, last),
        received=saved.input_bytes(first, stop, last, kept=True),
        unsaved=saved.input_bytes(first, stop, last, kept=False),
        grad=saved.grad_bytes(stop),
        recorded=saved.recorded_bytes(first, stop),
        released=saved.released_bytes(first, stop, last),
        replayed=saved.replayed_bytes(first, stop),
        replayed_released=saved.released_replayed_bytes(first, stop),
        skips_in=skips_in,
        skip_grads=skip_grads,
    )
    peaks = held_peaks(order, stage, checkpointed, one)
    return StageMemory(
        activations=peaks.activations,
        saved=peaks.saved,
        inputs=peaks.inputs,
        mail=peaks.mail,
        recorded=peaks.recorded,
        parameters=terms.nbytes,
        gradients=terms.trained,
        optimizer=terms.optimizer,
        gathered=terms.gathered,
    )
