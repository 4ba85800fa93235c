"""Automatic partition sizes for pipeline.Pipe: profile each layer, then solve exactly.

Each function returns a balance: how many consecutive layers each partition
gets, summing to ``len(module)`` with no empty partition, ready for
``pipeline.Pipe(module, balance)``.
"""

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from balance import blockpartition
from balance.checks import (
    check_count,
    check_device,
    check_non_negative,
    check_partitions,
    check_positive,
    check_sample,
    check_sequential,
)
from balance.errors import BalanceError
from balance.layerwise import Value
from balance.profile import parameter_bytes, profile_activations, profile_times

__all__ = [
    "BalanceError",
    "balance_by_params",
    "balance_by_size",
    "balance_by_time",
    "balance_cost",
    "blockpartition",
]


def balance_cost(costs: Sequence[float], partitions: int) -> list[int]:
    """The balance whose most costly partition costs as little as possible.

    ``costs`` holds one non-negative cost per layer; ties between optimal
    balances are broken as :func:`balance.blockpartition.solve` documents.

    Example:
        >>> balance_cost([1, 1, 1, 5, 1, 1], 3)
        [3, 1, 2]
    """
    return [len(block) for block in blockpartition.solve(costs, partitions)]


def balance_by_time(
    partitions: int,
    module: nn.Sequential,
    sample: Value,
    *,
    timeout: float = 1.0,
    device: torch.device | str | None = None,
    kwargs: Mapping[str, Value] | None = None,
) -> list[int]:
    """The balance whose slowest partition is as fast as possible, timed on ``device``.

    Each layer's forward and backward pass on ``sample`` (one non-empty
    micro-batch as the first layer takes it: a Tensor, or tuples, lists and
    dicts holding tensors, as a Pipe takes its input; a tuple of positional
    arguments for a ``PositionalSequential``, which calls its layers that
    way; ``kwargs``, the first layer's keyword arguments, as ``Pipe.step``
    takes them) is timed, each layer fed the previous layer's real output,
    over repeated passes for about
    ``timeout`` seconds. Layers run one at a time as copies in training mode
    on ``device`` (default: the accelerator if there is one, else the CPU),
    so ``module`` and the random generators are left as they were.

    Example:
        >>> model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(inplace=True), nn.Linear(8, 2))
        >>> balance = balance_by_time(2, model, torch.randn(4, 8), timeout=0.05, device="cpu")
        >>> sum(balance), len(balance)
        (3, 2)
    """
    layers = check_sequential(module)
    count = check_partitions(partitions, len(layers), "layers")
    inputs = check_sample(sample, kwargs)
    seconds = check_positive("timeout", timeout)
    target = check_device(device)
    return balance_cost(profile_times(layers, inputs, seconds, target), count)


def balance_by_size(
    partitions: int,
    module: nn.Sequential,
    sample: Value,
    *,
    chunks: int = 1,
    param_scale: float = 2.0,
    device: torch.device | str | None = None,
    kwargs: Mapping[str, Value] | None = None,
) -> list[int]:
    """The balance whose largest partition in memory is as small as possible.

    A layer's memory is the activations it keeps for backward on ``sample``
    (one micro-batch, and the first layer's ``kwargs``, as ``balance_by_time``
    takes them) times ``chunks`` (the micro-batches alive at once),
    plus its parameters times ``param_scale``: the copies of each parameter
    that training keeps (about 2 for SGD: weights and gradients; 3 with
    momentum; 4 for Adam). Layers are called as in ``balance_by_time``, and
    run one at a time as copies on ``device``
    (default: the accelerator if there is one, else the CPU); on CUDA the
    allocator measures the activations, elsewhere the tensors autograd saves.

    Example:
        >>> model = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 2))
        >>> balance_by_size(2, model, torch.randn(16, 8), chunks=4, device="cpu")
        [2, 1]
    """
    layers = check_sequential(module)
    count = check_partitions(partitions, len(layers), "layers")
    inputs = check_sample(sample, kwargs)
    copies = check_count("chunks", chunks)
    scale = check_non_negative("param_scale", param_scale)
    target = check_device(device)
    activations = profile_activations(layers, inputs, target)
    sizes = [
        activation * copies + parameter_bytes(layer) * scale
        for activation, layer in zip(activations, layers, strict=True)
    ]
    return balance_cost(sizes, count)


def balance_by_params(partitions: int, module: nn.Sequential) -> list[int]:
    """The balance whose largest partition holds as few parameter bytes as possible.

    Nothing runs, so this suits models too large to run even one layer at a
    time, including models built on the ``meta`` device. Layers without
    parameters cost nothing; they are spread so that layer counts are even.

    Example:
        >>> wide, narrow = nn.Linear(100, 100), nn.Linear(100, 10)
        >>> model = nn.Sequential(wide, nn.ReLU(), wide, nn.ReLU(), narrow)
        >>> balance_by_params(2, model)
        [2, 3]
    """
    layers = check_sequential(module)
    count = check_partitions(partitions, len(layers), "layers")
    return balance_cost([parameter_bytes(layer) for layer in layers], count)
