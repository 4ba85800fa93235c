"""Argument checks shared by the solver and the profilers, run before any work."""

import math
import numbers
from collections.abc import Mapping

import torch
from torch import Tensor, nn
from torch.utils._pytree import keystr, tree_flatten, tree_flatten_with_path, tree_map

from balance.errors import BalanceError
from balance.layerwise import Value
from pipeline.runtime.microbatch import Arguments, NoChunk


def check_partitions(partitions: object, items: int, noun: str) -> int:
    """Return ``partitions`` as an int once it can split ``items`` things called ``noun``."""
    count = check_count("partitions", partitions)
    if count > items:
        raise BalanceError(
            f"partitions={count} is more than the {items} {noun}; every partition needs "
            f"at least one, so pass partitions <= {items}"
        )
    return count


def check_count(name: str, value: object) -> int:
    """Return ``value`` as an int once it is a whole number of at least one."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    count = int(value)
    if count < 1:
        raise BalanceError(f"{name}={count}, but it must be at least 1")
    return count


def check_sample(sample: object, kwargs: object = None) -> Value:
    """Return ``sample`` as the first layer takes it, once it holds at least one row.

    ``sample`` is one micro-batch: a Tensor, or tuples, namedtuples, lists and
    dicts holding tensors (and other values), nested at will, as a Pipe takes
    its input. A tensor wrapped in ``pipeline.NoChunk`` is unwrapped, as each
    micro-batch of a Pipe gets it, and does not count as a row. ``kwargs``,
    the first layer's keyword arguments, count as ``sample`` does; with them,
    the first layer is called with ``(sample, **kwargs)`` (``(**kwargs)`` if
    ``sample`` is None), given as a ``pipeline.runtime.microbatch.Arguments``.
    """
    value = _with_keywords(sample, kwargs)
    parts = value.parts() if isinstance(value, Arguments) else [("sample", sample)]
    structured = not tree_flatten(value, is_leaf=_is_no_chunk)[1].is_leaf()
    if not structured and not isinstance(value, Tensor | NoChunk):
        raise TypeError(
            f"sample must be a Tensor or hold tensors (in tuples, lists, dicts or "
            f"namedtuples), got {type(sample).__name__}; pass one micro-batch as the first "
            "layer takes it"
        )
    rows = {
        name + keystr(path): leaf.size(0)
        for name, part in parts
        for path, leaf in tree_flatten_with_path(part, is_leaf=_is_no_chunk)[0]
        if isinstance(leaf, Tensor) and leaf.dim() > 0
    }
    if not rows:
        raise BalanceError(
            f"sample ({type(sample).__name__}) holds no tensor with a batch dimension "
            "(0-dim and NoChunk tensors do not count): balance needs at least one row to "
            "profile the layers on; pass one non-empty micro-batch as the first layer takes it"
        )
    for where, size in rows.items():
        if size == 0:
            raise BalanceError(
                f"{where} is empty (dim 0 has size 0): balance needs at least one row to "
                "profile the layers on, as a Pipe needs one to split into micro-batches; "
                "pass one non-empty micro-batch as the first layer takes it"
            )
    if isinstance(value, Tensor):
        return value
    return tree_map(_unwrap, value, is_leaf=_is_no_chunk)


def _with_keywords(sample: object, kwargs: object) -> object:
    """``sample``, or the ``Arguments`` of the first layer's call when keywords are given."""
    if kwargs is None:
        return sample
    if not isinstance(kwargs, Mapping) or not all(isinstance(key, str) for key in kwargs):
        raise TypeError(
            f"kwargs must be a dict of the first layer's keyword arguments by name, got "
            f"{type(kwargs).__name__} {kwargs!r}"
        )
    if not kwargs:
        return sample
    return Arguments(() if sample is None else (sample,), kwargs)


def _holds_leaves(sample: object) -> bool:
    return (
        isinstance(sample, Tensor | NoChunk) or not tree_flatten(sample, _is_no_chunk)[1].is_leaf()
    )


def _is_no_chunk(value: object) -> bool:
    return isinstance(value, NoChunk)


def _unwrap(value: object) -> object:
    return value.tensor if isinstance(value, NoChunk) else value


def check_device(device: object) -> torch.device:
    """The device to profile on: ``device``, or by default the accelerator if any, else the CPU."""
    if device is None:
        return torch.accelerator.current_accelerator(check_available=True) or torch.device("cpu")
    if not isinstance(device, torch.device | str):
        raise TypeError(
            f"device must be a torch.device or a str, got {type(device).__name__} {device!r}"
        )
    try:
        resolved = torch.device(device)
    except RuntimeError as error:
        raise BalanceError(
            f"device={device!r} is not a device ({error}); pass e.g. 'cpu' or 'cuda:0'"
        ) from None
    if resolved.type != "cpu" and resolved.type != _accelerator_type():
        raise BalanceError(
            f"device={device!r}, but no {resolved.type} device is available here; "
            "pass device='cpu' or profile on a machine that has one"
        )
    return resolved


def _accelerator_type() -> str | None:
    accelerator = torch.accelerator.current_accelerator(check_available=True)
    return None if accelerator is None else accelerator.type


def check_sequential(module: object) -> nn.Sequential:
    """Return ``module`` once it is a non-empty ``nn.Sequential``."""
    if not isinstance(module, nn.Sequential):
        raise TypeError(
            f"module must be an nn.Sequential, got {type(module).__name__}; "
            "wrap the layers in nn.Sequential(...) in the order they run"
        )
    if len(module) == 0:
        raise BalanceError("module is an empty nn.Sequential; there are no layers to balance")
    return module


def check_positive(name: str, value: object) -> float:
    """Return ``value`` as a float once it is a finite number above zero."""
    number = check_real(name, value)
    if number <= 0:
        raise BalanceError(f"{name}={value!r}, but it must be above 0")
    return number


def check_non_negative(name: str, value: object) -> float:
    """Return ``value`` as a float once it is a finite number of at least zero."""
    number = check_real(name, value)
    if number < 0:
        raise BalanceError(f"{name}={value!r}, but it must be 0 or more")
    return number


def check_real(name: str, value: object) -> float:
    """Return ``value`` as a float once it is a finite real number."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    number = float(value)
    if not math.isfinite(number):
        raise BalanceError(f"{name}={value!r}, but it must be a finite number")
    return number
