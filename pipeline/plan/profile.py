"""What the planner measures of a model, once per micro-batch size: times, saved bytes, boundaries.

Two passes over the layers of the ``nn.Sequential``, on copies, so that the
model, its gradients and the random generators are left as they were:

- **memory** (``saved_storages``): one forward of the whole model chained as
  a pipe chains its stages (each layer fed the previous layer's output, not
  a copy), then the loss, under ``saved_tensors_hooks`` that note every
  storage autograd saves, once, with the layers that saved it. Left out, as
  the step's own meter (``pipeline/step/activations.py``) leaves them out:
  parameters, and the caller's input and target (the micro-batches are
  views of them). Buffers are left out too, but for the copies a
  recomputation saves: a layer that changes a buffer in its training
  forward (BatchNorm's running statistics) runs its recomputation on copies
  of it (``pipeline/runtime/buffers.py``), so what its backward saved of
  those buffers is saved again, as copies, by a checkpointed task
  (``Saved.replayed``). A storage saved by two adjacent layers (Tanh saves its
  output, the next Linear its input) is one storage; cut between them it is
  counted on both stages, as each stage's meter counts it. The tensors that
  leave each layer (what crosses a cut there) are noted too, with the bytes
  of their gradient (what is mailed back across the cut); and, each layer
  run alone on inputs that require grad, the gradients that zero-bubble's
  ``I`` records for ``W`` (``pipeline/step/backward_in_two.py``).
- **time** (``layer_times``): each layer alone on a fresh copy of its input
  (``balance.layerwise``), its forward, its whole backward and its input
  gradient alone (``autograd.grad`` to the inputs: what a zero-bubble ``I``
  computes; ``W`` is taken as the rest), each the median of a few runs;
  the loss is timed as one more layer. Where the pipe will seed its tasks'
  draws (``seeded``: CPU partitions on threads of their own,
  ``pipeline/runtime/ownership.py``), each forward is timed under the same
  seeding mode (``task_forward``): it sends every op through Python, which
  on a model of many small ops costs more than the ops (docs/plan.md).
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
from torch import Tensor, nn

from pipeline.runtime.microbatch import to_device
from pipeline.runtime.partitions import PositionalSequential
from pipeline.runtime.rng import BaseSeed, TaskRandomness
from pipeline.skip.carrier import Carrier
from pipeline.skip.tracker import SkipKey, SkipTracker, use_tracker
from pipeline.step.activations import ActivationMeter
from pipeline.step.backward_in_two import backward_input

__all__ = ["LayerTimes", "Saved", "SkipBytes", "call_layer", "layer_times", "saved_storages"]

LossFn = Callable[[Any, Any], Tensor]
Value = Any  # what flows between layers: a tensor, or structures holding tensors


@dataclass(frozen=True)
class Saved:
    """The storages of one micro-batch, as a pipe's stages see them.

    ``storages[k]`` is the size in bytes of storage ``k``; ``saved_by[k]``
    the layers that saved it for backward (``len(layers)`` stands for the
    loss), empty for a storage that only crosses a cut; ``outputs[i]`` the
    storages of what layer ``i`` returns (stage ``j + 1``'s received input
    when a cut follows layer ``i``), ``output_grads[i]`` the bytes of their
    gradient (those that require grad); ``recorded[i]`` the bytes of the
    gradients a zero-bubble ``I`` records in layer ``i`` for its ``W``
    when the layer's input requires grad; ``tops[i]`` what layer ``i``
    alone saved above its topmost anchor (its input requiring grad), which
    that ``I`` lets go when the layer is the last of its stage with weights;
    ``anchored[i]`` whether layer ``i`` has one (weights it computes
    gradients of); ``whole[i]`` whether its ``I`` is a whole backward (a
    Python function's node among its anchors); ``replayed[i]`` the buffers
    layer ``i`` changes in its forward and saves for backward, as (storage
    key, bytes): their copies, which its recomputation saves instead;
    ``skips`` each skip: the layers that stash and pop it, its storages and
    the bytes of its gradient (what a stage popping it from an earlier one
    receives and holds, and mails back).
    """

    storages: tuple[int, ...]
    saved_by: tuple[frozenset[int], ...]
    outputs: tuple[tuple[int, ...], ...]
    output_grads: tuple[int, ...]
    recorded: tuple[int, ...]
    tops: tuple[int, ...]
    anchored: tuple[bool, ...]
    whole: tuple[bool, ...]
    replayed: tuple[tuple[tuple[int, int], ...], ...] = ()
    skips: tuple[SkipBytes, ...] = ()

    def saved_bytes(self, first: int, stop: int, loss: bool) -> int:
        """Bytes saved by layers ``first`` to ``stop - 1`` (and the loss): each storage once."""
        layers = set(range(first, stop))
        if loss:
            layers.add(len(self.outputs))
        return sum(
            size
            for size, by in zip(self.storages, self.saved_by, strict=True)
            if not by.isdisjoint(layers)
        )

    def input_bytes(self, first: int, stop: int, loss: bool, kept: bool, skips: bool = True) -> int:
        """Bytes of stage ``first..stop``'s received input held beside what it saved.

        ``kept``: the whole input (a checkpointed task keeps it and saves
        nothing until its backward); else only what its layers did not save.
        ``skips``: with the skips it pops from earlier stages. Stage 0's input
        is the caller's: nothing.
        """
        if first == 0:
            return 0
        layers = set(range(first, stop)) | ({len(self.outputs)} if loss else set())
        received = set(self.outputs[first - 1])
        for skip in self.skips_into(first, stop) if skips else ():
            received.update(skip.storages)
        return sum(
            self.storages[k] for k in received if kept or self.saved_by[k].isdisjoint(layers)
        )

    def skips_into(self, first: int, stop: int) -> list[SkipBytes]:
        """The skips that the stage of layers ``first..stop`` pops from an earlier stage."""
        return [s for s in self.skips if s.stashed_by < first <= s.popped_by < stop]

    def skips_out_of(self, first: int, stop: int) -> list[SkipBytes]:
        """The skips that the stage of layers ``first..stop`` stashes for a later stage."""
        return [s for s in self.skips if first <= s.stashed_by < stop <= s.popped_by]

    def released_bytes(self, first: int, stop: int, loss: bool) -> int:
        """Bytes zero-bubble's ``I`` lets go on the stage of layers ``first..stop`` (and the loss).

        ``I`` keeps the graph below the stage's topmost anchor for ``W`` and
        lets the nodes above it go: what the layers after the last one with
        weights saved, the loss's, and the top of that layer itself. A whole
        backward at ``I`` lets everything go. A stage whose input needs no
        gradient (stage 0's, or one after frozen layers) runs its whole
        backward at ``W``: nothing.
        """
        if not self.input_path(first):
            return 0
        if any(self.whole[first:stop]):
            return self.saved_bytes(first, stop, loss)
        anchored = [k for k in range(first, stop) if self.anchored[k]]
        top = anchored[-1] if anchored else first - 1
        mine = set(range(first, stop)) | ({len(self.outputs)} if loss else set())
        above = {k for k in mine if k > top}
        only_above = sum(
            size
            for size, by in zip(self.storages, self.saved_by, strict=True)
            if by & mine and by & mine <= above
        )
        return only_above + (self.tops[top] if anchored else 0)

    def replayed_bytes(self, first: int, stop: int, above: int = -1) -> int:
        """Bytes of the buffer copies that layers ``first`` to ``stop - 1`` (those after
        layer ``above``) save when a checkpointed task recomputes them: each copy once."""
        copies = {
            key: size
            for index in range(max(first, above + 1), stop)
            for key, size in (self.replayed[index] if self.replayed else ())
        }
        return sum(copies.values())

    def released_replayed_bytes(self, first: int, stop: int) -> int:
        """Of ``replayed_bytes``, those zero-bubble's ``I`` lets go with what lies above the
        stage's topmost anchor (``released_bytes``), when the task was recomputed."""
        if not self.input_path(first):
            return 0
        if any(self.whole[first:stop]):
            return self.replayed_bytes(first, stop)
        anchored = [k for k in range(first, stop) if self.anchored[k]]
        return self.replayed_bytes(first, stop, above=anchored[-1] if anchored else first - 1)

    def grad_bytes(self, stop: int) -> int:
        """Bytes of the gradient mailed back to the stage ending before layer ``stop``."""
        return 0 if stop == len(self.outputs) else self.output_grads[stop - 1]

    def recorded_bytes(self, first: int, stop: int) -> int:
        """Bytes zero-bubble's ``I`` keeps for ``W`` on the stage of layers ``first..stop``.

        Its layers' recorded gradients where the stage's input requires grad
        (a received one); where it does not (stage 0's, the caller's, or one
        after frozen layers), ``I`` has no input path and ``W`` keeps the
        outputs' gradient instead.
        """
        if not self.input_path(first):
            return self.grad_bytes(stop)
        return sum(self.recorded[first:stop])

    def input_path(self, first: int) -> bool:
        """Whether the stage starting at layer ``first`` receives an input that requires grad
        (stage 0's, the caller's, is taken not to)."""
        return first > 0 and self.output_grads[first - 1] > 0


@dataclass(frozen=True)
class SkipBytes:
    """One skip of a micro-batch: the layers that stash and pop it, the storages it holds
    (indices into ``Saved.storages``; none for a view of the caller's input) and the bytes
    of its gradient (0 where it needs none)."""

    stashed_by: int
    popped_by: int
    storages: tuple[int, ...]
    grad: int


@dataclass(frozen=True)
class LayerTimes:
    """Median seconds per layer for one micro-batch; index ``len(layers)`` is the loss.

    ``weight`` is ``backward - input_grad`` (at least 0): zero-bubble's W.
    """

    forward: tuple[float, ...]
    backward: tuple[float, ...]
    input_grad: tuple[float, ...]

    @cached_property
    def weight(self) -> tuple[float, ...]:
        return tuple(max(b - i, 0.0) for b, i in zip(self.backward, self.input_grad, strict=True))


def saved_storages(
    model: nn.Sequential, sample: Value, target: Value, loss_fn: LossFn, device: torch.device
) -> Saved:
    """The storages one micro-batch (``sample``, ``target``) leaves through the model's layers."""
    # Here, not at the top: balance imports pipeline, whose __init__ imports this module.
    from balance.layerwise import tensors_in
    from balance.profile import own_random_state

    # Each layer in its own mode, as the pipe runs it: a BatchNorm left in eval mode (frozen
    # for fine-tuning) saves less, and changes no buffer.
    layers = copy.deepcopy(model).to(device)
    excluded = {t.untyped_storage().data_ptr() for t in [*layers.parameters(), *layers.buffers()]}
    buffers = {
        b.untyped_storage().data_ptr(): b.untyped_storage().nbytes() for b in layers.buffers()
    }
    saved_buffers: list[set[int]] = [set() for _ in layers]
    sample, target = to_device(sample, device), to_device(target, device)
    excluded |= {t.untyped_storage().data_ptr() for t in [*tensors_in(sample), *tensors_in(target)]}
    keys: dict[int, int] = {}
    sizes: list[int] = []
    savers: list[set[int]] = []
    current = [0]
    # Everything noted stays alive until the end (the graph holds the saved
    # tensors, ``kept`` the outputs), so no address is reused meanwhile.
    kept: list[Any] = []

    def key_of(tensor: Tensor) -> int:
        storage = tensor.untyped_storage()
        pointer = storage.data_ptr()
        if pointer not in keys:
            keys[pointer] = len(sizes)
            sizes.append(storage.nbytes())
            savers.append(set())
        return keys[pointer]

    def pack(tensor: Tensor) -> Tensor:
        pointer = tensor.untyped_storage().data_ptr()
        if pointer not in excluded:
            savers[key_of(tensor)].add(current[0])
        elif pointer in buffers and current[0] < len(saved_buffers):
            saved_buffers[current[0]].add(pointer)
        return tensor

    outputs: list[tuple[int, ...]] = []
    grads: list[int] = []
    stashes = _Stashes()
    with (
        own_random_state(device),
        torch.inference_mode(False),
        torch.enable_grad(),
        torch.autograd.graph.saved_tensors_hooks(pack, _same),
        use_tracker(stashes),
    ):
        value = sample
        for index, layer in enumerate(layers):
            current[0] = stashes.layer = index
            with _changed_buffers(layer) as changed:
                value = call_layer(model, index, layer, value)
            saved_buffers[index] &= changed
            kept.append(value)
            outputs.append(
                tuple(key_of(t) for t in tensors_in(value) if t.untyped_storage().data_ptr()
                      not in excluded)
            )  # fmt: skip
            grads.append(sum(t.numel() * t.element_size() for t in tensors_in(value)
                             if t.requires_grad))  # fmt: skip
        current[0] = len(layers)
        kept.append(loss_fn(value, target))
    stashes.serving = True
    with (
        own_random_state(device),
        torch.inference_mode(False),
        torch.enable_grad(),
        use_tracker(stashes),
    ):
        splits = [
            _split_alone(
                model, index, layer, sample if index == 0 else kept[index - 1], device, stashes
            )
            for index, layer in enumerate(layers)
        ]
    # Before the sizes are read: a skip's storage may be one no layer saved or returned.
    skips = tuple(
        SkipBytes(
            stashes.stashed_by[key],
            stashes.popped_by[key],
            () if _storage(skip) in excluded else (key_of(skip),),
            skip.numel() * skip.element_size() if skip.requires_grad else 0,
        )
        for key, skip in stashes.kept.items()
        if key in stashes.popped_by
    )
    return Saved(
        tuple(sizes),
        tuple(frozenset(s) for s in savers),
        tuple(outputs),
        tuple(grads),
        tuple(split.recorded for split in splits),
        tuple(split.top for split in splits),
        tuple(split.anchored for split in splits),
        tuple(split.whole for split in splits),
        tuple(tuple((key, buffers[key]) for key in sorted(keys)) for keys in saved_buffers),
        skips,
    )


def _storage(tensor: Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


@contextmanager
def _changed_buffers(layer: nn.Module) -> Iterator[set[int]]:
    """The storages of the buffers of ``layer`` that the block changed, filled in after it;
    by value, as the runtime learns them (batch norm moves no version counter)."""
    before = [(b, b.detach().clone()) for b in layer.buffers()]
    changed: set[int] = set()
    yield changed
    changed.update(
        b.untyped_storage().data_ptr() for b, value in before if not torch.equal(b, value)
    )


@dataclass(frozen=True)
class _Split:
    """Zero-bubble's ``I`` on one layer alone: what it records, lets go, and whether it splits."""

    recorded: int
    top: int
    anchored: bool
    whole: bool


class _Stashes(SkipTracker):
    """The skips of a whole run, served again to each popping layer run alone.

    Each is served as the whole run stashed it, needing a gradient or not:
    a skip stashed from the caller's input needs none, and a stage receiving
    it holds no gradient of it. Served while ``serving``, when what a layer
    alone stashes is dropped; ``served`` lists what the last layer popped.
    """

    def __init__(self) -> None:
        super().__init__()
        self.kept: dict[SkipKey, Tensor] = {}
        self.serving = False
        self.served: list[Tensor] = []
        # In the whole run: the layer running now, and the layers that stashed and popped.
        self.layer = 0
        self.stashed_by: dict[SkipKey, int] = {}
        self.popped_by: dict[SkipKey, int] = {}

    def save(self, output: Carrier, key: SkipKey, tensor: Tensor) -> None:
        if not self.serving:
            self.kept[key] = tensor
            self.stashed_by[key] = self.layer
            super().save(output, key, tensor)

    def load(self, input: Carrier, key: SkipKey) -> Tensor:
        if not self.serving:
            self.popped_by[key] = self.layer
            return super().load(input, key)
        kept = self.kept[key]
        if not kept.requires_grad:
            fresh = kept.detach().clone()
            self.served.append(fresh)
            return fresh
        # A copy of a leaf, which a layer may write into in place, like a stage's received
        # skip; the leaf is served too, as fresh_inputs's leaves are.
        leaf = kept.detach().clone().requires_grad_()
        fresh = leaf.clone()
        self.served += [fresh, leaf]
        return fresh


def _split_alone(
    model: nn.Sequential,
    index: int,
    layer: nn.Module,
    value: Value,
    device: torch.device,
    stashes: _Stashes,
) -> _Split:
    """``I`` on layer ``index`` alone, its input requiring grad, as a stage runs it; the skips
    it pops as the whole run stashed them, among the inputs whose gradients ``I`` computes.

    ``recorded``: the bytes of the gradients ``I`` records at the anchors,
    which the stage keeps until ``W``; ``top``: the bytes saved above the
    topmost anchor, which go with the outputs once ``I`` is done.
    """
    from balance.layerwise import fresh_inputs, tensors_in  # as in saved_storages

    # The leaves under the copies are inputs too: I would take them for weights, and a
    # layer without weights for one with.
    leaves: list[Tensor] = []
    inputs = fresh_inputs(value, device, leaves)
    meter = ActivationMeter([*layer.parameters(), *layer.buffers()])  # as a stage's meter counts
    stashes.served = []
    with meter.hooks():
        outputs = call_layer(model, index, layer, inputs)
    roots = [t for t in tensors_in(outputs) if t.requires_grad]
    received = [*tensors_in(inputs), *leaves, *stashes.served]
    halves = backward_input(roots, [torch.ones_like(t) for t in roots], received)
    if halves is None:  # a Python function's node: I runs a whole backward, W has nothing left
        return _Split(0, 0, anchored=False, whole=True)
    weights = halves[1]
    before = meter.current
    del outputs, roots, halves
    # The gradients I recorded at each anchor, which the stage keeps until W.
    recorded = _storage_bytes(
        g for grads in weights._recorded.values() for g in grads if g is not None
    )
    anchored = any(group.weights for group in weights._groups)
    return _Split(recorded, before - meter.current, anchored, whole=False)


def _storage_bytes(tensors: Iterable[Tensor]) -> int:
    """The bytes of the storages of ``tensors``, each storage once."""
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
               .values())  # fmt: skip


def call_layer(model: nn.Sequential, index: int, layer: nn.Module, value: Value) -> Value:
    """Layer ``index`` of ``model`` on ``value``, called as a Pipe calls it.

    The first layer's ``Arguments`` are spread into its call, and so are the
    tuples between the layers of a ``PositionalSequential``.
    """
    from balance.layerwise import Spread, run_layer  # as in saved_storages

    spread = isinstance(model, PositionalSequential)
    return run_layer(index, Spread(layer) if spread else layer, value)


def task_forward(seeded: bool) -> AbstractContextManager[None]:
    """A forward as a pipe's task runs it: under the mode that seeds each random op, if
    ``seeded`` (the planner's placement makes the partitions seeded), else plainly."""
    return TaskRandomness(BaseSeed(), 0, 0).drawing() if seeded else nullcontext()


def layer_times(
    model: nn.Sequential,
    sample: Value,
    target: Value,
    loss_fn: LossFn,
    device: torch.device,
    repeats: int,
    seeded: bool = False,
) -> LayerTimes:
    """Median forward, backward and input-gradient seconds of each layer and of the loss;
    each forward under ``task_forward(seeded)``."""
    from balance.layerwise import fresh_inputs, run_layer, walk_layers  # as in saved_storages
    from balance.profile import own_random_state

    count = len(model) + 1
    forward: list[list[float]] = [[] for _ in range(count)]
    backward: list[list[float]] = [[] for _ in range(count)]
    input_grad: list[list[float]] = [[] for _ in range(count)]
    last: list[Value] = [None]

    def timed(index: int, layer: nn.Module, inputs: Value) -> Value:
        def call(value: Value) -> Value:
            with task_forward(seeded):
                return run_layer(index, layer, value)

        outputs = _time_layer(call, inputs, device, repeats, index, layer,
                              (forward[index], backward[index], input_grad[index]))  # fmt: skip
        last[0] = outputs
        return outputs

    with own_random_state(device):
        walk_layers(model, sample, device, timed)
        loss_target = to_device(target, device)

        def loss(value: Value) -> Value:
            with task_forward(seeded):
                return loss_fn(value, loss_target)

        with torch.enable_grad():
            _time_layer(loss, fresh_inputs(last[0], device), device, repeats, len(model), None,
                        (forward[-1], backward[-1], input_grad[-1]))  # fmt: skip
    return LayerTimes(
        tuple(map(statistics.median, forward)),
        tuple(map(statistics.median, backward)),
        tuple(map(statistics.median, input_grad)),
    )


def _time_layer(
    call: Callable[[Value], Value],
    inputs: Value,
    device: torch.device,
    repeats: int,
    index: int,
    layer: nn.Module | None,
    into: tuple[list[float], list[float], list[float]],
) -> Value:
    """Time ``call`` on copies of ``inputs``: forward, backward, input gradient; one warm-up."""
    from balance.layerwise import fresh_inputs  # as in saved_storages

    outputs: Value = None
    for run in range(repeats + 1):
        value = fresh_inputs(inputs, device)
        outputs, forward = _timed(device, call, value)
        _, backward = _timed(device, _backward, index, layer, outputs)
        value = fresh_inputs(inputs, device)
        _, input_grad = _timed(device, _input_grad, value, call(value))
        if run:
            for times, seconds in zip(into, (forward, backward, input_grad), strict=True):
                times.append(seconds)
    return outputs


def _timed(device: torch.device, function: Callable[..., Any], *args: Any) -> tuple[Any, float]:
    """``function(*args)`` and its seconds, the device's queued work included."""
    from balance.profile import synchronize  # as in saved_storages

    synchronize(device)
    start = time.perf_counter()
    result = function(*args)
    synchronize(device)
    return result, time.perf_counter() - start


def _backward(index: int, layer: nn.Module | None, outputs: Value) -> None:
    from balance.layerwise import backward_layer  # as in saved_storages

    if layer is not None:
        backward_layer(index, layer, outputs)
    elif isinstance(outputs, Tensor) and outputs.requires_grad:
        outputs.backward()


def _input_grad(inputs: Value, outputs: Value) -> None:
    """The gradient of the inputs alone, as zero-bubble's I asks autograd for it."""
    from balance.layerwise import tensors_in  # as in saved_storages

    wanted = [t for t in tensors_in(inputs) if t.requires_grad]
    roots = [t for t in tensors_in(outputs) if t.requires_grad]
    if wanted and roots:
        torch.autograd.grad(roots, wanted, [torch.ones_like(t) for t in roots], allow_unused=True)


def _same(tensor: Tensor) -> Tensor:
    return tensor
