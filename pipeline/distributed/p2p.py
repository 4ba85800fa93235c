"""Point-to-point transport: stages in separate processes, messages as sends on a process group.

The same stages and programs as in one process (``pipeline/step/stage.py``) run with one
or more stages per process; a message for a stage of another process is
sent to it. A message carries its own description, so nothing is declared
up front and shapes may change from step to step: an envelope, its
description and its tensors' raw bytes, in the format of ``wire_format.py``,
which decodes to data, never to code, with every size a peer announces
checked before anything is allocated. A message that fits in the room the
receiver posted for its envelope (the size of the peer's last message, up
to ``MAX_ROOM_BYTES``) travels whole in it: a stage's activations, alike
from one micro-batch to the next, take one send and one receive each.

Every process listens to each peer on a thread of its own, receiving in
the order the peer sent and filing each message under its key. Once it
knows a message's tensors it posts their receives, if they did not come in
the envelope, and the next envelope's together, so the next message arrives
while this one is filed (one wake-up of the listener per message, not one
per part). An action
takes what it needs by key, waiting at most ``timeout`` seconds. Messages
are therefore matched by key, not by order, and no schedule can make two
processes wait for each other's receives. Sends are asynchronous: a
message's sends are waited for when the next message to the same peer is
posted (the peer's listener has taken it by then), which lets go of what they
read (a stage's output sent apart, kept for nothing else; an envelope holds a
copy, and so does what its receiver takes out of it), and at the step's end.

Faults: an action that fails tells every peer (an ``abort`` message), whose
waiting actions then fail at once, naming the process and its action; a
peer that dies breaks its connection, which fails the listener and the
actions waiting on it; a peer that stalls makes them fail after
``timeout`` seconds, naming the peer and what they waited for. A peer whose
message is malformed is no longer listened to: every wait on it fails,
naming it and what was wrong.

Closing waits on no peer: ``close`` sends each peer a ``stop`` and waits
(a few seconds at most) only for these sends, which the peer's listener
receives whatever its own thread is doing. A listener ends when its peer's
``stop`` comes or the connection breaks; ``close`` does not join it, so two
processes closing pipelines in different orders never wait for each other.
A peer's ``stop`` comes after all its messages: the step under way
finishes, the next one is refused.

A listener that receives a ``stop`` answers it with this process's own
``stop`` (once per peer): the peer has closed, so it needs nothing more
from here, and its listener can end too. A wait for a message the peer did
not send fails at once, and so does a send to it.

At exit, and only then, the listeners are waited for: a listener that wakes
while the interpreter is finalizing is ended by Python inside torch's wait,
which aborts the process ("terminate called without an active exception").
So the process sends the ``stop`` of every pipeline it still has open, then
waits until each peer has answered (or its connection broke), which its
listener does whatever that process is doing: in a step, in a collective,
or exiting too. Only a peer that cannot run at all (stopped, or stuck
holding the interpreter) delays this exit, by ``_EXIT_WAIT_S`` at most.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable, Hashable, Iterable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from pipeline.distributed.groups import retire
from pipeline.distributed.wire_format import (
    ABORT,
    DATA,
    DEFAULT_MAX_MESSAGE_BYTES,
    ENVELOPE_BYTES,
    HEAD_BYTES,
    STOP,
    KnownValues,
    Layout,
    MalformedMessageError,
    TensorSlot,
    decode,
    encode,
    head,
    layout,
    read_head,
)
from pipeline.runtime.process_group import collective_device
from pipeline.step.mail import AbortedError, Mailboxes, MailTimeoutError, Message, describe

__all__ = ["DONE_KEYS", "END_KEYS", "ROUTER_KEYS", "P2PTransport", "PeerError"]

_TAG = 0
# Small messages of a step besides its stages' (a sum passed up the ranks and back down:
# the router loss's, the step's end): the room stays what the stages' messages made it,
# or the next step's first activation would not fit and take a send more.
ROUTER_KEYS = ("router-up", "router-down")
DONE_KEYS = ("done-up", "done-down")
END_KEYS = ("end-up", "end-down")
_ASIDE = frozenset(ROUTER_KEYS + DONE_KEYS + END_KEYS)

# How long closing waits for its own stop messages to leave, at most: a
# live peer's listener takes them at once; a dead one fails them at once.
_CLOSE_WAIT_S = 5.0

# How long a process that exits waits for its peers to answer its stops, at
# most: a live peer's listener answers at once.
_EXIT_WAIT_S = 10.0

_Receipt = tuple[dist.Work, torch.Tensor]


class PeerError(RuntimeError):
    """Another process of the pipeline failed, died, stalled, closed or sent a malformed message."""


class _RelayedError(PeerError):
    """A peer's abort, which this process's listener passed on to its other peers at once."""


class P2PTransport:
    """The transport of one process: local stages by mail, remote ones by sends on ``wire``.

    ``owner[s]`` is the rank in ``group`` that runs stage ``s``; ``peers`` the
    ranks this one exchanges messages with. ``wire`` has the same processes
    as ``group`` and carries nothing else (its receives wait between steps).
    A message's tensors may hold ``max_message_bytes`` together, in either
    direction. Call ``begin_step`` and ``end_step`` around each step, and
    ``close`` once.
    """

    def __init__(
        self,
        group: dist.ProcessGroup,
        wires: tuple[dist.ProcessGroup, dist.ProcessGroup],
        owner: list[int],
        peers: Iterable[int],
        devices: list[torch.device],
        timeout: float,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    ) -> None:
        self.group = group
        self.wires: tuple[dist.ProcessGroup, ...] = wires
        self.me = dist.get_rank(group)
        self.owner = owner
        self.peers = sorted(set(peers) - {self.me})
        # Sends and receives call the groups' own methods, by rank in the wires.
        self._wire_rank = {
            peer: dist.get_group_rank(wires[0], dist.get_global_rank(group, peer))
            for peer in self.peers
        }
        # How messages name a process: its rank in the pipeline, and in the job where the
        # pipeline is a subgroup (a pp x dp grid's pipeline of ranks 2 and 3).
        self._named = {
            rank: f"rank {rank}" + (f" (job rank {job})" if job != rank else "")
            for rank in {self.me, *self.peers}
            for job in [dist.get_global_rank(group, rank)]
        }
        self.devices = devices
        self.timeout = timeout
        self.max_message_bytes = max_message_bytes
        self.wire = collective_device(wires[0])
        self.step = 0
        self._received: dict[int, Counter[tuple[int, str]]] = {}
        self._received_lock = threading.Lock()
        self._mailboxes = Mailboxes(timeout)
        # Each peer's recent descriptions, decoded: read by its listener alone.
        self._known = {peer: KnownValues() for peer in self.peers}
        self._send_locks = {peer: threading.Lock() for peer in self.peers}
        # The room each peer's listener posted for the next envelope from here (under the
        # peer's send lock); its listener keeps the same number (wire_format.layout).
        self._room = dict.fromkeys(self.peers, ENVELOPE_BYTES)
        # Sends posted and not yet waited for, by peer: the tensors they read stay alive.
        self._pending: dict[int, list[tuple[dist.Work, torch.Tensor]]] = {}
        self._pending_lock = threading.Lock()
        self._closing = False
        self._stops_sent: set[int] = set()
        self._stops_lock = threading.Lock()
        # Why a peer is no longer listened to (it closed, broke or misbehaved).
        self._gone: dict[int, str] = {}
        self._left: set[int] = set()  # of those gone, the peers that closed or died
        self._gone_lock = threading.Lock()
        self._listeners = [
            threading.Thread(
                target=self._listen, args=(peer,), name=f"pipe-p2p-from-{peer}", daemon=True
            )
            for peer in self.peers
        ]
        for listener in self._listeners:
            listener.start()
        _at_exit.add(self)

    # Steps

    def begin_step(self) -> None:
        self.step += 1
        with self._received_lock:
            self._received = {s: c for s, c in self._received.items() if s >= self.step}
        self._mailboxes.begin(self.step)

    def end_step(self) -> None:
        """Wait until this step's sends are done (their tensors may then be freed)."""
        try:
            self._wait_for_sends(self.timeout)
        except RuntimeError as error:
            raise PeerError(f"a send of step {self.step} did not complete: {error}") from error

    def _wait_for_sends(self, seconds: float, peers: Iterable[int] | None = None) -> None:
        """Wait for the sends posted so far (to ``peers``; all), ``seconds`` at most for all.

        Their tensors are let go of as they complete: a stage's output, kept
        only for its send, is freed then, not at the step's end.
        """
        with self._pending_lock:
            chosen = list(self._pending) if peers is None else list(peers)
            pending = [send for peer in chosen for send in self._pending.pop(peer, [])]
        deadline = time.monotonic() + seconds
        while pending:
            work, _ = pending.pop(0)
            # gloo reads a zero timeout as none at all: never pass one.
            work.wait(timedelta(seconds=max(deadline - time.monotonic(), 0.001)))

    def check_peers(self) -> None:
        """Raise PeerError if a peer closed its pipeline, broke its connection or misbehaved."""
        with self._gone_lock:
            reasons = list(self._gone.values())
        if reasons:
            raise PeerError(f"{'; '.join(reasons)}: this pipeline cannot run another step")

    def alone(self) -> bool:
        """Whether every other process of the pipeline closed it or died: none would meet
        this one's collectives, which would wait their whole timeout. (One that sent a
        malformed message may still take part in them.)"""
        with self._gone_lock:
            return set(self.owner) - {self.me} <= self._left

    def explain(self, what: str, error: Exception) -> PeerError:
        """``error``, which ended a collective of the pipeline, naming the peers that left.

        A process that exits (its script raised) sends its stops first and
        its connections close then, so the collective fails at once and the
        listeners learn from whom within moments: wait a few seconds for them.
        """
        self.wait_for_listeners()
        with self._gone_lock:
            reasons = list(self._gone.values())
        because = f" ({'; '.join(reasons)})" if reasons else ""
        return PeerError(f"{what} failed{because}: {error}")

    # Transport

    def send(self, key: Hashable, message: Message, source: int, target: int, i: int) -> None:
        peer = self.owner[target]
        if peer == self.me:
            self._mailboxes.put(self.step, key, message)
            return

        def where() -> str:
            return (
                f"{describe(key)} that stage {source} sends to stage {target} ({self._named[peer]})"
            )

        with self._gone_lock:
            gone = self._gone.get(peer)
        if gone is not None:
            # A peer that failed the step aborts it before it closes (one
            # listener files both, in order): its failure is the reason.
            self._mailboxes.check(self.step)
            raise PeerError(f"cannot send {where()}: {gone}")
        self._post(peer, DATA, (self.step, key), message, where)

    def receive(self, key: Hashable, source: int, target: int) -> Message:
        peer = self.owner[source]
        where = "this process" if peer == self.me else self._named[peer]
        waiting_for = f"{describe(key)} from stage {source} ({where})"
        try:
            message = self._mailboxes.take(self.step, key, waiting_for, sender=peer)
        except MailTimeoutError as error:
            raise PeerError(
                f"{error}: that process is stalled or dead (raise the pipeline's timeout if its "
                "steps are slow)"
            ) from None
        device = self.devices[target]
        leaves = [
            x.wait(self.timeout, f"{waiting_for}, mid-message") if isinstance(x, _Arriving) else x
            for x in message.leaves
        ]
        return Message(
            [x.to(device) if isinstance(x, torch.Tensor) else x for x in leaves],
            message.spec,
            message.differentiable,
            sharing=message.sharing,
        )

    @property
    def apart(self) -> bool:
        return True  # other processes' stages receive copies

    def abort(self, error: BaseException | None = None) -> None:
        reason = error if error is not None else AbortedError("interrupted")
        if not self._mailboxes.abort(self.step, reason):
            return  # aborted already: the peers were told
        if isinstance(error, AbortedError) and isinstance(error.__cause__, _RelayedError):
            return  # a peer's abort reached this process: its listener passed it on
        # Else this process's own failure, or a wait that failed on a peer that closed or
        # died: the peers beyond it would not hear of it otherwise, and wait their timeout.
        summary = " ".join(
            [f"{self._named[self.me]} failed: {type(reason).__name__}: {reason}", *_notes(reason)]
        )
        self._tell_peers(self.step, summary, but=None)

    def _tell_peers(self, step: int, summary: str, but: int | None) -> None:
        """Send ``step``'s abort to every peer except ``but``."""
        for peer in self.peers:
            if peer == but:
                continue
            try:
                self._post(peer, ABORT, step, Message([summary]), lambda: "an abort")
            except Exception:
                continue

    def check(self) -> None:
        self._mailboxes.check(self.step)

    def received(self) -> dict[tuple[int, str], int]:
        """The stages' messages of this step that came from other processes (not the
        step's own sums and agreements): {(rank, kind): count}."""
        with self._received_lock:
            return dict(self._received.get(self.step, {}))

    def close(self) -> None:
        """Tell every peer that this process is done; wait only for these messages to leave.

        Each peer's listener takes the stop whatever that process is doing, so
        this ends within seconds and never waits for a peer to close in turn.
        The wait itself matters: a send dropped before it is done may never
        arrive, and the peer's listener would go on waiting for it. The
        message groups are retired, to be destroyed once the listeners end
        (``groups.py``).
        """
        if self._closing:
            return
        self._closing = True
        for peer in self.peers:
            self._send_stop(peer)
        with contextlib.suppress(RuntimeError):
            self._wait_for_sends(min(self.timeout, _CLOSE_WAIT_S))
        retire(self)

    def idle(self) -> bool:
        """Whether every listener has ended: nothing travels on the wires any more."""
        return not any(listener.is_alive() for listener in self._listeners)

    def take_groups(self) -> list[dist.ProcessGroup]:
        """The wires, forgotten here (once idle: their last use is a listener's).

        So is what a failed step left in the mailboxes: its error's frames
        hold receives posted on the wires, which would keep them alive.
        """
        self._mailboxes.begin(self.step + 1)
        wires, self.wires = list(self.wires), ()
        return wires

    def wait_for_listeners(self) -> None:
        """Wait a few seconds at most for the listeners to end (at their peers' stops)."""
        deadline = time.monotonic() + _CLOSE_WAIT_S
        for listener in self._listeners:
            if listener is not threading.current_thread():
                listener.join(max(deadline - time.monotonic(), 0.0))

    def _send_stop(self, peer: int) -> None:
        """Tell ``peer`` that this process sends it nothing more (once)."""
        with self._stops_lock:
            if peer in self._stops_sent:
                return
            self._stops_sent.add(peer)
        with contextlib.suppress(Exception):
            self._post(peer, STOP, 0, Message([]), lambda: "a stop")

    # Wire

    def _post(
        self, peer: int, kind: int, key: Any, message: Message, where: Callable[[], str]
    ) -> None:
        """Send ``message`` to ``peer``; refused before anything is sent if it cannot travel."""
        description, tensors = encode(
            key,
            message.leaves,
            message.spec,
            message.differentiable,
            where,
            self.max_message_bytes,
            message.sharing,
        )
        with self._send_locks[peer]:
            if kind == DATA:
                # The peer's listener has taken the earlier messages by now
                # (it posts their receives as their envelopes come): their
                # tensors, stage outputs among them, need not live longer.
                try:
                    self._wait_for_sends(self.timeout, [peer])
                except RuntimeError as error:
                    raise PeerError(
                        f"a send to {self._named[peer]} did not complete: {error}"
                    ) from error
            # Framed whole, on the wire, before its first part goes: a part that failed
            # after the envelope had left would leave the peer reading what comes next
            # (an abort) as its bytes.
            for part in self._parts(peer, kind, description, tensors, _aside(key)):
                work = self._wire(self.me, peer).send([part], self._wire_rank[peer], _TAG)
                with self._pending_lock:
                    self._pending.setdefault(peer, []).append((work, part))

    def _parts(
        self,
        peer: int,
        kind: int,
        description: bytes,
        tensors: list[torch.Tensor],
        aside: bool = False,
    ) -> list[torch.Tensor]:
        """A message's sends to ``peer``, on the wire: its envelope, then what did not fit in
        the room. The room moves on once nothing can stop the message from going, but for a
        message ``aside`` (``_aside``)."""
        laid = layout(self._room[peer], len(description), [t.nbytes for t in tensors])
        first = head(kind, description, len(tensors), laid.description_inline)
        if laid.offsets is None:
            parts = [torch.frombuffer(bytearray(first), dtype=torch.uint8)]
            if not laid.description_inline:
                parts.append(torch.frombuffer(bytearray(description), dtype=torch.uint8))
            parts += [_raw_bytes(t) for t in tensors]
        else:
            envelope = torch.empty(laid.size, dtype=torch.uint8, device=self.wire)
            end = len(first)
            envelope[:end].copy_(torch.frombuffer(bytearray(first), dtype=torch.uint8))
            for tensor, at in zip(tensors, laid.offsets, strict=True):
                envelope[end:at].zero_()  # the padding: nothing of this process's memory leaks
                end = at + tensor.nbytes
                envelope[at:end].copy_(_raw_bytes(tensor))
            parts = [envelope]
        parts = [part.to(self.wire) for part in parts]
        if not aside:  # the peer's listener moves on once it has this one
            self._room[peer] = laid.next_room
        return parts

    def _listen(self, peer: int) -> None:
        try:
            envelope = self._expect(_buffer(ENVELOPE_BYTES), peer)
            while True:
                kind, key, message, envelope = self._receive_one(peer, envelope)
                if kind == STOP:
                    # Not a failure: every message the peer sent came before
                    # its stop and is filed, and a peer that is done with a
                    # step may close while this process finishes it. Only a
                    # wait for more from it and a send to it fail, and the
                    # next step is refused (check_peers).
                    reason = (
                        f"{self._named[peer]} closed its pipeline (its script ended or raised, "
                        "or it called close())"
                    )
                    self._gone_because(peer, reason, left=True)
                    self._mailboxes.stopped(peer, PeerError(reason))
                    self._send_stop(peer)  # its listener, waiting for this one's, can end
                    return
                if kind == ABORT:
                    # Passed on at once, whatever this process is doing: the
                    # processes beyond it are not the failed one's neighbours.
                    summary = str(message.leaves[0])
                    if self._mailboxes.abort(key, _RelayedError(summary)):
                        self._tell_peers(key, summary, but=peer)
                    continue
                if not _aside(key):  # the report counts the stages' messages
                    with self._received_lock:
                        self._received.setdefault(key[0], Counter())[peer, _kind(key[1])] += 1
                self._mailboxes.put(key[0], key[1], message)
        except MalformedMessageError as error:
            self._leave(
                peer,
                f"{self._named[peer]} sent a malformed message ({error}), so this process stopped "
                "listening to it (a peer of another version, or not a pipeline process)",
            )
        except Exception as error:
            self._leave(peer, f"lost the connection to {self._named[peer]}: {error}", left=True)

    def _leave(self, peer: int, reason: str, left: bool = False) -> None:
        """``peer`` broke (``left``) or misbehaved: every wait, now and later, fails with
        ``reason``."""
        self._gone_because(peer, reason, left)
        if not self._closing:
            self._mailboxes.break_down(PeerError(reason))

    def _gone_because(self, peer: int, reason: str, left: bool = False) -> None:
        """``peer`` is no longer listened to, for ``reason`` (the first one stays); ``left``:
        it closed its pipeline or its connection broke."""
        with self._gone_lock:
            self._gone.setdefault(peer, reason)
            if left:
                self._left.add(peer)

    def _wire(self, sender: int, receiver: int) -> dist.ProcessGroup:
        """The group for messages from ``sender`` to ``receiver``: one per direction.

        Each direction has its own connection, so a process's sends and its
        receives from the same peer do not take turns on one socket.
        """
        return self.wires[0 if sender < receiver else 1]

    def _expect(self, buffer: torch.Tensor, peer: int) -> _Receipt:
        """Post the receive of ``buffer``'s next message from ``peer``; wait for it later."""
        on_wire = buffer.to(self.wire)
        return self._wire(peer, self.me).recv([on_wire], self._wire_rank[peer], _TAG), on_wire

    def _receive_one(self, peer: int, envelope: _Receipt) -> tuple[int, Any, Message, _Receipt]:
        """The message whose envelope was expected, and the next message's envelope, expected.

        Nothing a peer announces is allocated before it is checked.
        """
        received = _waited(envelope)
        room = received.numel()
        kind, length, count = read_head(_bytes_of(received, 0, HEAD_BYTES))
        if HEAD_BYTES + length <= room:
            description = _bytes_of(received, HEAD_BYTES, length)
        else:
            description = _bytes_of(_waited(self._expect(_buffer(length), peer)), 0, length)
        described = decode(description, kind, count, self.max_message_bytes, self._known[peer])
        slots = dict(described.slots())
        laid = layout(room, length, [slot.nbytes for slot in slots.values()])
        tensors: dict[int, torch.Tensor | _Arriving] = (
            _inline(received, laid, slots)
            if laid.offsets is not None
            else {
                k: _Arriving(self._expect(_buffer(slot.nbytes), peer), slot)
                for k, slot in slots.items()
            }
        )
        if kind != STOP:
            # What this envelope held is copied out by now: the next one may come in it.
            next_room = room if _aside(described.key) else laid.next_room
            reused = received if room == next_room else _buffer(next_room)
            envelope = self._expect(reused, peer)
        values = [tensors.get(k, leaf) for k, leaf in enumerate(described.leaves)]
        message = Message(
            values, described.spec, described.differentiable, sharing=described.sharing
        )
        return kind, described.key, message, envelope


def _aside(key: Any) -> bool:
    """Whether a message's key, ``(step, (name, ...))``, is one of ``_ASIDE``'s."""
    if not (isinstance(key, tuple) and len(key) == 2 and isinstance(key[1], tuple)):
        return False
    return bool(key[1]) and key[1][0] in _ASIDE


class _ListenersAtExit:
    """The transports of this process, whose listeners must end before the interpreter does."""

    def __init__(self) -> None:
        self._transports: weakref.WeakSet[P2PTransport] = weakref.WeakSet()
        self._registered = False

    def add(self, transport: P2PTransport) -> None:
        if not self._registered:
            atexit.register(self.end)
            self._registered = True
        self._transports.add(transport)

    def end(self) -> None:
        """Close every transport, then wait (bounded) until every listener has ended."""
        transports = list(self._transports)
        for transport in transports:
            transport.close()
        deadline = time.monotonic() + _EXIT_WAIT_S
        for transport in transports:
            for listener in transport._listeners:
                listener.join(max(deadline - time.monotonic(), 0.0))


_at_exit = _ListenersAtExit()


class _Arriving:
    """A tensor of a message whose receive is posted: the action that takes it waits for it.

    Waiting there, not on the listener, lets the listener expect the next
    message at once and spares a hand-over between threads on the way.
    """

    __slots__ = ("receipt", "slot")

    def __init__(self, receipt: _Receipt, slot: TensorSlot) -> None:
        self.receipt = receipt
        self.slot = slot

    def wait(self, timeout: float, waiting_for: str) -> torch.Tensor:
        work, buffer = self.receipt
        try:
            work.wait(timedelta(seconds=timeout))
        except RuntimeError as error:
            raise PeerError(f"lost {waiting_for}: {error}") from error
        return buffer.view(self.slot.dtype).reshape(self.slot.shape)


def _notes(error: BaseException) -> list[str]:
    notes: list[str] = getattr(error, "__notes__", [])
    return notes


def _bytes_of(buffer: torch.Tensor, start: int, length: int) -> bytes:
    """``length`` bytes of a uint8 tensor from ``start`` (which the caller checked fit)."""
    if buffer.is_cuda:
        return _bytes_of(buffer[start : start + length].cpu(), 0, length)
    return ctypes.string_at(buffer.data_ptr() + start, length)


def _waited(receipt: _Receipt) -> torch.Tensor:
    work, buffer = receipt
    work.wait()
    return buffer


def _buffer(nbytes: int) -> torch.Tensor:
    """An empty buffer for ``nbytes`` of a message (``_expect`` moves it to the wire's device)."""
    return torch.empty(nbytes, dtype=torch.uint8)


def _inline(
    envelope: torch.Tensor, laid: Layout, slots: dict[int, TensorSlot]
) -> dict[int, torch.Tensor | _Arriving]:
    """The tensors an envelope holds, each copied out of it: a view would keep the whole
    envelope alive as long as the tensor (autograd saves a stage's input), head and room
    included, so that what a stage holds would no longer be what it received."""
    assert laid.offsets is not None
    tensors: dict[int, torch.Tensor | _Arriving] = {
        k: envelope[at : at + slot.nbytes].view(slot.dtype).reshape(slot.shape).clone()
        for (k, slot), at in zip(slots.items(), laid.offsets, strict=True)
    }
    if envelope.is_cuda:
        # Copied on this listener's stream: done before any action's stream reads them.
        torch.cuda.current_stream(envelope.device).synchronize()
    return tensors


def _raw_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes of ``tensor``'s values: a conjugate or negative view's resolved first."""
    values = tensor.detach().resolve_conj().resolve_neg()
    return values.contiguous().reshape(-1).view(torch.uint8)


def _kind(key: Hashable) -> str:
    return key[0] if isinstance(key, tuple) and key and isinstance(key[0], str) else "other"
