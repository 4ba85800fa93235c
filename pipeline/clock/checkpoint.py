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
the forward saw (``pipeline/runtime/recompute.py``): the same random draws,
the same buffers, the same autocast state, and an in-place first layer gets
a copy of the input each time.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils.checkpoint

from pipeline.runtime.microbatch import Batch, Value
from pipeline.runtime.partitions import PartitionCall, protected
from pipeline.runtime.recompute import Recomputation
from pipeline.runtime.rng import own_checkpoint

__all__ = ["Checkpointing"]


class Checkpointing:
    """Checkpoints one task: ``checkpoint()`` runs its forward, backward calls back to recompute.

    ``recomputation`` keeps what the forward saw (buffers, inputs) and
    re-enters it for the replay (random draws, autocast, stream, buffers).
    """

    def __init__(
        self,
        function: PartitionCall,
        recomputation: Recomputation,
        *,
        protect_inputs: bool,
    ) -> None:
        self.function = function
        self.recomputation = recomputation
        self.protect_inputs = protect_inputs
        self.spec: Any = None
        self.forward_done = False

    def checkpoint(self, batch: Batch) -> Batch:
        """Run the function on ``batch``, keeping its inputs instead of its activations."""
        self.spec = batch.spec
        with self.recomputation.checkpointed(batch):
            # Random draws are replayed by the task's own seeds; and the whole
            # partition runs again (no early stop), so that recomputation is
            # one predictable replay of the forward.
            try:
                output = torch.utils.checkpoint.checkpoint(
                    self._run,
                    *batch.leaves,
                    use_reentrant=False,
                    preserve_rng_state=False,
                    early_stop=False,
                )
            except _StoppedError as stopped:
                raise stopped.error from None
            self.forward_done = True
        return Batch(output)

    def _run(self, *leaves: Any) -> Value:
        if not self.forward_done:
            with own_checkpoint():
                try:
                    return self._call(leaves)
                except StopIteration as error:
                    # torch's checkpoint runs the forward inside a generator, which would
                    # make it "RuntimeError: generator raised StopIteration" (PEP 479).
                    raise _StoppedError(error) from error
        with self.recomputation.replaying():
            return self._call(leaves)

    def _call(self, leaves: tuple[Any, ...]) -> Value:
        batch = Batch.of(list(leaves), self.spec)
        if self.protect_inputs:
            batch = protected(batch)
        return self.function(batch.value)


class _StoppedError(Exception):
    """A layer's StopIteration, carried through torch's checkpoint to be raised as it was."""

    def __init__(self, error: StopIteration) -> None:
        super().__init__(str(error))
        self.error = error
