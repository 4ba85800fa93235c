"""What each stage of a ``Pipe.step`` holds in total at its peak, counted from what the step keeps.

The allocator cannot say which partition a CPU tensor belongs to (every
partition of these tests is on ``cpu``), and an RSS or ``max_memory_allocated``
figure depends on the allocator's caching and on the threads' timing. So
this counts tensors, each storage once, from where a step keeps them,
sampled on stage ``j``:

- at each tensor that its forward (or a recomputation) saves for backward,
  where its activations grow;
- after every action of any stage, where mail arrives and stashes shrink.

What stage ``j`` holds at a sample is the union of the storages of

- the tensors autograd holds saved for its backward (its ``ActivationMeter``,
  ``measure_memory=True``);
- what its stash keeps from each micro-batch's forward to its backward:
  the received inputs and the messages they came from, received skips, the
  outputs kept as tensors (leaves), the loss, and what zero-bubble's ``I``
  left for ``W`` (the gradients it recorded, the outputs' gradients);
- the messages waiting in its mailbox (activations from stage ``j - 1``,
  gradients from ``j + 1``, the skips it pops, the gradients of those it
  stashed);
- the ``.grad`` of its parameters;

less the parameters and the caller's input and target, which the meter
leaves out too. Its peak plus the bytes of its parameters and of their
optimizer state, read off the tensors after the step, is the total.

Not counted (the planner does not predict them either): the transient
tensors of a running action (a backward's intermediate gradients, an
output on its way into the mailbox), the losses and outputs kept for the
caller, and the allocator's caches and rounding. The step runs with
``threads="device"`` (one thread runs every stage in the order
``Simulation.one_thread_order`` gives), so the samples, hence the figures,
do not depend on timing.

This reads the step's private state (``StageRun``'s stash, its meter's
live storages, the local transport's mailboxes) by wrapping two
``StageRun`` methods for the duration of ``measuring``: a test's
instrument, not an API.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from pipeline.step.mail import LocalTransport
from pipeline.step.stage import StageRun

__all__ = ["StageTotal", "measuring"]


@dataclass
class StageTotal:
    """One stage's measured peak, in bytes: what the step holds, and what is static.

    ``held`` is the peak of the step's own tensors and ``.grad`` together;
    ``gradients`` the ``.grad`` bytes at that peak; ``parameters`` and
    ``optimizer`` are read after the step.
    """

    held: int = 0
    gradients: int = 0
    parameters: int = 0
    optimizer: int = 0

    @property
    def total(self) -> int:
        return self.held + self.parameters + self.optimizer


@contextmanager
def measuring(
    partitions: list[nn.Module], optimizer: torch.optim.Optimizer | None = None
) -> Iterator[list[StageTotal]]:
    """Within the block, every ``Pipe.step`` is sampled; the list holds each stage's peak.

    ``partitions`` are the pipe's (``pipe.partitions``); ``optimizer``'s state
    of their parameters is read when the block ends.
    """
    totals = [StageTotal() for _ in partitions]
    runs: list[StageRun] = []
    init, act = StageRun.__init__, StageRun.act

    def sample(run: StageRun) -> None:
        held, grads = _held(run, partitions[run.j])
        if held > totals[run.j].held:
            totals[run.j].held, totals[run.j].gradients = held, grads

    def counted_init(self: StageRun, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        if not self.context.measure_memory:
            raise ValueError("measuring stage totals needs pipe.step(..., measure_memory=True)")
        meter, pack = self.meter, self.meter._pack  # type: ignore[union-attr]

        def counted_pack(tensor: Tensor) -> Any:
            saved = pack(tensor)
            sample(self)
            return saved

        meter._pack = counted_pack  # type: ignore[method-assign,union-attr]
        runs.append(self)

    def counted_act(self: StageRun, action: Any) -> None:
        act(self, action)
        for run in runs:
            if run.context is self.context:
                sample(run)

    StageRun.__init__ = counted_init  # type: ignore[method-assign]
    StageRun.act = counted_act  # type: ignore[method-assign]
    try:
        yield totals
    finally:
        StageRun.__init__ = init  # type: ignore[method-assign]
        StageRun.act = act  # type: ignore[method-assign]
    for total, partition in zip(totals, partitions, strict=True):
        parameters = list(partition.parameters())
        total.parameters = _bytes(parameters)
        if optimizer is not None:
            state = [optimizer.state.get(p, {}) for p in parameters]
            total.optimizer = _bytes(v for s in state for v in s.values())


def _held(run: StageRun, partition: nn.Module) -> tuple[int, int]:
    """What stage ``run.j`` holds now, and of that its ``.grad``, each storage once."""
    meter = run.meter
    assert meter is not None, "measuring refuses a step without its meter"
    storages: dict[int, int] = {k: size for k, (size, _) in meter._live.items()}
    kept: list[Any] = []
    for stashed in run.stash.values():
        kept += [*stashed.inputs.leaves, *stashed.sources, *stashed.skips_in.values()]
        kept += [*stashed.outputs, stashed.loss]
        work = stashed.weight_work
        if work is not None:
            kept += [g for grads in work._recorded.values() for g in grads]
            kept += [grad for group in work._groups for _, grad in group.outputs]
    transport = run.context.transport
    assert isinstance(transport, LocalTransport), "one process"
    routes = run.context.skip_layout.routes() if run.context.skip_layout else []
    for (_, key), message in list(transport.mailboxes._values.items()):
        if _mailed_to(key, run.j, routes):
            kept += message.leaves
    grads = [p.grad for p in partition.parameters() if p.grad is not None]
    for x in [*kept, *grads]:
        if isinstance(x, Tensor):
            storage = x.untyped_storage()
            storages.setdefault(storage.data_ptr(), storage.nbytes())
    for key in meter._excluded:
        storages.pop(key, None)
    return sum(storages.values()), _bytes(grads)


def _mailed_to(key: Any, j: int, routes: list[Any]) -> bool:
    """Whether a mailbox's message is for stage ``j``: an activation or a gradient from
    a neighbour, a skip it pops, or the gradient of a skip it stashed."""
    if not isinstance(key, tuple):
        return False
    if key[0] in ("act", "grad"):
        return bool(key[1] == j)
    if key[0] == "skip":
        return bool(routes[key[1]].target == j)
    return key[0] == "skip-grad" and bool(routes[key[1]].source == j)


def _bytes(tensors: Iterable[Any]) -> int:
    """The bytes of the storages of ``tensors`` (non-tensors skipped), each storage once."""
    storages = {
        x.untyped_storage().data_ptr(): x.untyped_storage().nbytes()
        for x in tensors
        if isinstance(x, Tensor)
    }
    return sum(storages.values())
