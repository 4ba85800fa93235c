"""Which generators a thread owns, hence which partitions draw with no seeding mode in the way.

A generator is owned by a thread when no other thread of the pipe can draw
from it. A partition draws from its device's default generator and, through
ops given no device (``torch.rand(n)``), from the CPU one::

    the default generator of ...   is owned by a thread when
    a CUDA (or other) device       that thread runs every partition on the device
    the CPU                        that thread runs every partition of the pipe

and no other thread of the pipe holds a compiled layer: dynamo sets the
default generators back to where it found them when it finishes compiling a
frame (``preserve_global_state``), on its own thread, so a compilation on
another thread can rewind an owned generator between two of the owner's
draws (repeating its numbers). Seeded draws hold dynamo's compile lock.
Each run (a forward pass, a step) looks at the partitions again: a layer
compiled in place or a generator given to a layer after the pipe was built
changes how its partition draws from the next run on.

A partition whose thread owns its device's generator runs its tasks with
nothing in the way, and its checkpointed tasks capture and replay the
generators' states (``rng.py``). That covers a partition alone on its GPU, the
partitions of one device on one thread (``threads='device'``), a pipe with a
single thread in all, and a ``DistributedPipe``'s process, which runs all its
stages on the caller's thread. A CUDA partition's draws from the CPU
generator, which other threads may share, are captured and checked too:
recomputation replays them exactly, or raises when another thread drew from
it meanwhile.

Every other partition seeds each random op on its own, and so does one that
holds a ``torch.Generator`` (only the seeding mode sees which generator an op
is given, and can replay a user generator's draws) and every partition of a
Pipe nested in another one's task (``BaseSeed.nested``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from pipeline.runtime.rng import (
    SEEDED,
    PartitionRandomness,
    default_generator,
)

__all__ = ["holds_compiled", "holds_generator", "randomness_plans"]


def randomness_plans(
    devices: Sequence[torch.device],
    stages_by_worker: Sequence[Sequence[int]],
    holding_generator: Sequence[bool],
    compiled: Sequence[bool],
) -> list[PartitionRandomness]:
    """How each partition draws, when ``stages_by_worker[w]`` lists those worker ``w`` runs.

    A partition that no thread runs here (another process's stage) is seeded.

    >>> cpu = torch.device("cpu")
    >>> [p.seeded for p in randomness_plans([cpu, cpu], [[0, 1]], [False, False], [False] * 2)]
    [False, False]
    >>> [p.seeded for p in randomness_plans([cpu, cpu], [[0], [1]], [False, False], [False] * 2)]
    [True, True]
    """
    thread_of = {j: t for t, partitions in enumerate(stages_by_worker) for j in partitions}
    compiling = {thread_of[j] for j in thread_of if compiled[j]}
    threads_of_device: dict[torch.device, set[int]] = {}
    for j, t in thread_of.items():
        threads_of_device.setdefault(devices[j], set()).add(t)
    plans = []
    for j, device in enumerate(devices):
        owned = (
            j in thread_of
            and len(threads_of_device[device]) == 1
            and (device.type != "cpu" or len(stages_by_worker) == 1)
            and not holding_generator[j]
            and compiling <= {thread_of[j]}
        )
        plans.append(
            PartitionRandomness(seeded=False, generators=_drawn_from(device))
            if owned
            else PartitionRandomness(seeded=True, compiled=compiled[j])
            if compiled[j]
            else SEEDED
        )
    return plans


def _drawn_from(device: torch.device) -> tuple[torch.Generator, ...]:
    """The generators a task on ``device`` draws from when an op is given none."""
    generators = [default_generator(device), torch.default_generator]
    return tuple(dict.fromkeys(g for g in generators if g is not None))


# nn.Module's own attributes (parameters, buffers, submodules, hooks) hold no
# generator, and skipping them keeps the search cheap enough for every run.
_MODULE_INTERNALS = frozenset(vars(nn.Module()))


def holds_generator(partition: nn.Module) -> bool:
    """Whether a module of ``partition`` keeps a ``torch.Generator`` (directly or in a container).

    A generator reached otherwise (a global, a closure) is not found, and
    an owned partition's recomputation does not replay its draws: it draws
    new numbers (docs/guide.md, "Randomness").
    """
    for module in partition.modules():
        for name, value in vars(module).items():
            if name in _MODULE_INTERNALS:
                continue
            items = value.values() if isinstance(value, dict) else value
            if _is_generator(type(value)) or (
                isinstance(value, list | tuple | dict)
                and any(_is_generator(type(item)) for item in items)
            ):
                return True
    return False


_generator_types: dict[type, bool] = {}


def _is_generator(kind: type) -> bool:
    # By type, remembered: isinstance(value, torch.Generator) goes through a
    # metaclass check that costs a microsecond for each attribute.
    found = _generator_types.get(kind)
    if found is None:
        found = _generator_types[kind] = issubclass(kind, torch.Generator)
    return found


def holds_compiled(partition: nn.Module) -> bool:
    """Whether ``partition`` holds a layer compiled with ``torch.compile`` (module or method).

    >>> holds_compiled(nn.Sequential(nn.Linear(2, 2)))
    False
    """
    return any(
        getattr(module, "_compiled_call_impl", None) is not None
        or type(module).__name__ == "OptimizedModule"
        for module in partition.modules()
    )
