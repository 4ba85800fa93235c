"""Bucket assignment: which tensors share one flat buffer, and in what order."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

# Tensors that belong to no signalled pipeline partition (or to a module that is
# not a pipeline at all) share this partition index.
NO_PARTITION = -1

GroupKey = tuple[int, torch.dtype, torch.device]


@dataclass(frozen=True)
class BucketSpec:
    """One bucket: its tensors' indices, in the order they are expected to be ready."""

    indices: tuple[int, ...]
    partition: int
    dtype: torch.dtype
    device: torch.device


def group_key(tensor: torch.Tensor, partition: int) -> GroupKey:
    """What two tensors must share to sit in one flat buffer (and one pipeline partition)."""
    return (partition, tensor.dtype, tensor.device)


def assign_buckets(
    tensors: Sequence[torch.Tensor],
    order: Sequence[int],
    *,
    cap_bytes: int,
    first_cap_bytes: int,
    partitions: Sequence[int] | None = None,
) -> list[BucketSpec]:
    """Cut `tensors`, visited in `order`, into buckets of about `cap_bytes` each.

    Tensors are grouped by (partition, dtype, device); within a group a bucket
    closes as soon as it holds at least its cap, and each group's first bucket
    uses `first_cap_bytes` so that the first all-reduce can start early in the
    backward pass. Buckets come back sorted by the position of their first
    tensor in `order`, which is the order they should be launched in.
    """
    if sorted(order) != list(range(len(tensors))):
        raise ValueError(f"order must be a permutation of range({len(tensors)}), got {order!r}")
    part = partitions if partitions is not None else [NO_PARTITION] * len(tensors)
    open_buckets: dict[GroupKey, list[int]] = {}
    open_bytes: dict[GroupKey, int] = {}
    closed_per_group: dict[GroupKey, int] = {}
    done: list[tuple[GroupKey, list[int]]] = []

    for i in order:
        key = group_key(tensors[i], part[i])
        open_buckets.setdefault(key, []).append(i)
        open_bytes[key] = open_bytes.get(key, 0) + tensors[i].numel() * tensors[i].element_size()
        cap = cap_bytes if closed_per_group.get(key, 0) else first_cap_bytes
        if open_bytes[key] >= cap:
            done.append((key, open_buckets.pop(key)))
            del open_bytes[key]
            closed_per_group[key] = closed_per_group.get(key, 0) + 1
    done.extend(open_buckets.items())

    position = {index: pos for pos, index in enumerate(order)}
    done.sort(key=lambda bucket: position[bucket[1][0]])
    return [
        BucketSpec(tuple(indices), partition, dtype, device)
        for (partition, dtype, device), indices in done
    ]
