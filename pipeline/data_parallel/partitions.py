"""The protocol by which a pipeline tells DataParallel that a partition's gradients are final."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

from torch import nn
from torch.utils.hooks import RemovableHandle

from pipeline.data_parallel.buckets import NO_PARTITION


@runtime_checkable
class SignalsPartitionBackward(Protocol):
    """A module run as partitions that signals when each partition's backward is complete.

    `hook(j)` is called once per backward, from an autograd thread, after the
    backward of every micro-batch through `partitions[j]` is done. Partitions
    whose completion cannot be observed are simply not signalled.
    """

    partitions: Sequence[nn.Module]

    def register_partition_backward_hook(self, hook: Callable[[int], None]) -> RemovableHandle:
        """Call `hook(j)` whenever partition j's parameter gradients are final."""
        ...


def partition_of_each(module: nn.Module, params: list[nn.Parameter]) -> list[int] | None:
    """The partition index of each of `params`, or None when `module` is no such pipeline.

    Parameters in no partition get NO_PARTITION: nothing signals them, so they
    are reduced at the end of the backward pass. A parameter shared by several
    partitions gets the first of them.
    """
    if not isinstance(module, SignalsPartitionBackward):
        return None
    owner: dict[int, int] = {}
    for j, part in enumerate(module.partitions):
        for param in part.parameters():
            # Backward runs through partitions last to first, so a parameter
            # shared by partitions i < j has its final gradient only when the
            # earliest one, i, is done.
            owner.setdefault(id(param), j)
    return [owner.get(id(p), NO_PARTITION) for p in params]
