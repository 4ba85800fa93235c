"""Mail: how the stages of a step hand values to each other, in one process or across processes.

A stage's forward puts its output for micro-batch ``i`` in the next stage's
mailbox; that stage's forward takes it when it runs, waiting if it is not
there yet. Gradients go the other way, skip tensors straight from the
stashing stage to the popping one. Values are handed over detached: each
stage runs its own autograd graph, and the receiver sends the gradient of
what it received back by mail. A value for another device is copied there by
the sender (``moved``) and waited for by the receiver (``arrived``).

When an action fails, its worker aborts the mailboxes: every worker waiting
in ``take`` (now or later) raises ``AbortedError`` at once, so all workers return
and the failure reaches the caller in bounded time. Both transports file
messages in one ``Mailboxes``: the local one here, the point-to-point one of
``pipeline/distributed/p2p.py``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from pipeline.runtime.stream import copy_to
from pipeline.trace.recording import span

__all__ = [
    "AbortedError",
    "LocalTransport",
    "MailTimeoutError",
    "Mailboxes",
    "Message",
    "Transport",
    "arrived",
    "describe",
    "moved",
]


class AbortedError(RuntimeError):
    """Another action of the step failed; this one stopped waiting for its input."""


class MailTimeoutError(RuntimeError):
    """Nothing came under a key within the mailboxes' timeout."""


class Mailboxes:
    """Messages by (step, key), each put once and taken once; a take waits for its key.

    A failed step is aborted: its takes, waiting or to come, raise
    ``AbortedError`` with the reason, while later steps' messages (a peer one
    step ahead) are kept. ``break_down`` fails every take of every step (a
    lost peer). A take may name its ``sender``: once that sender has
    ``stopped`` (it sends nothing more), a take of a message it did not send
    fails at once. With a ``timeout``, a take that waits longer raises
    ``MailTimeoutError``; without one it waits until its message or an abort.
    """

    def __init__(self, timeout: float | None = None) -> None:
        self.timeout = timeout
        self._values: dict[tuple[int, Hashable], Message] = {}
        self._aborted: dict[int, BaseException] = {}
        self._broken: BaseException | None = None
        self._stopped: dict[Hashable, BaseException] = {}
        self._changed = threading.Condition()
        # Takes waiting now: a put with none to wake (one thread running
        # every stage) notifies nobody.
        self._waiting = 0

    def put(self, step: int, key: Hashable, message: Message) -> None:
        """File ``message`` under (``step``, ``key``) and wake its take."""
        with self._changed:
            self._values[step, key] = message
            if self._waiting:
                self._changed.notify_all()

    def _wait(self, timeout: float | None = None) -> None:
        """Wait for a change, counted as waiting (the lock held by the caller)."""
        self._waiting += 1
        try:
            self._changed.wait(timeout)
        finally:
            self._waiting -= 1

    def take(
        self, step: int, key: Hashable, waiting_for: str, sender: Hashable | None = None
    ) -> Message:
        """Take the message put under (``step``, ``key``), waiting for it."""
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        with self._changed:
            while (step, key) not in self._values:
                failure = self._aborted.get(step) or self._broken or self._stopped.get(sender)
                if failure is not None:
                    raise AbortedError(f"gave up waiting for {waiting_for}: {failure}") from failure
                if deadline is None:
                    self._wait()
                    continue
                left = deadline - time.monotonic()
                if left <= 0:
                    raise MailTimeoutError(f"waited {self.timeout:g} s for {waiting_for}, in vain")
                self._wait(left)
            return self._values.pop((step, key))

    def take_if_there(self, step: int, key: Hashable) -> Message | None:
        """The message under (``step``, ``key``) if it is there (taken), else None, at once."""
        with self._changed:
            return self._values.pop((step, key), None)

    def has(self, step: int, key: Hashable) -> bool:
        """Whether a message waits under (``step``, ``key``)."""
        with self._changed:
            return (step, key) in self._values

    def wait_for_any(self, step: int, keys: list[Hashable], waiting_for: str) -> None:
        """Wait until a message is under one of ``keys`` (``step``), or the step is aborted."""
        with self._changed:
            while not any((step, key) in self._values for key in keys):
                failure = self._aborted.get(step) or self._broken
                if failure is not None:
                    raise AbortedError(f"gave up waiting for {waiting_for}: {failure}") from failure
                self._wait()

    def abort(self, step: int, error: BaseException) -> bool:
        """Fail ``step``'s takes, waiting or to come, with ``error`` (the first reason stays).

        Whether ``step`` was not aborted before.
        """
        with self._changed:
            first = step not in self._aborted
            self._aborted.setdefault(step, error)
            self._changed.notify_all()
            return first

    def stopped(self, sender: Hashable, error: BaseException) -> None:
        """``sender`` sends nothing more: takes of its messages not yet put fail with ``error``."""
        with self._changed:
            self._stopped.setdefault(sender, error)
            self._changed.notify_all()

    def break_down(self, error: BaseException) -> None:
        """A peer is gone: every take, now and later, fails with ``error``."""
        with self._changed:
            self._broken = self._broken or error
            self._changed.notify_all()

    def check(self, step: int) -> None:
        """Raise ``AbortedError`` with the reason if ``step`` was aborted or a peer is gone."""
        # Read without the lock, once per action: an abort this read misses
        # is seen by the next check or wait.
        failure = self._aborted.get(step) or self._broken
        if failure is not None:
            raise AbortedError(f"stopped: {failure}") from failure

    def begin(self, step: int) -> None:
        """Forget what earlier steps left (a failed step's messages)."""
        with self._changed:
            self._values = {k: v for k, v in self._values.items() if k[0] >= step}
            self._aborted = {s: e for s, e in self._aborted.items() if s >= step}


@dataclass(slots=True)
class Message:
    """Values handed to another stage: a value's leaves (or gradients), detached.

    ``differentiable`` says which tensors the receiver makes leaves that
    require grad; ``sharing``, which of them shared memory in the sender
    (``runtime/aliases.py``: groups of positions among the leaves);
    ``event`` (CUDA) marks when the sender's copy is done.
    """

    leaves: list[Any]
    spec: Any = None
    differentiable: list[bool] = field(default_factory=list)
    event: Any = None
    sharing: list[frozenset[int]] = field(default_factory=list)


def moved(message: Message, device: torch.device) -> Message:
    """``message`` with its tensors copied to ``device`` by the sender, on its current stream.

    The receiver waits for a copy into a GPU with ``arrived``: the copy
    overlaps the sender's next work and the receiver's until it is needed. A
    copy into the CPU is done before the message is filed (``copy_to``).
    """
    leaves = [
        copy_to(x, device) if isinstance(x, torch.Tensor) and x.device != device else x
        for x in message.leaves
    ]
    event = None
    if device.type == "cuda":
        # On the stream the copies into ``device`` were queued on (and the sender's work
        # there), which is not the current device's when the sender runs on another one.
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
    return Message(leaves, message.spec, message.differentiable, event, message.sharing)


def arrived(message: Message) -> Message:
    """``message``, once its copy is done as seen from the receiver's current stream."""
    if message.event is not None:
        torch.cuda.current_stream().wait_event(message.event)
    return message


class Transport(Protocol):
    """Hands a stage's messages to another stage, keyed like ``("act", stage, i)``."""

    def send(self, key: Hashable, message: Message, source: int, target: int, i: int) -> None:
        """Deliver ``message`` from stage ``source`` to stage ``target`` (micro-batch ``i``)."""
        ...

    def receive(self, key: Hashable, source: int, target: int) -> Message:
        """Take the message ``source`` sent to ``target`` under ``key``, waiting for it."""
        ...

    def abort(self, error: BaseException | None = None) -> None:
        """Stop every waiting ``receive`` (the step failed)."""
        ...

    @property
    def apart(self) -> bool:
        """Whether a message may arrive as a memory of its own (another device or process),
        so that a later write into what was sent does not show in what was received."""
        ...

    def check(self) -> None:
        """Raise ``AbortedError`` (with the reason) if the step was aborted."""
        ...


_WHAT = {
    "act": "the activation",
    "grad": "the gradient",
    "skip": "the skip tensor",
    "skip-grad": "the skip tensor's gradient",
    "output": "the model's output",
}
# Messages of the whole step, not of one micro-batch.
_OF_THE_STEP = {
    "router-up": "the router loss's counts of the ranks below",
    "router-down": "the router loss's counts of the whole batch",
    "done-up": "the word that the ranks below ran their actions",
    "done-down": "the word that every rank ran its actions",
    "end-up": "the word that the ranks below ended the step",
    "end-down": "the word that every rank ended the step",
}


def describe(key: Hashable) -> str:
    """How an error names the message of ``key``.

    >>> describe(("act", 2, 3))
    'the activation of micro-batch 3'
    """
    if isinstance(key, tuple) and key and key[0] in _WHAT:
        return f"{_WHAT[key[0]]} of micro-batch {key[-1]}"
    if isinstance(key, tuple) and key and key[0] in _OF_THE_STEP:
        return _OF_THE_STEP[key[0]]
    return repr(key)


# A LocalTransport serves one step: its mailboxes need no other step.
_ONE_STEP = 0


class LocalTransport:
    """Stages of one process: mailboxes, with device copies made by the sender."""

    def __init__(self, devices: list[torch.device]) -> None:
        self.devices = devices
        self.mailboxes = Mailboxes()

    def send(self, key: Hashable, message: Message, source: int, target: int, i: int) -> None:
        device = self.devices[target]
        if device != self.devices[source]:
            with span("copy", i, target):
                message = moved(message, device)
        self.mailboxes.put(_ONE_STEP, key, message)

    def receive(self, key: Hashable, source: int, target: int) -> Message:
        message = self.mailboxes.take_if_there(_ONE_STEP, key)
        if message is None:  # only a wait needs its description
            waiting_for = f"{describe(key)} from stage {source}"
            message = self.mailboxes.take(_ONE_STEP, key, waiting_for)
        return arrived(message)

    def has(self, key: Hashable) -> bool:
        """Whether the message of ``key`` is there (``receive`` would not wait)."""
        return self.mailboxes.has(_ONE_STEP, key)

    def wait_for_any(self, keys: list[Hashable], waiting_for: str) -> None:
        """Wait until the message of one of ``keys`` is there."""
        self.mailboxes.wait_for_any(_ONE_STEP, keys, waiting_for)

    def abort(self, error: BaseException | None = None) -> None:
        self.mailboxes.abort(_ONE_STEP, AbortedError("another action of the step failed"))

    @property
    def apart(self) -> bool:
        return len(set(self.devices)) > 1

    def check(self) -> None:
        self.mailboxes.check(_ONE_STEP)
