"""Skips in one forward pass of a Pipe: a tracker per task, portals per micro-batch.

A skip that stays in its partition waits in the task's tracker as in a plain
run (no copy, no portal); a skip that leaves its partition goes through a
``Portal`` of its micro-batch. The driver calls two hooks, and only for a
model with skippable layers:

- ``bind(i, j, function, checkpointed)`` on every task of micro-batch
  ``i``: the partition runs with a tracker of its own installed, sharing
  the micro-batch's portals. The tracker rides with the function, which a
  checkpointed task keeps for its recomputation (its runs after the first,
  counted by the tracker itself, not the phase flags a nested Pipe
  inherits): there the skips are not sent again (the forward's graph
  already carries them and their gradients), and the pops get back exactly
  what the forward popped, kept by the tracker for as long as the task's
  graph lives.
- ``fence(i, j, batch, move)`` in the fence phase of task ``(i, j)``: the
  skips that partition ``j`` pops from a partition on another device go
  straight there, copied by the driver's own ``move``.

The phony edges that order a skip's gradient (``dependency.py``) are drawn
here too: a fork off the popping layer's input, a join into the stashing
layer's output, each on the value's first tensor that needs a gradient
(``Carrier.unpacked``); no join where none does.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

from torch import Tensor

from pipeline.clock.dependency import fork, join
from pipeline.clock.phony import get_phony
from pipeline.clock.portal import Portal
from pipeline.runtime.aliases import noted_leaves, skip_aliases
from pipeline.runtime.microbatch import Batch, Value
from pipeline.runtime.partitions import PartitionCall, PartitionRuntime
from pipeline.skip.carrier import Carrier
from pipeline.skip.layout import Route, SkipLayout
from pipeline.skip.tracker import (
    SkipKey,
    SkipTracker,
    refuse_returned_into_a_copy,
    refuse_written_after_pop,
    refuse_written_after_stash,
    refuse_written_shared,
    use_tracker,
    version_of,
)

__all__ = ["Move", "PortalTracker", "SkipPortals", "skip_portals"]

# move(tensors, source, target): the driver's copy of a micro-batch's
# tensors from partition source's device to partition target's.
Move = Callable[[list[Tensor], int, int], list[Tensor]]

Portals = dict[SkipKey, Portal]


class PortalTracker(SkipTracker):
    """The tracker of one task: skips between partitions go through its micro-batch's portals."""

    def __init__(self, layout: SkipLayout, portals: Portals, checkpointed: bool) -> None:
        super().__init__()
        self.layout = layout
        self.portals = portals
        # This task's own phase: a Pipe nested in a recomputed partition runs a forward of
        # its own there, whatever the outer task's flags (``runtime/phase.py``) say.
        self.checkpointed = checkpointed
        self.runs = 0
        self.popped: dict[SkipKey, Tensor] = {}
        self.versions: dict[SkipKey, int] = {}  # each popped skip's, if checkpointed
        # The popped skips sharing memory with their partition's output, at their pop.
        self.shared: list[tuple[SkipKey, Tensor, int]] = []
        # The skips this task sent on, as stashed.
        self.entered: list[tuple[SkipKey, Tensor]] = []

    def save(self, output: Carrier, key: SkipKey, tensor: Tensor) -> None:
        route = self.layout.route(key)
        if not route.crosses_partitions:
            super().save(output, key, tensor)
            return
        if self.recomputing:
            # The forward's portal already links this skip to its pop; the output
            # still needs the gradient its join gave it there, so that the layers
            # after it save what they saved in the forward.
            if tensor.requires_grad:
                _join(output, get_phony(tensor.device, requires_grad=True))
            return
        portal = self.portals.setdefault(key, Portal())
        _join(output, portal.enter(tensor))
        self.entered.append((key, tensor))

    def load(self, input: Carrier, key: SkipKey) -> Tensor:
        route = self.layout.route(key)
        if not route.crosses_partitions:
            return super().load(input, key)
        if self.recomputing:
            return self.popped[key]
        portal = _portal(self.portals, route)
        tensor = portal.exit(_fork(input))
        if portal.shared:
            self.shared.append((key, tensor, version_of(tensor)))
        if self.checkpointed:
            # Requiring grad as in the forward, so recomputation saves the same tensors.
            self.popped[key] = tensor.detach().requires_grad_(tensor.requires_grad)
            self.versions[key] = version_of(tensor)
        return tensor

    @property
    def recomputing(self) -> bool:
        """Whether this run of the task is its recomputation (a run after the first)."""
        return self.runs > 1

    def check_popped(self, partition: int) -> None:
        """After the forward: refuse a skip it popped and wrote into, sharing memory with
        the main path; or, checkpointed, any skip it popped and wrote into."""
        for key, tensor, version in self.shared:
            refuse_written_shared(key, tensor, version, partition)
        if not self.checkpointed:
            return
        for key, version in self.versions.items():
            refuse_written_after_pop(key, self.popped[key], version, partition)

    def note_shared(
        self, returned: list[Any], inputs: Value, runtime: PartitionRuntime, partition: int
    ) -> None:
        """Note the output's leaves sharing memory with a skip this task sent on, or with
        what it was given sharing memory with one (``runtime/aliases.py``), and mark the skips
        sharing memory with those, with the output, or with each other."""
        shared = [tensor for _, tensor, _ in self.shared]
        shared += noted_leaves(inputs, runtime.sharing(partition - 1)) if partition else []
        tensors = [tensor for _, tensor in self.entered]
        shown, aliased = skip_aliases(returned, tensors, shared)
        runtime.note_sharing(partition, [frozenset({k}) for k in shown])
        for q in aliased:
            self.portals[self.entered[q][0]].shared = True


class SkipPortals:
    """The skip state of one forward pass: the portals of each micro-batch."""

    def __init__(self, layout: SkipLayout, m: int, runtime: PartitionRuntime) -> None:
        self.layout = layout
        self.portals: list[Portals] = [{} for _ in range(m)]
        self.runtime = runtime
        # Whether a skip and the main path may travel apart (partitions on several devices).
        self.apart = len(set(runtime.devices)) > 1

    def bind(self, i: int, j: int, function: PartitionCall, checkpointed: bool) -> PartitionCall:
        """``function`` (partition ``j``) run with a fresh tracker for micro-batch ``i``, whose
        task is ``checkpointed`` or not."""
        tracker = PortalTracker(self.layout, self.portals[i], checkpointed)
        return partial(_tracked, tracker, function, j, self.runtime, self.apart)

    def fence(self, i: int, j: int, batch: Batch, move: Move) -> None:
        """Move the skips partition ``j`` pops from other devices, for micro-batch ``i``."""
        moves = self.layout.moves_into(j)
        if not moves:
            return
        input = Carrier.around(batch, f"partition {j}", "input")
        portals = self.portals[i]
        for source, routes in moves:
            phony = _fork(input)
            taken = [_portal(portals, route) for route in routes]
            moved = move([portal.exit(phony) for portal in taken], source, j)
            for portal, tensor in zip(taken, moved, strict=True):
                _join(input, portal.enter(tensor))


def skip_portals(
    layout: SkipLayout | None, m: int, runtime: PartitionRuntime
) -> SkipPortals | None:
    """The skip state for a forward pass over ``runtime``'s partitions, or None for a model
    without skips (no cost then)."""
    if not layout:
        return None
    return SkipPortals(layout, m, runtime)


def _fork(carrier: Carrier) -> Tensor:
    """A phony whose gradient the carrier's value's backward waits for."""
    batch, index = carrier.unpacked()
    batch[index], phony = fork(batch[index])
    return phony


def _join(carrier: Carrier, phony: Tensor) -> None:
    """Make ``phony``'s backward wait for the carrier's value's gradient, if it gets one.

    A value that gets none (frozen layers before it) is left alone: joined,
    it would need a gradient, which the layers after it would see; the
    skip's gradient goes back by the ``Exit`` that hangs on ``phony``
    (``portal.py``), with nothing to wait for on this path.
    """
    batch, index = carrier.unpacked()
    if batch[index].requires_grad:
        batch[index] = join(batch[index], phony)


def _portal(portals: Portals, route: Route) -> Portal:
    """The route's portal, holding its tensor as it was stashed."""
    portal = portals.get(route.key)
    if portal is None:
        raise RuntimeError(
            f"partition {route.target} pops {route.name!r} ({route.namespace.label}), but "
            f"the layer of partition {route.source} that stashes it did not run for this "
            "micro-batch"
        )
    if portal.tensor is not None and portal.mark is not None:
        refuse_written_after_stash(route.key, portal.tensor, portal.mark)
    return portal


def _tracked(
    tracker: PortalTracker,
    function: PartitionCall,
    j: int,
    runtime: PartitionRuntime,
    apart: bool,
    value: Value,
) -> Value:
    """Run ``function`` (partition ``j`` of ``runtime``) with ``tracker``.

    Where every partition is on one device (not ``apart``), a skip and the main
    path stay one memory, and a write shows on both, as in the plain model:
    nothing is noted.
    """
    tracker.runs += 1
    with use_tracker(tracker):
        output = function(value)
    if tracker.recomputing:
        return output
    tracker.check_popped(j)
    protect = runtime.protect_inputs
    copied = j + 1 < len(protect) and protect[j + 1] and tracker.entered
    if not (copied or apart):
        return output
    returned = Batch(output).leaves
    for key, tensor in tracker.entered if copied else ():
        refuse_returned_into_a_copy(key, tensor, returned, j)
    if apart:
        tracker.note_shared(returned, value, runtime, j)
    return output
