"""Comparing values across the processes of a group: fixed-size rows of 64-bit hashes, no pickle.

Each process encodes what must agree as a row of int64s of a length every
process knows in advance (one entry per value, a text as its hash), and one
``all_gather`` gives every process every row. A mismatch is then seen by
all of them at once, so they all raise, naming the ranks that agree with
each other, instead of some waiting in a later collective whose sizes no
longer match (gloo aborts such a process). Where a mismatch needs
explaining, ``gather_texts`` brings every process's text, its length agreed
and bounded first: texts are data, and nothing received is unpickled. A
rank that refused its arguments says so in its row's first entry, with the
kind of its error (``refusal_entry``): the others raise one of that kind,
naming it, and saying why where its text travels too (``refusal_heard``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch
import torch.distributed as dist

from pipeline.runtime.process_group import collective_device

__all__ = [
    "camps",
    "fingerprint",
    "gather_rows",
    "gather_texts",
    "ranks_text",
    "refusal_elsewhere",
    "refusal_entry",
    "refusal_heard",
    "refusal_texts",
    "refused_text",
]


def fingerprint(text: str) -> int:
    """A signed 64-bit hash of ``text``, alike in every process (``hash()`` is salted)."""
    digest = hashlib.blake2b(_utf8(text), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def gather_rows(row: Sequence[int], group: dist.ProcessGroup) -> list[list[int]]:
    """Every rank's ``row``, by group rank; every rank must give a row of the same length."""
    device = collective_device(group)
    mine = torch.tensor(list(row), dtype=torch.int64, device=device)
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(rows, mine, group=group)
    return [[int(v) for v in r.tolist()] for r in rows]


def _utf8(text: str) -> bytes:
    """``text`` as UTF-8, a lone surrogate (a file name decoded by ``os.fsdecode``) escaped:
    a text that failed to encode on one rank would leave the others waiting for it."""
    return text.encode("utf-8", "backslashreplace")


def gather_texts(text: str, group: dist.ProcessGroup, limit: int) -> list[str] | None:
    """Every rank's ``text``, by group rank; None (on every rank) if one is over ``limit`` bytes.

    The lengths travel first, in a row of their own, so that no rank
    allocates more than ``limit`` bytes for another's text.
    """
    data = _utf8(text)
    lengths = [row[0] for row in gather_rows([len(data)], group)]
    if any(not 0 <= n <= limit for n in lengths):
        return None
    if not any(lengths):
        return ["" for _ in lengths]
    padded = torch.zeros(max(lengths), dtype=torch.uint8, device=collective_device(group))
    if data:
        padded[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    received = [torch.empty_like(padded) for _ in lengths]
    dist.all_gather(received, padded, group=group)
    # tolist() rather than NumPy, which this library does not need.
    return [
        bytes(t[:n].tolist()).decode("utf-8", "replace")
        for t, n in zip(received, lengths, strict=True)
    ]


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


# A row's first entry where its rank refused with an error that is not the library's own
# ValueError: the others raise a plain ValueError.
_PLAIN_REFUSAL = 1
# The most of a refusal's text that travels to the other ranks.
REFUSAL_TEXT_LIMIT = 4096


def refusal_entry(refusal: BaseException | None) -> int:
    """A row's first entry: 0 where nothing was refused, else the refusal's kind.

    The kind is the hash of the name of the library's own ``ValueError``
    (``ProgramError``, ...) that the refusal is, so that the other ranks
    raise it too; 1 for any other error.
    """
    if refusal is None:
        return 0
    kinds = _library_kinds()
    kind = next((k for k in type(refusal).__mro__ if k in kinds), None)
    return _PLAIN_REFUSAL if kind is None else _kind_entry(kind)


def _kind_entry(kind: type) -> int:
    return fingerprint(f"{kind.__module__}.{kind.__qualname__}")


def _library_kinds(base: type[ValueError] = ValueError) -> list[type[ValueError]]:
    """The library's own subclasses of ``base``, found by their module: the refusing rank's
    kind is one of those the others import, where the runtime imports none of them."""
    found: list[type[ValueError]] = []
    for kind in base.__subclasses__():
        if kind.__module__.split(".")[0] == __name__.split(".")[0]:
            found.append(kind)
        found += _library_kinds(kind)
    return found


def _refused_kind(entry: int) -> type[ValueError]:
    """The error a row's first entry names (``refusal_entry``): ValueError where none."""
    return next((k for k in _library_kinds() if _kind_entry(k) == entry), ValueError)


def refusal_elsewhere(
    rows: Sequence[Sequence[int]], what: str, undone: str, texts: Sequence[str] | None = None
) -> ValueError | None:
    """The error naming the ranks whose row's first entry is not 0 (they refused ``what``),
    or None; of the first one's kind (``refusal_entry``), saying why with its text in
    ``texts`` (every rank's, by rank) where given.

    ``undone``: what no process did, since one refused.
    """
    refused = [rank for rank, row in enumerate(rows) if row[0]]
    if not refused:
        return None
    first = refused[0]
    said = texts[first] if texts else ""
    why = f"(rank {first}: {said})" if said else "(its error says why)"
    kind = _refused_kind(rows[first][0])
    return kind(f"{refused_text(refused)} {what} {why}; {undone}")


def refusal_heard(
    refusal: Exception | None,
    rows: Sequence[Sequence[int]],
    group: dist.ProcessGroup,
    what: str,
    undone: str,
) -> Exception | None:
    """``refusal``, or the error of a rank that refused (``refusal_elsewhere``, saying why),
    or None; ``rows`` gathered from ``refusal_entry`` rows.

    A collective over ``group`` where a row says that its rank refused: the
    refusals' texts travel (every rank sees the rows, so all of them take
    part).
    """
    if not any(row[0] for row in rows):
        return refusal
    texts = refusal_texts("" if refusal is None else str(refusal), group)
    return refusal or refusal_elsewhere(rows, what, undone, texts)


def refusal_texts(text: str, group: dist.ProcessGroup) -> list[str]:
    """Every rank's refusal ``text`` (empty where none), each clipped to the limit."""
    clipped = _utf8(text)[:REFUSAL_TEXT_LIMIT].decode("utf-8", "ignore")
    return gather_texts(clipped, group, REFUSAL_TEXT_LIMIT) or []


def refused_text(refused: Sequence[int]) -> str:
    """``rank 1`` or ``ranks 0 and 2``: the processes that refused their arguments."""
    if len(refused) == 1:
        return f"rank {refused[0]}"
    return f"ranks {', '.join(map(str, refused[:-1]))} and {refused[-1]}"
