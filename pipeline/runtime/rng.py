"""Random draws replayed exactly, whatever op makes them, on worker threads sharing a generator.

Each device has one default generator (the CPU one serves the whole
process), and partitions on one device run at once on their own threads, so
their draws would interleave in an order that changes from run to run. A
checkpointed task must also draw again, in recomputation, exactly what its
forward drew, although other micro-batches have advanced the generator in
between. A list of random layers cannot promise that: ``F.dropout``,
``torch.rand``, ``bernoulli_``, attention dropout all draw. What is random is
the op, and aten tags every such op ``nondeterministic_seeded``.

So every task runs under ``TaskRandomness.drawing()``, a dispatch mode that
lets ordinary ops through untouched and runs each random op from a seed of
its own, derived from the run's base seed (a forward pass or a step), the
micro-batch, the partition and the rank of the draw in the task::

    task (i, j):  linear  dropout              matmul  rand_like
                          |lock, seed(i,j,1)|          |lock, seed(i,j,2)|

The generator is locked, seeded, used and restored around that one op only,
so everything else overlaps. Recomputation replays the task under
``replaying()`` and gets the same seeds, so the same masks. A generator the
user passes to an op (``torch.rand(..., generator=g)``) keeps its own
stream: its state before each draw is recorded and restored for the replay.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

__all__ = ["BaseSeed", "TaskRandomness"]

_SEED_MASK = (1 << 63) - 1
_MIX_MASK = (1 << 64) - 1

_locks: dict[int, threading.Lock] = {}
_locks_guard = threading.Lock()
_current = threading.local()


def _mix(*values: int) -> int:
    """A well-spread 63-bit seed from a few ints (SplitMix64 finaliser per value)."""
    state = 0x9E3779B97F4A7C15
    for value in values:
        state = (state ^ (value & _MIX_MASK)) * 0xBF58476D1CE4E5B9 & _MIX_MASK
        state = (state ^ (state >> 31)) * 0x94D049BB133111EB & _MIX_MASK
        state ^= state >> 29
    return state & _SEED_MASK


def _lock(generator: torch.Generator) -> threading.Lock:
    lock = _locks.get(id(generator))
    if lock is None:
        with _locks_guard:
            lock = _locks.setdefault(id(generator), threading.Lock())
    return lock


def _default_generator(device: torch.device) -> torch.Generator | None:
    """The generator an op on ``device`` draws from when given none (None if there is none)."""
    if device.type == "cpu":
        return torch.default_generator
    module = getattr(torch, device.type, None)
    generators = getattr(module, "default_generators", None)
    if not generators:
        return None
    index = device.index if device.index is not None else module.current_device()
    return generators[index]  # type: ignore[no-any-return]


def _draw_device(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.device:
    """The device a random op draws on: its ``device`` argument or its first tensor's."""
    device = kwargs.get("device")
    if device is not None:
        return torch.device(device)
    for arg in args:
        if isinstance(arg, torch.Tensor):
            return arg.device
        if isinstance(arg, list | tuple):
            for item in arg:
                if isinstance(item, torch.Tensor):
                    return item.device
    return torch.get_default_device()


_is_random_op: dict[Any, bool] = {}


def _random(func: Any) -> bool:
    random = _is_random_op.get(func)
    if random is None:
        random = _is_random_op[func] = torch.Tag.nondeterministic_seeded in func.tags
    return random


class BaseSeed:
    """The base seed of one run through the partitions, drawn once, when a task first needs it.

    One run is a ``pipe(x)`` forward pass, or a ``Pipe.step``. Drawn from the
    CPU generator, so ``torch.manual_seed`` makes a run reproducible, and
    only if some op draws: a model without randomness leaves the generator
    as the plain model does. A Pipe called from inside another Pipe's task
    takes its seed from that task instead, so the outer task's
    recomputation replays the inner Pipe's draws too.
    """

    def __init__(self) -> None:
        outer: TaskRandomness | None = getattr(_current, "task", None)
        self._value = None if outer is None else outer.derive_seed()
        self._lock = threading.Lock()

    def value(self) -> int:
        if self._value is None:
            with self._lock:
                if self._value is None:
                    generator = torch.default_generator
                    with _lock(generator), _disable_current_modes():
                        self._value = int(torch.randint(0, _SEED_MASK, (), generator=generator))
        return self._value


class TaskRandomness:
    """The random draws of task (micro-batch ``i``, partition ``j``): made once, replayable."""

    __slots__ = ("_base", "_draws", "_recorded", "_seed", "_task")

    def __init__(self, base: BaseSeed, microbatch: int, partition: int) -> None:
        self._base = base
        self._task = (microbatch, partition)
        self._seed: int | None = None
        self._draws = 0
        self._recorded: dict[int, torch.Tensor] = {}

    def seed(self) -> int:
        if self._seed is None:
            self._seed = _mix(self._base.value(), *self._task)
        return self._seed

    def derive_seed(self) -> int:
        """A seed for a nested Pipe, taken like a draw so that replay derives it again."""
        self._draws += 1
        return _mix(self.seed(), self._draws, 1)

    @contextmanager
    def drawing(self) -> Iterator[None]:
        """Run the task's forward: every random op draws from its own seed."""
        with self._mode(replay=False):
            yield

    @contextmanager
    def replaying(self) -> Iterator[None]:
        """Run the task again (recomputation): the same ops draw the same numbers."""
        with self._mode(replay=True):
            yield

    @contextmanager
    def _mode(self, replay: bool) -> Iterator[None]:
        previous = getattr(_current, "task", None)
        self._draws = 0
        _current.task = self
        try:
            with _SeedEachDraw(self, replay):
                yield
        finally:
            _current.task = previous

    def draw(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], replay: bool) -> Any:
        """Run random op ``func`` as this task's next draw."""
        self._draws += 1
        generator = kwargs.get("generator")
        default = _default_generator(_draw_device(args, kwargs))
        if generator is None or generator is default:
            if default is None:
                return func(*args, **kwargs)
            # The seed first: drawing the base seed takes the CPU generator's lock.
            return self._seeded(default, _mix(self.seed(), self._draws), func, args, kwargs)
        return self._replayable(generator, func, args, kwargs, replay)

    @staticmethod
    def _seeded(
        generator: torch.Generator,
        seed: int,
        func: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        with _lock(generator):
            saved = generator.get_state()
            generator.manual_seed(seed)
            try:
                return func(*args, **kwargs)
            finally:
                generator.set_state(saved)

    def _replayable(
        self,
        generator: torch.Generator,
        func: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        replay: bool,
    ) -> Any:
        with _lock(generator):
            if not replay:
                self._recorded[self._draws] = generator.get_state()
                return func(*args, **kwargs)
            recorded = self._recorded.get(self._draws)
            if recorded is None:
                raise RuntimeError(
                    f"recomputation drew from a user generator at draw {self._draws} of task "
                    f"{self._task}, which its forward did not: the partition's random ops "
                    "differ between forward and recomputation"
                )
            saved = generator.get_state()
            generator.set_state(recorded)
            try:
                return func(*args, **kwargs)
            finally:
                generator.set_state(saved)


class _SeedEachDraw(TorchDispatchMode):
    """Ordinary ops pass straight through; random ones go to the task's ``draw``."""

    def __init__(self, task: TaskRandomness, replay: bool) -> None:
        super().__init__()
        self.task = task
        self.replay = replay

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if not _random(func):
            return func(*args, **kwargs)
        return self.task.draw(func, args, kwargs, self.replay)
