"""Random draws replayed exactly, whatever op makes them, on threads that may share a generator.

A checkpointed task must draw again, in recomputation, exactly what its
forward drew, although other micro-batches have advanced the generator in
between. A list of random layers cannot promise that: ``F.dropout``,
``torch.rand``, ``bernoulli_``, attention dropout all draw. What is random is
the op, and aten tags every such op ``nondeterministic_seeded``. Each device
has one default generator (the CPU one serves the whole process), so a task's
draws are made replayable in one of two ways, chosen per partition
(``ownership.py``):

- Owned: no other thread of the pipe draws from the generators the task can
  draw from, so the task runs with nothing in the way. A checkpointed task
  notes their states at the start and at the end of its forward;
  recomputation sets the start state, runs, checks the end state and puts
  back the state it found, as torch's own checkpointing does::

      forward:     S0 -> [the task draws] -> E
      recompute:   T (now) saved, S0 set -> [the same draws] -> E? -> T restored

  Ending at E is exact; ending at S0 means the replay drew nothing, so the
  forward did not either (its change came from another thread). Anything
  else raises: another thread drew meanwhile.

- Seeded: partitions that run at once on threads of their own share a
  generator, so their draws would interleave in an order that changes from
  run to run. Their tasks run under ``TaskRandomness.drawing()``, a dispatch
  mode that lets ordinary ops through untouched and runs each random op from
  a seed of its own, derived from the run's base seed (a forward pass or a
  step), the micro-batch, the partition and the rank of the draw in the
  task::

      task (i, j):  linear  dropout              matmul  rand_like
                            |lock, seed(i,j,1)|          |lock, seed(i,j,2)|

  The generator is locked, seeded, used and restored around that one op
  only, so everything else overlaps. Dynamo's compile lock is held too: a
  compilation on another thread sets the generators back when it ends.
  Recomputation replays the task under ``replaying()`` and gets the same
  seeds, so the same masks; a checkpointed task notes the state each draw
  ends in, and its replay raises if one ends elsewhere (a thread drew
  without the lock inside the window). A generator the user passes to an op
  (``torch.rand(..., generator=g)``) keeps its own stream: its state before
  each draw is recorded and restored for the replay. The mode lets compiled
  code run compiled (torch >= 2.9: ``ignore_compile_internals``): inductor's
  graphs draw their seeds through it with one op per call.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils.checkpoint
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

__all__ = [
    "SEEDED",
    "BaseSeed",
    "PartitionRandomness",
    "TaskRandomness",
    "default_generator",
    "inside_a_checkpoint_of_its_own",
    "running_microbatch",
]

_SEED_MASK = (1 << 63) - 1
_MIX_MASK = (1 << 64) - 1

# Whether dynamo compiles under a dispatch mode that asks it to (torch >= 2.9);
# before, code compiled in a seeded partition would silently run eager.
MODE_COMPILES = hasattr(TorchDispatchMode, "ignore_compile_internals")

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
    """The lock around every use of ``generator``; enter it after ``_compile_lock()``."""
    lock = _locks.get(id(generator))
    if lock is None:
        with _locks_guard:
            lock = _locks.setdefault(id(generator), threading.Lock())
    return lock


def _compile_lock() -> AbstractContextManager[Any]:
    """Dynamo's compile lock once dynamo is loaded; entered before a generator's lock.

    Dynamo notes the default generators' states when it starts compiling a
    frame and sets them back when it is done (``preserve_global_state``), on
    the thread that compiles and without a lock of ours. Landing inside
    another thread's seeded draw, that rewind changes the numbers drawn:
    silently without checkpointing, and with it the recomputation raises.
    Dynamo compiles under its ``compile_lock``, a reentrant lock, so holding
    it around every use of a generator keeps compilations out. Taken first
    everywhere, it cannot deadlock: a compilation that draws already holds it.

    Both locks are entered by a ``with`` of their own, never by Python code
    between an acquire and the block: a KeyboardInterrupt raised there (a
    blocked acquire in the main thread is interruptible) would leave a lock
    held and every worker that draws waiting for it forever. A ``with`` on a
    lock, whose ``__enter__`` is C, releases it whatever interrupts the block.
    """
    convert_frame = sys.modules.get("torch._dynamo.convert_frame")
    compiling: AbstractContextManager[Any] | None = getattr(convert_frame, "compile_lock", None)
    return nullcontext() if compiling is None else compiling


def default_generator(device: torch.device) -> torch.Generator | None:
    """The generator an op on ``device`` draws from when given none (None if there is none)."""
    if device.type == "cpu":
        return torch.default_generator
    module: Any = getattr(torch, device.type, None)
    generators = getattr(module, "default_generators", None)
    if not generators and hasattr(module, "init") and module.is_available():
        # CUDA makes its generators when it starts, at its first use: a pipe
        # planned before (partitions without parameters) would not own its
        # GPU's generator, and recomputation would draw new masks.
        module.init()
        generators = module.default_generators
    if not generators:
        return None
    index = device.index if device.index is not None else module.current_device()
    return generators[index]  # type: ignore[no-any-return]


def _draw_device(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.device:
    """The device a random op draws on: its ``device`` argument, else its first tensor's.

    Tensors among the keyword arguments count too: inductor's seeds come from
    ``randint.low_out(low, high, size, out=buffer)``, whose only tensor is ``out``.
    """
    device = kwargs.get("device")
    if device is not None:
        return torch.device(device)
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value.device
        if isinstance(value, list | tuple):
            for item in value:
                if isinstance(item, torch.Tensor):
                    return item.device
    return torch.get_default_device()


_is_random_op: dict[Any, bool] = {}


def _random(func: Any) -> bool:
    random = _is_random_op.get(func)
    if random is None:
        random = _is_random_op[func] = torch.Tag.nondeterministic_seeded in func.tags
    return random


# Arguments that, given these values, make an op tagged random draw nothing: attention's
# dropout of 0 (CPU's scaled dot product attention is tagged whatever its dropout), a
# dropout or RReLU outside training.
_DRAWS_NOTHING = {"dropout_p": 0.0, "train": False, "training": False}
# Arguments whose values may leave nothing to draw: an empty tensor, a size holding 0 (torch
# draws nothing for zero elements, so its generator stays as it was).
_SIZES = ("self", "input", "size")
_switches: dict[Any, list[tuple[int, str, Any]]] = {}


def _draws(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether this call of ``func`` draws random numbers."""
    if not _random(func):
        return False
    switches = _switches.get(func)
    if switches is None:
        switches = _switches[func] = [
            (k, a.name, a.default_value)
            for k, a in enumerate(func._schema.arguments)
            if a.name in _DRAWS_NOTHING or a.name in _SIZES
        ]
    for index, name, default in switches:
        value = kwargs.get(name, args[index] if index < len(args) else default)
        if name in _SIZES:
            if _no_elements(value):
                return False
        elif value is not None and value == _DRAWS_NOTHING[name]:
            return False
    return True


def _no_elements(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.numel() == 0
    return isinstance(value, list | tuple) and any(type(n) is int and n == 0 for n in value)


def _state(generator: torch.Generator) -> torch.Tensor:
    """The generator's state, never read inside another thread's seeded draw."""
    with _compile_lock(), _lock(generator):
        return generator.get_state()


def _key(state: torch.Tensor) -> bytes:
    """A state as bytes, compared in Python (``torch.equal`` would be one more op)."""
    return state.numpy().tobytes()


@dataclass(frozen=True)
class PartitionRandomness:
    """How the tasks of one partition draw: seeded op by op, or from generators its thread owns.

    ``generators``: what an owned partition's checkpointed tasks capture and
    replay (its device's default generator, and the CPU one). ``compiled``:
    the partition holds a compiled layer, which the seeding mode would run
    eager before torch 2.9.
    """

    seeded: bool
    generators: tuple[torch.Generator, ...] = ()
    compiled: bool = False


SEEDED = PartitionRandomness(seeded=True)


class BaseSeed:
    """The base seed of one run through the partitions, drawn once, when a task first needs it.

    One run is a ``pipe(x)`` forward pass, or a ``Pipe.step``. Drawn from the
    CPU generator, so ``torch.manual_seed`` makes a run reproducible, and
    only if some op draws: a model without randomness leaves the generator
    as the plain model does. A Pipe called from inside another Pipe's task
    takes its seed from that task instead (``nested``), and seeds every
    draw of its own, so the outer task's recomputation replays the inner
    Pipe's draws too.
    """

    def __init__(self) -> None:
        outer: TaskRandomness | None = getattr(_current, "task", None)
        self.nested = outer is not None
        self._value = None if outer is None else outer.derive_seed()
        self._lock = threading.Lock()

    def value(self) -> int:
        if self._value is None:
            with self._lock:
                if self._value is None:
                    generator = torch.default_generator
                    with _compile_lock(), _lock(generator), _disable_current_modes():
                        self._value = int(torch.randint(0, _SEED_MASK, (), generator=generator))
        return self._value


class TaskRandomness:
    """The random draws of task (micro-batch ``i``, partition ``j``): made once, replayable.

    ``checkpointed``: the task will be recomputed, so what it drew is noted
    for the replay; other tasks pay nothing for it.
    """

    __slots__ = (
        "_base",
        "_checkpointed",
        "_compiled",
        "_draws",
        "_ends",
        "_generators",
        "_recorded",
        "_seed",
        "_seeded",
        "_span",
        "_task",
    )

    def __init__(
        self,
        base: BaseSeed,
        microbatch: int,
        partition: int,
        plan: PartitionRandomness = SEEDED,
        checkpointed: bool = False,
    ) -> None:
        self._base = base
        self._task = (microbatch, partition)
        self._seeded = plan.seeded or base.nested
        self._generators = plan.generators
        self._compiled = plan.compiled
        self._checkpointed = checkpointed
        self._seed: int | None = None
        self._draws = 0
        # Seeded: a user generator's state before each draw; the state each
        # seeded draw ended in (checkpointed tasks).
        self._recorded: dict[int, torch.Tensor] = {}
        self._ends: dict[int, int] = {}
        # Owned: the generators' states at the start and the end of the forward.
        self._span: tuple[list[torch.Tensor], list[bytes]] | None = None

    def seed(self) -> int:
        if self._seed is None:
            self._seed = _mix(self._base.value(), *self._task)
        return self._seed

    def derive_seed(self) -> int:
        """A seed for a nested Pipe, taken like a draw so that replay derives it again."""
        self._draws += 1
        return _mix(self.seed(), self._draws, 1)

    def drawing(self) -> AbstractContextManager[None]:
        """Run the task's forward."""
        if self._seeded:
            return self._mode(replay=False)
        if self._checkpointed:
            return self._captured()
        return _Acting(self)

    def replaying(self) -> AbstractContextManager[None]:
        """Run the task again (recomputation): the same ops draw the same numbers."""
        if self._seeded:
            return self._mode(replay=True)
        return self._replayed()

    # Owned generators

    @contextmanager
    def _captured(self) -> Iterator[None]:
        start = [_state(g) for g in self._generators]
        with _Acting(self):
            yield
        self._span = (
            start,
            [_key(state) for state in start] + [_key(_state(g)) for g in self._generators],
        )

    @contextmanager
    def _replayed(self) -> Iterator[None]:
        assert self._span is not None, "replaying() follows a checkpointed drawing()"
        start, keys = self._span
        count = len(start)
        found: list[torch.Tensor] = []
        try:
            for generator, state in zip(self._generators, start, strict=True):
                with _compile_lock(), _lock(generator):
                    found.append(generator.get_state())
                    generator.set_state(state)
            with _Acting(self):
                yield
            for k, generator in enumerate(self._generators):
                ended = _key(_state(generator))
                if ended != keys[count + k] and ended != keys[k]:
                    raise self._foreign_draw(generator, "its forward or this recomputation")
        finally:
            # An interrupt may have come before every state was set: put back those found.
            for generator, state in zip(self._generators, found, strict=False):
                with _compile_lock(), _lock(generator):
                    generator.set_state(state)

    # Seeded draws

    @contextmanager
    def _mode(self, replay: bool) -> Iterator[None]:
        if self._compiled and not MODE_COMPILES:
            raise RuntimeError(_compiled_message(self._task[1]))
        with _Acting(self), _SeedEachDraw(self, replay):
            yield

    def partition(self) -> int:
        return self._task[1]

    def draw(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], replay: bool) -> Any:
        """Run random op ``func`` as this task's next draw."""
        self._draws += 1
        generator = _generator_of(args, kwargs)
        default = default_generator(_draw_device(args, kwargs))
        if generator is None or generator is default:
            if default is None:
                return func(*args, **kwargs)
            # The seed first: drawing the base seed takes the CPU generator's lock.
            seed = _mix(self.seed(), self._draws)
            return self._seeded_draw(default, seed, func, args, kwargs, replay)
        return self._replayable(generator, func, args, kwargs, replay)

    def _seeded_draw(
        self,
        generator: torch.Generator,
        seed: int,
        func: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        replay: bool,
    ) -> Any:
        with _compile_lock(), _lock(generator):
            saved = generator.get_state()
            try:
                generator.manual_seed(seed)
                result = func(*args, **kwargs)
                if self._checkpointed:
                    self._check_end(generator, replay)
                return result
            finally:
                generator.set_state(saved)

    def _check_end(self, generator: torch.Generator, replay: bool) -> None:
        """Note (forward) or compare (replay) the state this seeded draw ended in."""
        ended = hash(_key(generator.get_state()))
        if not replay:
            self._ends[self._draws] = ended
        elif self._ends.get(self._draws, ended) != ended:
            raise self._foreign_draw(generator, f"draw {self._draws} of its forward or replay")

    def _foreign_draw(self, generator: torch.Generator, where: str) -> RuntimeError:
        i, j = self._task
        return RuntimeError(
            f"the recomputation of micro-batch {i} on partition {j} did not draw the random "
            f"numbers its forward drew from the {generator.device} generator: another thread "
            f"drew from that generator during {where} (a thread of yours, another Pipe, or "
            "torch.compile compiling on another thread, which rewinds the generator); give "
            "that thread a torch.Generator of its own, or use checkpoint='never'"
        )

    def _replayable(
        self,
        generator: torch.Generator,
        func: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        replay: bool,
    ) -> Any:
        with _compile_lock(), _lock(generator):
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
            try:
                generator.set_state(recorded)
                return func(*args, **kwargs)
            finally:
                generator.set_state(saved)


def _generator_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Generator | None:
    """The generator a random op is given: a keyword of most, positional in some
    schemas (``poisson``, ``_standard_gamma``, ``rrelu_with_noise``)."""
    given = kwargs.get("generator")
    if given is None:
        given = next((a for a in args if isinstance(a, torch.Generator)), None)
    return given


def running_microbatch() -> int | None:
    """The micro-batch of the task this thread runs (its forward or its recomputation), or None.

    A layer whose work depends on which micro-batch it sees (the router
    loss reads that micro-batch's attention mask) asks here.
    """
    task: TaskRandomness | None = getattr(_current, "task", None)
    return None if task is None else task._task[0]


class _Acting:
    """The task running on this thread (a nested Pipe seeds from it); its draws counted anew."""

    __slots__ = ("previous", "task")

    def __init__(self, task: TaskRandomness) -> None:
        self.task = task
        self.previous: TaskRandomness | None = None

    def __enter__(self) -> None:
        self.previous = getattr(_current, "task", None)
        self.task._draws = 0
        _current.task = self.task

    def __exit__(self, *exc_info: object) -> None:
        _current.task = self.previous


def _compiled_message(partition: int) -> str:
    return (
        f"partition {partition} holds a compiled layer, but its random ops are seeded one by "
        "one by a dispatch mode (its generator is shared with other threads of the pipe, or "
        "another thread of the pipe compiles, which sets generators back when it is done), and "
        f"torch {torch.__version__} runs compiled code eagerly under such a mode: use torch "
        ">= 2.9, or run the partitions on one thread (Pipe(..., threads='device') with every "
        "partition on one device, or a DistributedPipe), where no seeding is needed"
    )


class _SeedEachDraw(TorchDispatchMode):
    """Ordinary ops pass straight through; random ones go to the task's ``draw``.

    Compiled code runs compiled under it: dynamo compiles with the mode off
    and the compiled graphs' random ops (a seed draw per call with inductor)
    come through it at run time.
    """

    def __init__(self, task: TaskRandomness, replay: bool) -> None:
        super().__init__()
        self.task = task
        self.replay = replay

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if not _draws(func, args, kwargs):
            return func(*args, **kwargs)
        if not self.replay:
            _refuse_a_checkpoint_of_its_own(self.task.partition())
        return self.task.draw(func, args, kwargs, self.replay)


# The saved-tensors hook of the pipe's own torch checkpoint around the task this
# thread runs (``pipe(x)``'s checkpointed tasks), told apart from a layer's own.
_own = threading.local()


@contextmanager
def own_checkpoint() -> Iterator[None]:
    """Around a task's forward inside the pipe's own ``torch.utils.checkpoint``."""
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    previous = getattr(_own, "hook", None)
    _own.hook = None if top is None else top[0]
    try:
        yield
    finally:
        _own.hook = previous


def _refuse_a_checkpoint_of_its_own(partition: int) -> None:
    """Refuse a draw inside a layer's own ``torch.utils.checkpoint``.

    This partition seeds each draw by its place in the task; the layer's
    recomputation, run by autograd inside the backward, would draw from the
    generator's state instead: other masks than its forward's, and gradients
    that are not the forward's, without an error (transformers' gradient
    checkpointing with dropout).
    """
    if not inside_a_checkpoint_of_its_own():
        return
    raise RuntimeError(
        f"partition {partition} drew random numbers inside a torch.utils.checkpoint of a "
        "layer's own (transformers' gradient checkpointing): its recomputation in the "
        "backward would not draw what its forward drew, as this partition seeds each draw "
        "(CPU partitions on threads of their own); let the pipe recompute instead "
        "(checkpoint=..., model.gradient_checkpointing_disable()), or run the partitions on "
        "one thread (threads='device'), or turn the dropout off"
    )


def inside_a_checkpoint_of_its_own() -> bool:
    """Whether this forward runs inside a layer's own ``torch.utils.checkpoint`` (either
    kind), whose recomputation autograd runs in the backward, outside the pipe's task.

    A reentrant checkpoint's forward is an autograd Function's, run with grad
    off: only then are the frames walked (a DeferredBatchNorm asks at every call).
    """
    if _inside_non_reentrant_checkpoint():
        return True
    return not torch.is_grad_enabled() and _inside_reentrant_checkpoint()


def _inside_non_reentrant_checkpoint() -> bool:
    """Whether the innermost saved-tensors hook is a torch checkpoint's, not the pipe's own."""
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    if top is None or top[0] is getattr(_own, "hook", None):
        return False
    return "_checkpoint_hook" in getattr(top[0], "__qualname__", "")


# A reentrant checkpoint runs its forward inside this function's frame, with no
# hook to see it by: the frames above the draw are what tell.
_REENTRANT_FORWARD = torch.utils.checkpoint.CheckpointFunction.forward.__code__


def _inside_reentrant_checkpoint() -> bool:
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is _REENTRANT_FORWARD:
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False
