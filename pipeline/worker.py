"""Persistent worker threads, one per partition.

Each partition gets its own thread, started with the Pipe and kept for its
lifetime, so that partitions run at once even when they share a device (two
CPU partitions overlap; a Python thread releases the GIL inside torch ops).
A worker takes tasks from its inbox and answers each with exactly one
result, a value or the exception it raised, so the driver never waits for
an answer that will not come. Each task comes with the queue to answer on,
which belongs to the call that submitted it: a caller interrupted while
waiting (Ctrl-C in a notebook) drops its queue, and the answers still to
come are garbage as soon as they are put there; no other call ever sees them.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["Failure", "Replies", "Worker", "stop_workers"]

Task = Callable[[], Any]
Replies = queue.SimpleQueue[Any]


class Failure:
    """An exception raised by a task, carried back to the driver thread."""

    __slots__ = ("exception",)

    def __init__(self, exception: BaseException) -> None:
        self.exception = exception


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


def stop_workers(workers: list[Worker], timeout: float = 10.0) -> None:
    """Stop the threads and wait for them to end (each finishes its task first)."""
    for worker in workers:
        worker.stop()
    current = threading.current_thread()
    for worker in workers:
        if worker.thread is not current:
            worker.thread.join(timeout)
