"""Gradients of a step: summed over the micro-batches, accumulated once per tensor.

A step runs one backward per micro-batch and stage. Accumulating each into
``.grad`` would call a parameter's hooks once per micro-batch, with a part
of its gradient, where the plain model's one backward calls them once with
all of it (``register_hook``, ``register_post_accumulate_grad_hook``: the
optimizer-in-backward recipe). So a stage's backward computes the gradients
of every leaf it reaches without accumulating them (``autograd.grad``, the
leaves' hooks held back meanwhile: ``held_hooks.py``), adds them up here,
and each tensor gets its step's sum in one accumulation, through its own
``AccumulateGrad``, when it is final::

    stage j, micro-batch i:  autograd.grad --> sums of stage j   (nothing in .grad)
    stage j's last action:   its partition's parameters --> AccumulateGrad (hooks, once)
                             a parameter held by several partitions: at the last of them
                             FSDP2 units: their unsharded parameters, then one reduction
    after every stage:       other leaves (a tensor of the script, a plain attribute),
                             the caller's graph (stage 0's input gradient), and what the
                             pipe keeps for itself (weights tied across processes)
                             --> one backward: AccumulateGrad (hooks, once)

The accumulation goes through autograd (``_Deliver``) rather than writing
``.grad``, so that it is exactly a backward's: hooks, sparse and layout
rules, and a sum that ``.grad`` takes over without a copy when it was empty.

All this is for hooks and for what waits for the step's end. A backward
none of whose leaves has hooks or waits for the end (the common case) has
nothing to hold back: it is a plain backward, accumulating into ``.grad``
micro-batch by micro-batch, as gradient accumulation over the plain model's
micro-batches would (and without the sums' cost per leaf).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any, TypeAlias

import torch
from torch import Tensor, nn
from torch.autograd.graph import GradientEdge, Node

from pipeline.runtime.microbatch import Batch
from pipeline.runtime.threadstate import ThreadState
from pipeline.step.held_hooks import HeldHooks
from pipeline.step.sharded import ShardedUnits

__all__ = [
    "REENTRANT_CHECKPOINT",
    "GradientSums",
    "Root",
    "StepGradients",
    "accumulate",
    "backward_to_leaves",
    "caller_reached",
    "gradient_node",
    "leaves_of",
]


# What a backward starts from: a tensor, or the edge of one whose storage is gone.
Root: TypeAlias = Tensor | GradientEdge


class GradientSums:
    """Per tensor (by identity), the sum of the gradients added for it.

    The first gradient is kept as it came (autograd may hand one tensor to
    several places); from the second on, the sum is a tensor of its own, so
    nothing outside is ever written.
    """

    __slots__ = ("_sums",)

    def __init__(self) -> None:
        # id(tensor) -> (tensor, sum, whether the sum is a tensor of our own)
        self._sums: dict[int, tuple[Tensor, Tensor, bool]] = {}

    def add(self, tensors: Iterable[Tensor], grads: Iterable[Tensor | None]) -> None:
        """Add each gradient to its tensor's sum (a None gradient adds nothing)."""
        for tensor, grad in zip(tensors, grads, strict=True):
            if grad is not None:
                self._add(tensor, grad, owned=False)

    def _add(self, tensor: Tensor, grad: Tensor, owned: bool) -> None:
        entry = self._sums.get(id(tensor))
        if entry is None:
            self._sums[id(tensor)] = (tensor, grad, owned)
            return
        _, total, total_owned = entry
        # Gradients record no graph (no create_graph): no need for no_grad here.
        if total_owned:
            total += grad
        elif owned:
            grad += total
            total = grad
        else:
            total = total + grad
        self._sums[id(tensor)] = (tensor, total, True)

    def move(self, tensors: Iterable[Tensor], into: GradientSums) -> None:
        """Move the sums of ``tensors`` (those it holds) into ``into``."""
        for tensor in tensors:
            entry = self._sums.pop(id(tensor), None)
            if entry is not None:
                into._add(*entry)

    def merge(self, other: GradientSums) -> None:
        """Add everything ``other`` holds, emptying it."""
        other.move(other.tensors(), self)

    def take(self, tensor: Tensor) -> Tensor | None:
        """The sum for ``tensor`` as a tensor of its own (None if none), no longer kept here."""
        entry = self._sums.pop(id(tensor), None)
        if entry is None:
            return None
        _, total, owned = entry
        return total if owned else total.clone()

    def tensors(self) -> list[Tensor]:
        """The tensors with a sum here, in the order they came."""
        return [entry[0] for entry in self._sums.values()]

    def pop_all(self) -> tuple[list[Tensor], list[Tensor]]:
        """Every tensor with its sum, in the order they came; nothing is kept here after."""
        entries = list(self._sums.values())
        self._sums.clear()
        return [entry[0] for entry in entries], [entry[1] for entry in entries]

    def __len__(self) -> int:
        return len(self._sums)


class StepGradients:
    """Where one step's gradients wait until they are final, and when they are accumulated.

    ``partitions`` are the pipe's partitions and ``stages`` those run here: a
    parameter registered in several of them is final at the end of the last
    one. The tensors of ``at_end`` (the pipe's own, such as weights tied
    across processes), the leaves that no partition here registers and the
    caller's graph wait for the step's end. A stage's FSDP2 units
    (``sharded.py``) reduce their gradients at the stage's end, once those of
    their unsharded parameters are in.
    """

    def __init__(
        self, partitions: Sequence[nn.Module], stages: Iterable[int], at_end: Iterable[Tensor]
    ) -> None:
        self._lock = threading.Lock()
        self._kept = kept = {id(t) for t in at_end}
        # Per stage, the parameters it registers; per parameter, how many
        # of those stages have not ended yet.
        self._registered: dict[int, set[int]] = {}
        self._holders: dict[int, int] = {}
        for j in stages:
            self._registered[j] = {id(p) for p in partitions[j].parameters()} - kept
            for key in self._registered[j]:
                self._holders[key] = self._holders.get(key, 0) + 1
        # Summed per stage, then added in stage order: never in the order threads end.
        self._stages = {j: GradientSums() for j in self._registered}
        # Stages that ended while a parameter they share with another still waits.
        self._unfinished: set[int] = set()
        self._waiting: dict[int, GradientSums] = {}  # by stage
        self._end = GradientSums()
        self.hooks = HeldHooks()
        self.sharded = ShardedUnits(partitions, list(self._registered))

    @contextmanager
    def holding(self) -> Iterator[None]:
        """Around a step's run: hooks held back and FSDP2 reductions deferred, both given back.

        A step that failed accumulates nothing more, leaves no hook held, and
        its FSDP2 units not reduced yet drop its gradients.
        """
        try:
            with self.sharded.deferred():
                yield
        finally:
            self.hooks.release()

    def hold(self, tensors: Sequence[Tensor]) -> bool:
        """Hold the hooks of ``tensors`` back: their gradient is about to be computed in part.

        Whether their gradients must be summed here: one of them has hooks,
        or waits for the step's end. If not, a backward may accumulate them
        into ``.grad`` at once, micro-batch by micro-batch, as the plain
        model's gradient accumulation would.
        """
        holding = self.hooks.hold(tensors)
        return holding or (bool(self._kept) and any(id(t) in self._kept for t in tensors))

    def summed(self, tensor: Tensor) -> bool:
        """Whether ``tensor``'s gradient (after ``hold``) must be summed here: its hooks are
        held back, or it waits for the step's end."""
        return self.hooks.holds(tensor) or id(tensor) in self._kept

    def add(self, j: int, tensors: Sequence[Tensor], grads: Sequence[Tensor | None]) -> None:
        """Stage ``j`` computed ``grads`` for the leaves ``tensors`` (on its own thread)."""
        self._stages[j].add(tensors, grads)

    def to_caller(self, sources: Sequence[Tensor], grads: Sequence[Tensor | None]) -> None:
        """Stage 0's input gradient: into the caller's graph, at the step's end."""
        with self._lock:
            self._end.add(sources, grads)

    def stage_done(self, j: int) -> list[int]:
        """Stage ``j`` ran its last action: accumulate what is final now.

        Returns the stages whose parameters' gradients are all final now: ``j``
        unless it shares a parameter with a stage still running (whichever
        ends first in the schedule, 0 or the last in ZB-H1), and the stages
        that waited for ``j`` so.
        """
        sums = self._stages[j]
        final = GradientSums()
        with self._lock:
            registered = self._registered[j]
            waiting = self._waiting.setdefault(j, GradientSums())
            sums.move([t for t in sums.tensors() if id(t) in registered], waiting)
            sums.move(self.sharded.unsharded(j), final)
            self._end.merge(sums)
            for key in registered:
                self._holders[key] -= 1
            for k in sorted(self._waiting):
                held = self._waiting[k]
                held.move([t for t in held.tensors() if self._holders[id(t)] == 0], final)
            self._unfinished.add(j)
            finished = [k for k in sorted(self._unfinished) if self._final(k)]
            self._unfinished.difference_update(finished)
        self.accumulate(final)
        self.sharded.reduce(j)
        return finished

    def _final(self, j: int) -> bool:
        """Whether every parameter stage ``j`` registers has had its last stage end."""
        return all(self._holders[key] == 0 for key in self._registered[j])

    def accumulate(self, sums: GradientSums) -> None:
        """Give the tensors of ``sums`` their hooks back, and their sums (``accumulate``)."""
        self.hooks.release(sums.tensors())
        accumulate(sums)

    def at_end(self) -> GradientSums:
        """What waits for the step's end, once every stage here has ended: to ``accumulate``."""
        with self._lock:
            for k in sorted(self._waiting):
                self._end.merge(self._waiting[k])
            self._waiting = {}
            rest, self._end = self._end, GradientSums()
        return rest


def accumulate(sums: GradientSums) -> None:
    """Give each tensor its sum, as one backward would: leaves through AccumulateGrad.

    A tensor with a history passes its sum on into its graph (the caller's
    graph for stage 0's inputs). Runs outside autocast, as a backward should.
    """
    tensors, grads = sums.pop_all()
    if not tensors:
        return
    with ExitStack() as stack:
        stack.enter_context(torch.enable_grad())
        for autocast in ThreadState.capture().autocasts:
            stack.enter_context(torch.autocast(autocast.device_type, enabled=False))
        # The node alone holds the list, and empties it in backward: an
        # empty .grad then takes the sum over without a copy.
        torch.autograd.backward(_Deliver.apply(grads, *tensors))


class _Deliver(torch.autograd.Function):
    """Hands a list of gradients to its inputs in backward (the list is emptied)."""

    @staticmethod
    def forward(ctx: Any, grads: list[Tensor], *tensors: Tensor) -> Tensor:
        ctx.grads = grads
        return torch.zeros(())

    @staticmethod
    def backward(ctx: Any, _: Tensor) -> tuple[Tensor | None, ...]:
        grads = tuple(ctx.grads)
        ctx.grads.clear()
        return (None, *grads)


def leaves_of(roots: Iterable[Root]) -> tuple[list[Tensor], bool]:
    """The leaves a backward from ``roots`` reaches (their ``AccumulateGrad`` nodes' tensors).

    Also whether it crosses a reentrant checkpoint (``torch.utils.checkpoint``
    with ``use_reentrant=True``), whose backward runs a backward of its own.
    Each backward of a step walks its graph once: the walk keeps to a node's
    type (no attribute lookups that fail) and names the types it met once, at
    the end.
    """
    seen: set[Node] = set()
    kinds: set[type] = set()
    found: list[Tensor] = []
    pending = [gradient_node(t) for t in roots]
    while pending:
        node = pending.pop()
        if node in seen:
            continue
        seen.add(node)
        kind = type(node)
        if kind is _ACCUMULATE_GRAD:
            found.append(node.variable)  # type: ignore[attr-defined]
            continue
        kinds.add(kind)
        for child, _ in node.next_functions:
            if child is not None:
                pending.append(child)
    return found, any(kind.__name__ == REENTRANT_CHECKPOINT for kind in kinds)


def caller_reached(parameters: Iterable[Tensor], batches: Iterable[Batch]) -> set[int]:
    """The ids of ``parameters`` that a backward through the tensors of ``batches`` (the
    caller's input or target, with a history) reaches: nothing to walk for tensors that
    need no gradient, the usual input."""
    roots = [x for b in batches for x in b.leaves if isinstance(x, Tensor) and x.requires_grad]
    if not roots:
        return set()
    reached = {id(t) for t in leaves_of(roots)[0]}
    return {id(p) for p in parameters if id(p) in reached}


def gradient_node(tensor: Root) -> Node:
    """Where a backward from ``tensor`` starts: its ``grad_fn``, or a leaf's ``AccumulateGrad``.

    An edge (a stage's output, whose storage was freed once sent) starts at its node.
    """
    if isinstance(tensor, GradientEdge):
        return tensor.node
    node = tensor.grad_fn
    return node if node is not None else torch.autograd.graph.get_gradient_edge(tensor).node


_ACCUMULATE_GRAD = type(gradient_node(torch.zeros((), requires_grad=True)))
REENTRANT_CHECKPOINT = "CheckpointFunctionBackward"


def backward_to_leaves(
    roots: Sequence[Root],
    grads: Sequence[Tensor | None],
    inputs: Sequence[Tensor],
    hold: Callable[[list[Tensor]], bool],
    parameters: Iterable[Tensor] = (),
    summed: Callable[[Tensor], bool] = lambda tensor: True,
) -> tuple[list[Tensor | None], list[Tensor], list[Tensor | None]]:
    """One backward from ``roots``, accumulating nothing (but see below).

    Returns the gradients of ``inputs`` (None where unused, ``inputs`` being
    leaves of the stage's own), every other leaf it reaches, and their
    gradients; ``hold`` is first given those leaves (their hooks wait for
    the whole gradient) and says whether their gradients must be summed. If
    not, it is a plain backward that accumulates into every leaf at once (no
    other leaf is returned). Through a reentrant checkpoint, which refuses
    ``autograd.grad`` and accumulates into ``.grad`` from a backward of its
    own, a plain backward too, the ``.grad`` of each leaf to be ``summed``
    set aside meanwhile: what it accumulated is then their gradient (the
    others accumulate as in a plain backward: another partition may be
    accumulating into them at the same time). Its own backward reaches
    leaves that the walk of the graph does not see: the stage's
    ``parameters`` count among them then.
    """
    if not roots:
        return [None] * len(inputs), [], []
    known = {id(x) for x in inputs}
    reached, reentrant = leaves_of(roots)
    if reentrant:
        reached = list({id(t): t for t in (*reached, *parameters)}.values())
    leaves = [t for t in reached if id(t) not in known]
    # torch takes tensors and edges mixed, though its hints name one or the other.
    if not hold(leaves):
        torch.autograd.backward(roots, grads)  # type: ignore[arg-type]
        return [x.grad for x in inputs], [], []
    if reentrant:
        apart = [t for t in leaves if summed(t)]
        of_inputs, of_leaves = _accumulated_apart(roots, grads, inputs, apart)
        return of_inputs, apart, of_leaves
    wanted = [*inputs, *leaves]
    found: list[Tensor | None] = (
        list(torch.autograd.grad(roots, wanted, grads, allow_unused=True))  # type: ignore[arg-type]
        if wanted
        else []
    )
    return found[: len(inputs)], leaves, found[len(inputs) :]


# Held around one stage's backward into the .grad of leaves it sums (below).
_APART = threading.Lock()


def _accumulated_apart(
    roots: Sequence[Root],
    grads: Sequence[Tensor | None],
    inputs: Sequence[Tensor],
    leaves: list[Tensor],
) -> tuple[list[Tensor | None], list[Tensor | None]]:
    """A plain backward whose accumulations into ``leaves`` are taken out of their ``.grad``
    (their hooks held back meanwhile), which is then as it was: the gradients of
    ``inputs`` and of ``leaves``.

    One stage at a time: a weight tied across stages on threads of their own
    is one ``.grad``, which another stage's backward would otherwise set aside
    or put back in the middle of this one's. The backward waits on no other
    stage (its inputs are leaves of this stage's graph).
    """
    with _APART:
        kept = [leaf.grad for leaf in leaves]
        for leaf in leaves:
            leaf.grad = None
        try:
            torch.autograd.backward(roots, grads)  # type: ignore[arg-type]
            return [x.grad for x in inputs], [leaf.grad for leaf in leaves]
        finally:
            for leaf, grad in zip(leaves, kept, strict=True):
                leaf.grad = grad
