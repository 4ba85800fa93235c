"""Buckets: which gradients share one flat buffer, and the buffer that averages them.

A bucket never spans two pipeline partitions, dtypes or devices
(``assign_buckets``); a pipeline tells which partition each parameter belongs
to (``SignalsPartitionBackward``); a ``GradBucket`` holds its gradients flat
and all-reduces them at once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import record_function
from torch.utils.hooks import RemovableHandle

# Tensors that belong to no signalled pipeline partition (or to a module that is
# not a pipeline at all) share this partition index.
NO_PARTITION = -1


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


class GradBucket:
    """The flat gradient buffer of a few parameters of one dtype and device.

    Each parameter owns a slot (a view of `flat` shaped like the parameter).
    Gradients are divided by the world size as they are loaded, so the sum
    all-reduce leaves the average (gloo has no average reduction; dividing
    first also keeps low-precision sums in range, and doing it during the copy
    saves a pass over memory). With `track_use`, `flat` ends with one flag per
    parameter, 1 where this rank produced a gradient: the flags ride along in
    the same all-reduce, so afterwards a zero flag means no rank used the
    parameter and its `.grad` is left alone, as if it had not been wrapped.
    """

    def __init__(
        self,
        index: int,
        params: list[nn.Parameter],
        *,
        world_size: int,
        track_use: bool,
        as_view: bool,
    ) -> None:
        self.index = index
        self.params = params
        self._scale = 1.0 / world_size
        self._as_view = as_view
        sizes = [p.numel() for p in params]
        total = sum(sizes)
        self.nbytes = total * params[0].element_size()
        self.flat = torch.zeros(
            total + (len(params) if track_use else 0),
            dtype=params[0].dtype,
            device=params[0].device,
        )
        self._slots = [
            part.view_as(p) for p, part in zip(params, self.flat[:total].split(sizes), strict=True)
        ]
        self._used = self.flat[total:] if track_use else None
        self._pending = len(params)
        self._work: dist.Work | None = None
        if as_view:
            self._adopt_existing_grads()

    def describe(self) -> str:
        """How error messages name this bucket."""
        size = f"{len(self.params)} parameters, {self.nbytes / 2**20:.2f} MiB"
        return f"gradient bucket {self.index} ({size})"

    @property
    def full(self) -> bool:
        """Whether every parameter's gradient has been loaded since the last reset."""
        return self._pending == 0

    def reset(self, abandoned: bool = False) -> None:
        """Forget the last iteration: no gradient loaded, no all-reduce in flight.

        An all-reduce the last iteration left in flight (its backward failed
        after launching it, on every replica alike) is waited for first: left
        to run, it would write its average into the bucket while the next
        iteration fills it (the next averages were wrong by up to 0.18).
        ``abandoned``: the last iteration's backward did so. Where ``.grad`` is
        the bucket (``as_view``), that all-reduce wrote its average into it,
        maybe after the caller zeroed it (``zero_grad(set_to_none=False)``):
        the bucket is zeroed, as the caller left it (the retried step's
        gradients were 4.9e-2 off).
        """
        launched = self._work is not None
        if self._work is not None and not self._work.is_completed():
            try:
                self._work.wait()
            except RuntimeError as error:
                raise RuntimeError(
                    f"DataParallel: the all-reduce of {self.describe()} that the last "
                    f"backward, which failed, left in flight did not complete ({error}): "
                    "the replicas' backwards failed at different points; a replica whose "
                    "step fails must stop every replica"
                ) from error
        if abandoned and launched and self._as_view:
            with torch.no_grad():
                self.flat.zero_()
        self._pending = len(self.params)
        self._work = None

    @torch.no_grad()
    def load(self, slot: int) -> None:
        """Put parameter `slot`'s final gradient, divided by the world size, in its slot."""
        param, view = self.params[slot], self._slots[slot]
        grad = param.grad
        if grad is None:
            view.zero_()
        elif grad.data_ptr() == view.data_ptr():
            view.mul_(self._scale)
        else:
            torch.mul(grad, self._scale, out=view)
            if self._as_view:
                # The optimizer's zero_grad(set_to_none=True) dropped the view,
                # so autograd stored a fresh tensor: point .grad back at the slot.
                param.grad = view
        if self._used is not None:
            self._used[slot] = 0.0 if grad is None else 1.0
        self._pending -= 1

    def launch(self, group: dist.ProcessGroup) -> None:
        """Start the asynchronous all-reduce that turns the bucket into the average."""
        with record_function(f"dp.allreduce[bucket={self.index}]"):
            self._work = dist.all_reduce(self.flat, group=group, async_op=True)

    @property
    def launched(self) -> bool:
        """Whether this iteration's all-reduce has been started."""
        return self._work is not None

    def wait(self) -> None:
        """Block until the all-reduce is done (bounded by the process group's timeout)."""
        assert self._work is not None, "wait() before launch()"
        with record_function(f"dp.wait[bucket={self.index}]"):
            self._work.wait()

    @torch.no_grad()
    def store(self) -> bool:
        """Hand every parameter that any rank used its averaged gradient; False if none was used."""
        used = self._used.tolist() if self._used is not None else [1.0] * len(self.params)
        for param, view, flag in zip(self.params, self._slots, used, strict=True):
            if flag == 0.0:
                continue
            if self._as_view:
                param.grad = view
            elif param.grad is None:
                param.grad = view.clone()
            else:
                param.grad.copy_(view)
        return any(flag != 0.0 for flag in used)

    @torch.no_grad()
    def _adopt_existing_grads(self) -> None:
        """Move gradients that already exist into their slots, and make `.grad` the slot."""
        for param, view in zip(self.params, self._slots, strict=True):
            if param.grad is not None:
                view.copy_(param.grad)
                param.grad = view
