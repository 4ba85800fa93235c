"""The process groups a DistributedPipe makes, and how they are given back once it is closed.

A pipeline makes two groups for its messages (one per direction) and one per
set of processes holding a tied weight. Each holds connections, threads and
file descriptors in every process (a gloo group of two: 3 threads and 5
descriptors, measured), so a process building pipelines one after another
would run out of descriptors if they outlived their pipeline. torch's
``destroy_process_group`` drops torch's own references to a group; its
threads and descriptors go with the last one, so the pipeline's holder of
the group forgets it too.

Closing never waits for a peer, so each process gives its groups back on
its own, in whatever order its pipes close. With gloo that is this
process's business alone: destroying a group closes its own connections
(measured: a peer that keeps the group longer is not disturbed). A message
group is given back only once this process's listeners on it have ended,
at their peers' stops: no receive is pending on it then, and none will
come. A group whose listener still waits (a stalled peer) is kept, and
tried again at the next chance.

A destroy changes torch.distributed's registries of groups, which garbage
collection may interrupt (it runs a pipe's finalizer wherever an
allocation triggers it, inside torch.distributed's own code too). So
closing only retires the groups here; they are destroyed at safe points:
an explicit ``close()``, and the construction of the next pipeline.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Protocol, cast

import torch.distributed as dist

__all__ = ["GroupHolder", "give_back", "message_groups", "retire"]

# For the message groups' blocking receives, which wait between steps too.
_NEVER = timedelta(days=365)


class GroupHolder(Protocol):
    """What holds a closed pipeline's groups: the transport (its listeners), the tied weights."""

    def idle(self) -> bool:
        """Whether nothing can travel on the groups any more (a listener may still receive)."""

    def take_groups(self) -> list[dist.ProcessGroup]:
        """The groups, which the holder forgets: the last reference goes with the destroy."""


_retired: list[GroupHolder] = []
_retired_lock = threading.Lock()


def message_groups(pipelines: list[list[int]]) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """Two groups of this pipeline's processes for its messages alone, one per direction.

    Collective over the job. Each process listens to its peers with a
    blocking receive between steps too, for as long as the pipeline lives; a
    receive that times out closes the connection (gloo), so these groups
    never time out and must not be the user's, whose collectives keep their
    own timeout. A stalled peer is caught by the transport's own timeout
    instead. Closed pipelines' groups are given back first.
    """
    give_back()
    wires = []
    for _ in ("down", "up"):
        wire, _ = dist.new_subgroups_by_enumeration(pipelines, timeout=_NEVER)
        assert wire is not None, "every process is in one of the pipelines"
        wires.append(cast(dist.ProcessGroup, wire))
    return wires[0], wires[1]


def retire(holder: GroupHolder) -> None:
    """Hand over a closed pipeline's ``holder``, whose groups go once it is idle."""
    with _retired_lock:
        _retired.append(holder)


def give_back() -> None:
    """Destroy the groups of every retired holder that is idle (it waits for none).

    Call it where garbage collection cannot have interrupted torch.distributed:
    from this library's own code, never from a finalizer.
    """
    with _retired_lock:
        idle = [holder for holder in _retired if holder.idle()]
        _retired[:] = [holder for holder in _retired if holder not in idle]
    for holder in idle:
        for group in holder.take_groups():
            _destroy(group)


def _destroy(group: dist.ProcessGroup) -> None:
    """Destroy ``group``, unless the whole job's groups already were (at exit)."""
    if not dist.is_initialized():
        return  # destroy_process_group() destroyed every group
    try:
        dist.destroy_process_group(group)
    except ValueError:
        # torch's "Invalid process group": every group was destroyed, and the
        # default group made anew since (a job that restarted its groups).
        return
