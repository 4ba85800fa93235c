"""The driver: runs micro-batches through the partitions, clock cycle by clock cycle.

Each clock cycle has two phases, both issued from the caller's thread:

- fence: draw the autograd edges that order the backward pass (``depend``)
  and move each micro-batch to the device of the partition it enters
  (``Copy``/``Wait`` on copy streams);
- compute: hand every task of the cycle to its partition's worker thread and
  collect the results. Partitions that share a thread (``threads='device'``)
  run their tasks of the cycle one after another on it, as torchgpipe does.
  A task that raises does not stop the others of its cycle; once all have
  answered, the first exception is re-raised here with its original
  traceback and a note naming the task. An interrupt (Ctrl-C)
  is re-raised once the cycle's tasks have ended too, so that none of them
  writes a buffer (BatchNorm statistics) after the call has raised.

When one thread runs every partition (one device, ``threads='device'``),
the caller hands it each whole cycle, fence included. That is one hand-off
per cycle instead of one per task, and it decides the order of the backward
pass: on one device, autograd runs, of the nodes that are ready, the one
made last on its thread (nodes are numbered per thread). Made on one
thread, fence by fence and task by task in the cycle's order (partition
ascending), the nodes lead it through GPipe's backward wave, micro-batch
``i - 1`` on partition ``j + 1`` before micro-batch ``i`` on partition ``j``,
which frees later partitions' activations before earlier partitions' weights
get their gradients (torchgpipe's order, and its peak memory). Made on the
caller's thread, the fence's nodes would be numbered apart from the tasks',
and the backward would go depth-first, micro-batch by micro-batch.

A task runs its partition under the caller's thread state and context
variables, on the partition's compute stream, with its random draws
replayable (``pipeline/runtime/rng.py``), and checkpointed
(``checkpoint.py``) when its micro-batch is below the checkpoint stop.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from pipeline.clock.checkpoint import Checkpointing
from pipeline.clock.completion import Arrival, PartitionCompletion
from pipeline.clock.copy import Copy, Wait
from pipeline.clock.cycles import clock_cycles
from pipeline.clock.dependency import depend
from pipeline.clock.skips import skip_portals
from pipeline.runtime import rng
from pipeline.runtime.microbatch import Batch
from pipeline.runtime.partitions import Hook, PartitionCall, PartitionRuntime, protected
from pipeline.runtime.recompute import Recomputation
from pipeline.runtime.stream import Stream, current_stream, new_stream, use_stream
from pipeline.runtime.threadstate import ThreadState
from pipeline.runtime.worker import Failure, Replies, Worker, add_note
from pipeline.skip.layout import SkipLayout
from pipeline.trace.recording import span, traced

__all__ = ["ClockDriver"]


class ClockDriver:
    """Runs GPipe's clock cycles over the partitions of ``runtime``.

    Partition ``j`` runs on ``workers[thread_of[j]]``.
    """

    def __init__(
        self,
        runtime: PartitionRuntime,
        workers: list[Worker],
        thread_of: list[int],
        skip_layout: SkipLayout,
    ) -> None:
        self.runtime = runtime
        self.workers = workers
        self.thread_of = thread_of
        self.skip_layout = skip_layout
        self.copy_streams: list[list[Stream]] = [[] for _ in range(len(runtime))]
        self.stages_by_worker = [
            [j for j, t in enumerate(thread_of) if t == w] for w in range(len(workers))
        ]

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
        forward = _ForwardPass(self, batches, checkpoint_stop, completion_hooks, rows)
        one_thread = len(set(self.thread_of)) == 1
        for cycle in clock_cycles(len(batches), len(self.runtime)):
            if one_thread:
                forward.run_on_its_thread(cycle)
            else:
                forward.fence(cycle)
                forward.compute(cycle)

    def copy_streams_for(self, m: int) -> list[list[Stream]]:
        """One copy stream per (partition, micro-batch), made once and reused."""
        for device, streams in zip(self.runtime.devices, self.copy_streams, strict=True):
            while len(streams) < m:
                streams.append(new_stream(device))
        return self.copy_streams


class _ForwardPass:
    """The state of one forward pass through the partitions."""

    def __init__(
        self,
        driver: ClockDriver,
        batches: list[Batch],
        checkpoint_stop: int,
        completion_hooks: list[Hook],
        rows: int,
    ) -> None:
        self.driver = driver
        self.runtime = driver.runtime
        self.batches = batches
        self.checkpoint_stop = checkpoint_stop
        self.rows = rows
        self.sizes = [b.rows() for b in batches]
        self.state = ThreadState.capture()
        self.compute_streams = [current_stream(d) for d in self.runtime.devices]
        self.copy_streams = driver.copy_streams_for(len(batches))
        self.seeds = rng.BaseSeed()
        self.randomness = self.runtime.randomness(driver.stages_by_worker)
        self.completions = self._completions(completion_hooks)
        self.skips = skip_portals(driver.skip_layout, len(batches), self.runtime)

    def _completions(self, hooks: list[Hook]) -> list[PartitionCompletion | None]:
        """A completion counter per partition whose inputs all carry gradients."""
        if not (hooks and torch.is_grad_enabled()):
            return [None] * len(self.runtime)
        m = len(self.batches)
        first_observable = all(_gradient_index(b) is not None for b in self.batches)
        observable = [first_observable] + [True] * (len(self.runtime) - 1)
        return [PartitionCompletion(j, m, hooks) if ok else None for j, ok in enumerate(observable)]

    def fence(self, cycle: list[tuple[int, int]]) -> None:
        batches, devices = self.batches, self.runtime.devices
        for i, j in cycle:
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

    def compute(self, cycle: list[tuple[int, int]]) -> None:
        workers, thread_of = self.driver.workers, self.driver.thread_of
        replies = Replies()
        for i, j in cycle:
            workers[thread_of[j]].submit(partial(self.state.run, self._task, i, j), replies)
        failure: Failure | None = None
        for result in replies.collect(len(cycle)):
            if isinstance(result, Failure):
                failure = failure or result
            else:
                i, batch = result
                self.batches[i] = batch
        if failure is not None:
            raise failure.exception

    def run_on_its_thread(self, cycle: list[tuple[int, int]]) -> None:
        """Fence and compute ``cycle`` on the one thread that runs every partition."""
        replies = Replies()
        worker = self.driver.workers[self.driver.thread_of[0]]
        worker.submit(partial(self.state.run, self._fence_and_compute, cycle), replies)
        (result,) = replies.collect(1)
        if isinstance(result, Failure):
            raise result.exception

    def _fence_and_compute(self, cycle: list[tuple[int, int]]) -> None:
        """Both phases of ``cycle`` on this thread; each task runs, the first failure raises.

        The fence runs in the caller's state (grad and inference mode,
        autocast), as it does on the caller's thread.
        """
        with self.state.applied(self.runtime.devices[0]):
            self.fence(cycle)
        failure: BaseException | None = None
        for i, j in cycle:
            try:
                self.batches[i] = self._task(i, j)[1]
            except BaseException as exception:
                failure = failure or exception
        if failure is not None:
            raise failure

    def _task(self, i: int, j: int) -> tuple[int, Batch]:
        """Run partition ``j`` on micro-batch ``i`` (on partition ``j``'s worker)."""
        try:
            return i, self._run(i, j)
        except BaseException as exception:
            add_note(exception, self._where(i, j))
            raise

    def _run(self, i: int, j: int) -> Batch:
        runtime = self.runtime
        function: PartitionCall = partial(runtime.call, j)
        checkpointed = i < self.checkpoint_stop
        if self.skips is not None:
            function = self.skips.bind(i, j, function, checkpointed)
        function = traced(function, i, j)
        randomness = rng.TaskRandomness(self.seeds, i, j, self.randomness[j], checkpointed)
        self._mark_arrival(i, j)
        batch = self.batches[i]
        with (
            self.state.applied(runtime.devices[j]),
            use_stream(self.compute_streams[j]),
            randomness.drawing(),
        ):
            if checkpointed:
                recomputation = Recomputation(
                    randomness,
                    runtime.buffers[j],
                    self.state,
                    runtime.devices[j],
                    self.compute_streams[j],
                    lock=runtime.lock,
                )
                checkpointing = Checkpointing(
                    function, recomputation, protect_inputs=runtime.protect_inputs[j]
                )
                output = checkpointing.checkpoint(batch)
            else:
                if j == 0 and runtime.protect_inputs[0]:
                    batch = protected(batch)  # never write into the caller's input
                output = batch.call(function)
        _check_output(output, j)
        return output

    def _where(self, i: int, j: int) -> str:
        return (
            f"(raised in partition {j} on {self.runtime.devices[j]}, micro-batch {i} of "
            f"{len(self.batches)}: the Pipe split {self.rows} rows into micro-batches of "
            f"{self.sizes} rows)"
        )

    def _mark_arrival(self, i: int, j: int) -> None:
        completion = self.completions[j]
        if completion is None:
            return
        batch = self.batches[i]
        index = _gradient_index(batch)
        if index is None:
            # Some micro-batch carries no gradient here: the partition's
            # completion cannot be observed, so it is never signalled.
            self.completions[j] = None
            return
        batch[index] = Arrival.apply(batch[index], completion)


def _gradient_index(batch: Batch) -> int | None:
    """The index of a tensor of ``batch`` that will receive a gradient, if any: the first
    that requires grad (a mask before it needs none)."""
    return next((i for i in batch.tensor_indices() if batch[i].requires_grad), None)


def _check_output(output: Batch, j: int) -> None:
    if not any(True for _ in output.tensor_indices()):
        kind = type(output.value).__name__
        raise TypeError(
            f"partition {j} returned {kind}, which holds no tensor; a partition must return "
            "a tensor, or tuples, lists or dicts holding tensors, since that is what the "
            "next partition (or the Pipe's output) receives"
        )


def _depend(before: Batch, after: Batch) -> None:
    """Order ``before``'s backward after ``after``'s, on tensors that carry gradients.

    An edge into a micro-batch none of whose tensors requires grad (behind
    frozen partitions) would make it require grad, which the layers and
    their hooks would see: there is no backward through it to order then.
    """
    if not torch.is_grad_enabled():
        return  # fork and join draw no edge without grad; skip finding their carriers
    a, b = _gradient_index(before), _gradient_index(after)
    if a is not None and b is not None:
        before[a], after[b] = depend(before[a], after[b])
