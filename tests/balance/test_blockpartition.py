"""balance.blockpartition.solve against brute force and a plain exact dynamic program."""

import itertools
import random
from collections.abc import Sequence
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from balance import balance_cost
from balance.blockpartition import solve

Key = tuple[Fraction, Fraction, int, tuple[int, ...]]


def split_key(costs: Sequence[float], lengths: Sequence[int]) -> Key:
    """The documented order of splits: bottleneck, squared sums, squared lengths, longest first."""
    sums = []
    start = 0
    for length in lengths:
        sums.append(sum((Fraction(cost) for cost in costs[start : start + length]), Fraction(0)))
        start += length
    return (
        max(sums),
        sum((total * total for total in sums), Fraction(0)),
        sum(length * length for length in lengths),
        tuple(-length for length in lengths),
    )


def brute_force(costs: Sequence[float], partitions: int) -> list[int]:
    """The block lengths of the best split by the documented order, trying every split."""
    size = len(costs)
    splits = []
    for cuts in itertools.combinations(range(1, size), partitions - 1):
        bounds = (0, *cuts, size)
        splits.append([stop - start for start, stop in itertools.pairwise(bounds)])
    return min(splits, key=lambda lengths: split_key(costs, lengths))


def plain_bottleneck(costs: Sequence[float], partitions: int) -> Fraction:
    """The smallest largest block sum, by the textbook O(n^2 k) dynamic program on fractions."""
    prefix = [Fraction(0)]
    for cost in costs:
        prefix.append(prefix[-1] + Fraction(cost))
    size = len(costs)
    best = [Fraction(0)] + [Fraction(-1)] * size
    for blocks in range(1, partitions + 1):
        following = [Fraction(-1)] * (size + 1)
        for stop in range(blocks, size + 1):
            options = [
                max(best[start], prefix[stop] - prefix[start])
                for start in range(blocks - 1, stop)
                if best[start] >= 0
            ]
            following[stop] = min(options)
        best = following
    return best[size]


def plain_reference(costs: Sequence[float], partitions: int) -> list[int]:
    """The block lengths of the best split by the documented order, by a plain suffix program."""
    limit = plain_bottleneck(costs, partitions)
    size = len(costs)
    prefix = [Fraction(0)]
    for cost in costs:
        prefix.append(prefix[-1] + Fraction(cost))
    # best[j]: the least (squared sums, squared lengths, negated lengths) from j on.
    best: list[tuple[Fraction, int, tuple[int, ...]] | None] = [None] * size + [
        (Fraction(0), 0, ())
    ]
    for _ in range(partitions):
        following: list[tuple[Fraction, int, tuple[int, ...]] | None] = [None] * (size + 1)
        for start in range(size):
            for stop in range(start + 1, size + 1):
                total = prefix[stop] - prefix[start]
                rest = best[stop]
                if rest is None or total > limit:
                    continue
                length = stop - start
                option = (total * total + rest[0], length * length + rest[1], (-length, *rest[2]))
                current = following[start]
                if current is None or option < current:
                    following[start] = option
        best = following
    answer = best[0]
    assert answer is not None
    return [-length for length in answer[2]]


def lengths_of(costs: Sequence[float], partitions: int) -> list[int]:
    blocks = solve(costs, partitions)
    assert [cost for block in blocks for cost in block] == list(costs)
    return [len(block) for block in blocks]


tricky_floats = st.sampled_from([0.0, 0.1, 0.2, 0.3, 1.0, 1e-9, 1e9, 2.5])
cost_lists = st.one_of(
    st.lists(st.integers(0, 20), min_size=1, max_size=9),
    st.lists(st.integers(0, 2), min_size=1, max_size=9),
    st.lists(
        st.floats(0, 1e6, allow_nan=False, allow_infinity=False, allow_subnormal=True),
        min_size=1,
        max_size=9,
    ),
    st.lists(tricky_floats, min_size=1, max_size=9),
    st.lists(st.one_of(st.integers(0, 5), tricky_floats), min_size=1, max_size=9),
)


@settings(max_examples=400, deadline=None, derandomize=True)
@given(data=st.data(), costs=cost_lists)
def test_solve_equals_brute_force(data: st.DataObject, costs: list[float]) -> None:
    partitions = data.draw(st.integers(1, len(costs)), label="partitions")
    assert lengths_of(costs, partitions) == brute_force(costs, partitions)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(data=st.data(), costs=st.lists(st.integers(0, 9), min_size=10, max_size=40))
def test_solve_equals_plain_program_on_longer_sequences(
    data: st.DataObject, costs: list[int]
) -> None:
    partitions = data.draw(st.integers(1, 8), label="partitions")
    assert lengths_of(costs, partitions) == plain_reference(costs, partitions)


def adversarial(size: int) -> dict[str, Sequence[float]]:
    rng = random.Random(size)
    return {
        "uniform": [1] * size,
        "uniform float": [0.1] * size,
        "increasing": list(range(1, size + 1)),
        "decreasing": list(range(size, 0, -1)),
        "squares": [index * index for index in range(size)],
        "huge first": [1000.0] + [1.0] * (size - 1),
        "huge middle": [1.0] * (size // 2) + [1000.0] + [1.0] * (size - size // 2 - 1),
        "huge last": [1.0] * (size - 1) + [1000.0],
        "zeros": [0] * size,
        "zeros and one": [0] * (size - 1) + [1],
        "zeros around two": [0, 5] + [0] * (size - 4) + [5, 0],
        "alternating": [index % 2 * 3.5 for index in range(size)],
        "tiny and huge": [1e-300, 1e300] * (size // 2) + [1e-300] * (size % 2),
        "big ints": [10**30 + index for index in range(size)],
        "random floats": [rng.random() for _ in range(size)],
        "random ints": [rng.randint(0, 100) for _ in range(size)],
        "ints and floats": [rng.choice([0, 1, 0.5, 2.25, 3]) for _ in range(size)],
    }


@pytest.mark.parametrize("size", [1, 2, 3, 5, 8, 10])
def test_adversarial_sequences_equal_brute_force(size: int) -> None:
    for name, costs in adversarial(size).items():
        for partitions in range(1, size + 1):
            expected = brute_force(costs, partitions)
            assert lengths_of(costs, partitions) == expected, (name, partitions)


def test_adversarial_sequences_equal_plain_program() -> None:
    for name, costs in adversarial(30).items():
        for partitions in (2, 3, 8, 30):
            expected = plain_reference(costs, partitions)
            assert lengths_of(costs, partitions) == expected, (name, partitions)


def needs_more_blocks_below(costs: Sequence[float], limit: Fraction, partitions: int) -> bool:
    """Whether blocks with sums strictly below ``limit`` need more than ``partitions`` blocks."""
    blocks = 1
    total = Fraction(0)
    for cost in map(Fraction, costs):
        if cost >= limit:
            return True
        if total + cost >= limit:
            blocks += 1
            total = Fraction(0)
        total += cost
    return blocks > partitions


@pytest.mark.parametrize("partitions", [1, 2, 8, 64, 128, 2999])
def test_large_sequences_have_no_smaller_bottleneck(partitions: int) -> None:
    rng = random.Random(partitions)
    costs = [rng.expovariate(1.0) for _ in range(3000)]
    costs[rng.randrange(3000)] = 40.0
    lengths = lengths_of(costs, partitions)
    assert len(lengths) == partitions
    assert min(lengths) >= 1
    bottleneck = split_key(costs, lengths)[0]
    assert needs_more_blocks_below(costs, bottleneck, partitions)


def test_ties_follow_the_documented_order() -> None:
    # Zero costs: lengths as even as possible, the longer blocks first.
    assert lengths_of([0] * 10, 4) == [3, 3, 2, 2]
    # One layer is the bottleneck; the others still share their costs evenly.
    assert lengths_of([100] + [1] * 40, 4) == [1, 14, 13, 13]
    # Equal sums either way: the even layer counts win, then the longer first block.
    assert lengths_of([5, 0, 0, 0, 5], 2) == [3, 2]
    assert lengths_of([5, 0, 0, 5], 2) == [2, 2]
    # Squared sums decide before squared lengths: 41 and 13 beat 43 and 11 here.
    assert lengths_of([2, 1, 4, 1, 0, 1, 4], 5) == [1, 1, 1, 3, 1]


def test_solve_is_deterministic_and_keeps_the_cost_objects() -> None:
    costs = [3, 0.5, 2, 2, 0, 1.25, 7, 1]
    first = solve(costs, 3)
    assert solve(tuple(costs), 3) == first
    assert [type(cost) for block in first for cost in block] == [type(cost) for cost in costs]


def test_float_sums_are_exact() -> None:
    # Summed in floats, 0.3 + 0.1 + 0.4 rounds up to 0.4 + 0.4 and the two splits
    # look tied; exactly, the first block of [3, 1] is the smaller bottleneck.
    costs = [0.3, 0.1, 0.4, 0.4]
    assert (0.3 + 0.1) + 0.4 == 0.4 + 0.4
    assert lengths_of(costs, 2) == [3, 1]


def test_balance_cost_gives_block_lengths() -> None:
    assert balance_cost([1, 1, 1, 5, 1, 1], 3) == [3, 1, 2]
    assert balance_cost([2.5], 1) == [1]
    assert balance_cost(list(range(12)), 12) == [1] * 12
