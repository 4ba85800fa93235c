"""The partitions as both engines run them: devices, buffers, call style, BN deferral, a lock.

``pipe(x)`` (``pipeline/clock/``) and ``step`` (``pipeline/step/``) run
partition ``j`` on a value through ``PartitionRuntime.call(j, value)``: with
the pipe's call style (a tuple as positional arguments, or as one value) and
its DeferredBatchNorm layers deferring their statistics. The runtime also
keeps what running the partitions needs from one pass to the next: each
partition's buffers as recomputation replays them (``buffers.py``), whether
its first layer writes into its input, how its random draws are replayed
(``ownership.py``), the parameters tied across devices that it lends
(``borrowed.py``), and the lock under which one thread at a time runs the
partitions.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Literal

import torch
from torch import Tensor, nn

from pipeline.runtime.aliases import (
    raise_shared_written,
    refuse_written,
    sharing_groups,
    versions_at,
)
from pipeline.runtime.batchnorm import deferring_batch_norm
from pipeline.runtime.borrowed import find_loans
from pipeline.runtime.buffers import PartitionBuffers, check_shared_kept, shared_buffers
from pipeline.runtime.microbatch import (
    Arguments,
    Batch,
    Value,
    refuse_attributes_in,
    shared_leaves,
)
from pipeline.runtime.ownership import holds_compiled, holds_generator, randomness_plans
from pipeline.runtime.rng import PartitionRandomness

__all__ = [
    "Hook",
    "KeywordSequential",
    "PartitionCall",
    "PartitionRuntime",
    "PositionalSequential",
    "call_style_of",
    "protected",
    "starts_in_place",
]

# Called with j once partition j's gradients are final (register_partition_backward_hook).
Hook = Callable[[int], None]
# A partition's call on the value of one micro-batch.
PartitionCall = Callable[[Value], Value]


class PartitionRuntime:
    """The partitions of one pipe and what running them needs.

    ``partitions[j]`` runs on ``devices[j]``. ``positional``: a tuple reaches a
    partition as positional arguments (``partition(*value)``).
    ``deferred_batch_norm``: DeferredBatchNorm layers defer their statistics
    to the end of the pass (set for each pass: ``PipeBase._one_pass``).
    """

    def __init__(
        self,
        partitions: list[nn.Sequential],
        devices: list[torch.device],
        *,
        positional: bool,
    ) -> None:
        self.partitions = partitions
        self.devices = devices
        self.positional = positional
        self.deferred_batch_norm = False
        self.buffers = [PartitionBuffers(p, j) for j, p in enumerate(partitions)]
        # By partition: its buffers another partition (or a stage elsewhere) holds too.
        self.shared_buffers = shared_buffers(partitions)
        self.protect_inputs = [starts_in_place(p) for p in partitions]
        self.loans = find_loans(partitions, devices)
        # Held by each forward pass, each recomputation and each Pipe.step:
        # one thread at a time runs the partitions and touches their buffers.
        self.lock = threading.RLock()
        self._shared: list[tuple[Tensor, int]] = []
        # By partition: the groups of its output's leaves whose memory overlaps.
        self._sharing: dict[int, list[frozenset[int]]] = {}

    def __len__(self) -> int:
        return len(self.partitions)

    def randomness(self, stages_by_worker: list[list[int]]) -> list[PartitionRandomness]:
        """How each partition draws when ``stages_by_worker[w]`` lists those worker ``w`` runs.

        Read from the partitions as they are now, at each run: a layer
        compiled in place (``pipe[k].compile()``) or a generator given to a
        layer after the pipe was built changes how its partition must draw.
        """
        return randomness_plans(
            self.devices,
            stages_by_worker,
            [holds_generator(p) for p in self.partitions],
            [holds_compiled(p) for p in self.partitions],
        )

    def call(self, j: int, value: Value) -> Value:
        """Run partition ``j`` on ``value``, with the pipe's call style and BatchNorm deferral."""
        partition = self.partitions[j]
        sharing = self._sharing.get(j - 1)
        noted = versions_at(value, sharing) if sharing else []
        held = self.shared_buffers.get(j)
        if held:
            buffers = dict(partition.named_buffers(remove_duplicate=False))
            versions = [buffers[name]._version for name in held]
        with deferring_batch_norm(self.deferred_batch_norm), self.loans.lent(j):
            if type(value) is Arguments:
                output = value.call(partition)
            elif self.positional and type(value) is tuple:
                output = partition(*value)
            else:
                output = partition(value)
        if self._shared:
            self._check_shared(j)
        if noted:
            refuse_written(j, noted)
        if held:
            check_shared_kept(j, partition, held, versions)
        if j < len(self.partitions) - 1:
            refuse_attributes_in(output, f"partition {j}'s output", "the next partition's input")
            self._note_sharing(j, output)
        return output

    def _note_sharing(self, j: int, output: Value) -> None:
        """Note where partition ``j`` returned tensors sharing memory (``aliases.py``)."""
        found = sharing_groups(output)
        if not found:
            return
        if self.protect_inputs[j + 1] and not len(self.partitions[j + 1]):
            # In another process (a DistributedPipe's), which cannot see the groups: its
            # first layer writes into a copy of what it receives.
            raise_shared_written(j + 1, "starts with a layer that writes into its input")
        self.note_sharing(j, found)

    def sharing(self, j: int) -> list[frozenset[int]]:
        """The groups of partition ``j``'s output leaves seen sharing memory so far."""
        return list(self._sharing.get(j, ()))

    def note_sharing(self, j: int, groups: list[frozenset[int]]) -> None:
        """Note ``groups`` of partition ``j``'s output leaves as sharing memory: seen here,
        or by the process that ran partition ``j`` (told in its message)."""
        known = self._sharing.setdefault(j, [])
        known += [g for g in groups if g not in known]

    @contextmanager
    def watching(self, batches: list[Batch]) -> Iterator[None]:
        """Around a pass over ``batches``: a partition that writes into a tensor every
        micro-batch holds (a ``NoChunk`` input) fails at once."""
        self._shared = [(t, t._version) for t in shared_leaves(batches)]
        try:
            yield
        finally:
            self._shared = []

    def _check_shared(self, j: int) -> None:
        for tensor, version in self._shared:
            if tensor._version != version:
                raise RuntimeError(
                    f"partition {j} wrote in place into a tensor that every micro-batch is "
                    f"given whole (a NoChunk input of shape {tuple(tensor.shape)}): the write "
                    "would be made once per micro-batch, where the plain model makes it once; "
                    "write into a copy (tensor.clone()) inside the layer"
                )


class KeywordSequential(nn.Sequential):
    """An ``nn.Sequential`` whose first layer is called as it is, keyword arguments included.

    A partition of the ``'tuple'`` call style: ``partition(x)`` is
    ``nn.Sequential``'s call, and ``partition(x, mask=m)`` calls the first
    layer with ``(x, mask=m)``; each later layer gets the previous output.
    """

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        layers = iter(self)
        value = next(layers)(*args, **kwargs)
        for layer in layers:
            value = layer(value)
        return value


class PositionalSequential(nn.Sequential):
    """An ``nn.Sequential`` that passes a tuple to the next layer as positional arguments.

    The plain model that a Pipe with ``call_style='positional'`` equals
    (``torch.distributed.pipeline.sync.Pipe``'s convention); keyword
    arguments go to the first layer::

        model = PositionalSequential(Split(), Add())   # Split returns (a, b); Add(a, b)
        model(x)

    The first layer takes the arguments as they came: ``model(a, b)`` calls
    it as ``layer(a, b)`` and ``model((a, b))`` as ``layer((a, b))``.
    """

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        # As torch's PipeSequential: the first layer takes the arguments as
        # they came, so one tuple stays one argument; the keywords are its.
        value: Any = inputs
        first = kwargs
        for layer in self:
            value = layer(*value, **first) if type(value) is tuple else layer(value, **first)
            first = {}
        return value


def protected(batch: Batch) -> Batch:
    """A copy of ``batch`` whose tensors a layer may write into without touching the originals."""
    return Batch.of([x.clone() if isinstance(x, Tensor) else x for x in batch.leaves], batch.spec)


def starts_in_place(partition: nn.Sequential) -> bool:
    """Whether the first layer of ``partition`` declares that it writes into its input."""
    first: nn.Module = partition
    while isinstance(first, nn.Sequential) and len(first) > 0:
        first = first[0]
    return getattr(first, "inplace", False) is True


def call_style_of(model: nn.Module) -> Literal["tuple", "positional"]:
    """The call style a Pipe of ``model`` takes to run its layers as ``model`` does: a
    ``PositionalSequential`` spreads a tuple into the next layer's arguments."""
    return "positional" if isinstance(model, PositionalSequential) else "tuple"
