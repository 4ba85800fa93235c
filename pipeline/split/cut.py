"""Cutting: which piece computes each node, and how each value reaches the pieces that use it.

The graph's nodes are in the order the model ran them. A piece starts at
each split point's block call, and takes every node up to the next one. A
value used by pieces other than its own goes from piece to piece along its
users only, each hop the shortest way::

    piece:      0            1            2            3
    mask        made ------> used ------> used         .        next piece: on the main path
    embedding   made ---------------------------------> used    later piece: a skip (stash, pop)

A tensor whose next user is a later piece travels as a skip, straight there,
never through the pieces between; a value used by many pieces (a mask, the
rotary tables) is relayed from each user to the next. A value that is not a
tensor (a size) cannot be stashed, so it rides along the main path; it costs
nothing to carry. Parameters and buffers are not values here: every piece
reads its own from their modules.
"""

from __future__ import annotations

import itertools
from bisect import bisect_right
from dataclasses import dataclass, field

from torch import Tensor, fx

__all__ = ["Cut", "PieceNodes", "cut"]


@dataclass
class PieceNodes:
    """What one piece computes and exchanges, as graph nodes."""

    nodes: list[fx.Node] = field(default_factory=list)
    receives: list[fx.Node] = field(default_factory=list)
    sends: list[fx.Node] = field(default_factory=list)
    pops: list[tuple[str, fx.Node]] = field(default_factory=list)
    stashes: list[tuple[str, fx.Node]] = field(default_factory=list)


@dataclass
class Cut:
    pieces: list[PieceNodes]
    piece_of: dict[fx.Node, int]


def cut(graph: fx.Graph, inputs: list[fx.Node], starts: list[fx.Node]) -> Cut:
    """Cut ``graph`` into pieces that start at the nodes ``starts`` (in graph order).

    ``inputs`` are the placeholders of the model's arguments, in order; other
    placeholders (parameters, buffers, constants) are read where used.
    """
    body = [node for node in graph.nodes if node.op not in ("placeholder", "output")]
    position = {node: i for i, node in enumerate(body)}
    bounds = sorted({position[node] for node in starts} - {0})
    pieces = [PieceNodes() for _ in range(len(bounds) + 1)]
    piece_of: dict[fx.Node, int] = dict.fromkeys(inputs, 0)
    for node in body:
        j = bisect_right(bounds, position[node])
        piece_of[node] = j
        pieces[j].nodes.append(node)
    last = len(pieces) - 1
    for node in graph.nodes:
        if node.op == "output":
            piece_of[node] = last
    pieces[0].receives = list(inputs)
    for value in [*inputs, *body]:
        _route(value, piece_of, pieces)
    # Piece j's sends are piece j + 1's receives, in graph order both.
    order = {node: i for i, node in enumerate(graph.nodes)}
    for j, piece in enumerate(pieces):
        piece.sends.sort(key=order.__getitem__)
        if j > 0:
            piece.receives.sort(key=order.__getitem__)
    return Cut(pieces, piece_of)


def _route(value: fx.Node, piece_of: dict[fx.Node, int], pieces: list[PieceNodes]) -> None:
    """Add the hops that take ``value`` from its piece to each later piece that uses it."""
    home = piece_of[value]
    users = sorted({piece_of[user] for user in value.users} - {home})
    chain = [home, *users]
    for source, target in itertools.pairwise(chain):
        if target == source + 1 or not is_tensor(value):
            for j in range(source, target):
                pieces[j].sends.append(value)
                pieces[j + 1].receives.append(value)
        else:
            name = f"{value.name}->{target}"
            pieces[source].stashes.append((name, value))
            pieces[target].pops.append((name, value))


def is_tensor(node: fx.Node) -> bool:
    """Whether ``node`` makes a tensor (rather than a size, a list or nothing)."""
    return isinstance(node.meta.get("val"), Tensor)
