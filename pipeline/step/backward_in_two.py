"""Backward split in two: input gradients now (I), weight gradients later (W).

A zero-bubble schedule sends a stage's input gradients upstream as soon as
possible and computes its weight gradients in the gaps. Both halves walk the
one autograd graph of the stage's forward::

    outputs --> a2 --------> a1 --------> input      (the input path)
                 \\            \\
                  +--> W2      +--> W1               (weight branches)

- I runs ``autograd.grad`` from the outputs to the inputs, keeping the graph.
  The engine computes only what the inputs need, so ``a2`` (a matrix
  product, say) skips its weight gradient. A pre-hook on every *anchor*, an
  input-path node where a branch toward weights leaves the path (``a2``,
  ``a1``), records the gradient reaching it.
- W runs ``autograd.grad`` from the anchors, with their recorded
  gradients, to the weights of their branches only, so that no input-path
  work is done twice: each anchor computes just its weight outputs. A group
  none of whose weights has hooks accumulates into ``.grad`` as it goes, as
  ``B`` does (no copy of the weights' gradients waits for the step's end);
  the others' gradients are returned, and the stage sums them and
  accumulates each weight once per step (``gradients.py``).

The weights are every leaf the outputs reach other than the inputs: the
partition's parameters, and any other tensor that requires grad (a
parameter of the script, a plain attribute), as a backward would find them.

Cases torch's own split has got wrong, and how this one handles them:

- a weight reached from two anchors (a layer used twice on the input path):
  the two are one group, run together, and a pre-hook replaces whatever
  reaches an anchor during W by its recorded gradient, so nothing is counted
  twice;
- a node with several outputs: its whole recorded gradient is replayed;
- a weight reached from an output without crossing the input path, or no
  input needing a gradient at all: that output itself is a root of W;
- weights shared by two layers of the stage: one ``AccumulateGrad`` node,
  one gradient, the sum;
- a weight reached from an anchor's branch and also, down the input path,
  from a lower anchor's (T5's relative position bias, made once and used by
  every block): W from the upper anchor walks the path down to the lower
  one, through whatever anchors lie between, which may be another group's;
  each group but the last keeps the graph for the next;
- an anchor that is the node of a Python ``autograd.Function`` (a layer
  compiled by ``torch.compile``: ``CompiledFunctionBackward``; a fused
  kernel written by hand) computes its input and weight gradients in one
  backward, which cannot be split, and running it twice is not safe:
  inductor's compiled backward reuses the buffers it saved, so its second
  run (W) returns other numbers, with no error. Such a stage's I is a whole
  backward (``B``), and its W has nothing left to do;
- a stage crossing a reentrant checkpoint (``torch.utils.checkpoint`` with
  ``use_reentrant=True``), whose backward runs a backward of its own that
  ``autograd.grad`` refuses (it failed mid-step, other stages' W done): the
  same, a whole backward.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence

import torch
from torch import Tensor
from torch.autograd.function import BackwardCFunction
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

from pipeline.step.gradients import REENTRANT_CHECKPOINT, Root, gradient_node

__all__ = ["WeightWork", "backward_input"]

Grads = tuple[Tensor | None, ...]


class _Group:
    """Roots of W that share weights, run in one backward: anchors and outputs off the path."""

    __slots__ = ("anchors", "outputs", "weights")

    def __init__(self) -> None:
        self.anchors: list[Node] = []
        self.outputs: list[tuple[GradientEdge, Tensor]] = []
        self.weights: list[Tensor] = []


class WeightWork:
    """W, recorded by I: each group's anchors with their gradients, and its weights.

    ``WeightWork()``: nothing left to do (I was a whole backward).
    """

    __slots__ = ("_groups", "_recorded")

    def __init__(
        self, groups: list[_Group] | None = None, recorded: dict[Node, Grads] | None = None
    ) -> None:
        self._groups = groups or []
        self._recorded = recorded or {}

    def run(self, hold: Callable[[list[Tensor]], bool]) -> tuple[list[Tensor], list[Tensor | None]]:
        """The weights to sum and their gradients (None where unused); frees what W used.

        ``hold`` is given each group's weights before their gradients are
        computed, and says whether they must be summed: if not, they are
        accumulated into ``.grad`` at once, and not returned.
        """
        groups, recorded = self._groups, self._recorded
        self._groups, self._recorded = [], {}
        weights: list[Tensor] = []
        found: list[Tensor | None] = []
        for k, group in enumerate(groups):
            roots: list[GradientEdge] = []
            grads: list[Tensor] = []
            for anchor in group.anchors:
                for k, grad in enumerate(recorded.get(anchor, ())):
                    if grad is not None:
                        roots.append(GradientEdge(anchor, k))
                        grads.append(grad)
            for edge, grad in group.outputs:
                roots.append(edge)
                grads.append(grad)
            if not roots:
                continue
            handles = [
                anchor.register_prehook(_replacing(recorded[anchor]))
                for anchor in group.anchors
                if anchor in recorded
            ]
            summed = hold(group.weights)
            # Kept for the next groups: a weight reached from an anchor and, down the
            # input path, from a lower one (T5's position bias) has W walk the path
            # between, whose anchors may be another group's. The last frees what it
            # walked, as a backward does; the rest goes with the groups.
            keep = k < len(groups) - 1
            try:
                if summed:
                    found += torch.autograd.grad(
                        roots, group.weights, grads, allow_unused=True, retain_graph=keep
                    )
                    weights += group.weights
                else:
                    torch.autograd.backward(roots, grads, inputs=group.weights, retain_graph=keep)
            finally:
                for handle in handles:
                    handle.remove()
        return weights, found


def backward_input(
    outputs: Sequence[Root], grads: Sequence[Tensor | None], inputs: Sequence[Tensor]
) -> tuple[list[Tensor | None], WeightWork] | None:
    """I: the gradients of ``inputs`` (None where unused); and the W still to do.

    ``outputs`` and ``grads`` are the roots of the backward (a ``None``
    gradient for a scalar loss); W computes the gradients of every other
    leaf the outputs reach (the weights). None, with nothing computed, when
    an anchor is a Python function's node, or the graph crosses a reentrant
    checkpoint: the caller runs a whole backward.
    """
    wanted = [x for x in inputs if x.requires_grad]
    graph = _successors(gradient_node(o) for o in outputs)
    if any(type(node).__name__ == REENTRANT_CHECKPOINT for node in graph):
        return None  # its backward runs a backward of its own, which autograd.grad refuses
    weight_of = _weights(graph, {gradient_node(x) for x in wanted})
    input_path = _reaching({gradient_node(x) for x in wanted}, graph)
    groups = _groups(outputs, grads, graph, input_path, weight_of)
    recorded: dict[Node, Grads] = {}
    anchors = [anchor for group in groups for anchor in group.anchors]
    if any(isinstance(anchor, BackwardCFunction) for anchor in anchors):
        return None
    handles = [anchor.register_prehook(_recording(recorded, anchor)) for anchor in anchors]
    try:
        found = (
            # Tensors and edges mixed, which torch takes, though its hints name one or the other.
            torch.autograd.grad(outputs, wanted, grads, retain_graph=True, allow_unused=True)  # type: ignore[arg-type]
            if wanted
            else ()
        )
    finally:
        for handle in handles:
            handle.remove()
    by_input = dict(zip(map(id, wanted), found, strict=True))
    return [by_input.get(id(x)) for x in inputs], WeightWork(groups, recorded)


def _weights(graph: dict[Node, list[Node]], inputs: set[Node]) -> dict[Node, Tensor]:
    """The leaves of ``graph`` other than ``inputs``, by their ``AccumulateGrad`` node."""
    found = {}
    for node in graph:
        variable = getattr(node, "variable", None)
        if isinstance(variable, Tensor) and node not in inputs:
            found[node] = variable
    return found


def _successors(roots: Iterable[Node]) -> dict[Node, list[Node]]:
    """Every node reachable from ``roots``, with the nodes its gradients go to."""
    graph: dict[Node, list[Node]] = {}
    pending = list(roots)
    while pending:
        node = pending.pop()
        if node in graph:
            continue
        graph[node] = [child for child, _ in node.next_functions if child is not None]
        pending += graph[node]
    return graph


def _reaching(targets: set[Node], graph: dict[Node, list[Node]]) -> set[Node]:
    """The nodes of ``graph`` from which a node of ``targets`` can be reached."""
    parents: dict[Node, list[Node]] = defaultdict(list)
    for node, children in graph.items():
        for child in children:
            parents[child].append(node)
    reached = set(targets & graph.keys())
    pending = list(reached)
    while pending:
        for parent in parents[pending.pop()]:
            if parent not in reached:
                reached.add(parent)
                pending.append(parent)
    return reached


def _branch_weights(
    starts: Iterable[Node], graph: dict[Node, list[Node]], input_path: set[Node], weights: set[Node]
) -> set[Node]:
    """The weights reached from ``starts`` without entering the input path."""
    found: set[Node] = set()
    seen: set[Node] = set()
    pending = [n for n in starts if n not in input_path]
    while pending:
        node = pending.pop()
        if node in seen:
            continue
        seen.add(node)
        if node in weights:
            found.add(node)
        pending += [c for c in graph[node] if c not in input_path]
    return found


def _groups(
    outputs: Sequence[Root],
    grads: Sequence[Tensor | None],
    graph: dict[Node, list[Node]],
    input_path: set[Node],
    weight_of: dict[Node, Tensor],
) -> list[_Group]:
    """W's roots, grouped so that roots reaching a common weight run together."""
    weights = set(weight_of)
    roots: list[tuple[Node | tuple[GradientEdge, Tensor], set[Node]]] = []
    for node in graph:  # in a fixed order: sums of shared weights are then reproducible
        if node not in input_path:
            continue
        reached = _branch_weights(graph[node], graph, input_path, weights)
        if reached:
            roots.append((node, reached))
    for output, grad in zip(outputs, grads, strict=True):
        edge = output if isinstance(output, GradientEdge) else get_gradient_edge(output)
        if edge.node in input_path:
            continue
        reached = _branch_weights([edge.node], graph, input_path, weights)
        if reached:
            seed = grad if grad is not None else _ones_like(output)
            roots.append(((edge, seed), reached))
    merged = _merge(roots)
    groups = []
    for members in merged:
        group = _Group()
        reached_weights: set[Node] = set()
        for root, reached in members:
            if isinstance(root, tuple):
                group.outputs.append(root)
            else:
                group.anchors.append(root)
            reached_weights |= reached
        group.weights = [weight_of[node] for node in reached_weights]
        groups.append(group)
    return groups


def _merge(
    roots: list[tuple[Node | tuple[GradientEdge, Tensor], set[Node]]],
) -> list[list[tuple[Node | tuple[GradientEdge, Tensor], set[Node]]]]:
    """Group the roots whose weight sets overlap, transitively."""
    owner: dict[Node, int] = {}
    parent = list(range(len(roots)))

    def find(k: int) -> int:
        while parent[k] != k:
            parent[k] = parent[parent[k]]
            k = parent[k]
        return k

    for k, (_, reached) in enumerate(roots):
        for weight in reached:
            if weight in owner:
                parent[find(k)] = find(owner[weight])
            else:
                owner[weight] = k
    grouped: dict[int, list[tuple[Node | tuple[GradientEdge, Tensor], set[Node]]]] = defaultdict(
        list
    )
    for k, root in enumerate(roots):
        grouped[find(k)].append(root)
    return list(grouped.values())


def _ones_like(output: Root) -> Tensor:
    """The seed of a scalar loss (a tensor: only outputs mailed on are edges)."""
    assert isinstance(output, Tensor), "an output without a gradient is the loss, a tensor"
    return torch.ones_like(output)


def _recording(recorded: dict[Node, Grads], node: Node) -> Callable[[Grads], None]:
    def record(grads: Grads) -> None:
        recorded[node] = tuple(grads)

    return record


def _replacing(recorded: Grads) -> Callable[[Grads], Grads]:
    def replace(grads: Grads) -> Grads:
        return recorded

    return replace
