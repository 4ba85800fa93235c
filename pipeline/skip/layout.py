"""Skip layout: for each skip of a Pipe, the partition that stashes it and the one that pops it.

``Pipe.skip_layout`` shows the user where skip tensors travel::

    pipe.skip_layout
    SkipLayout(4 partitions):
      'a' (default): partition 0 -> partition 3, copied cpu -> cuda:0
      'skip' (level1): partition 1 -> partition 2, same device
      'skip' (level2): within partition 2

The driver asks it which skips its fence must move between devices, and
the trackers ask it which skips leave their partition.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import nn

from pipeline.skip.namespace import Namespace
from pipeline.skip.skippable import Skippable
from pipeline.skip.tracker import SkipKey

__all__ = ["Route", "SkipLayout", "inspect_skip_layout"]


class Route(NamedTuple):
    """One skip: stashed in partition ``source``, popped in partition ``target``."""

    namespace: Namespace
    name: str
    source: int
    target: int

    @property
    def key(self) -> SkipKey:
        return self.namespace, self.name

    @property
    def crosses_partitions(self) -> bool:
        return self.source != self.target


class SkipLayout:
    """The routes of every skip of a Pipe, in the order they are stashed."""

    def __init__(self, routes: Sequence[Route], devices: Sequence[torch.device]) -> None:
        self.devices = list(devices)
        self._routes = {route.key: route for route in routes}
        self._numbers = {key: n for n, key in enumerate(self._routes)}
        moves: list[dict[int, list[Route]]] = [{} for _ in self.devices]
        for route in routes:
            if self.is_copied(route):
                moves[route.target].setdefault(route.source, []).append(route)
        self._moves = [list(by_source.items()) for by_source in moves]

    def routes(self) -> list[Route]:
        """Every skip as (namespace, name, source partition, target partition)."""
        return list(self._routes.values())

    def route(self, key: SkipKey) -> Route:
        try:
            return self._routes[key]
        except KeyError:
            ns, name = key
            raise RuntimeError(
                f"skip {name!r} ({ns}) is not in this Pipe's skip layout; was its layer added "
                "after the Pipe was built?"
            ) from None

    def number(self, key: SkipKey) -> int:
        """The skip's position in stash order: the same in every process built from one model.

        Namespaces compare by identity, so a key means nothing to another
        process; its number does.
        """
        self.route(key)
        return self._numbers[key]

    def is_copied(self, route: Route) -> bool:
        """Whether the skip changes device, and so is moved by the fence."""
        return self.devices[route.source] != self.devices[route.target]

    def moves_into(self, partition: int) -> list[tuple[int, list[Route]]]:
        """The skips to move to ``partition``'s device, grouped by source partition."""
        return self._moves[partition]

    def __bool__(self) -> bool:
        return bool(self._routes)

    def __len__(self) -> int:
        return len(self._routes)

    def __repr__(self) -> str:
        lines = [f"SkipLayout({len(self.devices)} partitions):"]
        lines += [f"  {self._describe(route)}" for route in self._routes.values()]
        if not self._routes:
            lines[0] += " no skips"
        return "\n".join(lines)

    def _describe(self, route: Route) -> str:
        skip = f"{route.name!r} ({route.namespace.label})"
        if not route.crosses_partitions:
            return f"{skip}: within partition {route.source}"
        if not self.is_copied(route):
            where = "same device"
        else:
            where = f"copied {self.devices[route.source]} -> {self.devices[route.target]}"
        return f"{skip}: partition {route.source} -> partition {route.target}, {where}"


def inspect_skip_layout(
    partitions: Sequence[nn.Module], devices: Sequence[torch.device]
) -> SkipLayout:
    """Find where each skip is stashed and popped (the model is already verified)."""
    sources: dict[SkipKey, int] = {}
    targets: dict[SkipKey, int] = {}
    for j, partition in enumerate(partitions):
        for layer in partition.modules():
            if isinstance(layer, Skippable):
                sources.update(dict.fromkeys(layer.stashable(), j))
                targets.update(dict.fromkeys(layer.poppable(), j))
    routes = [Route(ns, name, j, targets[ns, name]) for (ns, name), j in sources.items()]
    return SkipLayout(routes, devices)
