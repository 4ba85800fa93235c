"""Bucket assignment: sizes, order, first bucket and (partition, dtype, device) grouping."""

from __future__ import annotations

import pytest
import torch

from pipeline.data_parallel.buckets import NO_PARTITION, assign_buckets

KIB = 1024


def floats(count: int, kib: int = 1, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    return [
        torch.empty(kib * KIB // torch.empty((), dtype=dtype).element_size(), dtype=dtype)
        for _ in range(count)
    ]


def indices(specs: list) -> list[tuple[int, ...]]:
    return [spec.indices for spec in specs]


def test_small_first_bucket_then_capped_buckets_in_reverse_order() -> None:
    tensors = floats(10)
    specs = assign_buckets(
        tensors, list(reversed(range(10))), cap_bytes=3 * KIB, first_cap_bytes=KIB
    )
    assert indices(specs) == [(9,), (8, 7, 6), (5, 4, 3), (2, 1, 0)]
    assert all(spec.partition == NO_PARTITION for spec in specs)


def test_bucket_closes_once_it_reaches_the_cap() -> None:
    tensors = floats(1, kib=5) + floats(3)
    specs = assign_buckets(tensors, [0, 1, 2, 3], cap_bytes=2 * KIB, first_cap_bytes=2 * KIB)
    assert indices(specs) == [(0,), (1, 2), (3,)]


def test_order_is_followed_and_buckets_sorted_by_first_member() -> None:
    tensors = floats(4)
    specs = assign_buckets(tensors, [2, 0, 3, 1], cap_bytes=2 * KIB, first_cap_bytes=2 * KIB)
    assert indices(specs) == [(2, 0), (3, 1)]


def test_dtypes_never_share_a_bucket_and_each_gets_a_first_bucket() -> None:
    tensors = [
        t for pair in zip(floats(4), floats(4, dtype=torch.float64), strict=True) for t in pair
    ]
    specs = assign_buckets(tensors, list(range(8)), cap_bytes=2 * KIB, first_cap_bytes=KIB)
    for spec in specs:
        assert {tensors[i].dtype for i in spec.indices} == {spec.dtype}
    assert indices(specs) == [(0,), (1,), (2, 4), (3, 5), (6,), (7,)]


def test_devices_never_share_a_bucket() -> None:
    tensors = [torch.empty(256), torch.empty(256, device="meta"), torch.empty(256)]
    specs = assign_buckets(tensors, [0, 1, 2], cap_bytes=10 * KIB, first_cap_bytes=10 * KIB)
    assert indices(specs) == [(0, 2), (1,)]
    assert [spec.device.type for spec in specs] == ["cpu", "meta"]


def test_partitions_never_share_a_bucket() -> None:
    tensors = floats(6)
    partitions = [0, 0, 0, 1, 1, 1]
    specs = assign_buckets(
        tensors,
        list(reversed(range(6))),
        cap_bytes=10 * KIB,
        first_cap_bytes=10 * KIB,
        partitions=partitions,
    )
    assert indices(specs) == [(5, 4, 3), (2, 1, 0)]
    assert [spec.partition for spec in specs] == [1, 0]


def test_order_must_be_a_permutation() -> None:
    with pytest.raises(ValueError, match="permutation"):
        assign_buckets(floats(3), [0, 0, 1], cap_bytes=KIB, first_cap_bytes=KIB)
