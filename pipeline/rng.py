"""Random generators shared by partitions that run at once on worker threads.

Each device has one default generator (the CPU one serves the whole process).
Two partitions on the same device draw from it concurrently, in an order that
changes from run to run. A partition that may draw random numbers in training
(dropout and friends, or a layer marked with ``mark_random``) therefore runs
each task under its device's generator lock, from a seed derived from the
micro-batch and partition indices: masks are reproducible for a fixed
``torch.manual_seed`` however the threads interleave, and recomputation under
checkpointing replays them exactly. Every other task runs without the lock.
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
    return [
        m for m in module.modules() if isinstance(m, _RANDOM_LAYERS) or getattr(m, _MARK, False)
    ]


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


@contextlib.contextmanager
def seeded(device: torch.device, seed: int) -> Iterator[None]:
    """Run with ``device``'s generator seeded by ``seed``, holding its lock.

    The generator's state is restored afterwards, so tasks do not advance it.
    """
    gen = generator(device)
    with _lock(device):
        saved = gen.get_state()
        gen.manual_seed(seed)
        try:
            yield
        finally:
            gen.set_state(saved)


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
