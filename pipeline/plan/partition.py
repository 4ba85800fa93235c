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
from collections.abc import Callable

__all__ = ["fitting_balance", "least_memory_balance"]

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
    sizes = []
    a = 0
    for j in range(stages):
        b = choice[j][a]
        sizes.append(b - a)
        a = b
    return sizes
