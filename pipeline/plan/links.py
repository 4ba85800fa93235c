"""What crossing a cut between two processes costs: one message per micro-batch each way.

A ``DistributedPipe`` stage sends its output to the next stage's process
after each forward, and that stage sends the output's gradient back after
each backward (or ``I``). The model (docs/plan.md, "Planning a
DistributedPipe"): a message of ``b`` bytes is usable by its receiver
``latency + b * seconds_per_byte`` after the sender's action ends; the
sender does not wait (sends are asynchronous, ``distributed/p2p.py``); the
messages of one cut in one direction go one after another (one connection
per direction). Cuts within one process (interleaved stages on one rank)
cost nothing. The bytes are the profile's (``profile.Saved``): what the
cut's layer returns, and its gradient.

The schedule's programs are played with this by ``linked_programs``: a
link stage between every two stages, whose ``F`` is the activation's
transfer and ``B`` the gradient's, each direction on a worker of its own.

``measure_link`` measures ``latency`` and ``seconds_per_byte`` on the
group's own backend, ranks 0 and 1 sending a small and a large tensor back
and forth; what the pipe's transport adds per message beyond that (its
envelope, its listener thread) is measured with the cost of an action
(``overhead.py``).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pipeline.plan.agreement import from_rank_zero
from pipeline.plan.profile import Saved
from pipeline.runtime.process_group import collective_device
from pipeline.step.actions import Action, Program

__all__ = ["CutSeconds", "Link", "cut_seconds", "linked_programs", "measure_link"]

# The tensors timed by measure_link: a message's latency, and its bytes' cost.
SMALL_BYTES, LARGE_BYTES = 8, 2**22


@dataclass(frozen=True)
class Link:
    """The transport between two processes: seconds per message and per byte."""

    latency: float
    seconds_per_byte: float

    def seconds(self, nbytes: int) -> float:
        """Seconds from a message's send to its receiver holding it.

        >>> Link(1e-4, 1e-9).seconds(10**6)
        0.0011
        """
        return self.latency + nbytes * self.seconds_per_byte


@dataclass(frozen=True)
class CutSeconds:
    """Per cut ``j`` (after stage ``j``): one micro-batch's activation and gradient transfers."""

    forward: tuple[float, ...]
    backward: tuple[float, ...]


def cut_seconds(
    saved: Saved, spans: Sequence[tuple[int, int]], owner: Sequence[int], link: Link
) -> CutSeconds:
    """The transfers of each cut between stages of layers ``spans``, run by ranks ``owner``."""
    forward, backward = [], []
    for j in range(len(spans) - 1):
        crosses = owner[j] != owner[j + 1]
        first, stop = spans[j + 1]
        sent = saved.input_bytes(first, stop, loss=False, kept=True)
        forward.append(link.seconds(sent) if crosses else 0.0)
        backward.append(link.seconds(saved.grad_bytes(spans[j][1])) if crosses else 0.0)
    return CutSeconds(tuple(forward), tuple(backward))


def linked_programs(
    programs: Sequence[Program], stages: int
) -> tuple[list[Program], dict[Action, Action]]:
    """``programs`` with a link stage between every two stages; each played action's original.

    Stage ``s`` becomes ``2 s`` and the link after it ``2 s + 1``: its ``F``
    (the activation's transfer) follows stage ``s``'s forward, in the order
    stage ``s`` sends them; its ``B`` (the gradient's) follows stage
    ``s + 1``'s backward or ``I``, in that stage's order. Each direction of
    each link is a worker of its own, after the stages' workers.

    >>> from pipeline.step.actions import parse_program
    >>> linked, _ = linked_programs([parse_program("0F0 0B0"), parse_program("1F0 1B0")], 2)
    >>> [" ".join(map(str, p)) for p in linked]
    ['0F0 0B0', '2F0 2B0', '1F0', '1B0']
    """
    original: dict[Action, Action] = {}
    linked: list[Program] = []
    for program in programs:
        moved = [Action(2 * a.stage, a.kind, a.microbatch) for a in program]
        original.update(zip(moved, program, strict=True))
        linked.append(moved)
    flat = [a for program in programs for a in program]
    for j in range(stages - 1):
        linked.append([Action(2 * j + 1, "F", a.microbatch) for a in flat
                       if a.stage == j and a.kind == "F"])  # fmt: skip
        linked.append([Action(2 * j + 1, "B", a.microbatch) for a in flat
                       if a.stage == j + 1 and a.kind in ("B", "I")])  # fmt: skip
    return linked, original


def measure_link(group: dist.ProcessGroup, repeats: int) -> Link:
    """The group's transport between ranks 0 and 1, the same on every rank (a collective).

    Half the median round trip of a ``SMALL_BYTES`` tensor is the latency
    (the wait for the peer to wake, which the machine's load sets); the
    extra half round trip of a ``LARGE_BYTES`` one over it, per extra byte,
    the seconds per byte, from the fastest round trip of each (a copy's
    cost, which the load only adds noise to). A group of one process has
    no link: zero.
    """
    if dist.get_world_size(group) < 2:
        return Link(0.0, 0.0)
    small = _round_trips(group, SMALL_BYTES, repeats)
    large = _round_trips(group, LARGE_BYTES, repeats)

    def measured() -> list[float]:
        extra = (min(large) - min(small)) / 2
        return [statistics.median(small) / 2, max(extra, 0.0) / (LARGE_BYTES - SMALL_BYTES)]

    latency, per_byte = from_rank_zero(group, 2, measured)
    return Link(latency, per_byte)


def _round_trips(group: dist.ProcessGroup, nbytes: int, repeats: int) -> list[float]:
    """Rank 0's seconds per round trip of ``nbytes`` to rank 1 and back; the first one warms up.

    Each receive lands in a buffer of its own, as a message of the transport
    does (``p2p.py``): what the allocator costs a message is part of its cost.
    """
    rank = dist.get_rank(group)
    device = collective_device(group)
    sent = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    times: list[float] = []
    for run in range(repeats + 1):
        start = time.perf_counter()
        if rank == 0:
            dist.send(sent, group=group, group_dst=1)
            dist.recv(torch.empty_like(sent), group=group, group_src=1)
        elif rank == 1:
            received = torch.empty_like(sent)
            dist.recv(received, group=group, group_src=0)
            dist.send(received, group=group, group_dst=0)
        if run:
            times.append(time.perf_counter() - start)
    return times
