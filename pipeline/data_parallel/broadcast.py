"""Coalesced broadcast from rank 0: make every replica's tensors equal to rank 0's."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from pipeline.data_parallel.buckets import assign_buckets

# Large messages amortise the per-collective cost; torch's DDP uses the same
# 250 MiB when it broadcasts a model's state at construction.
BROADCAST_CAP_BYTES = 250 * 2**20


@torch.no_grad()
def broadcast_from_rank0(
    tensors: Sequence[torch.Tensor], group: dist.ProcessGroup, what: str
) -> None:
    """Overwrite `tensors` in place with rank 0's values, one flat message per bucket.

    `what` names the tensors in the error raised when the collective fails or
    times out (for example "parameters and buffers").
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
                f"DataParallel: broadcast of {what} from rank 0 failed or timed out "
                f"on rank {dist.get_rank(group)}: {error}"
            ) from error
        if dist.get_rank(group) == 0:
            continue  # rank 0's tensors already hold the values it sent
        for tensor, part in zip(members, flat.split([t.numel() for t in members]), strict=True):
            tensor.copy_(part.view_as(tensor))
