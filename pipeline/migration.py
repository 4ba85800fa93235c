"""Loading a checkpoint saved by a predecessor's pipe (torchgpipe, fairscale, torch's Pipe).

Those pipes registered their layers under ``partitions.<j>.``, so their
``state_dict()`` keys are ``partitions.1.fc.weight`` where the plain model's
(and this Pipe's) are ``fc.weight``. torchgpipe and fairscale kept each
layer's name inside its partition; ``torch.distributed.pipeline.sync.Pipe``
renumbered the layers of each partition from 0.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Mapping
from typing import Literal

from torch import Tensor

from pipeline.base import PipeBase

__all__ = ["from_partitioned_state_dict"]

_PARTITIONED_KEY = re.compile(r"partitions\.(\d+)\.([^.]+)(\..+)?$")


def from_partitioned_state_dict(
    state_dict: Mapping[str, Tensor],
    pipe: PipeBase,
    *,
    layer_names: Literal["kept", "renumbered"] = "kept",
) -> OrderedDict[str, Tensor]:
    """``state_dict`` of a predecessor's pipe with the keys of ``pipe`` (the plain model's).

    ``layer_names='kept'`` for torchgpipe's ``GPipe`` and fairscale's ``Pipe``,
    ``'renumbered'`` for ``torch.distributed.pipeline.sync.Pipe``. ``pipe``
    (a ``Pipe``, or a ``DistributedPipe``: the whole model's keys, of which
    each process loads its own) must have the same balance as the pipe that
    saved the checkpoint::

        state = torch.load("gpipe.pt")
        pipe.load_state_dict(from_partitioned_state_dict(state, pipe))
    """
    names = pipe.partition_names
    converted: OrderedDict[str, Tensor] = OrderedDict()
    for key, value in state_dict.items():
        match = _PARTITIONED_KEY.match(key)
        if match is None:
            raise ValueError(
                f"key {key!r} is not of the form 'partitions.<j>.<layer>...' that a "
                "predecessor's pipe saves; load a plain model's state_dict with "
                "pipe.load_state_dict directly"
            )
        j, layer, rest = int(match[1]), match[2], match[3] or ""
        converted[_layer_name(names, j, layer, layer_names, key) + rest] = value
    return converted


def _layer_name(names: list[list[str]], j: int, layer: str, layer_names: str, key: str) -> str:
    if j < len(names):
        partition = names[j]
        if layer_names == "kept" and layer in partition:
            return layer
        if layer_names == "renumbered" and layer.isdigit() and int(layer) < len(partition):
            return partition[int(layer)]
    raise ValueError(
        f"key {key!r} names layer {layer!r} of partition {j}, which this Pipe (partitions "
        f"{names}) does not have; build the Pipe with the balance the checkpoint was saved "
        "with, and pass layer_names='renumbered' for torch.distributed.pipeline.sync.Pipe"
    )
