"""The optimal contiguous block partition of a cost sequence (the balance solver)."""

import math
import numbers
from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from fractions import Fraction
from itertools import pairwise

from balance.checks import check_partitions
from balance.errors import BalanceError


def solve(costs: Sequence[float], partitions: int) -> list[list[float]]:
    """Split ``costs`` into ``partitions`` contiguous blocks, the largest sum as small as can be.

    The answer is exact: costs (ints or floats, both non-negative and finite)
    are turned into integers over a common denominator without rounding, so
    sums are compared exactly, not in floating point.

    Among all splits, the one returned is the first by these criteria, each
    one deciding only among the splits tied on all before it:

    1. the smallest largest block sum (the pipeline's bottleneck);
    2. the smallest sum of squared block sums (the other blocks' costs as
       even as the bottleneck allows);
    3. the smallest sum of squared block lengths (layer counts as even as
       possible, which decides among zero-cost layers);
    4. the largest block lengths, compared from the first block on (earlier
       blocks take the extra layers, as ``numpy.array_split`` does).

    The bottleneck comes from a binary search over integers with a greedy
    check. Criteria 2 and 3 come from a dynamic program over the splits
    whose blocks stay within the bottleneck (divide and conquer over its
    monotone choices, O(partitions * n log n) at worst), and criterion 4
    from reading the split back with each block as long as it can be.

    Example:
        >>> solve([1, 1, 1, 5, 1, 1], 3)
        [[1, 1, 1], [5], [1, 1]]
        >>> solve([0, 0, 0, 0, 0], 2)
        [[0, 0, 0], [0, 0]]

    Raises:
        TypeError: a cost is not a real number, or ``partitions`` is not an int.
        BalanceError: a cost is negative or not finite, ``partitions`` < 1, or
            there are fewer costs than partitions.
    """
    values = _exact_integers(costs)
    count = check_partitions(partitions, len(values), "costs")
    prefix = _prefix_sums(values)
    bottleneck = _smallest_bottleneck(values, prefix, count)
    boundaries = _most_even_boundaries(prefix, bottleneck, count)
    return [list(costs[start:stop]) for start, stop in pairwise(boundaries)]


def _exact_integers(costs: Sequence[float]) -> list[int]:
    """The costs scaled by one common factor into integers, with no rounding."""
    fractions = [_exact_cost(index, cost) for index, cost in enumerate(costs)]
    denominator = math.lcm(*(fraction.denominator for fraction in fractions))
    return [fraction.numerator * (denominator // fraction.denominator) for fraction in fractions]


def _exact_cost(index: int, cost: object) -> Fraction:
    if isinstance(cost, bool) or not isinstance(cost, numbers.Real):
        raise TypeError(
            f"costs[{index}] is {type(cost).__name__} {cost!r}; costs must be real numbers "
            "(turn a tensor into a list with .tolist())"
        )
    if isinstance(cost, numbers.Rational):
        exact = Fraction(cost)
    elif math.isfinite(cost):
        # Every finite binary float is a fraction; going through float also
        # accepts float-like types that Fraction does not know (numpy.float32).
        exact = Fraction(float(cost))
    else:
        raise BalanceError(f"costs[{index}] is {cost!r}; every cost must be a finite number")
    if exact < 0:
        raise BalanceError(f"costs[{index}] is {cost!r}; every cost must be 0 or more")
    return exact


def _prefix_sums(values: list[int]) -> list[int]:
    prefix = [0]
    for value in values:
        prefix.append(prefix[-1] + value)
    return prefix


def _smallest_bottleneck(values: list[int], prefix: list[int], partitions: int) -> int:
    """The smallest largest block sum over all splits into ``partitions`` blocks."""
    # Integers make the search exact: the answer is a block sum, so an integer.
    low = max(max(values), -(-prefix[-1] // partitions))
    high = prefix[-1]
    while low < high:
        middle = (low + high) // 2
        if _fits(prefix, middle, partitions):
            high = middle
        else:
            low = middle + 1
    return low


def _fits(prefix: list[int], limit: int, partitions: int) -> bool:
    """Whether at most ``partitions`` blocks, each summing to at most ``limit``, cover all."""
    # Blocks as long as the limit allows use the fewest blocks; costs are
    # non-negative, so fewer blocks can be split into exactly ``partitions``.
    end = len(prefix) - 1
    start = 0
    for _ in range(partitions):
        start = bisect_right(prefix, prefix[start] + limit) - 1
        if start == end:
            return True
    return False


def _most_even_boundaries(prefix: list[int], limit: int, partitions: int) -> list[int]:
    """The block boundaries that win criteria 2 to 4 among splits within ``limit``.

    ``best[b][j]`` is the least weight of the costs from index ``j`` on split
    into ``b`` blocks within the limit, where a block from ``j`` to ``i`` weighs
    ``scale * (sum)**2 + (i - j)**2``; ``scale`` exceeds any sum of squared
    lengths, so that the weight ranks criterion 2 before criterion 3.
    """
    end = len(prefix) - 1
    reach = [bisect_right(prefix, total + limit) - 1 for total in prefix]
    rows = _live_rows(prefix, reach, limit, partitions)
    scale = end * end + 1
    best = [[0] * (end + 1) for _ in range(partitions + 1)]
    for blocks in range(1, partitions + 1):
        _fill_least_weights(
            prefix, reach, scale, best[blocks], best[blocks - 1], rows[blocks], rows[blocks - 1]
        )
    return _trace_boundaries(prefix, reach, scale, best, rows)


def _live_rows(
    prefix: list[int], reach: list[int], limit: int, partitions: int
) -> list[tuple[int, int]]:
    """For ``b`` blocks left, the first and last index where they can start in a valid split."""
    end = len(prefix) - 1
    # furthest[t]: the furthest index t blocks can cover from the start;
    # nearest[t]: the nearest index from which t blocks can cover the rest.
    furthest = [0]
    nearest = [end]
    for _ in range(partitions):
        furthest.append(reach[furthest[-1]])
        nearest.append(bisect_left(prefix, prefix[nearest[-1]] - limit))
    return [
        (
            max(nearest[blocks], partitions - blocks),
            min(end - blocks, furthest[partitions - blocks]),
        )
        for blocks in range(partitions + 1)
    ]


def _fill_least_weights(
    prefix: list[int],
    reach: list[int],
    scale: int,
    current: list[int],
    previous: list[int],
    rows: tuple[int, int],
    columns: tuple[int, int],
) -> None:
    """Fill ``current[j]`` for each live row ``j`` from ``previous`` (one block fewer).

    Block weights form a Monge array (convex in the block sum and length,
    infinite past the limit), so the leftmost best end of the first block
    never moves left as its start moves right: solving the middle row bounds
    the search of the rows on either side.
    """
    pending = [(rows[0], rows[1], columns[0], columns[1])]
    while pending:
        first_row, last_row, first_column, last_column = pending.pop()
        if first_row > last_row:
            continue
        row = (first_row + last_row) // 2
        base = prefix[row]
        least = -1
        chosen = first_column
        for column in range(max(first_column, row + 1), min(last_column, reach[row]) + 1):
            total = prefix[column] - base
            length = column - row
            weight = scale * total * total + length * length + previous[column]
            if least < 0 or weight < least:
                least = weight
                chosen = column
        current[row] = least
        pending.append((first_row, row - 1, first_column, chosen))
        pending.append((row + 1, last_row, chosen, last_column))


def _trace_boundaries(
    prefix: list[int],
    reach: list[int],
    scale: int,
    best: list[list[int]],
    rows: list[tuple[int, int]],
) -> list[int]:
    """Walk the least weights from the start, each block as long as an optimal split allows."""
    boundaries = [0]
    row = 0
    for blocks in range(len(best) - 1, 0, -1):
        first_column, last_column = rows[blocks - 1]
        column = min(last_column, reach[row])
        while column > max(first_column, row + 1):
            total = prefix[column] - prefix[row]
            length = column - row
            weight = scale * total * total + length * length + best[blocks - 1][column]
            if weight == best[blocks][row]:
                break
            column -= 1
        boundaries.append(column)
        row = column
    return boundaries
