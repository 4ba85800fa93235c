"""Activation checkpointing: drop a task's activations in forward, recompute them in backward.

A checkpointed task runs its partition under torch's non-reentrant
checkpointing (``torch.utils.checkpoint``, ``use_reentrant=False``): the
forward builds the autograd graph as usual, but every tensor that graph
would save is replaced by a handle. When backward first needs one of them,
the partition runs again on the inputs the forward saw and the handles are
filled from that recomputation::

    forward:   input --> [partition, saved tensors dropped] --> output
                 |  (kept)
    backward:    +------> recompute partition --> saved tensors --> gradients

Because the graph is the forward's own, every autograd entry point works as
on the plain model: ``torch.autograd.grad`` with respect to inputs or
parameters, ``backward(inputs=...)``, ``create_graph=True``, and
``retain_graph=True`` (each backward recomputes). Recomputation replays what
the forward saw: the same random draws (``pipeline/runtime/rng.py``), the
same buffers (``pipeline/runtime/buffers.py``), the same autocast state, and
an in-place first layer gets a copy of the input each time.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.utils.checkpoint
from torch import Tensor

from pipeline.runtime.buffers import PartitionBuffers
from pipeline.runtime.microbatch import Batch, Value
from pipeline.runtime.partitions import PartitionCall, protected
from pipeline.runtime.phase import is_checkpointing, is_recomputing, phase

__all__ = [
    "Checkpointing",
    "check_inputs_unchanged",
    "input_versions",
    "is_checkpointing",
    "is_recomputing",
]


class Checkpointing:
    """Checkpoints one task: ``checkpoint()`` runs its forward, backward calls back to recompute.

    ``recompute_context`` re-enters what the forward ran under (random
    draws, autocast, stream); ``buffers`` replays the buffers it changed.
    """

    def __init__(
        self,
        function: PartitionCall,
        recompute_context: Callable[[], AbstractContextManager[None]],
        buffers: PartitionBuffers,
        *,
        protect_inputs: bool,
    ) -> None:
        self.function = function
        self.recompute_context = recompute_context
        self.buffers = buffers
        self.protect_inputs = protect_inputs
        self.spec: Any = None
        self.snapshot: Any = None
        self.forward_done = False

    def checkpoint(self, batch: Batch) -> Batch:
        """Run the function on ``batch``, keeping its inputs instead of its activations."""
        self.spec = batch.spec
        versions = input_versions(batch)
        self.snapshot = self.buffers.before_forward()
        with phase("checkpointing"):
            # Random draws are replayed by the task's own seeds; and the whole
            # partition runs again (no early stop), so that recomputation is
            # one predictable replay of the forward.
            output = torch.utils.checkpoint.checkpoint(
                self._run,
                *batch.leaves,
                use_reentrant=False,
                preserve_rng_state=False,
                early_stop=False,
            )
        self.forward_done = True
        check_inputs_unchanged(versions, self.buffers.index)
        self.buffers.after_forward(self.snapshot)
        return Batch(output)

    def _run(self, *leaves: Any) -> Value:
        if not self.forward_done:
            return self._call(leaves)
        with (
            self.recompute_context(),
            self.buffers.replayed(self.snapshot),
            phase("checkpointing", False),
            phase("recomputing"),
        ):
            return self._call(leaves)

    def _call(self, leaves: tuple[Any, ...]) -> Value:
        batch = Batch.of(list(leaves), self.spec)
        if self.protect_inputs:
            batch = protected(batch)
        return self.function(batch.value)


def input_versions(batch: Batch) -> list[tuple[Tensor, int]]:
    """The version counters of ``batch``'s tensors, to tell later if a layer wrote into them.

    Inference tensors have none (and cannot be written outside inference
    mode); saving them for backward fails with torch's own clear error.
    """
    return [(x, x._version) for x in batch.leaves if isinstance(x, Tensor) and not x.is_inference()]


def check_inputs_unchanged(versions: list[tuple[Tensor, int]], partition: int) -> None:
    """Refuse a checkpointed forward that wrote into its inputs: recomputation needs them."""
    if any(x._version != version for x, version in versions):
        raise RuntimeError(
            f"checkpointed partition {partition} modified its input in place, so "
            "recomputation would start from the modified values; give its first layer an "
            "attribute inplace=True (the Pipe then hands it a copy), make that layer "
            "out-of-place, or use checkpoint='never'"
        )
