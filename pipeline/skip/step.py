"""Skips in one forward pass of a Pipe: a tracker per micro-batch, and the driver's hooks.

Each micro-batch gets a ``PortalTracker``. A skip that stays in its
partition waits in the tracker's dict as in a plain run (no copy, no
portal); a skip that leaves its partition goes through a ``Portal``. The
driver calls two hooks, and only for a model with skippable layers:

- ``bind(i, function)`` on every task of micro-batch ``i``: the partition
  runs with the micro-batch's tracker installed. The tracker rides with the
  function, which the task's ``Checkpointing`` keeps, so the recomputation
  (run by the autograd engine on another thread) finds the same tracker
  and pops the same tensors again.
- ``fence(i, j, batch, move)`` in the fence phase of task ``(i, j)``: the
  skips that partition ``j`` pops from a partition on another device go
  straight there, copied by the driver's own ``move``.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from torch import Tensor

from pipeline.checkpoint import Function, is_recomputing
from pipeline.microbatch import Batch, TensorOrValues
from pipeline.skip.carrier import Carrier
from pipeline.skip.layout import Route, SkipLayout
from pipeline.skip.portal import Portal
from pipeline.skip.tracker import SkipKey, SkipTracker, use_tracker

__all__ = ["Move", "PortalTracker", "SkipStep", "start_step"]

# move(tensors, source, target): the driver's copy of a micro-batch's
# tensors from partition source's device to partition target's.
Move = Callable[[list[Tensor], int, int], list[Tensor]]


class PortalTracker(SkipTracker):
    """The tracker of one micro-batch: skips between partitions go through portals."""

    def __init__(self, layout: SkipLayout, checkpointed: bool) -> None:
        super().__init__()
        self.layout = layout
        self.checkpointed = checkpointed
        self.portals: dict[SkipKey, Portal] = {}

    def save(self, output: Carrier, key: SkipKey, tensor: Tensor) -> None:
        route = self.layout.route(key)
        if not route.crosses_partitions:
            super().save(output, key, tensor)
            return
        portal = self.portals.get(key)
        if portal is None:
            portal = self.portals[key] = Portal()
        output.join(portal.enter(tensor, self._reads_after_stash(route)))

    def load(self, input: Carrier, key: SkipKey) -> Tensor:
        route = self.layout.route(key)
        if not route.crosses_partitions:
            return super().load(input, key)
        return self._portal(route).exit(input.fork())

    def move(
        self, input: Carrier, source: int, target: int, routes: list[Route], move: Move
    ) -> None:
        """Copy the skips of ``routes`` from ``source``'s device into ``target``'s portals."""
        phony = input.fork()
        portals = [self._portal(route) for route in routes]
        moved = move([portal.exit(phony) for portal in portals], source, target)
        for portal, tensor in zip(portals, moved, strict=True):
            input.join(portal.enter(tensor, self._reads_by_pops()))

    def _reads_after_stash(self, route: Route) -> int:
        if is_recomputing():
            # Backward reaches the stashing partition after the popping one:
            # the pops are done, this stash only links the recomputed tensor
            # to the gradient waiting in the portal.
            return 0
        if self.layout.is_copied(route):
            return 1  # by the fence's move; the pops read the copy
        return self._reads_by_pops()

    def _reads_by_pops(self) -> int:
        # A checkpointed partition pops once in forward, once in recomputation.
        return 2 if self.checkpointed else 1

    def _portal(self, route: Route) -> Portal:
        portal = self.portals.get(route.key)
        if portal is None:
            raise RuntimeError(
                f"partition {route.target} pops {route.name!r} ({route.namespace.label}), but "
                f"the layer of partition {route.source} that stashes it did not run for this "
                "micro-batch"
            )
        return portal


class SkipStep:
    """The skip state of one forward pass: a ``PortalTracker`` per micro-batch."""

    def __init__(self, layout: SkipLayout, m: int, checkpoint_stop: int) -> None:
        self.layout = layout
        self.trackers = [PortalTracker(layout, i < checkpoint_stop) for i in range(m)]

    def bind(self, i: int, function: Function) -> Function:
        """``function`` run with micro-batch ``i``'s tracker installed."""
        return partial(_tracked, self.trackers[i], function)

    def fence(self, i: int, j: int, batch: Batch, move: Move) -> None:
        """Move the skips partition ``j`` pops from other devices, for micro-batch ``i``."""
        moves = self.layout.moves_into(j)
        if not moves:
            return
        input = Carrier.around(batch, f"partition {j}", "input")
        for source, routes in moves:
            self.trackers[i].move(input, source, j, routes, move)


def start_step(layout: SkipLayout | None, m: int, checkpoint_stop: int) -> SkipStep | None:
    """The skip state for a forward pass, or None for a model without skips (no cost then)."""
    if not layout:
        return None
    return SkipStep(layout, m, checkpoint_stop)


def _tracked(tracker: SkipTracker, function: Function, value: TensorOrValues) -> TensorOrValues:
    with use_tracker(tracker):
        return function(value)
