"""The driver: runs micro-batches through the partitions, clock cycle by clock cycle.

Each clock cycle has two phases, both issued from the caller's thread:

- fence: draw the autograd edges that order the backward pass (``depend``)
  and move each micro-batch to the device of the partition it enters
  (``Copy``/``Wait`` on copy streams);
- compute: hand every task of the cycle to its partition's worker thread and
  collect the results. A task that raises does not stop the others of its
  cycle; once all have answered, the first exception is re-raised here with
  its original traceback and a note naming the task. An interrupt (Ctrl-C)
  is re-raised once the cycle's tasks have ended too, so that none of them
  writes a buffer (BatchNorm statistics) after the call has raised.

A task runs its partition under the caller's thread state, on the
partition's compute stream, with its random draws seeded (``pipeline/runtime/rng.py``), and
checkpointed (``checkpoint.py``) when its micro-batch is below the
checkpoint stop.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
from torch import nn

from pipeline.clock.checkpoint import Checkpointing, Function, protected, starts_in_place
from pipeline.clock.completion import Arrival, Hook, PartitionCompletion
from pipeline.clock.copy import Copy, Wait
from pipeline.clock.cycles import clock_cycles
from pipeline.clock.dependency import depend
from pipeline.clock.skips import start_step
from pipeline.runtime import rng
from pipeline.runtime.batchnorm import deferring_batch_norm
from pipeline.runtime.buffers import PartitionBuffers
from pipeline.runtime.microbatch import Batch, Value
from pipeline.runtime.stream import Stream, current_stream, new_stream, use_stream
from pipeline.runtime.threadstate import ThreadState
from pipeline.runtime.worker import Failure, Replies, Worker, add_note
from pipeline.skip.layout import SkipLayout
from pipeline.trace.recording import span, traced

__all__ = ["Pipeline", "call_partition"]


class Pipeline:
    """Runs a GPipe schedule over partitions, each with its own worker thread.

    ``positional``: a tuple reaches a partition as positional arguments
    (``partition(*value)``) instead of as one argument.
    """

    def __init__(
        self,
        partitions: list[nn.Sequential],
        devices: list[torch.device],
        workers: list[Worker],
        skip_layout: SkipLayout | None = None,
        *,
        positional: bool = False,
        deferred_batch_norm: bool = False,
    ) -> None:
        self.partitions = partitions
        self.devices = devices
        self.workers = workers
        self.skip_layout = skip_layout
        self.positional = positional
        self.deferred_batch_norm = deferred_batch_norm
        self.buffers = [PartitionBuffers(p, j) for j, p in enumerate(partitions)]
        self.protect_inputs = [starts_in_place(p) for p in partitions]
        self.copy_streams: list[list[Stream]] = [[] for _ in partitions]
        # Held by each forward and each recomputation: one thread at a time
        # runs the partitions and touches their buffers.
        self.lock = threading.RLock()

    def run(
        self,
        batches: list[Batch],
        checkpoint_stop: int,
        completion_hooks: list[Hook],
        rows: int,
    ) -> None:
        """Run every micro-batch through every partition, in place in ``batches``.

        ``completion_hooks`` are called with ``j`` during backward once
        partition ``j``'s gradients are final (see ``completion.py``);
        ``rows`` is the mini-batch size, for error notes.
        """
        step = _Step(self, batches, checkpoint_stop, completion_hooks, rows)
        for schedule in clock_cycles(len(batches), len(self.partitions)):
            step.fence(schedule)
            step.compute(schedule)

    def copy_streams_for(self, m: int) -> list[list[Stream]]:
        """One copy stream per (partition, micro-batch), made once and reused."""
        for device, streams in zip(self.devices, self.copy_streams, strict=True):
            while len(streams) < m:
                streams.append(new_stream(device))
        return self.copy_streams


class _Step:
    """The state of one forward pass through the pipeline."""

    def __init__(
        self,
        pipeline: Pipeline,
        batches: list[Batch],
        checkpoint_stop: int,
        completion_hooks: list[Hook],
        rows: int,
    ) -> None:
        self.pipeline = pipeline
        self.batches = batches
        self.checkpoint_stop = checkpoint_stop
        self.rows = rows
        self.sizes = [b.rows() for b in batches]
        self.state = ThreadState.capture()
        self.compute_streams = [current_stream(d) for d in pipeline.devices]
        self.copy_streams = pipeline.copy_streams_for(len(batches))
        self.seeds = rng.StepSeeds()
        self.completions = self._completions(completion_hooks)
        self.skips = start_step(pipeline.skip_layout, len(batches))

    def _completions(self, hooks: list[Hook]) -> list[PartitionCompletion | None]:
        """A completion counter per partition whose inputs all carry gradients."""
        if not (hooks and torch.is_grad_enabled()):
            return [None] * len(self.pipeline.partitions)
        m = len(self.batches)
        first_observable = all(_carrier(b) is not None for b in self.batches)
        observable = [first_observable] + [True] * (len(self.pipeline.partitions) - 1)
        return [PartitionCompletion(j, m, hooks) if ok else None for j, ok in enumerate(observable)]

    def fence(self, schedule: list[tuple[int, int]]) -> None:
        batches, devices = self.batches, self.pipeline.devices
        for i, j in schedule:
            # Partition 0's inputs are left alone: a phony edge there would
            # make them require grad and cost an extra input gradient.
            if i > 0 and j > 0:
                _depend(batches[i - 1], batches[i])
            if j > 0 and devices[j] != devices[j - 1]:
                with span("copy", i, j):
                    self._copy(batches[i], i, j)
            if self.skips is not None:
                self.skips.fence(i, j, batches[i], partial(self._move, i))

    def _copy(self, batch: Batch, i: int, j: int) -> None:
        batch.leaves[:] = self._move(i, batch.leaves, j - 1, j)

    def _move(self, i: int, values: list[Any], source: int, target: int) -> list[Any]:
        """Copy micro-batch ``i``'s values from partition ``source``'s device to ``target``'s."""
        prev_copy, next_copy = self.copy_streams[source][i], self.copy_streams[target][i]
        prev_compute, next_compute = self.compute_streams[source], self.compute_streams[target]
        values = Wait.apply(prev_compute, prev_copy, *values)
        values = Copy.apply(prev_copy, next_copy, *values)
        return list(Wait.apply(next_copy, next_compute, *values))

    def compute(self, schedule: list[tuple[int, int]]) -> None:
        workers = self.pipeline.workers
        replies = Replies()
        for i, j in schedule:
            workers[j].submit(partial(self._task, i, j), replies)
        failure: Failure | None = None
        for result in replies.collect(len(schedule)):
            if isinstance(result, Failure):
                failure = failure or result
            else:
                i, batch = result
                self.batches[i] = batch
        if failure is not None:
            raise failure.exception

    def _task(self, i: int, j: int) -> tuple[int, Batch]:
        """Run partition ``j`` on micro-batch ``i`` (on partition ``j``'s worker)."""
        try:
            return i, self._run(i, j)
        except BaseException as exception:
            add_note(exception, self._where(i, j))
            raise

    def _run(self, i: int, j: int) -> Batch:
        pipeline = self.pipeline
        function: Function = partial(call_partition, pipeline, j)
        if self.skips is not None:
            function = self.skips.bind(i, function)
        function = traced(function, i, j)
        randomness = rng.TaskRandomness(self.seeds, i, j)
        self._mark_arrival(i, j)
        batch = self.batches[i]
        with (
            self.state.applied(pipeline.devices[j]),
            use_stream(self.compute_streams[j]),
            randomness.drawing(),
        ):
            if i < self.checkpoint_stop:
                chk = Checkpointing(
                    function,
                    partial(self._recompute_context, j, randomness),
                    pipeline.buffers[j],
                    protect_inputs=pipeline.protect_inputs[j],
                )
                output = chk.checkpoint(batch)
            else:
                if j == 0 and pipeline.protect_inputs[0]:
                    batch = protected(batch)  # never write into the caller's input
                output = batch.call(function)
        _check_output(output, j)
        return output

    @contextmanager
    def _recompute_context(self, j: int, randomness: rng.TaskRandomness) -> Iterator[None]:
        """What task (i, j)'s recomputation runs under, on the thread running backward."""
        with (
            self.pipeline.lock,
            self.state.autocast_applied(self.pipeline.devices[j]),
            use_stream(self.compute_streams[j]),
            randomness.replaying(),
        ):
            yield

    def _where(self, i: int, j: int) -> str:
        return (
            f"(raised in partition {j} on {self.pipeline.devices[j]}, micro-batch {i} of "
            f"{len(self.batches)}: the Pipe split {self.rows} rows into micro-batches of "
            f"{self.sizes} rows)"
        )

    def _mark_arrival(self, i: int, j: int) -> None:
        completion = self.completions[j]
        if completion is None:
            return
        batch = self.batches[i]
        carrier = _carrier(batch)
        if carrier is None:
            # Some micro-batch carries no gradient here: the partition's
            # completion cannot be observed, so it is never signalled.
            self.completions[j] = None
            return
        batch[carrier] = Arrival.apply(batch[carrier], completion)


def _carrier(batch: Batch) -> int | None:
    """The index of a tensor of ``batch`` that will receive a gradient, if any."""
    index = batch.first_differentiable()
    if index is None or not batch[index].requires_grad:
        return None
    return index


def call_partition(pipeline: Pipeline, j: int, value: Value) -> Value:
    """Run partition ``j`` on ``value``, with the Pipe's call style and BatchNorm deferral."""
    partition = pipeline.partitions[j]
    with deferring_batch_norm(pipeline.deferred_batch_norm):
        if pipeline.positional and type(value) is tuple:
            return partition(*value)
        return partition(value)


def _check_output(output: Batch, j: int) -> None:
    if not any(True for _ in output.tensor_indices()):
        kind = type(output.value).__name__
        raise TypeError(
            f"partition {j} returned {kind}, which holds no tensor; a partition must return "
            "a tensor, or tuples, lists or dicts holding tensors, since that is what the "
            "next partition (or the Pipe's output) receives"
        )


def _depend(before: Batch, after: Batch) -> None:
    if not torch.is_grad_enabled():
        return  # fork and join draw no edge without grad; skip finding their carriers
    a, b = before.first_differentiable(), after.first_differentiable()
    if a is not None and b is not None:
        before[a], after[b] = depend(before[a], after[b])
