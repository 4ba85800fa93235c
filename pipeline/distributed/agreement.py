"""Comparing values across the processes of a group: fixed-size rows of 64-bit hashes, no pickle.

Each process encodes what must agree as a row of int64s of a length every
process knows in advance (one entry per value, a text as its hash), and one
``all_gather`` gives every process every row. A mismatch is then seen by
all of them at once, so they all raise, naming the ranks that agree with
each other, instead of some waiting in a later collective whose sizes no
longer match (gloo aborts such a process).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch
import torch.distributed as dist

from pipeline.runtime.process_group import collective_device

__all__ = ["camps", "fingerprint", "gather_rows", "ranks_text", "refused_text"]


def fingerprint(text: str) -> int:
    """A signed 64-bit hash of ``text``, alike in every process (``hash()`` is salted)."""
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def gather_rows(row: Sequence[int], group: dist.ProcessGroup) -> list[list[int]]:
    """Every rank's ``row``, by group rank; every rank must give a row of the same length."""
    device = collective_device(group)
    mine = torch.tensor(list(row), dtype=torch.int64, device=device)
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(rows, mine, group=group)
    return [[int(v) for v in r.tolist()] for r in rows]


def camps(values: Sequence[int]) -> list[list[int]]:
    """The ranks (indices of ``values``) holding each distinct value, by their first rank."""
    found: dict[int, list[int]] = {}
    for rank, value in enumerate(values):
        found.setdefault(value, []).append(rank)
    return list(found.values())


def ranks_text(groups: Sequence[Sequence[int]]) -> str:
    """``ranks [0, 2] and ranks [1]`` (or ``ranks [0], ranks [1] and ranks [2]``)."""
    parts = [f"ranks {list(g)}" for g in groups]
    return parts[0] if len(parts) == 1 else f"{', '.join(parts[:-1])} and {parts[-1]}"


def refused_text(refused: Sequence[int]) -> str:
    """``rank 1`` or ``ranks 0 and 2``: the processes that refused their arguments."""
    if len(refused) == 1:
        return f"rank {refused[0]}"
    return f"ranks {', '.join(map(str, refused[:-1]))} and {refused[-1]}"
