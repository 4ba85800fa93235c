"""Runs an nn.Sequential one layer at a time on throwaway copies, for profiling."""

import copy
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeAlias

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_map

from balance.errors import BalanceError
from pipeline.runtime.microbatch import Arguments
from pipeline.runtime.partitions import PositionalSequential
from pipeline.skip.carrier import Carrier
from pipeline.skip.tracker import SkipKey, SkipTracker, use_tracker

# What flows between layers, as in pipeline.Pipe: a Tensor, or tuples,
# namedtuples, lists and dicts of tensors and other values, nested at will.
# Tensors are found wherever torch.utils._pytree finds them; any other object
# is passed on as it is.
Value: TypeAlias = Any

# Runs one layer copy on its inputs, measures what the caller wants, and
# returns the layer's outputs (see ``run_layer``).
Measure = Callable[[int, nn.Module, Value], Value]


def walk_layers(
    module: nn.Sequential, sample: Value, device: torch.device, measure: Measure
) -> None:
    """Call ``measure`` on each layer in order, fed the previous layer's real output.

    Each layer runs as a fresh copy on ``device`` in training mode, so that
    ``module`` (parameters, buffers, gradients, flags) is never touched and
    only one layer's copy lives on the device at a time. Layers are called as
    ``module`` calls them: in a ``PositionalSequential`` a tuple reaches a
    layer as positional arguments (``layer(*value)``), else as one value.
    """
    positional = isinstance(module, PositionalSequential)
    # Profiling needs autograd even where the caller turned it off.
    with torch.inference_mode(False), torch.enable_grad(), use_tracker(_SkipSandbox(device)):
        inputs = fresh_inputs(sample, device)
        for index, layer in enumerate(module):
            # Only a detached copy of the outputs outlives this line, so the
            # layer's copy and its graph are freed before the next layer runs.
            copied = sandbox(index, layer, device)
            if positional:
                copied = Spread(copied)
            inputs = fresh_inputs(measure(index, copied, inputs), device)


class Spread(nn.Module):
    """A layer of a ``PositionalSequential``: a tuple reaches it as positional arguments."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, *args: Value, **kwargs: Value) -> Value:
        # One tuple (with or without the first layer's keywords) is spread, as a Pipe does.
        if len(args) == 1 and type(args[0]) is tuple:
            args = args[0]
        return self.layer(*args, **kwargs)


def _name(layer: nn.Module) -> str:
    """The class name of the layer itself (not of its ``Spread``)."""
    return type(layer.layer if isinstance(layer, Spread) else layer).__name__


class _SkipSandbox(SkipTracker):
    """Keeps stashed skip tensors as fresh copies, so each layer is profiled alone.

    A popping layer then gets the stashed tensor without the stashing layer's
    graph: its backward stops at its own inputs, as for the main path. A
    layer timed several times in a row pops again what it popped: the
    sandbox serves it a fresh copy each time.
    """

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device
        self.popped: dict[SkipKey, Tensor] = {}

    def save(self, output: Carrier, key: SkipKey, tensor: Tensor) -> None:
        self.popped.pop(key, None)
        super().save(output, key, _fresh_tensor(tensor, self.device))

    def load(self, input: Carrier, key: SkipKey) -> Tensor:
        if key in self.popped:
            return _fresh_tensor(self.popped[key], self.device)
        tensor = super().load(input, key)
        self.popped[key] = tensor.detach()
        return tensor


def run_layer(index: int, layer: nn.Module, inputs: Value) -> Value:
    """Run layer ``index`` on ``inputs``; errors name the layer, its class and the input shapes.

    Every measurement runs layers through this one function.
    """
    try:
        outputs = inputs.call(layer) if type(inputs) is Arguments else layer(inputs)
    except torch.OutOfMemoryError:
        raise
    except Exception as error:
        fix = (
            "pass a sample that this layer accepts"
            if index == 0
            else f"check that it accepts the output of layer {index - 1}"
        )
        raise BalanceError(
            f"layer {index} ({_name(layer)}) failed on input {describe(inputs)} "
            f"with {type(error).__name__}: {error}; {fix}"
        ) from error
    return outputs


def backward_layer(index: int, layer: nn.Module, outputs: Value) -> None:
    """Backpropagate ones from every output of layer ``index`` that requires grad."""
    tensors = [tensor for tensor in tensors_in(outputs) if tensor.requires_grad]
    if not tensors:
        return
    try:
        torch.autograd.backward(tensors, [torch.ones_like(tensor) for tensor in tensors])
    except torch.OutOfMemoryError:
        raise
    except Exception as error:
        raise BalanceError(
            f"backward of layer {index} ({_name(layer)}) failed with "
            f"{type(error).__name__}: {error}; the layer must be differentiable to be timed"
        ) from error


def sandbox(index: int, layer: nn.Module, device: torch.device) -> nn.Module:
    """A copy of layer ``index`` on ``device``, in training mode.

    Deep copies of parameters carry no gradients, so the copy starts clean.
    A layer that cannot be copied or moved raises ``BalanceError`` naming it.
    """
    name = f"layer {index} ({type(layer).__name__})"
    try:
        copied = copy.deepcopy(layer)
    except torch.OutOfMemoryError:
        raise
    except Exception as error:
        raise BalanceError(
            f"{name} cannot be copied: copy.deepcopy raised {type(error).__name__}: {error}; "
            "profiling runs a deep copy of each layer so that the model is left untouched. "
            f"Give {type(layer).__name__} a __deepcopy__ that copies it (leaving out or "
            "recreating what cannot be copied, such as a lock, a file or a Pipe), profile a "
            "copyable stand-in with the same layers, or pass the balance yourself "
            "(balance_by_params copies nothing)"
        ) from error
    try:
        return copied.to(device).train()
    except torch.OutOfMemoryError:
        raise
    except Exception as error:
        meta = any(tensor.is_meta for tensor in [*layer.parameters(), *layer.buffers()])
        fix = (
            "a layer on the meta device has no data to run; use balance_by_params"
            if meta
            else f"check that the layer can run on {device}"
        )
        raise BalanceError(
            f"{name} cannot be moved to {device}: {type(error).__name__}: {error}; {fix}"
        ) from error


def fresh_inputs(value: Value, device: torch.device, leaves: list[Tensor] | None = None) -> Value:
    """A copy of ``value`` on ``device`` that a layer may change in place.

    Every tensor in it, at any depth, is copied; containers keep their types.
    A floating tensor is a clone of a leaf that requires grad, appended to
    ``leaves`` if given: a backward that wants the input's gradient wants
    the leaf's too, or takes it for a weight.
    """
    if isinstance(value, Tensor):
        return _fresh_tensor(value, device, leaves)
    return tree_map(
        lambda item: _fresh_tensor(item, device, leaves) if isinstance(item, Tensor) else item,
        value,
    )


def _fresh_tensor(
    tensor: Tensor, device: torch.device, leaves: list[Tensor] | None = None
) -> Tensor:
    detached = tensor.detach().to(device)
    if detached.is_inference():
        # A tensor made under torch.inference_mode cannot join autograd; a copy can.
        detached = detached.clone()
    if detached.is_floating_point() or detached.is_complex():
        # A layer may not change a leaf that requires grad (or a view of one)
        # in place, so it gets a clone of the leaf: a tensor with a history.
        leaf = detached.requires_grad_()
        if leaves is not None:
            leaves.append(leaf)
        return leaf.clone()
    return detached.clone()


def tensors_in(value: Value) -> Iterator[Tensor]:
    """The tensors in ``value``, at any depth."""
    if isinstance(value, Tensor):
        yield value
        return
    for leaf in tree_flatten(value)[0]:
        if isinstance(leaf, Tensor):
            yield leaf


def describe(value: Value) -> str:
    """The dtypes and shapes of ``value``, like ``float32[8, 3]``, ``(int64[8], int)``
    or ``{'x': [float32[8, 3]]}``; other objects by their type's name.
    """
    if isinstance(value, Tensor):
        return _describe_tensor(value)
    if isinstance(value, tuple):
        items = ", ".join(describe(item) for item in value)
        prefix = "" if type(value) is tuple else type(value).__name__
        return f"{prefix}({items})"
    if isinstance(value, list):
        return "[" + ", ".join(describe(item) for item in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{key!r}: {describe(item)}" for key, item in value.items()) + "}"
    if isinstance(value, Arguments):
        shown = [describe(item) for item in value.args]
        shown += [f"{key}={describe(item)}" for key, item in value.kwargs.items()]
        return f"({', '.join(shown)})"
    return type(value).__name__


def _describe_tensor(tensor: Tensor) -> str:
    dtype = str(tensor.dtype).removeprefix("torch.")
    return f"{dtype}[{', '.join(str(size) for size in tensor.shape)}]"
