"""Schedules: which (micro-batch, partition) tasks run together.

GPipe's schedule for ``m`` micro-batches over ``n`` partitions runs ``m + n - 1``
clock cycles; in cycle ``k`` every task ``(i, j)`` with ``i + j == k`` runs at
once, partition ``j`` working on micro-batch ``i``::

            partition 0   1   2
    cycle 0:        (0,0)
    cycle 1:        (1,0) (0,1)
    cycle 2:        (2,0) (1,1) (0,2)
    cycle 3:              (2,1) (1,2)
    cycle 4:                    (2,2)
"""

from __future__ import annotations

from collections.abc import Iterator

__all__ = ["bubble_fraction", "clock_cycles"]


def clock_cycles(m: int, n: int) -> Iterator[list[tuple[int, int]]]:
    """Yield the tasks of each clock cycle, micro-batch index ascending.

    >>> list(clock_cycles(2, 2))
    [[(0, 0)], [(0, 1), (1, 0)], [(1, 1)]]
    """
    for k in range(m + n - 1):
        yield [(i, k - i) for i in range(max(k - n + 1, 0), min(k + 1, m))]


def bubble_fraction(m: int, n: int) -> float:
    """The share of idle partition time in GPipe's schedule: (n-1)/(m+n-1).

    >>> bubble_fraction(4, 2)
    0.2
    """
    return (n - 1) / (m + n - 1)
