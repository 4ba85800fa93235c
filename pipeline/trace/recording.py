"""Timeline traces: which task of the pipeline ran on which partition, and when.

Wrap the steps to look at in ``pipeline.trace()``::

    with pipeline.trace() as t:
        loss_fn(pipe(x), y).backward()
    t.save_chrome_trace("trace.json")  # open in chrome://tracing or ui.perfetto.dev
    print(t.summary())                 # busy and idle (bubble) time per partition
    print(t.render())                  # the schedule as a text Gantt chart

The driver reports each task: ``forward`` (a partition run on a micro-batch,
on its worker), ``copy`` (a micro-batch moved to the next partition's
device, in the fence), ``recompute`` (a checkpointed task run again in
backward) and ``backward`` (timed by gradient hooks on each task's input and
output, only while tracing). Outside a trace, a task costs a check of two flags.

Under ``torch.profiler`` the same tasks appear as ranges with the events'
names (``pipe.forward[mb=3,part=1]``). The profiler records the thread that
started it and autograd's threads; the forward tasks run on the Pipe's
worker threads, which ``pipeline.profile()`` (``profiling.py``) records too::

    with pipeline.profile() as prof:
        pipe(x).sum().backward()
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager
from functools import partial
from typing import Any

import torch
from torch.autograd import profiler as _profiler

from pipeline.runtime.microbatch import Value
from pipeline.runtime.partitions import PartitionCall
from pipeline.runtime.phase import is_recomputing
from pipeline.trace.backward import BackwardSpan, run_hooked
from pipeline.trace.chrome import chrome_trace
from pipeline.trace.event import Event, Kind, task_name
from pipeline.trace.gantt import render
from pipeline.trace.summary import Summary, summarize
from pipeline.trace.svg import render_svg

__all__ = ["Trace", "begin_explicit_step", "span", "trace", "traced"]


# The trace recording now. A process-wide global, not a thread-local: the
# tasks it records run on worker and autograd threads. The thread that entered it.
_active: Trace | None = None
_entered_by: threading.Thread | None = None
_entering = threading.Lock()
_UNTRACED = contextlib.nullcontext()


class Trace:
    """The tasks recorded inside one ``pipeline.trace()`` block.

    A step begins with the forward task of micro-batch 0 on partition 0 (one
    ``Pipe`` call). A backward that runs after the block still reports the
    tasks hooked inside it::

        with pipeline.trace() as t:
            out = pipe(x)
        out.sum().backward()
        [e.name for e in t.events if e.kind == "backward"]

    A trace can also be made of given events (times relative to ``origin``),
    to report on them: ``Trace(events, origin=0.0).summary()``.
    """

    def __init__(self, events: Iterable[Event] = (), origin: float | None = None) -> None:
        self.origin = time.perf_counter() if origin is None else origin
        self._events: list[Event] = list(events)
        self._backward: list[BackwardSpan] = []
        self._step = max((e.step for e in self._events), default=-1)
        self._schedule_bounds: list[float] = []

    @property
    def events(self) -> list[Event]:
        """Every finished task, in order of start."""
        backward = (span.event() for span in self._backward)
        finished = [*self._events, *(e for e in backward if e is not None)]
        return sorted(finished, key=lambda e: e.start)

    @property
    def step(self) -> int:
        """The index of the step being recorded (-1 before the first)."""
        return self._step

    def _begin_step(self, schedule_bound: float | None = None) -> None:
        self._step += 1
        if schedule_bound is not None:
            self._schedule_bounds.append(schedule_bound)

    def _record(
        self, kind: Kind, microbatch: int, partition: int, step: int, start: float, end: float
    ) -> None:
        thread = threading.current_thread().name
        self._events.append(Event(kind, microbatch, partition, step, thread, start, end))

    def _backward_span(self, microbatch: int, partition: int, step: int) -> BackwardSpan:
        """A span that the autograd engine will fill in with the task's backward."""
        span = BackwardSpan(microbatch, partition, step)
        self._backward.append(span)
        return span

    def chrome_trace(self) -> dict[str, Any]:
        """The trace as a Chrome trace event JSON object, one row per partition.

        Example: ``len(t.chrome_trace()["traceEvents"])``.
        """
        return chrome_trace(self.events, self.origin)

    def save_chrome_trace(self, path: str | os.PathLike[str]) -> None:
        """Write the Chrome trace JSON to ``path`` (chrome://tracing and Perfetto open it).

        Example: ``t.save_chrome_trace("pipe.json")``.
        """
        with open(path, "w") as file:
            json.dump(self.chrome_trace(), file)

    def summary(self) -> Summary:
        """Busy time and idle fraction per partition, beside GPipe's bound.

        Example: ``print(t.summary())`` prints a table.
        """
        return summarize(self.events, self._schedule_bounds)

    def render(self, width: int = 72, step: int | None = None) -> str:
        """A text Gantt chart of step ``step`` (default: the last), one line per partition.

        Example: ``print(t.render(width=100))``.
        """
        return render(self._step_events(step), width)

    def save_svg(
        self, path: str | os.PathLike[str], step: int | None = None, title: str = ""
    ) -> None:
        """Draw step ``step`` (default: the last) as an SVG picture at ``path``.

        One row per partition, each task a box where and when it ran, waits
        for messages in grey (``svg.py``). Example: ``t.save_svg("1f1b.svg")``.
        """
        with open(path, "w") as file:
            file.write(render_svg(self._step_events(step), title))

    def _step_events(self, step: int | None) -> list[Event]:
        events = self.events
        if events and step is None:
            step = events[-1].step
        return [e for e in events if e.step == step]


@contextlib.contextmanager
def trace(enabled: bool = True) -> Iterator[Trace]:
    """Record the pipeline's tasks while the block runs (an empty trace unless ``enabled``).

    Example::

        with pipeline.trace() as t:
            pipe(x).sum().backward()
        print(t.summary())

    Traces nest: the innermost one records. A trace records every pipe of
    the process, whichever thread calls it; a second thread's trace, which
    would take the first one's records, is refused while the first records.
    """
    global _active, _entered_by
    recording = Trace()
    if not enabled:
        yield recording
        return
    here = threading.current_thread()
    with _entering:
        if _active is not None and _entered_by is not here:
            raise RuntimeError(
                f"pipeline.trace() is recording already, entered by thread "
                f"{getattr(_entered_by, 'name', None)!r}: a trace records the tasks of every "
                "pipe in the process (they run on worker and autograd threads), so a trace "
                "of this thread's would take the other's records and the other this one's; "
                "trace one thread at a time, or put one trace around both"
            )
        previous, _active, _entered_by = _active, recording, here
    try:
        yield recording
    finally:
        with _entering:
            _active = previous
            _entered_by = here if previous is not None else None


def span(kind: Kind, microbatch: int, partition: int) -> AbstractContextManager[None]:
    """Report the enclosed work as a task to the trace and to ``torch.profiler``.

    Example::

        with span("copy", i, j):
            copy(batch)
    """
    recording = _active
    if recording is None and not _profiler._is_profiler_enabled:
        return _UNTRACED
    return _span(kind, microbatch, partition, recording, _step_of(recording))


def begin_explicit_step(schedule_bound: float | None = None) -> None:
    """Begin a step of ``Pipe.step`` in the trace recording now, with its simulated idle share.

    An evaluation (``Pipe.evaluate``) begins one too, with its forwards' share.
    """
    if _active is not None:
        _active._begin_step(schedule_bound)


def traced(function: PartitionCall, microbatch: int, partition: int) -> PartitionCall:
    """``function`` (a partition's call) reporting to the trace recording now.

    Call it once per forward task, as the task starts; the task of
    micro-batch 0 on partition 0 begins a step of the trace (one ``pipe(x)``
    call). The function's calls are
    ``forward`` tasks, or ``recompute`` tasks when made in checkpointing's
    recomputation (reported to the trace and step of the forward). With grad
    enabled, its backward is hooked too. Example::

        function = traced(partial(partition_call, partition), i, j)
    """
    recording = _active
    if recording is not None and microbatch == partition == 0:
        recording._begin_step()
    step = _step_of(recording)
    return partial(_call_traced, function, microbatch, partition, recording, step)


def _call_traced(
    function: PartitionCall,
    microbatch: int,
    partition: int,
    recording: Trace | None,
    step: int,
    value: Value,
) -> Value:
    if recording is None and not _profiler._is_profiler_enabled:
        return function(value)
    kind: Kind = "recompute" if is_recomputing() else "forward"
    with _span(kind, microbatch, partition, recording, step):
        # A recomputation only refills saved tensors of the forward's graph,
        # whose backward the forward's hooks already time.
        if recording is None or kind == "recompute" or not torch.is_grad_enabled():
            return function(value)
        span = recording._backward_span(microbatch, partition, step)
        return run_hooked(function, value, span)


def _step_of(recording: Trace | None) -> int:
    return -1 if recording is None else recording.step


@contextlib.contextmanager
def _span(
    kind: Kind, microbatch: int, partition: int, recording: Trace | None, step: int
) -> Iterator[None]:
    profiling = _profiler._is_profiler_enabled
    name = task_name(kind, microbatch, partition)
    with _profiler.record_function(name) if profiling else _UNTRACED:
        start = time.perf_counter()
        try:
            yield
        finally:
            # Recorded even when the work ends early: checkpointing stops a
            # recomputation by raising once it has what backward needs.
            if recording is not None:
                recording._record(kind, microbatch, partition, step, start, time.perf_counter())
