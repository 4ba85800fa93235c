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
    """Yield the tasks of each clock cycle, partition index ascending.

    Where one thread runs a cycle's tasks, in this order, a later partition's
    autograd nodes are made after an earlier one's: autograd's backward, which
    runs the most recently made node among those ready, then reaches
    micro-batch ``i - 1`` on partition ``j + 1`` before micro-batch ``i`` on
    partition ``j`` (GPipe's backward wave; see ``driver.py``).

    >>> list(clock_cycles(2, 2))
    [[(0, 0)], [(1, 0), (0, 1)], [(1, 1)]]
    """
    for k in range(m + n - 1):
        yield [(k - j, j) for j in range(max(k - m + 1, 0), min(k + 1, n))]


def bubble_fraction(m: int, n: int) -> float:
    """The share of idle partition time in GPipe's schedule: (n-1)/(m+n-1).

    >>> bubble_fraction(4, 2)
    0.2
    """
    return (n - 1) / (m + n - 1)
