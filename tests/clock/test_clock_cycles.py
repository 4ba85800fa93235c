from __future__ import annotations

import pytest

from pipeline.clock.cycles import bubble_fraction, clock_cycles


def test_three_by_three_is_a_diagonal_wave() -> None:
    assert list(clock_cycles(3, 3)) == [
        [(0, 0)],
        [(1, 0), (0, 1)],
        [(2, 0), (1, 1), (0, 2)],
        [(2, 1), (1, 2)],
        [(2, 2)],
    ]


@pytest.mark.parametrize(("m", "n"), [(1, 1), (1, 4), (4, 1), (5, 3), (8, 2)])
def test_every_task_once_and_after_its_predecessors(m: int, n: int) -> None:
    cycles = list(clock_cycles(m, n))
    assert len(cycles) == m + n - 1
    when = {task: k for k, tasks in enumerate(cycles) for task in tasks}
    assert sorted(when) == [(i, j) for i in range(m) for j in range(n)]
    for (i, j), k in when.items():
        if j > 0:
            assert when[(i, j - 1)] < k
        if i > 0:
            assert when[(i - 1, j)] < k


def test_bubble_fraction() -> None:
    assert bubble_fraction(4, 1) == 0
    assert bubble_fraction(3, 2) == pytest.approx(1 / 4)
