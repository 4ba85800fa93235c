"""Random generators shared by partitions that run at once on worker threads.

Each device has one default generator (the CPU one serves the whole process).
Two partitions on the same device draw from it concurrently, in an order that
changes from run to run. So each call of a layer that may draw random numbers
in training (dropout and friends, or a layer marked with ``mark_random``)
runs under its device's generator lock, from a seed derived from the
forward pass, the micro-batch, the partition and the call's rank in the
task::

    task (i, j) on its worker:  Linear  Dropout          Linear  Dropout
                                        |lock, seed(i,j,1)|      |lock, seed(i,j,2)|

Masks are reproducible for a fixed ``torch.manual_seed`` however the
threads interleave, recomputation under checkpointing replays them exactly,
and the lock is held only while a random layer runs: the rest of the
partitions overlap.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import TypeVar

import torch
from torch import nn

__all__ = ["mark_random", "may_draw_random"]

_RANDOM_LAYERS: tuple[type[nn.Module], ...] = (nn.modules.dropout._DropoutNd, nn.RReLU)
_MARK = "_pipeline_draws_random"
_HOOKED = "_pipeline_seeding_hooks"
_SEED_MASK = (1 << 63) - 1

_locks: dict[torch.device, threading.Lock] = {}
_locks_guard = threading.Lock()

ModuleT = TypeVar("ModuleT", bound=nn.Module)


def mark_random(module: ModuleT) -> ModuleT:
    """Declare that ``module`` draws random numbers in training mode.

    Dropout, alpha dropout and RReLU are detected; declare any other layer
    that samples (``torch.rand``, ``bernoulli_``...) so that its draws are
    reproducible and replayed exactly under checkpointing::

        noise = mark_random(GaussianNoise(0.1))
    """
    setattr(module, _MARK, True)
    return module


def may_draw_random(module: nn.Module) -> list[nn.Module]:
    """The submodules of ``module`` that draw random numbers in training."""
    return [m for m in module.modules() if _is_random(m)]


def _is_random(module: nn.Module) -> bool:
    return isinstance(module, _RANDOM_LAYERS) or getattr(module, _MARK, False) is True


def generator(device: torch.device) -> torch.Generator:
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        torch.cuda.init()
        return torch.cuda.default_generators[index]
    return torch.default_generator


def _lock(device: torch.device) -> threading.Lock:
    key = torch.device("cpu") if device.type != "cuda" else device
    lock = _locks.get(key)
    if lock is None:
        with _locks_guard:
            lock = _locks.setdefault(key, threading.Lock())
    return lock


def draw_base_seed() -> int:
    """One seed per forward pass, drawn from (and advancing) the CPU generator."""
    with _lock(torch.device("cpu")):
        return int(torch.randint(0, _SEED_MASK, (), generator=torch.default_generator))


def task_seed(base: int, microbatch: int, partition: int) -> int:
    """A seed for task (microbatch, partition), distinct per task."""
    mixed = base ^ (microbatch * 0x9E3779B97F4A7C15) ^ (partition * 0xBF58476D1CE4E5B9)
    return mixed & _SEED_MASK


class _TaskRandomness:
    """The random context of the task running on this thread."""

    __slots__ = ("calls", "device", "held", "seed")

    def __init__(self, device: torch.device, seed: int) -> None:
        self.device = device
        self.seed = seed
        self.calls = 0
        self.held: list[tuple[nn.Module, torch.Generator, torch.Tensor]] = []


_task = threading.local()


@contextlib.contextmanager
def seeded(device: torch.device, seed: int) -> Iterator[None]:
    """Run a task whose random layers draw from seeds derived from ``seed``.

    Calling it again with the same arguments (recomputation) replays the same
    draws. The generator itself is left as it was.
    """
    previous = getattr(_task, "context", None)
    _task.context = _TaskRandomness(device, seed)
    try:
        yield
    finally:
        _task.context = previous


def install_seeding(partition: nn.Module) -> None:
    """Make the random layers of ``partition`` draw from their task's seeds.

    The hooks do nothing outside a ``seeded`` task, so the layers behave as
    before when used without a Pipe. Installed once per layer.
    """
    for module in _outermost_random(partition):
        if getattr(module, _HOOKED, False):
            continue
        module.register_forward_pre_hook(_seed_call)
        module.register_forward_hook(_restore_generator, always_call=True)
        setattr(module, _HOOKED, True)


def _outermost_random(module: nn.Module) -> Iterator[nn.Module]:
    # A declared layer that contains dropout is seeded once, around all of it.
    if _is_random(module):
        yield module
        return
    for child in module.children():
        yield from _outermost_random(child)


def _seed_call(module: nn.Module, args: object) -> None:
    context: _TaskRandomness | None = getattr(_task, "context", None)
    if context is None or not module.training:
        return
    context.calls += 1
    gen = generator(context.device)
    _lock(context.device).acquire()
    context.held.append((module, gen, gen.get_state()))
    gen.manual_seed(task_seed(context.seed, context.calls, 0))


def _restore_generator(module: nn.Module, args: object, output: object) -> None:
    context: _TaskRandomness | None = getattr(_task, "context", None)
    if context is None or not context.held or context.held[-1][0] is not module:
        return
    _, gen, saved = context.held.pop()
    gen.set_state(saved)
    _lock(context.device).release()


RngStates = list[tuple[torch.device, torch.Tensor]]


def capture_states(device: torch.device) -> RngStates:
    """The states of the generators a task on ``device`` may draw from."""
    devices = [torch.device("cpu")] + ([device] if device.type == "cuda" else [])
    return [(d, generator(d).get_state()) for d in devices]


@contextlib.contextmanager
def replaying(states: RngStates) -> Iterator[None]:
    """Run with the generators set to ``states``; restore them afterwards."""
    with contextlib.ExitStack() as stack:
        saved = []
        for device, state in states:
            stack.enter_context(_lock(device))
            gen = generator(device)
            saved.append((gen, gen.get_state()))
            gen.set_state(state)
        try:
            yield
        finally:
            for gen, state in saved:
                gen.set_state(state)
