"""Skip trackers: where a stashed tensor waits until a later layer pops it.

``SkipTracker`` keeps the tensors in a dict. That is all a plain run needs:
the stash and the pop happen on one thread, one after the other, and the
popped tensor is the stashed one, with its autograd history. A Pipe gives
each micro-batch a tracker of its own that also sends skips between
partitions through portals (``pipeline/clock/skips.py``).

A skippable layer finds its tracker with ``current_tracker()``: the one
installed by ``use_tracker`` on the calling thread, or else the thread's own.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TypeAlias

import torch
from torch import Tensor

from pipeline.runtime.aliases import SKIP_APART
from pipeline.skip.carrier import Carrier
from pipeline.skip.namespace import Namespace

__all__ = [
    "SkipKey",
    "SkipTracker",
    "StashMark",
    "current_tracker",
    "discard_stashed",
    "refuse_returned_into_a_copy",
    "refuse_written_after_pop",
    "refuse_written_after_stash",
    "refuse_written_shared",
    "use_tracker",
    "version_of",
]

SkipKey: TypeAlias = tuple[Namespace, str]

_local = threading.local()


class SkipTracker:
    """Holds stashed tensors, by (namespace, name), until they are popped."""

    def __init__(self) -> None:
        self.tensors: dict[SkipKey, Tensor] = {}

    def save(self, output: Carrier, key: SkipKey, tensor: Tensor) -> None:
        """Keep ``tensor``, stashed by the layer whose output is ``output``."""
        self.tensors[key] = tensor

    def load(self, input: Carrier, key: SkipKey) -> Tensor:
        """Give up the tensor stashed as ``key`` to the layer whose input is ``input``."""
        try:
            return self.tensors.pop(key)
        except KeyError:
            ns, name = key
            raise RuntimeError(
                f"{input.owner} pops {name!r} ({ns.label}) but no earlier layer of this "
                "forward pass has stashed it; check the layer order and namespaces "
                "(verify_skippables(model) lists every mismatch)"
            ) from None


class StashMark:
    """What a skip that leaves its partition was when stashed: its version, and a view's
    values (a view's version counter is its base's, which a write into another view of the
    base moves too: ``q.mul_(s)`` beside a stashed ``k``, both slices of one projection)."""

    __slots__ = ("values", "version")

    def __init__(self, tensor: Tensor) -> None:
        self.version = version_of(tensor)
        viewed = not tensor.is_inference() and tensor._base is not None
        self.values = tensor.detach().clone() if viewed else None

    def written(self, tensor: Tensor) -> bool:
        if version_of(tensor) == self.version:
            return False
        return self.values is None or not torch.equal(self.values, tensor)


def refuse_written_after_stash(key: SkipKey, tensor: Tensor, mark: StashMark) -> None:
    """Refuse a skip that leaves its partition and was written in place after its stash.

    The plain model's pop gets the same tensor, with the write and its place
    in the graph; a pipeline's pop gets it as it was stashed (a message sent
    then, or a portal's entry in that tensor's history).
    """
    if mark.written(tensor):
        namespace, name = key
        raise RuntimeError(
            f"the skip {name!r} ({namespace.label}) was written in place after it was stashed "
            "(an in-place layer after the stashing one, such as nn.ReLU(inplace=True), "
            "writing into the tensor the layer also returned): its pop in a later partition "
            "would not see the write the plain model's pop sees; stash a tensor nothing "
            "writes into afterwards (stash(name, h.clone())), or make that layer out-of-place"
        )


def refuse_written_after_pop(key: SkipKey, tensor: Tensor, version: int, partition: int) -> None:
    """Refuse a skip a checkpointed task popped and wrote into in place (one that needs no
    gradient: the plain model takes that write): its recomputation would pop the written
    values, and the stashing task's too, where the skip was its own input."""
    if version_of(tensor) != version:
        namespace, name = key
        raise RuntimeError(
            f"checkpointed partition {partition} modified the skip {name!r} "
            f"({namespace.label}) it popped in place, so its recomputation would pop the "
            "modified values; write into a copy (s = s * 3, or s.clone()), or use "
            "checkpoint='never'"
        )


def refuse_written_shared(key: SkipKey, tensor: Tensor, version: int, partition: int) -> None:
    """Refuse ``partition``'s write into the skip it popped, which shares memory with the main
    path or another skip where it was stashed (``version``: the skip's at its pop)."""
    if version_of(tensor) != version:
        namespace, name = key
        raise RuntimeError(
            f"partition {partition} wrote in place into the skip {name!r} ({namespace.label}) "
            "it popped, which shares memory with the main path or another skip where it was "
            f"stashed: {SKIP_APART}"
        )


def refuse_returned_into_a_copy(
    key: SkipKey, tensor: Tensor, returned: list[Any], partition: int
) -> None:
    """Refuse a skip that is also what ``partition`` returns, into a partition that copies
    its input (its first layer writes in place).

    The plain model's in-place layer writes into the very tensor the pop
    gets; a pipeline's next partition gets its input as a leaf of its own
    graph and hands such a layer a copy, so the pop would not see the write.
    """
    storage = tensor.untyped_storage().data_ptr()
    shared = storage != 0 and any(
        isinstance(t, Tensor) and t.untyped_storage().data_ptr() == storage for t in returned
    )
    if shared:
        namespace, name = key
        raise RuntimeError(
            f"the skip {name!r} ({namespace.label}) is also what partition {partition} returns, "
            f"and partition {partition + 1} starts with a layer that writes into its input in "
            "place (nn.ReLU(inplace=True)), which a pipeline hands a copy: its pop would not "
            "see the write the plain model's pop sees; stash a tensor of its own "
            "(stash(name, h.clone())), or make that layer out-of-place"
        )


def version_of(tensor: Tensor) -> int:
    """``tensor``'s version counter; -1 for an inference tensor, which has none (and which
    nothing outside inference mode writes into)."""
    return -1 if tensor.is_inference() else tensor._version


def current_tracker() -> SkipTracker:
    """The tracker that skippable layers on this thread use now."""
    tracker: SkipTracker | None = getattr(_local, "tracker", None)
    if tracker is None:
        tracker = _local.tracker = SkipTracker()
    return tracker


def discard_stashed() -> None:
    """Drop the tensors stashed on this thread by a plain run and never popped.

    A plain run (no Pipe) that fails between a stash and its pop leaves the
    stashed tensor, and its graph, in the thread's tracker; the next run
    stashing the same name replaces it, so at most one per skip stays. Call
    this after such a failure to free it at once::

        try:
            model(x)
        except RuntimeError:
            discard_stashed()
    """
    current_tracker().tensors.clear()


@contextmanager
def use_tracker(tracker: SkipTracker) -> Iterator[None]:
    """Make ``tracker`` the current one on this thread for the block."""
    previous = getattr(_local, "tracker", None)
    _local.tracker = tracker
    try:
        yield
    finally:
        _local.tracker = previous
