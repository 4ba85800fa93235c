"""The arguments of a Pipe, checked before any work: what was wrong, and how to fix it.

Balance, chunks, checkpoint mode, call style, devices, and layers shared by
partitions; ``check_pipe_arguments`` checks what every pipe takes, for
``Pipe`` and ``DistributedPipe`` alike. Conversions follow the predecessors'
(``chunks=8.0`` is 8, an object whose ``str()`` is a mode names it), but
nothing is truncated or ignored silently.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeAlias, cast

import torch
from torch import nn

from pipeline.runtime.buffers import updated_in_forward
from pipeline.runtime.layers import modules_only_read
from pipeline.runtime.module_hooks import call_hook_kinds, state_dict_hook_kinds
from pipeline.skip.verify import verify_skippables

__all__ = [
    "CALL_STYLES",
    "CHECKPOINT_MODES",
    "BalanceError",
    "CallStyle",
    "CheckpointMode",
    "Device",
    "LossReduction",
    "PipeArguments",
    "check_balance",
    "check_call_style",
    "check_checkpoint",
    "check_chunks",
    "check_module",
    "check_pipe_arguments",
    "check_sharing",
    "normalize_device",
    "resolve_devices",
]

Device: TypeAlias = torch.device | str | int
CheckpointMode: TypeAlias = Literal["always", "except_last", "never"]
CHECKPOINT_MODES = ("always", "except_last", "never")
CallStyle: TypeAlias = Literal["tuple", "positional"]
LossReduction: TypeAlias = Literal["mean", "sum"]
CALL_STYLES = ("tuple", "positional")


class BalanceError(ValueError):
    """The ``balance`` given to a Pipe does not describe a split of its module."""


@dataclass(frozen=True)
class PipeArguments:
    """The arguments every pipe takes, each checked on its own."""

    balance: list[int]
    chunks: int
    checkpoint: CheckpointMode
    call_style: CallStyle
    deferred_batch_norm: bool


def check_pipe_arguments(
    module: Any,
    balance: Sequence[int] | None,
    chunks: Any,
    checkpoint: Any,
    call_style: Any,
    deferred_batch_norm: Any,
) -> PipeArguments:
    """Check a pipe's arguments before anything changes: the module, its skips, each argument."""
    check_module(module)
    verify_skippables(module)
    return PipeArguments(
        check_balance(balance, len(module)),
        check_chunks(chunks),
        check_checkpoint(checkpoint),
        check_call_style(call_style),
        bool(deferred_batch_norm),
    )


def check_module(module: Any) -> None:
    if not isinstance(module, nn.Sequential):
        raise TypeError(
            f"Pipe splits an nn.Sequential, got {type(module).__name__}; for any other model, "
            "pipeline.split(model, example_args) makes the nn.Sequential to pass (docs/split.md), "
            "or wrap your layers in nn.Sequential(...)"
        )
    kinds = call_hook_kinds(module) + state_dict_hook_kinds(module)
    if kinds:
        raise ValueError(
            f"the nn.Sequential given to the pipe has {' and '.join(kinds)}, but the pipe runs "
            "its layers, never the Sequential's own forward, and makes its state_dict itself, "
            "so they would never run: register them on the layers, or the state_dict hooks "
            "on the pipe"
        )


def check_balance(balance: Sequence[int] | None, layers: int) -> list[int]:
    hint = (
        "use balance=balance.balance_by_time(partitions, module, sample) to compute one, or "
        "give the number of layers of each partition"
    )
    if balance is None:
        raise BalanceError(f"Pipe needs balance, the number of layers in each partition; {hint}")
    if isinstance(balance, int | str) or not isinstance(balance, Iterable):
        raise BalanceError(f"balance must be a list of ints, got {balance!r}; {hint}")
    balance = list(balance)
    if not balance and layers > 0:
        raise BalanceError(f"balance is empty; {hint}")
    bad = [b for b in balance if isinstance(b, bool) or not isinstance(b, int) or b <= 0]
    if bad:
        raise BalanceError(
            f"balance {balance} has entries that are not positive ints ({bad}); every partition "
            f"needs at least one layer; {hint}"
        )
    if sum(balance) != layers:
        raise BalanceError(
            f"balance {balance} sums to {sum(balance)} but the module has {layers} layers; {hint}"
        )
    return balance


def check_chunks(chunks: Any) -> int:
    """``chunks`` as an int; a float that is a whole number is accepted, as predecessors do.

    >>> check_chunks(8.0)
    8
    """
    if isinstance(chunks, float) and chunks.is_integer():
        chunks = int(chunks)
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks <= 0:
        raise ValueError(f"chunks must be a positive int (micro-batches per batch), got {chunks!r}")
    return chunks


def check_checkpoint(checkpoint: Any) -> CheckpointMode:
    """The mode named by ``checkpoint`` (any object whose ``str()`` names one, like an enum)."""
    mode = checkpoint if isinstance(checkpoint, str) else str(checkpoint)
    if mode not in CHECKPOINT_MODES or checkpoint is None:
        raise ValueError(
            f"checkpoint must be one of {', '.join(map(repr, CHECKPOINT_MODES))}, got "
            f"{checkpoint!r}"
        )
    return cast(CheckpointMode, str(mode))


def check_call_style(call_style: Any) -> CallStyle:
    if call_style not in CALL_STYLES:
        raise ValueError(
            f"call_style must be one of {', '.join(map(repr, CALL_STYLES))}, got {call_style!r}"
        )
    return cast(CallStyle, call_style)


def normalize_device(device: Device) -> torch.device:
    if isinstance(device, int) and not isinstance(device, bool):
        device = torch.device("cuda", device)
    device = torch.device(device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def resolve_devices(devices: Sequence[Device] | None, partitions: int) -> list[torch.device]:
    if devices is None:
        if not torch.cuda.is_available():
            return [torch.device("cpu")] * partitions
        count = torch.cuda.device_count()
        if partitions > count:
            raise ValueError(
                f"{partitions} partitions but only {count} CUDA devices; pass devices=[...] "
                "(a device may appear several times) or use fewer partitions"
            )
        return [torch.device("cuda", j) for j in range(partitions)]
    if isinstance(devices, str | torch.device | int):
        raise TypeError(f"devices must be a list of devices, got {devices!r}")
    resolved = [normalize_device(d) for d in devices]
    if len(resolved) != partitions:
        raise ValueError(
            f"{partitions} partitions but {len(resolved)} devices ({[str(d) for d in resolved]}); "
            "give one device per partition (a device may appear several times)"
        )
    for device in resolved:
        if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
            raise ValueError(
                f"device {device} is not available (torch.cuda.device_count() is "
                f"{torch.cuda.device_count()})"
            )
    return resolved


def check_sharing(partitions: list[nn.Sequential], devices: list[torch.device]) -> None:
    """Refuse a layer or buffer used by two partitions unless they share a device.

    A parameter may be (tied weights, ``runtime/borrowed.py``): a layer could
    not be run by two devices' threads at once, nor a buffer written by both.
    A module whose tensors every partition holding it only reads (a split
    model's tied head, ``layers.ReadsModules``) may be too: none runs it.
    """
    read = [modules_only_read(partition.children()) for partition in partitions]
    held: dict[int, list[tuple[int, str, nn.Module | torch.Tensor]]] = {}
    for j, partition in enumerate(partitions):
        named = [*partition.named_modules(remove_duplicate=False)]
        named += [*partition.named_buffers(remove_duplicate=False)]
        for name, thing in named:
            held.setdefault(id(thing), []).append((j, name, thing))
    for key, holders in held.items():
        (first, first_name, thing), *others = holders
        _refuse_shared_statistics(thing, first, first_name, others)
        elsewhere = [(j, name) for j, name, _ in others if devices[j] != devices[first]]
        if not elsewhere or _only_read(key, thing, holders, read):
            continue
        j, name = elsewhere[0]
        what = "buffer" if isinstance(thing, torch.Tensor) else "layer"
        raise ValueError(
            f"{type(thing).__name__} {first_name!r} of partition {first} (on "
            f"{devices[first]}) is also {name!r} of partition {j} (on {devices[j]}); "
            f"a {what} can be shared between partitions on the same device only: put "
            "those partitions on one device, keep its uses in one partition, or share "
            "its parameters between two layers instead (a parameter may be tied across "
            "devices)"
        )


def _refuse_shared_statistics(
    thing: nn.Module | torch.Tensor,
    first: int,
    name: str,
    others: list[tuple[int, str, nn.Module | torch.Tensor]],
) -> None:
    """Refuse a layer that updates state in its forward (BatchNorm's running statistics,
    spectral norm's vectors) run by two partitions: it would be updated in the order the
    partitions' tasks run (the clock's, or the threads'), not the plain model's."""
    other = next(((j, n) for j, n, _ in others if j != first), None)
    updated = None if isinstance(thing, torch.Tensor) else updated_in_forward(thing)
    if other is None or updated is None:
        return
    raise ValueError(
        f"{type(thing).__name__} {name!r} of partition {first} is also {other[1]!r} of "
        f"partition {other[0]}: its {updated} would be updated in the order the partitions "
        "run their micro-batches, not the plain model's; give each use a layer of its own, "
        "or keep its uses in one partition"
    )


def _only_read(
    key: int,
    thing: nn.Module | torch.Tensor,
    holders: list[tuple[int, str, nn.Module | torch.Tensor]],
    read: list[set[int]],
) -> bool:
    """Whether ``thing`` is a module every partition holding it only reads tensors of."""
    return isinstance(thing, nn.Module) and all(key in read[j] for j, _, _ in holders)
