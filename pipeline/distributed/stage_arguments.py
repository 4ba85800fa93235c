"""What every process of a DistributedPipe must be given alike, compared when it is built.

Each process builds its DistributedPipe from its own arguments. A balance
computed on each rank (``balance_by_time``), a ``chunks`` read from a
per-rank config, or a model built differently on one rank would otherwise
run wrong with no error (a layer running in two processes) or crash inside a
later collective whose sizes no longer match. Before anything is built, one
``all_gather`` of fixed-length rows of hashes (``agreement.py``) compares
them all, and every process raises on a mismatch, naming the argument and
which ranks agree with which.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch.distributed as dist
from torch import nn

from pipeline.arguments import PipeArguments, check_pipe_arguments
from pipeline.runtime.agreement import (
    camps,
    fingerprint,
    gather_rows,
    ranks_text,
    refusal_elsewhere,
)
from pipeline.runtime.buffers import updated_in_forward
from pipeline.runtime.layers import named_layers

__all__ = ["check_alone", "disagreement"]

_SAME_MODEL = (
    "build the same model on every process (the same layers, with the same parameter and "
    "buffer names, shapes and dtypes)"
)
_HINTS = {
    "balance": (
        "give every process the same balance (compute it once, e.g. on rank 0, and broadcast it)"
    ),
    "chunks": "give every process the same chunks",
    "checkpoint": "give every process the same checkpoint mode",
    "deferred_batch_norm": "give every process the same deferred_batch_norm",
    "call_style": "give every process the same call_style",
}
# Longer descriptions of a layer are cut here in error messages.
_SHOWN_CHARS = 300


def _texts(arguments: PipeArguments) -> dict[str, str]:
    """The arguments that must agree, by name, as error messages show them."""
    return {
        "balance": str(arguments.balance),
        "chunks": str(arguments.chunks),
        "checkpoint": repr(arguments.checkpoint),
        "deferred_batch_norm": str(arguments.deferred_batch_norm),
        "call_style": repr(arguments.call_style),
    }


def check_alone(
    module: Any,
    balance: Sequence[int] | None,
    chunks: Any,
    checkpoint: Any,
    call_style: Any,
    deferred_batch_norm: bool,
    processes: int,
) -> PipeArguments:
    """This process's arguments, checked as far as one process can tell."""
    checked = check_pipe_arguments(
        module, balance, chunks, checkpoint, call_style, deferred_batch_norm
    )
    stages = len(checked.balance)
    if stages % processes:
        raise ValueError(
            f"balance has {stages} stages for {processes} processes; give a multiple of "
            f"{processes} stages (one per process, or several with the interleaved schedule)"
        )
    _check_state_in_one_process(module, checked.balance, processes)
    return checked


def _check_state_in_one_process(module: nn.Sequential, balance: list[int], processes: int) -> None:
    """Refuse a layer that updates state in its forward (``updated_in_forward``) run by
    stages of two processes: each would keep and update a copy of its own, never made equal
    (tied weights are, their buffers not)."""
    runs: dict[int, tuple[str, nn.Module, set[int]]] = {}
    layers = list(named_layers(module).items())
    start = 0
    for stage, count in enumerate(balance):
        for name, layer in layers[start : start + count]:
            for inner, sub in layer.named_modules(prefix=name):
                if updated_in_forward(sub) is not None:
                    runs.setdefault(id(sub), (inner, sub, set()))[2].add(stage % processes)
        start += count
    for name, sub, ranks in runs.values():
        if len(ranks) > 1:
            raise ValueError(
                f"{type(sub).__name__} {name!r} is run by stages of processes "
                f"{sorted(ranks)}: each process would keep and update its own "
                f"{updated_in_forward(sub)}, never made equal, where the plain model updates "
                "one; give each use a layer of its own, or keep its uses in one process's stages"
            )


def disagreement(
    module: nn.Sequential,
    arguments: PipeArguments | None,
    group: dist.ProcessGroup,
) -> ValueError | None:
    """Why the processes of ``group`` cannot build the pipeline together, or None.

    A collective over ``group``: every process calls it, ``arguments`` None
    where its own arguments were refused (that process raises its own error;
    the others get one naming it). Every process gets an error, or none does.
    """
    rank = dist.get_rank(group)
    layers = [] if arguments is None else _layer_texts(module)
    texts = {} if arguments is None else _texts(arguments)
    layer_hashes = [fingerprint(full) for full, _ in layers]
    row = [int(arguments is None), len(layers), fingerprint(str(layer_hashes))]
    row += [fingerprint(texts[name]) if texts else 0 for name in _HINTS]
    rows = gather_rows(row, group)
    elsewhere = refusal_elsewhere(
        rows, "of the pipeline refused its DistributedPipe arguments", "no process built anything"
    )
    if elsewhere is not None:
        return elsewhere
    if len(camps([theirs[2] for theirs in rows])) > 1:
        return _model_difference(layers, layer_hashes, max(r[1] for r in rows), group)
    for column, name in enumerate(_HINTS, start=3):
        split = camps([theirs[column] for theirs in rows])
        if len(split) > 1:
            return ValueError(
                f"{name} differs between the processes of the pipeline: {ranks_text(split)} "
                f"were given different values; this process (rank {rank}) has {texts[name]}; "
                f"{_HINTS[name]}"
            )
    return None


def _model_difference(
    layers: list[tuple[str, str]], hashes: list[int], width: int, group: dist.ProcessGroup
) -> ValueError:
    """The first layer that differs between the processes (a second, equally sized all_gather)."""
    rows = gather_rows(hashes + [0] * (width - len(hashes)), group)
    # The models' hashes are hashes of these rows, so some column differs.
    index = next(i for i in range(width) if len({theirs[i] for theirs in rows}) > 1)
    split = camps([theirs[index] for theirs in rows])
    mine = (
        layers[index][1]
        if index < len(layers)
        else f"no layer there (its model has {len(layers)} layers)"
    )
    return ValueError(
        f"the model differs between the processes of the pipeline at layer {index}: "
        f"{ranks_text(split)} have different layers there; this process (rank "
        f"{dist.get_rank(group)}) has {mine}; {_SAME_MODEL}"
    )


def _layer_texts(module: nn.Sequential) -> list[tuple[str, str]]:
    """Each layer the pipe splits (its modules' names and types, its tensors): hashed, shown."""
    found = []
    for name, layer in named_layers(module).items():
        modules = [
            f"{path}: {type(sub).__module__}.{type(sub).__qualname__}"
            for path, sub in layer.named_modules(remove_duplicate=False)
        ]
        tensors = [
            f"{kind} {path} {tuple(tensor.shape)} {tensor.dtype}"
            for kind, named in (
                ("parameter", layer.named_parameters(remove_duplicate=False)),
                ("buffer", layer.named_buffers(remove_duplicate=False)),
            )
            for path, tensor in named
        ]
        shown = f"{name!r}: {type(layer).__name__}" + "".join(f", {t}" for t in tensors)
        if len(shown) > _SHOWN_CHARS:
            shown = shown[:_SHOWN_CHARS] + " ..."
        found.append(("; ".join([name, *modules, *tensors]), shown))
    return found
