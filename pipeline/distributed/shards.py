"""Checkpoints of a DistributedPipe: one file per process, loaded back as one state dict.

Each process saves its own layers' state under the plain ``nn.Sequential``'s
keys; the files of one pipeline, merged, are the plain model's state dict,
which loads into the plain model, into a single-process ``Pipe``, and into a
``DistributedPipe`` with any balance or number of processes (each takes its
own layers' keys)::

    if dp_rank == 0:                       # one replica saves
        save_shard(pipe, "ckpt")           # every process of that pipeline
    dist.barrier()
    state = load_shards("ckpt")            # anywhere, any process count
    model.load_state_dict(state)
"""

from __future__ import annotations

import os
import re
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

from pipeline.distributed.pipe import DistributedPipe

__all__ = ["load_shards", "save_shard"]

_NAME = "stages-{rank}-of-{size}.pt"
_PATTERN = re.compile(r"stages-(\d+)-of-(\d+)\.pt$")


def save_shard(pipe: DistributedPipe, directory: str | os.PathLike[str]) -> Path:
    """Save this process's layers (``pipe.state_dict()``) in ``directory``; return the file."""
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / _NAME.format(rank=pipe.rank, size=pipe.size)
    torch.save(pipe.state_dict(), path)
    return path


def load_shards(directory: str | os.PathLike[str]) -> OrderedDict[str, Any]:
    """The whole model's state dict, from the files every process of a pipeline saved.

    Raises ``FileNotFoundError`` naming the missing files when the set is
    incomplete, and ``ValueError`` when two files disagree on a key's value.
    """
    folder = Path(directory)
    found = {int(m[1]): (int(m[2]), p) for p in folder.iterdir() if (m := _PATTERN.match(p.name))}
    sizes = {size for size, _ in found.values()}
    if len(sizes) != 1:
        what = "no shard files" if not sizes else f"shards of pipelines of sizes {sorted(sizes)}"
        raise FileNotFoundError(f"{folder} holds {what}; save_shard() writes one per process")
    size = sizes.pop()
    missing = [_NAME.format(rank=r, size=size) for r in range(size) if r not in found]
    if missing:
        raise FileNotFoundError(f"{folder} lacks {', '.join(missing)}: every process must save")
    merged: OrderedDict[str, Any] = OrderedDict()
    for rank in range(size):
        for key, value in torch.load(found[rank][1], weights_only=True).items():
            if key in merged and not torch.equal(merged[key], value):
                raise ValueError(
                    f"{key!r} differs between the shards (a tied weight that was not kept "
                    "equal?); save after the same step on every process"
                )
            merged[key] = value
    return merged
