"""Mail: how the stages of an explicit schedule hand values to each other.

A stage's forward puts its output for micro-batch ``i`` in the next stage's
mailbox; that stage's forward takes it when it runs, waiting if it is not
there yet. Gradients go the other way, skip tensors straight from the
stashing stage to the popping one. Values are handed over detached: each
stage runs its own autograd graph, and the receiver sends the gradient of
what it received back by mail. A value for another device is copied there by
the sender (``moved``) and waited for by the receiver (``arrived``).

When an action fails, its worker aborts the mailboxes: every worker waiting
in ``get`` (now or later) raises ``AbortedError`` at once, so all workers return
and the failure reaches the caller in bounded time.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from pipeline.trace.recording import span

__all__ = [
    "AbortedError",
    "LocalTransport",
    "Mailboxes",
    "Message",
    "Transport",
    "arrived",
    "moved",
]


class AbortedError(RuntimeError):
    """Another action of the step failed; this one stopped waiting for its input."""


class Mailboxes:
    """Values by key, each put once and taken once; ``get`` waits for its key."""

    def __init__(self) -> None:
        self._values: dict[Hashable, Any] = {}
        self._changed = threading.Condition()
        self._aborted = False

    def put(self, key: Hashable, value: Any) -> None:
        with self._changed:
            self._values[key] = value
            self._changed.notify_all()

    def get(self, key: Hashable) -> Any:
        """Take the value put under ``key``, waiting for it; ``AbortedError`` if the step failed."""
        with self._changed:
            while key not in self._values:
                if self._aborted:
                    raise AbortedError(
                        f"gave up waiting for {key}: another action of the step failed"
                    )
                self._changed.wait()
            return self._values.pop(key)

    @property
    def aborted(self) -> bool:
        return self._aborted

    def abort(self) -> None:
        """Wake every waiting ``get`` with ``AbortedError``; drop what was never taken."""
        with self._changed:
            self._aborted = True
            self._values.clear()
            self._changed.notify_all()


@dataclass
class Message:
    """Values handed to another stage: a value's leaves (or gradients), detached.

    ``differentiable`` says which tensors the receiver makes leaves that
    require grad; ``event`` (CUDA) marks when the sender's copy is done.
    """

    leaves: list[Any]
    spec: Any = None
    differentiable: list[bool] = field(default_factory=list)
    event: Any = None


def moved(message: Message, device: torch.device) -> Message:
    """``message`` with its tensors copied to ``device`` by the sender, on its current stream.

    The receiver waits for the copy with ``arrived``: the copy overlaps the
    sender's next work and the receiver's until it is needed.
    """
    leaves = [
        x.to(device, non_blocking=True) if isinstance(x, torch.Tensor) and x.device != device else x
        for x in message.leaves
    ]
    event = None
    if device.type == "cuda" or any(isinstance(x, torch.Tensor) and x.is_cuda for x in leaves):
        event = torch.cuda.Event()
        event.record()
    return Message(leaves, message.spec, message.differentiable, event)


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

    def check(self) -> None:
        """Raise ``AbortedError`` (with the reason) if the step was aborted."""
        ...


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
        self.mailboxes.put(key, message)

    def receive(self, key: Hashable, source: int, target: int) -> Message:
        return arrived(self.mailboxes.get(key))

    def abort(self, error: BaseException | None = None) -> None:
        self.mailboxes.abort()

    def check(self) -> None:
        if self.mailboxes.aborted:
            raise AbortedError("stopped: another action of the step failed")
