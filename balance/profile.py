"""Per-layer costs of an nn.Sequential: time, memory and parameter size."""

import time
from contextlib import AbstractContextManager
from itertools import chain

import torch
from torch import Tensor, nn

from balance.layerwise import Value, backward_layer, run_layer, walk_layers


def profile_times(
    module: nn.Sequential, sample: Value, timeout: float, device: torch.device
) -> list[float]:
    """Mean seconds of each layer's forward and backward pass on ``sample``.

    One untimed pass warms up (and reports a layer that fails); then timed
    passes over all layers repeat until ``timeout`` seconds have gone, at
    least once, so that every layer is timed the same number of times.
    """
    totals = [0.0] * len(module)

    def untimed(index: int, layer: nn.Module, inputs: Value) -> Value:
        outputs = run_layer(index, layer, inputs)
        backward_layer(index, layer, outputs)
        return outputs

    def timed(index: int, layer: nn.Module, inputs: Value) -> Value:
        synchronize(device)
        start = time.perf_counter()
        outputs = untimed(index, layer, inputs)
        synchronize(device)
        totals[index] += time.perf_counter() - start
        return outputs

    with own_random_state(device):
        walk_layers(module, sample, device, untimed)
        passes = 0
        deadline = time.perf_counter() + timeout
        while passes == 0 or time.perf_counter() < deadline:
            walk_layers(module, sample, device, timed)
            passes += 1
    return [total / passes for total in totals]


def profile_activations(module: nn.Sequential, sample: Value, device: torch.device) -> list[int]:
    """Bytes of activations each layer keeps for its backward pass on ``sample``.

    On CUDA this is what the caching allocator holds after the layer's
    forward pass beyond what it held before (what the forward pass left
    alive: its output and what it saved). Elsewhere it is the bytes of the
    distinct storages that autograd saved for backward, less the layer's own
    parameters and buffers.
    """
    sizes = [0] * len(module)
    measure = _allocated_bytes if device.type == "cuda" else _saved_bytes

    def sized(index: int, layer: nn.Module, inputs: Value) -> Value:
        outputs, sizes[index] = measure(index, layer, inputs, device)
        return outputs

    with own_random_state(device):
        walk_layers(module, sample, device, sized)
    return sizes


def parameter_bytes(layer: nn.Module) -> int:
    """Bytes of the layer's parameters (counted once each, on any device, even ``meta``)."""
    return sum(parameter.numel() * parameter.element_size() for parameter in layer.parameters())


def _allocated_bytes(
    index: int, layer: nn.Module, inputs: Value, device: torch.device
) -> tuple[Value, int]:
    before = torch.cuda.memory_allocated(device)
    outputs = run_layer(index, layer, inputs)
    return outputs, torch.cuda.memory_allocated(device) - before


def _saved_bytes(
    index: int, layer: nn.Module, inputs: Value, device: torch.device
) -> tuple[Value, int]:
    owned = {_storage_key(tensor) for tensor in chain(layer.parameters(), layer.buffers())}
    saved: dict[int, int] = {}

    def pack(tensor: Tensor) -> Tensor:
        key = _storage_key(tensor)
        if key not in owned:
            saved[key] = tensor.untyped_storage().nbytes()
        return tensor

    def unpack(tensor: Tensor) -> Tensor:
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        outputs = run_layer(index, layer, inputs)
    return outputs, sum(saved.values())


def _storage_key(tensor: Tensor) -> int:
    # Views of one tensor share a storage; count its memory once.
    return tensor.untyped_storage().data_ptr()


def synchronize(device: torch.device) -> None:
    """Wait for ``device``'s queued work (kernels run asynchronously on accelerators).

    Around a timed region, so that the clock measures the work, not the launch.
    """
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def own_random_state(device: torch.device) -> AbstractContextManager[object]:
    """Leave the caller's random generators as they were, whatever profiling draws (dropout)."""
    if device.type == "cpu":
        return torch.random.fork_rng(devices=[])
    index = torch.accelerator.current_device_index() if device.index is None else device.index
    return torch.random.fork_rng(devices=[index], device_type=device.type)
