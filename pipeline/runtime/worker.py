"""Persistent worker threads: one per partition, or one per device.

Threads are started with the Pipe and kept for its lifetime. Which
partitions share one is the Pipe's ``threads`` choice (``thread_layout``):

- ``"partition"``: a thread each, so that partitions run at once even when
  they share a device (two CPU partitions overlap on two cores; a Python
  thread releases the GIL inside torch ops). Handing work between threads
  costs a wake-up and a GIL hand-off per task.
- ``"device"``: one thread runs every partition of a device, one task after
  another. A GPU runs its kernels asynchronously, so a second thread on it
  adds hand-offs, not overlap; on the CPU it gives up overlap for fewer
  hand-offs, and a thread that owns the device's random generator
  (``ownership.py``).
- ``"auto"`` (the default): by device for CUDA, by partition elsewhere.

A worker takes tasks from its inbox and answers each with exactly one
result, a value or the exception it raised, so the driver never waits for
an answer that will not come. Each task comes with the ``Replies`` of the
call that submitted it, so no other call ever sees its answers. The caller
collects every answer even when it is interrupted (Ctrl-C in a notebook):
the interrupt is re-raised once the tasks have ended, so no task of a call
still touches the model when the call has raised.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any, Literal, TypeAlias

import torch

__all__ = [
    "THREADS",
    "Failure",
    "Replies",
    "Threads",
    "Worker",
    "add_note",
    "check_threads",
    "start_workers",
    "stop_workers",
    "thread_layout",
]

Task = Callable[[], Any]
Threads: TypeAlias = Literal["auto", "partition", "device"]
THREADS = ("auto", "partition", "device")

# How long the caller sleeps between two looks for an interrupt that is no signal.
_WAKE_S = 0.05


def check_threads(threads: Any) -> Threads:
    """``threads`` if it is one of ``THREADS``."""
    if threads not in THREADS:
        raise ValueError(
            f"threads must be 'auto' (a thread per CUDA device, per partition elsewhere), "
            f"'partition' or 'device', got {threads!r}"
        )
    chosen: Threads = threads
    return chosen


def thread_layout(devices: Sequence[torch.device], threads: Threads) -> list[int]:
    """The worker of each partition, as an index into the pipe's workers.

    >>> cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    >>> thread_layout([cpu, cpu, gpu, gpu], "auto")
    [0, 1, 2, 2]
    >>> thread_layout([cpu, cpu, gpu, gpu], "device")
    [0, 0, 1, 1]
    """
    keys = [_thread_key(j, d, threads) for j, d in enumerate(devices)]
    index: dict[object, int] = {}
    return [index.setdefault(key, len(index)) for key in keys]


def _thread_key(j: int, device: torch.device, threads: Threads) -> object:
    """What partition ``j`` shares its thread by: its device, or nothing (itself)."""
    by_device = threads == "device" or (threads == "auto" and device.type == "cuda")
    return device if by_device else j


def start_workers(devices: Sequence[torch.device], threads: Threads) -> list[Worker]:
    """The workers of ``thread_layout``, named by what they run.

    ``pipe-partition-{j}`` runs partition ``j`` only; ``pipe-device-{device}``
    runs the partitions of that device.
    """
    names: dict[object, str] = {}
    for j, device in enumerate(devices):
        key = _thread_key(j, device, threads)
        names.setdefault(
            key, f"pipe-device-{device}" if isinstance(key, torch.device) else f"pipe-partition-{j}"
        )
    return [Worker(name) for name in names.values()]


class Failure:
    """An exception raised by a task, carried back to the driver thread."""

    __slots__ = ("exception",)

    def __init__(self, exception: BaseException) -> None:
        self.exception = exception


class Replies:
    """The answers to one call's tasks, kept here as the workers put them.

    An answer is stored here by the worker, not handed over through a queue,
    so an interrupt in the caller cannot lose one on the way: ``collect``
    counts what has arrived and uses the queue only to sleep until the next
    arrival.
    """

    def __init__(self) -> None:
        self._answers: list[Any] = []
        self._arrivals: queue.SimpleQueue[None] = queue.SimpleQueue()

    def put(self, answer: Any) -> None:
        """Keep ``answer`` (a task's value or its ``Failure``) and wake the caller."""
        self._answers.append(answer)
        self._arrivals.put(None)

    def collect(self, count: int, interrupted: Callable[[], object] = lambda: None) -> list[Any]:
        """Wait for ``count`` answers; return them in the order they came.

        An exception raised in the caller while it waits (Ctrl-C, any
        ``BaseException``) does not end the wait: ``interrupted()`` is called,
        to make the tasks stop early, and the exception is re-raised once
        every task has answered, so no task of the call runs on after the
        caller regained control. Each task answers once the work it is in has
        ended, so the wait lasts no longer than that. Further interrupts while
        it waits are noted on the first, which is the one raised.
        """
        interrupts: list[BaseException] = []
        stopping = False
        while True:
            # The whole wait is in the try, so that an interrupt between two
            # arrivals is caught as well as one in the middle of a wait.
            try:
                while len(self._answers) < count:
                    if interrupts and not stopping:
                        # Set before the call: a second interrupt inside it must not
                        # make it run at every arrival; if it is cut short, the tasks
                        # merely run to their end.
                        stopping = True
                        interrupted()
                    with contextlib.suppress(queue.Empty):
                        # A wait with a timeout: an interrupt that is no signal
                        # (_thread.interrupt_main, a debugger's) is seen between two.
                        self._arrivals.get(timeout=_WAKE_S)
                break
            except BaseException as exception:
                interrupts.append(exception)
        if interrupts:
            first = interrupts[0]
            for later in interrupts[1:]:
                add_note(
                    first,
                    f"(a further {later!r} came while the workers ended the work they were in; "
                    "it was held back so that none runs on once this one is raised)",
                )
            raise first
        return self._answers


class Worker:
    """A thread that runs tasks in the order they are submitted."""

    def __init__(self, name: str) -> None:
        self._inbox: queue.SimpleQueue[tuple[Task, Replies] | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=_work, args=(self._inbox,), name=name, daemon=True)
        self.thread.start()

    def submit(self, task: Task, replies: Replies) -> None:
        """Run ``task``; put its return value (or its ``Failure``) on ``replies``."""
        self._inbox.put((task, replies))

    def stop(self) -> None:
        self._inbox.put(None)


def _work(inbox: queue.SimpleQueue[tuple[Task, Replies] | None]) -> None:
    # The loop holds no reference to the Pipe, so the Pipe can be collected
    # (which stops this thread) while the thread waits here.
    while True:
        item = inbox.get()
        if item is None:
            return
        task, replies = item
        del item
        try:
            result = task()
        except BaseException as exception:
            result = Failure(exception)
        del task
        replies.put(result)
        del replies, result


def add_note(exception: BaseException, note: str) -> None:
    """Add ``note`` to ``exception``'s notes (shown under its traceback; Python 3.11+)."""
    method = getattr(exception, "add_note", None)  # Python 3.11+
    if method is not None and note not in getattr(exception, "__notes__", ()):
        method(note)


def stop_workers(workers: list[Worker], timeout: float = 10.0) -> None:
    """Stop the threads and wait for them to end (each finishes its task first)."""
    for worker in workers:
        worker.stop()
    current = threading.current_thread()
    for worker in workers:
        if worker.thread is not current:
            worker.thread.join(timeout)
