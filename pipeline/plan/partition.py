"""The balance for time and memory together: the least bottleneck among cuts that fit.

``balance.blockpartition.solve`` cuts for compute alone. Here a stage's
memory depends on where it is (1F1B's first stage holds as many
micro-batches as there are stages, the last one), so each stage ``j`` of
layers ``first..stop`` must fit its own budget, and the cut chosen is the
one whose slowest stage is fastest among those that fit; ties go to the
cut whose stage times are most even (least sum of squares). Exact: the
bottleneck is searched over every stage cost there is, each candidate
checked by a dynamic program over (stage, first layer), O(stages x
layers^2) per check.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from itertools import combinations, pairwise

__all__ = [
    "ENUMERATED",
    "KEPT",
    "fitting_balance",
    "least_memory_balance",
    "least_peak_balance",
    "shared_balances",
]

# The most cuts ``shared_balances`` walks: beyond, stages sharing a place are cut by the
# even share of its limit and by the least memory summed over every stage alone.
ENUMERATED = 50_000
# The fitting cuts ``shared_balances`` keeps, whose step times the search then predicts.
KEPT = 16

# cost(j, first, stop) and fits(j, first, stop) of stage j holding layers first..stop.
Cost = Callable[[int, int, int], float]
Fits = Callable[[int, int, int], bool]


def fitting_balance(layers: int, stages: int, cost: Cost, fits: Fits) -> list[int] | None:
    """The balance of ``layers`` into ``stages``: its slowest stage fastest, every stage fitting.

    None when no cut fits.

    >>> fitting_balance(4, 2, lambda j, a, b: b - a, lambda j, a, b: True)
    [2, 2]
    >>> fitting_balance(4, 2, lambda j, a, b: b - a, lambda j, a, b: j == 1 or b - a == 1)
    [1, 3]
    >>> fitting_balance(4, 2, lambda j, a, b: b - a, lambda j, a, b: False) is None
    True
    """
    candidates = sorted(
        {
            cost(j, a, b)
            for j in range(stages)
            for a in range(layers)
            for b in range(a + 1, layers + 1)
            if fits(j, a, b)
        }
    )
    low, high = 0, len(candidates) - 1
    found: list[int] | None = None
    while low <= high:
        middle = (low + high) // 2
        cut = _even_cut(layers, stages, cost, fits, candidates[middle])
        if cut is None:
            low = middle + 1
        else:
            found, high = cut, middle - 1
    return found


def _even_cut(
    layers: int, stages: int, cost: Cost, fits: Fits, bottleneck: float
) -> list[int] | None:
    """The cut within ``bottleneck`` with the least sum of squared stage costs, or None."""

    def square(j: int, a: int, b: int) -> float:
        if not fits(j, a, b):
            return math.inf
        seconds = cost(j, a, b)
        return seconds * seconds if seconds <= bottleneck else math.inf

    return _least_sum(layers, stages, square)


def least_memory_balance(
    layers: int, stages: int, total: Callable[[int, int, int], int]
) -> list[int]:
    """The balance of ``layers`` into ``stages`` whose stages' ``total`` bytes sum least.

    Stages sharing a device share its limit: a cut may fit their sum where
    ``fitting_balance``'s even share of it per stage does not.

    >>> least_memory_balance(4, 2, lambda j, a, b: (b - a) * (3 if j == 0 else 1))
    [1, 3]
    """
    cut = _least_sum(layers, stages, total)
    assert cut is not None, "every stage's total is finite"
    return cut


def shared_balances(
    layers: int,
    stages: int,
    cost: Cost,
    totals: Callable[[list[tuple[int, int]]], list[int]],
    places: Sequence[str],
    limit: int,
) -> tuple[list[list[int]], list[int]] | None:
    """The ``KEPT`` cuts whose every place's stages sum within ``limit`` whose busiest place
    computes least (none if none fits), and the cut whose fullest place holds least; None
    where there are more than ``ENUMERATED`` cuts to walk. ``totals(spans)``: each stage's
    bytes under the cut of ``spans`` (``(first, stop)`` per stage); ``places[j]``: where
    stage ``j``'s count. The search then predicts each kept cut's step time.

    Exact for memory: every cut is walked. Where stages share a place, its stages
    are not adjacent (interleaved: stage ``j`` in process ``j % n``); where a
    stage's bytes depend on the rest of the cut (a skip's stages, a weight tied
    across a process's stages), they are not its own: no dynamic program over
    the layers' order sums them. A place runs its stages one after another, so
    cuts are ranked by its summed cost, then by the slowest stage.

    Four layers of a byte each, stages 0 and 2 in place ``a``: within 2 bytes a place, only
    ``[1, 2, 1]`` fits (an even share of 1 byte a stage fits no cut):

    >>> sizes = lambda spans: [b - a for a, b in spans]
    >>> shared_balances(4, 3, lambda j, a, b: b - a, sizes, ["a", "b", "a"], 2)
    ([[1, 2, 1]], [1, 2, 1])
    """
    if math.comb(layers - 1, stages - 1) > ENUMERATED:
        return None
    fastest: list[tuple[float, float, float, list[int]]] = []
    least: tuple[float, list[int]] | None = None
    for stops in combinations(range(1, layers), stages - 1):
        spans = list(pairwise((0, *stops, layers)))
        cut = [b - a for a, b in spans]
        peak = max(_by_place(totals(spans), places).values())
        if least is None or peak < least[0]:
            least = peak, cut
        if peak <= limit:
            seconds = [cost(j, a, b) for j, (a, b) in enumerate(spans)]
            busiest = max(_by_place(seconds, places).values())
            fastest.append((busiest, max(seconds), sum(t * t for t in seconds), cut))
            if len(fastest) > 4 * KEPT:
                fastest = sorted(fastest)[:KEPT]
    assert least is not None, "at least one cut"
    return [rank[3] for rank in sorted(fastest)[:KEPT]], least[1]


def _by_place(values: Sequence[float], places: Sequence[str]) -> dict[str, float]:
    """``values`` (one per stage) summed per place."""
    summed: dict[str, float] = {}
    for value, place in zip(values, places, strict=True):
        summed[place] = summed.get(place, 0) + value
    return summed


def least_peak_balance(
    layers: int, stages: int, total: Callable[[int, int, int], int]
) -> list[int]:
    """The balance of ``layers`` into ``stages`` (each its own place) whose largest stage
    ``total`` is least: a dynamic program over (stage, first layer).

    >>> least_peak_balance(4, 2, lambda j, a, b: (b - a) * (3 if j == 0 else 1))
    [1, 3]
    """
    # best[j][a]: the least largest total of stages j.. covering layers a..; choice: its stop.
    best = [[math.inf] * (layers + 1) for _ in range(stages + 1)]
    choice = [[0] * (layers + 1) for _ in range(stages + 1)]
    best[stages][layers] = -math.inf
    for j in range(stages - 1, -1, -1):
        left = stages - j
        for a in range(j, layers - left + 1):
            for b in range(a + 1, layers - left + 2):
                peak = max(total(j, a, b), best[j + 1][b])
                if peak < best[j][a]:
                    best[j][a], choice[j][a] = peak, b
    return _walk(choice, stages)


def _least_sum(layers: int, stages: int, value: Cost) -> list[int] | None:
    """The cut whose stages' ``value`` sum least (``inf``: a stage that may not be), or None.

    A dynamic program over (stage, first layer), O(stages x layers^2).
    """
    # best[j][a]: least sum of stages j.. covering layers a..; choice: its first stop.
    best = [[math.inf] * (layers + 1) for _ in range(stages + 1)]
    choice = [[0] * (layers + 1) for _ in range(stages + 1)]
    best[stages][layers] = 0.0
    for j in range(stages - 1, -1, -1):
        left = stages - j
        for a in range(j, layers - left + 1):
            for b in range(a + 1, layers - left + 2):
                if best[j + 1][b] == math.inf:
                    continue
                summed = value(j, a, b) + best[j + 1][b]
                if summed < best[j][a]:
                    best[j][a], choice[j][a] = summed, b
    if best[0][0] == math.inf:
        return None
    return _walk(choice, stages)


def _walk(choice: list[list[int]], stages: int) -> list[int]:
    """The sizes of the cut a dynamic program chose: stage ``j`` from ``a`` to ``choice[j][a]``."""
    sizes = []
    a = 0
    for j in range(stages):
        b = choice[j][a]
        sizes.append(b - a)
        a = b
    return sizes
