"""The driver: runs micro-batches through the partitions, clock cycle by clock cycle.

Each clock cycle has two phases, both issued from the caller's thread:

- fence: draw the autograd edges that order the backward pass (``depend``)
  and move each micro-batch to the device of the partition it enters
  (``Copy``/``Wait`` on copy streams);
- compute: hand every task of the cycle to its partition's worker thread and
  collect the results. A task that raises does not stop the others of its
  cycle; once all have answered, the first exception is re-raised here with
  its original traceback.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from functools import partial
from typing import Any

import torch
from torch import nn

from pipeline import rng
from pipeline.checkpoint import Checkpointing, Function, starts_in_place
from pipeline.completion import Arrival, Hook, PartitionCompletion
from pipeline.copy import Copy, Wait
from pipeline.dependency import depend
from pipeline.microbatch import Batch, TensorOrValues
from pipeline.schedule import clock_cycles
from pipeline.skip.layout import SkipLayout
from pipeline.skip.step import start_step
from pipeline.stream import Stream, current_stream, new_stream, use_stream
from pipeline.threadstate import ThreadState
from pipeline.trace import span, traced
from pipeline.worker import Failure, Worker

__all__ = ["Pipeline"]


class Pipeline:
    """Runs a GPipe schedule over partitions, each with its own worker thread."""

    def __init__(
        self,
        partitions: list[nn.Sequential],
        devices: list[torch.device],
        workers: list[Worker],
        skip_layout: SkipLayout | None = None,
    ) -> None:
        self.partitions = partitions
        self.devices = devices
        self.workers = workers
        self.skip_layout = skip_layout
        self.random_layers = [rng.may_draw_random(p) for p in partitions]
        for partition in partitions:
            rng.install_seeding(partition)
        self.protect_inputs = [starts_in_place(p) for p in partitions]
        self.copy_streams: list[list[Stream]] = [[] for _ in partitions]

    def run(self, batches: list[Batch], checkpoint_stop: int, completion_hooks: list[Hook]) -> None:
        """Run every micro-batch through every partition, in place in ``batches``.

        ``completion_hooks`` are called with ``j`` during backward once
        partition ``j``'s gradients are final (see ``completion.py``).
        """
        step = _Step(self, batches, checkpoint_stop, completion_hooks)
        for schedule in clock_cycles(len(batches), len(self.partitions)):
            step.fence(schedule)
            step.compute(schedule)

    def copy_streams_for(self, m: int) -> list[list[Stream]]:
        """One copy stream per (partition, micro-batch), made once and reused."""
        for device, streams in zip(self.devices, self.copy_streams, strict=True):
            while len(streams) < m:
                streams.append(new_stream(device))
        return self.copy_streams

    def seeds_for_random_partitions(self) -> list[int | None]:
        """Per partition, a base seed if it may draw random numbers now, else None."""
        active = [any(m.training for m in layers) for layers in self.random_layers]
        if not any(active):
            return [None] * len(active)
        base = rng.draw_base_seed()
        return [base if a else None for a in active]


class _Step:
    """The state of one forward pass through the pipeline."""

    def __init__(
        self,
        pipeline: Pipeline,
        batches: list[Batch],
        checkpoint_stop: int,
        completion_hooks: list[Hook],
    ) -> None:
        self.pipeline = pipeline
        self.batches = batches
        self.checkpoint_stop = checkpoint_stop
        self.state = ThreadState.capture()
        self.compute_streams = [current_stream(d) for d in pipeline.devices]
        self.copy_streams = pipeline.copy_streams_for(len(batches))
        self.seeds = pipeline.seeds_for_random_partitions()
        self.completions = self._completions(completion_hooks)
        self.skips = start_step(pipeline.skip_layout, len(batches), checkpoint_stop)

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
        batch.values[:] = self._move(i, batch.values, j - 1, j)

    def _move(self, i: int, values: list[Any], source: int, target: int) -> list[Any]:
        """Copy micro-batch ``i``'s values from partition ``source``'s device to ``target``'s."""
        prev_copy, next_copy = self.copy_streams[source][i], self.copy_streams[target][i]
        prev_compute, next_compute = self.compute_streams[source], self.compute_streams[target]
        values = Wait.apply(prev_compute, prev_copy, *values)
        values = Copy.apply(prev_copy, next_copy, *values)
        return list(Wait.apply(next_copy, next_compute, *values))

    def compute(self, schedule: list[tuple[int, int]]) -> None:
        workers = self.pipeline.workers
        for i, j in schedule:
            workers[j].submit(self, partial(self._task, i, j))
        failure: Failure | None = None
        for i, j in schedule:
            result = workers[j].result(self)
            if isinstance(result, Failure):
                failure = failure or result
            else:
                self.batches[i] = result
        if failure is not None:
            raise failure.exception

    def _task(self, i: int, j: int) -> Batch:
        """Run partition ``j`` on micro-batch ``i`` (on partition ``j``'s worker)."""
        device = self.pipeline.devices[j]
        function: Function = partial(_call_partition, self.pipeline.partitions[j], j)
        if self.skips is not None:
            function = self.skips.bind(i, function)
        function = traced(function, i, j)
        base = self.seeds[j]
        seed = None if base is None else rng.task_seed(base, i, j)
        self._mark_arrival(i, j)
        with (
            self.state.applied(device),
            use_stream(self.compute_streams[j]),
            contextlib.nullcontext() if seed is None else rng.seeded(device, seed),
        ):
            if i < self.checkpoint_stop:
                chk = Checkpointing(
                    function,
                    device,
                    self.state,
                    _rng_replay(device, seed),
                    partition=j,
                    protect_inputs=self.pipeline.protect_inputs[j],
                )
                return chk.checkpoint(self.batches[i])
            return self.batches[i].call(function)

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


def _rng_replay(
    device: torch.device, seed: int | None
) -> Callable[[], AbstractContextManager[None]]:
    """How recomputation gets back the random state the forward pass saw."""
    if seed is not None:
        return partial(rng.seeded, device, seed)
    return partial(rng.replaying, rng.capture_states(device))


def _call_partition(partition: nn.Sequential, j: int, value: TensorOrValues) -> TensorOrValues:
    output = partition(value)
    if not isinstance(output, torch.Tensor | tuple):
        raise TypeError(
            f"partition {j} returned {type(output).__name__}; a partition must return a "
            "Tensor or a tuple of values, since that is what the next partition receives"
        )
    return output


def _depend(before: Batch, after: Batch) -> None:
    if not torch.is_grad_enabled():
        return  # fork and join draw no edge without grad; skip finding their carriers
    a, b = before.first_differentiable(), after.first_differentiable()
    if a is not None and b is not None:
        before[a], after[b] = depend(before[a], after[b])
