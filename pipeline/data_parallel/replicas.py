"""Replicas: every rank holds the same model, checked before any exchange, and starts from
rank 0's values.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from pipeline.data_parallel.buckets import NO_PARTITION, assign_buckets, partition_of_each
from pipeline.runtime.agreement import camps, fingerprint, gather_rows, gather_texts, ranks_text

# DataParallel's keyword arguments, by name.
Options = Mapping[str, float | bool]

# The fields in which replicas of different models differ (as opposed to
# replicas of one model split or placed differently).
MODEL_FIELDS = ("shape", "dtype", "requires_grad")

SAME_MODEL = (
    "every rank must build the same model (same layers, shapes, dtypes and frozen parameters)"
)
SAME_BALANCE = (
    "build every replica's Pipe with the same balance (compute it once on rank 0 and "
    "broadcast it, or pass it explicitly)"
)
SAME_PLACEMENT = (
    "place the layers on every rank's devices in the same pattern (tensors that share a "
    "device on one rank must share one on every rank)"
)
SAME_OPTIONS = "pass the same options to DataParallel on every rank"


class TensorSignature(NamedTuple):
    """What must agree across ranks for one parameter or buffer."""

    kind: str
    name: str
    shape: tuple[int, ...]
    dtype: str
    requires_grad: bool
    # Buckets never span two pipeline partitions (NO_PARTITION outside a
    # pipeline, and for buffers, which are only broadcast).
    partition: int
    # Nor two devices. Ranks use different GPUs, so what must agree is the
    # device's number in the order the rank's tensors first use them; the
    # device itself only names it in the error.
    device_slot: int
    device: str


class ReplicaSignature(NamedTuple):
    """Everything that decides which collectives a rank issues and how large they are."""

    tensors: list[TensorSignature]
    options: dict[str, float | bool]


def signature(module: nn.Module, options: Options) -> ReplicaSignature:
    """The module's parameters then buffers, and DataParallel's options, as ranks compare them."""
    named_params = list(module.named_parameters())
    partitions = partition_of_each(module, [p for _, p in named_params])
    if partitions is None:
        partitions = [NO_PARTITION] * len(named_params)
    entries: list[tuple[str, str, torch.Tensor, bool, int]] = [
        ("parameter", name, p, p.requires_grad, j)
        for (name, p), j in zip(named_params, partitions, strict=True)
    ]
    entries += [("buffer", name, b, False, NO_PARTITION) for name, b in module.named_buffers()]
    slots: dict[torch.device, int] = {}
    tensors = [
        TensorSignature(
            kind,
            name,
            tuple(tensor.shape),
            str(tensor.dtype),
            requires_grad,
            partition,
            slots.setdefault(tensor.device, len(slots)),
            str(tensor.device),
        )
        for kind, name, tensor, requires_grad, partition in entries
    ]
    return ReplicaSignature(tensors, dict(options))


def first_difference(reference: ReplicaSignature, other: ReplicaSignature, rank: int) -> str | None:
    """How `other` (rank `rank`) first differs from rank 0's `reference`, and the fix; or None."""
    for mine, theirs in zip(reference.tensors, other.tensors, strict=False):
        difference = _tensor_difference(mine, theirs, rank)
        if difference is not None:
            return difference
    return _count_difference(reference.tensors, other.tensors, rank) or _option_difference(
        reference.options, other.options, rank
    )


def _tensor_difference(mine: TensorSignature, theirs: TensorSignature, rank: int) -> str | None:
    what = f"{mine.kind} '{mine.name}'"
    if (mine.kind, mine.name) != (theirs.kind, theirs.name):
        return (
            f"{what} on rank 0 stands where rank {rank} has {theirs.kind} '{theirs.name}'; "
            f"{SAME_MODEL}"
        )
    for field in MODEL_FIELDS:
        if getattr(mine, field) != getattr(theirs, field):
            return (
                f"{what} has {field} {getattr(mine, field)} on rank 0 but "
                f"{getattr(theirs, field)} on rank {rank}; {SAME_MODEL}"
            )
    if mine.partition != theirs.partition:
        return (
            f"{what} is in {_partition_text(mine.partition)} on rank 0 but "
            f"{_partition_text(theirs.partition)} on rank {rank}: {SAME_BALANCE}"
        )
    if mine.device_slot != theirs.device_slot:
        return (
            f"{what} is on device #{mine.device_slot} ({mine.device}) of rank 0 but on device "
            f"#{theirs.device_slot} ({theirs.device}) of rank {rank}, numbering each rank's "
            f"devices in the order its parameters and buffers first use them: {SAME_PLACEMENT}"
        )
    return None


def _partition_text(partition: int) -> str:
    if partition == NO_PARTITION:
        return "no pipeline partition"
    return f"pipeline partition {partition}"


def _count_difference(
    reference: list[TensorSignature], other: list[TensorSignature], rank: int
) -> str | None:
    if len(reference) == len(other):
        return None
    longer, owner = (reference, 0) if len(reference) > len(other) else (other, rank)
    extra = longer[min(len(reference), len(other))]
    return (
        f"rank 0 has {len(reference)} parameters and buffers but rank {rank} has "
        f"{len(other)}; the first extra one is {extra.kind} '{extra.name}' on rank {owner}; "
        f"{SAME_MODEL}"
    )


def _option_difference(
    reference: Mapping[str, float | bool], other: Mapping[str, float | bool], rank: int
) -> str | None:
    for name, value in reference.items():
        if other.get(name) != value:
            return (
                f"{name} is {value!r} on rank 0 but {other.get(name)!r} on rank {rank}: "
                f"{SAME_OPTIONS}"
            )
    return None


def check_replicas_match(module: nn.Module, options: Options, group: dist.ProcessGroup) -> None:
    """Raise ValueError on every rank if any rank's model or options differ from rank 0's.

    One all-gather of a fixed-size row (a hash of what must agree) finds a
    difference; only then do the ranks exchange their signatures, as JSON
    text whose length is agreed and bounded first (data, never unpickled),
    so that every rank raises the same error naming the first difference,
    instead of some waiting in a later collective, or summing gradient
    buckets laid out differently.
    """
    mine = signature(module, options)
    try:
        hashes = gather_rows([fingerprint(json.dumps(_compared(mine)))], group)
        if len(camps([row[0] for row in hashes])) == 1:
            return
        texts = gather_texts(json.dumps(_as_json(mine)), group, SIGNATURE_LIMIT_BYTES)
    except RuntimeError as error:
        raise RuntimeError(
            "DataParallel: comparing the replicas across ranks (all_gather) failed or timed out "
            f"on rank {dist.get_rank(group)}: {error}"
        ) from error
    if texts is not None:
        signatures = [_from_json(text, rank) for rank, text in enumerate(texts)]
        for rank, other in enumerate(signatures[1:], start=1):
            difference = first_difference(signatures[0], other, rank)
            if difference is not None:
                raise ValueError(f"DataParallel: the replicas differ: {difference}")
    # Signatures too long to exchange (or texts that do not say how they differ).
    raise ValueError(
        f"DataParallel: the replicas differ: {ranks_text(camps([r[0] for r in hashes]))} hold "
        f"different models or options; {SAME_MODEL}, and {SAME_OPTIONS}"
    )


# A signature's text is about 100 bytes per parameter or buffer.
SIGNATURE_LIMIT_BYTES = 256 * 2**20


def _compared(mine: ReplicaSignature) -> list[Any]:
    """What must agree across ranks: the signature without the device names (GPUs differ)."""
    return [[list(t[:-1]) for t in mine.tensors], sorted(mine.options.items())]


def _as_json(mine: ReplicaSignature) -> list[Any]:
    return [[list(t) for t in mine.tensors], mine.options]


def _from_json(text: str, rank: int) -> ReplicaSignature:
    """Rank ``rank``'s signature from its text, every field's type checked."""
    try:
        tensors, options = json.loads(text)
        signature = ReplicaSignature(
            [_tensor_from_json(entry) for entry in tensors],
            {_typed(k, str): _typed(v, bool, int, float) for k, v in options.items()},
        )
    except (ValueError, TypeError, AttributeError, RecursionError) as error:
        raise ValueError(
            f"DataParallel: rank {rank} sent a malformed replica signature ({error})"
        ) from None
    return signature


def _tensor_from_json(entry: list[Any]) -> TensorSignature:
    kind, name, shape, dtype, requires_grad, partition, slot, device = entry
    return TensorSignature(
        _typed(kind, str),
        _typed(name, str),
        tuple(_typed(n, int) for n in shape),
        _typed(dtype, str),
        _typed(requires_grad, bool),
        _typed(partition, int),
        _typed(slot, int),
        _typed(device, str),
    )


def _typed(value: Any, *kinds: type) -> Any:
    if type(value) not in kinds:
        raise TypeError(f"{value!r} where a {' or '.join(k.__name__ for k in kinds)} belongs")
    return value


# Large messages amortise the per-collective cost; torch's DDP uses the same
# 250 MiB when it broadcasts a model's state at construction.
BROADCAST_CAP_BYTES = 250 * 2**20


@torch.no_grad()
def broadcast_from_rank0(
    tensors: Sequence[torch.Tensor], group: dist.ProcessGroup, what: str, who: str = "DataParallel"
) -> None:
    """Overwrite `tensors` in place with rank 0's values, one flat message per bucket.

    `what` names the tensors, and `who` the caller, in the error raised when the
    collective fails or times out (for example "parameters and buffers").
    """
    specs = assign_buckets(
        tensors,
        range(len(tensors)),
        cap_bytes=BROADCAST_CAP_BYTES,
        first_cap_bytes=BROADCAST_CAP_BYTES,
    )
    for spec in specs:
        members = [tensors[i] for i in spec.indices]
        flat = torch.cat([t.detach().reshape(-1) for t in members])
        try:
            dist.broadcast(flat, group=group, group_src=0)
        except RuntimeError as error:
            raise RuntimeError(
                f"{who}: broadcast of {what} from rank 0 failed or timed out "
                f"on rank {dist.get_rank(group)}: {error}"
            ) from error
        if dist.get_rank(group) == 0:
            continue  # rank 0's tensors already hold the values it sent
        for tensor, part in zip(members, flat.split([t.numel() for t in members]), strict=True):
            tensor.copy_(part.view_as(tensor))
