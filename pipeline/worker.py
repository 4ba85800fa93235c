"""Persistent worker threads, one per partition.

Each partition gets its own thread, started with the Pipe and kept for its
lifetime, so that partitions run at once even when they share a device (two
CPU partitions overlap; a Python thread releases the GIL inside torch ops).
A worker takes tasks from its inbox and answers each with exactly one
result, a value or the exception it raised, so the driver never waits for
an answer that will not come. Each answer carries the tag its task was
submitted with: a caller interrupted while waiting (Ctrl-C in a notebook)
leaves answers behind, and the next caller recognises and drops them.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["Failure", "Worker", "stop_workers"]

Task = Callable[[], Any]
Tagged = tuple[object, Task]


class Failure:
    """An exception raised by a task, carried back to the driver thread."""

    __slots__ = ("exception",)

    def __init__(self, exception: BaseException) -> None:
        self.exception = exception


class Worker:
    """A thread that runs tasks in the order they are submitted."""

    def __init__(self, name: str) -> None:
        self._inbox: queue.SimpleQueue[Tagged | None] = queue.SimpleQueue()
        self._outbox: queue.SimpleQueue[tuple[object, Any]] = queue.SimpleQueue()
        self.thread = threading.Thread(
            target=_work, args=(self._inbox, self._outbox), name=name, daemon=True
        )
        self.thread.start()

    def submit(self, tag: object, task: Task) -> None:
        self._inbox.put((tag, task))

    def result(self, tag: object) -> Any:
        """The return value (or ``Failure``) of the next task submitted with ``tag``.

        Answers to tasks submitted with other tags are dropped: their caller
        stopped waiting for them.
        """
        while True:
            answered, result = self._outbox.get()
            if answered is tag:
                return result

    def stop(self) -> None:
        self._inbox.put(None)


def _work(
    inbox: queue.SimpleQueue[Tagged | None], outbox: queue.SimpleQueue[tuple[object, Any]]
) -> None:
    # The loop holds no reference to the Pipe, so the Pipe can be collected
    # (which stops this thread) while the thread waits here.
    while True:
        item = inbox.get()
        if item is None:
            return
        tag, task = item
        del item
        try:
            result = task()
        except BaseException as exception:
            result = Failure(exception)
        del task
        outbox.put((tag, result))
        del tag, result


def stop_workers(workers: list[Worker], timeout: float = 10.0) -> None:
    """Stop the threads and wait for them to end (each finishes its task first)."""
    for worker in workers:
        worker.stop()
    current = threading.current_thread()
    for worker in workers:
        if worker.thread is not current:
            worker.thread.join(timeout)
