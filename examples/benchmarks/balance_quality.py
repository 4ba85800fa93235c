"""Benchmark of balance.blockpartition.solve: its bottleneck against exact optima, and its speed.

For each family of cost sequences, the largest block sum that ``solve`` returns
is divided by the optimum found by another exact method: trying every split
for short sequences, and for longer ones a search over the sorted candidate
block sums (every contiguous sum) with a greedy check, all in exact fractions.
A ratio of 1.000 means optimal. For contrast, the largest block of a naive
split into equal layer counts is shown against the same optimum. Then the
time ``solve`` takes on a few sizes. The last line is JSON.

Run: python examples/benchmarks/balance_quality.py
"""

import functools
import itertools
import json
import random
import statistics
import time
from bisect import bisect_left
from collections.abc import Callable, Sequence
from fractions import Fraction

from balance.blockpartition import solve

SHORT_SIZES = range(1, 11)
LONG_SIZES = (60, 150, 400)
LONG_PARTITIONS = (2, 3, 8, 16)


def families(size: int, rng: random.Random) -> dict[str, list[float]]:
    half = size // 2
    return {
        "uniform": [1.0] * size,
        "increasing": [float(index + 1) for index in range(size)],
        "decreasing": [float(size - index) for index in range(size)],
        "one huge layer": [1.0] * half + [10.0 * size] + [1.0] * (size - half - 1),
        "zeros": [0.0] * size,
        "zeros and ones": [float(rng.random() < 0.2) for _ in range(size)],
        "random floats": [rng.random() for _ in range(size)],
        "random ints": [float(rng.randint(0, 50)) for _ in range(size)],
        "rounding (0.1 .. 0.3)": [rng.choice([0.1, 0.2, 0.3]) for _ in range(size)],
        "tiny and huge": [rng.choice([1e-12, 1e12]) for _ in range(size)],
        "heavy tail": [rng.paretovariate(1.2) for _ in range(size)],
    }


def block_sums(costs: Sequence[float], lengths: Sequence[int]) -> list[Fraction]:
    sums = []
    start = 0
    for length in lengths:
        sums.append(sum(map(Fraction, costs[start : start + length]), Fraction(0)))
        start += length
    return sums


def brute_force_bottleneck(costs: Sequence[float], partitions: int) -> Fraction:
    size = len(costs)
    return min(
        max(block_sums(costs, [b - a for a, b in itertools.pairwise((0, *cuts, size))]))
        for cuts in itertools.combinations(range(1, size), partitions - 1)
    )


@functools.cache
def sorted_block_sums(costs: tuple[float, ...]) -> list[Fraction]:
    """Every contiguous block sum of ``costs``, exactly, sorted and without repeats."""
    exact = [Fraction(cost) for cost in costs]
    candidates = set()
    for start in range(len(exact)):
        total = Fraction(0)
        for cost in exact[start:]:
            total += cost
            candidates.add(total)
    return sorted(candidates)


def candidate_search_bottleneck(costs: Sequence[float], partitions: int) -> Fraction:
    exact = [Fraction(cost) for cost in costs]
    ordered = sorted_block_sums(tuple(costs))

    def fits(limit: Fraction) -> bool:
        blocks, total = 1, Fraction(0)
        for cost in exact:
            if cost > limit:
                return False
            if total + cost > limit:
                blocks, total = blocks + 1, Fraction(0)
            total += cost
        return blocks <= partitions

    low = bisect_left(ordered, max(exact))
    high = len(ordered) - 1
    while low < high:
        middle = (low + high) // 2
        if fits(ordered[middle]):
            high = middle
        else:
            low = middle + 1
    return ordered[low]


def ratio(value: Fraction, optimum: Fraction) -> Fraction:
    return Fraction(1) if value == optimum else value / optimum


def even_split(size: int, partitions: int) -> list[int]:
    share, extra = divmod(size, partitions)
    return [share + (index < extra) for index in range(partitions)]


def quality() -> tuple[dict[str, dict[str, float]], int]:
    rng = random.Random(2024)
    cases: list[tuple[str, list[float], int, Callable[[Sequence[float], int], Fraction]]] = []
    for size in SHORT_SIZES:
        for name, costs in families(size, rng).items():
            for partitions in range(1, size + 1):
                cases.append((name, costs, partitions, brute_force_bottleneck))
    for size in LONG_SIZES:
        for name, costs in families(size, rng).items():
            for partitions in LONG_PARTITIONS:
                cases.append((name, costs, partitions, candidate_search_bottleneck))
    ratios: dict[str, list[Fraction]] = {}
    exact: dict[str, int] = {}
    naive: dict[str, list[Fraction]] = {}
    for name, costs, partitions, exact_bottleneck in cases:
        optimum = exact_bottleneck(costs, partitions)
        lengths = [len(block) for block in solve(costs, partitions)]
        bottleneck = max(block_sums(costs, lengths))
        ratios.setdefault(name, []).append(ratio(bottleneck, optimum))
        exact[name] = exact.get(name, 0) + (bottleneck == optimum)
        even = max(block_sums(costs, even_split(len(costs), partitions)))
        naive.setdefault(name, []).append(ratio(even, optimum))
    table = {
        name: {
            "sequences": len(values),
            "exact": exact[name],
            "worst": float(max(values)),
            "best": float(min(values)),
            "even_split_mean": float(statistics.fmean(map(float, naive[name]))),
        }
        for name, values in ratios.items()
    }
    return table, len(cases)


def timing(size: int, partitions: int, costs: list[float], repeats: int = 7) -> float:
    """Median milliseconds of one solve."""
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        solve(costs, partitions)
        samples.append(time.perf_counter() - start)
    return 1000 * statistics.median(samples)


def speed() -> dict[str, float]:
    rng = random.Random(7)
    thousand = [rng.random() for _ in range(1000)]
    one_huge = [1.0] * 1000
    one_huge[500] = 1000.0
    return {
        "1000x8 random": timing(1000, 8, thousand),
        "1000x8 one huge layer": timing(1000, 8, one_huge),
        "1000x8 zeros": timing(1000, 8, [0.0] * 1000),
        "1000x64 random": timing(1000, 64, thousand),
        "5000x8 random": timing(5000, 8, [rng.random() for _ in range(5000)]),
    }


def main() -> None:
    table, cases = quality()
    print(
        f"{'family':24} {'sequences':>9} {'exact':>6} {'worst':>7} {'best':>7} {'even split':>10}"
    )
    for name, row in table.items():
        print(
            f"{name:24} {row['sequences']:>9} {row['exact']:>6} {row['worst']:>7.3f} "
            f"{row['best']:>7.3f} {row['even_split_mean']:>10.3f}"
        )
    print(
        "worst/best: solve's largest block sum / the exact optimum; exact: sequences where "
        "the two are equal as fractions; even split: equal layer counts, mean ratio"
    )
    times = speed()
    for name, milliseconds in times.items():
        print(f"solve {name:24} {milliseconds:8.1f} ms (median of 7)")
    worst = max(row["worst"] for row in table.values())
    best = min(row["best"] for row in table.values())
    print(
        json.dumps(
            {
                "benchmark": "balance_quality",
                "sequences": cases,
                "exact_optima": sum(row["exact"] for row in table.values()),
                "worst_ratio": round(worst, 6),
                "best_ratio": round(best, 6),
                "solve_ms": {name: round(value, 2) for name, value in times.items()},
            }
        )
    )


if __name__ == "__main__":
    main()
