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

from pipeline.plan.held import MicroBatchBytes, PeakForms
from pipeline.plan.profile import Saved

__all__ = [
    "LayerParameters",
    "StageMemory",
    "TensorBytes",
    "by_layer",
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


def layer_parameters(model: nn.Sequential, optimizer_bytes_per_param: int) -> LayerParameters:
    """Each layer's parameter and buffer bytes, whole (a buffer has no gradient or state)."""

    def terms(tensor: Tensor) -> TensorBytes:
        nbytes = tensor.numel() * tensor.element_size()
        if not (isinstance(tensor, nn.Parameter) and tensor.requires_grad):
            return TensorBytes(nbytes, 0, 0)
        return TensorBytes(nbytes, nbytes, tensor.numel() * optimizer_bytes_per_param)

    return by_layer(model, terms)


def stage_memory(
    forms: PeakForms,
    saved: Saved,
    parameters: LayerParameters,
    first: int,
    stop: int,
    stage_of: Callable[[int], int] | None = None,
    counted: frozenset[int] | None = None,
) -> StageMemory:
    """The peak of ``forms.stage``, of layers ``first..stop``, along the order of ``forms``.

    ``stage_of(layer)``: the stage holding a layer, where the cut is known
    (else a skip comes from, and goes to, the neighbouring stage);
    ``counted``: for a stage in a process of its own, the parameters its
    process's earlier stages hold (``LayerParameters.stage``).
    """
    stage = forms.stage
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
    peaks = forms.peaks(one)
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
