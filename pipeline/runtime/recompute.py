"""Recomputation: what a checkpointed task's forward keeps, and what its recomputation runs under.

Both engines checkpoint a task the same way around the partition's call:
``pipe(x)`` under torch's checkpointing (``pipeline/clock/checkpoint.py``), a
stage of ``Pipe.step`` without grad (``pipeline/step/stage.py``)::

    forward:    note the inputs' and parameters' versions, snapshot the
                buffers -> run -> refuse inputs written in place, keep the
                changed buffers
    recompute:  refuse parameters written in place since (an optimizer step
                before the backward: the plain model's backward refuses it);
                the caller's autocast and device, the task's stream, the same
                random draws, the buffers as the forward saw them -> run again
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from pipeline.runtime.buffers import BufferSnapshot, PartitionBuffers
from pipeline.runtime.microbatch import Batch
from pipeline.runtime.phase import phase
from pipeline.runtime.rng import TaskRandomness
from pipeline.runtime.stream import Stream, use_stream
from pipeline.runtime.threadstate import ThreadState

if TYPE_CHECKING:
    from pipeline.arguments import CheckpointMode

__all__ = ["Recomputation", "checkpoint_stop"]


class Recomputation:
    """One checkpointed task: the prologue and epilogue of its forward, and its replay.

    ``lock`` is held around the replay by ``pipe(x)``, whose recomputation runs in
    the caller's backward after the forward let the lock go; a stage of
    ``Pipe.step`` replays inside the step, whose caller holds it already (None).
    """

    def __init__(
        self,
        randomness: TaskRandomness,
        buffers: PartitionBuffers,
        state: ThreadState,
        device: torch.device,
        stream: Stream,
        lock: AbstractContextManager[Any] | None,
    ) -> None:
        self.randomness = randomness
        self.buffers = buffers
        self.state = state
        self.device = device
        self.stream = stream
        self.lock = lock
        self.snapshot: BufferSnapshot | None = None
        self.parameters: list[tuple[Tensor, int]] = []

    @contextmanager
    def checkpointed(self, inputs: Batch) -> Iterator[None]:
        """Around the task's forward: keep what recomputation needs; refuse input writes."""
        versions = _input_versions(inputs)
        # Names only on a refusal: this runs for every checkpointed micro-batch.
        self.parameters = [(p, p._version) for p in self.buffers.partition.parameters()]
        self.snapshot = self.buffers.before_forward()
        with phase("checkpointing"):
            yield
        _check_inputs_unchanged(versions, self.buffers.index)
        self.buffers.after_forward(self.snapshot)

    @contextmanager
    def replaying(self) -> Iterator[None]:
        """What the recomputation runs under: what the forward ran under, and its buffers."""
        assert self.snapshot is not None, "replaying() follows checkpointed()"
        _check_parameters_unchanged(self.parameters, self.buffers)
        if self.lock is not None:
            # pipe(x) replays after its call returned, where what the call swapped in
            # (torch.func.functional_call) is gone; a step replays within its call, where
            # FSDP2 units swap their own parameters between forward and backward.
            _check_same_tensors(self.parameters, self.snapshot, self.buffers)
        with (
            self.lock if self.lock is not None else contextlib.nullcontext(),
            self.state.autocast_applied(self.device),
            use_stream(self.stream),
            self.randomness.replaying(),
            self.buffers.replayed(self.snapshot),
            phase("checkpointing", False),
            phase("recomputing"),
        ):
            yield


def checkpoint_stop(mode: CheckpointMode, m: int, training: bool) -> int:
    """Micro-batches with an index below this one are checkpointed (none outside training).

    >>> checkpoint_stop("except_last", 4, training=True)
    3
    >>> checkpoint_stop("always", 4, training=False)
    0
    """
    if not (training and torch.is_grad_enabled()):
        return 0
    return {"always": m, "except_last": m - 1, "never": 0}[mode]


def _input_versions(batch: Batch) -> list[tuple[Tensor, int]]:
    """The version counters of ``batch``'s tensors, to tell later if a layer wrote into them.

    Inference tensors have none (and cannot be written outside inference
    mode); saving them for backward fails with torch's own clear error.
    """
    return [(x, x._version) for x in batch.leaves if isinstance(x, Tensor) and not x.is_inference()]


def _check_inputs_unchanged(versions: list[tuple[Tensor, int]], partition: int) -> None:
    """Refuse a checkpointed forward that wrote into its inputs: recomputation needs them."""
    if any(x._version != version for x, version in versions):
        raise RuntimeError(
            f"checkpointed partition {partition} modified its input in place, so "
            "recomputation would start from the modified values; give its first layer an "
            "attribute inplace=True (the Pipe then hands it a copy), make that layer "
            "out-of-place, or use checkpoint='never'"
        )


def _check_same_tensors(
    parameters: list[tuple[Tensor, int]], snapshot: BufferSnapshot, buffers: PartitionBuffers
) -> None:
    """Refuse to recompute with other parameters, or other buffers among those the forward
    left alone, than the forward's: ``torch.func.functional_call`` swaps in the tensors it
    is given for the call only, and puts the module's own back before the backward."""
    now = list(buffers.partition.named_parameters())
    swapped = [n for (n, p), (q, _) in zip(now, parameters, strict=False) if p is not q]
    if len(now) == len(parameters) and not swapped:
        current = dict(buffers.partition.named_buffers())
        swapped = [
            name
            for name, (ident, _) in snapshot.versions.items()
            if name not in snapshot.values and id(current.get(name)) != ident
        ]
    if swapped or len(now) != len(parameters):
        changed = swapped[0] if swapped else "(the parameters themselves)"
        raise RuntimeError(
            f"'{changed}' of checkpointed partition {buffers.index} is not the tensor its "
            "forward used (torch.func.functional_call gives the module other tensors for the "
            "call only, or it was replaced since), so its recomputation in the backward would "
            "compute the gradient of another weight; use checkpoint='never' for such calls"
        )


def _check_parameters_unchanged(
    versions: list[tuple[Tensor, int]], buffers: PartitionBuffers
) -> None:
    """Refuse to recompute with parameters written in place since the forward.

    The plain model's backward refuses it (a saved weight "modified by an
    inplace operation"); recomputed, the gradient would be the new weights'.
    """
    written = next((p for p, version in versions if p._version != version), None)
    if written is not None:
        found = (n for n, p in buffers.partition.named_parameters() if p is written)
        changed = next(found, f"of shape {tuple(written.shape)}")
        raise RuntimeError(
            f"parameter '{changed}' of checkpointed partition {buffers.index} was modified by an "
            "inplace operation since its forward began (an optimizer step or a weight update "
            "before backward(), or a layer updating its own parameter in its forward, as an "
            "EMA does), so its recomputation would not be the forward that ran; run backward "
            "before changing the parameters, keep such state in a buffer, or use "
            "checkpoint='never'"
        )
