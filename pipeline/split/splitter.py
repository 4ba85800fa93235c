"""split(): capture a model on example inputs, check it, cut it into pieces, build them.

See ``docs/split.md`` for the guide. The steps, each in its own file:

  points.py     which modules start pieces, which are kept whole
  capture.py    torch.export of the call, blocks opaque (opaque.py)
  hooks.py      hooks on captured modules: refused (and at every call)
  attributes.py what the captured code reads and assigns of modules' attributes
  checks.py     what the pieces could not do the same way: refused
  variants.py   a second capture: one graph for both modes? for one row? (compare.py)
  cut.py        which piece computes what, and how values travel
  build.py      each piece's instructions (instructions.py), then its Piece (piece.py)
  watch.py      what every piece checks at every call: attributes, hooks, modules
  model.py      the SplitModel holding the pieces under the model's names
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from contextlib import nullcontext
from typing import Any

import torch
from torch import Tensor, fx, nn
from torch.utils._pytree import keystr, tree_flatten, tree_flatten_with_path, tree_unflatten

from pipeline.skip.namespace import Namespace
from pipeline.split.attributes import recording
from pipeline.split.build import BLOCK_OP, DROPPED, Built, Sources, build_piece, training_of
from pipeline.split.capture import Captured, capture, unaliased
from pipeline.split.checks import (
    check_calls,
    check_inputs,
    check_mutations,
    check_regions,
    check_writes,
)
from pipeline.split.cut import PieceNodes, cut
from pipeline.split.errors import SplitError
from pipeline.split.hooks import captured_modules, refuse_hooks, refuse_recorded_outputs
from pipeline.split.model import SplitModel
from pipeline.split.piece import ModeCheck, Piece
from pipeline.split.points import kept_whole, resolve_points
from pipeline.split.routers import FLAG, RouterLoss, asked, flag_off, router_loss_of
from pipeline.split.signature import Signature, in_order
from pipeline.split.variants import Variants, batch_symbols, variants
from pipeline.split.watch import Watch
from pipeline.split.where import describe_module, node_module

__all__ = ["split"]


def split(
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any] | None = None,
    *,
    points: Sequence[str] | None = None,
) -> SplitModel:
    """``pipeline.split``: see its docstring (``pipeline/split/__init__.py``)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"split takes an nn.Module, got {type(model).__name__}")
    if isinstance(model, SplitModel):
        raise TypeError("this model is split already; split the original model again")
    if not isinstance(args, tuple):
        raise TypeError(
            f"args must be a tuple of the model's positional arguments, e.g. (x,), got "
            f"{type(args).__name__}"
        )
    if kwargs is not None and not isinstance(kwargs, dict):
        raise TypeError(f"kwargs must be a dict of keyword arguments, got {type(kwargs).__name__}")
    args, kwargs = unaliased(args, dict(kwargs or {}))
    _refuse_meta_apart(model, args, kwargs)
    names = {module: name for name, module in model.named_modules()}
    starts, default = resolve_points(model, points)
    blocks = kept_whole(model, starts)
    on, in_call = asked(model, kwargs)
    routers = router_loss_of(model, kwargs, blocks, SplitError) if on else None
    refuse_recorded_outputs(model, kwargs, SplitError, allowed=(FLAG,) if routers else ())
    # With a router loss, the model is captured without router logits: the loss is kept apart.
    example = kwargs
    if routers and in_call:
        kwargs = {**kwargs, FLAG: False}
    captured_code = captured_modules(model, blocks)
    refuse_hooks(
        captured_code,
        SplitError,
        "remove the hooks before splitting, or (for a module's own hooks) name the module in "
        "points: a point runs as itself, hooks included",
    )
    # The flag is off before the recording starts: that change is split's own, not the code's.
    with flag_off(model) if routers else nullcontext(), recording(names) as recorded:
        captured = capture(model, args, kwargs, blocks, names)
        check_writes(recorded)
        check_inputs(captured)
        check_regions(captured)
        check_calls(captured, starts)
        bounds = _boundaries(captured, starts, default)
        pieces = cut(captured.program.graph, captured.inputs(), bounds)
        check_mutations(captured, pieces.piece_of)
        found = variants(model, args, kwargs, blocks, names, captured)
        check_writes(recorded)
    sources = Sources(
        model,
        captured.program.graph_module,
        captured.calls,
        captured.state(model),
        _device(model, args, kwargs),
        found.dropouts_follow_mode,
    )
    signature = Signature(
        captured.spec,
        captured.inputs(),
        captured.names,
        tree_flatten((args, in_order(example, captured.spec)))[0],
        _ranges(captured, found),
    )
    output = next(node for node in captured.program.graph.nodes if node.op == "output")
    count = len(pieces.pieces)
    built = [
        build_piece(nodes, sources, output if j == count - 1 else None)
        for j, nodes in enumerate(pieces.pieces)
    ]
    followed = {(id(module), attribute) for one in built for module, attribute in one.follows}
    if routers:
        # The router loss follows the configs' flag at every call (routers.py).
        followed |= {key for key in recorded.reads if key[1] == FLAG}
    reads = [read for key, read in recorded.reads.items() if key not in followed]
    watch = Watch(reads, names, captured_code, recorded.held)
    watched = {**dict((module, name) for name, module in captured_code), **blocks}
    watch.add_places(watched, watched)
    namespace = Namespace(f"split {type(model).__name__}")
    made = [
        _piece(j, count, nodes, one, captured, sources, names, found, namespace, signature, watch)
        for j, (nodes, one) in enumerate(zip(pieces.pieces, built, strict=True))
    ]
    router_loss = RouterLoss(model, *routers, in_call, signature) if routers else None
    split_model = SplitModel(model, made, router_loss, rows_across(captured))
    # The split model holds the model's children too: seq.head = ... replaces one there.
    watch.add_places([split_model], watched)
    fetched = [read for one in built for read in one.fetched]
    watch.add_tensors(model, split_model, fetched, blocks, names)
    return split_model


def rows_across(captured: Captured) -> tuple[str, ...]:
    """The model's outputs whose size past their first dimension is the batch's (CLIP's
    ``logits_per_image``, every image against every text), by their place in the output.

    A pipe computes them per micro-batch and gathers them along dim 0: the
    gathered tensor would hold each micro-batch's rows against its own rows
    alone (``base.py`` refuses gathering them over several micro-batches).
    """
    batch = batch_symbols(captured)
    if not batch:
        return ()
    output = next(node for node in captured.program.graph.nodes if node.op == "output")
    leaves = list(output.args[0])
    spec = captured.program.call_spec.out_spec
    places = [keystr(path) for path, _ in tree_flatten_with_path(tree_unflatten(leaves, spec))[0]]
    return tuple(
        place or "output"
        for place, node in zip(places, leaves, strict=True)
        if _across(node.meta.get("val") if isinstance(node, fx.Node) else None, batch)
    )


def _across(value: Any, batch: set[str]) -> bool:
    """Whether ``value`` is a tensor with the batch's size past its first dimension."""
    if not isinstance(value, Tensor):
        return False
    symbols: set[str] = set()
    for size in value.shape[1:]:
        if isinstance(size, torch.SymInt):
            symbols.update(str(symbol) for symbol in size.node.expr.free_symbols)
    return bool(symbols & batch)


def _piece(
    j: int,
    count: int,
    nodes: PieceNodes,
    built: Built,
    captured: Captured,
    sources: Sources,
    names: dict[nn.Module, str],
    found: Variants,
    namespace: Namespace,
    signature: Signature,
    watch: Watch,
) -> Piece:
    last = j == count - 1
    calls = [captured.calls[n.args[0]] for n in nodes.nodes if n.target is BLOCK_OP]  # type: ignore[index]
    owners = {module: names[module] for module, _ in built.fetched}
    return Piece(
        j,
        "the start" if j == 0 else calls[0].name if calls else "after the last block",
        built,
        [(call.name, call.module) for call in calls],
        [(name, module) for module, name in owners.items()],
        namespace,
        signature if j == 0 else None,
        captured.program.call_spec.out_spec if last else None,
        [] if found.dropouts_follow_mode else _mode_checks(nodes.nodes, sources.model),
        watch,
    )


def _boundaries(captured: Captured, starts: list[str], default: bool) -> list[fx.Node]:
    """The nodes where pieces start: each point's call, and after the last block by default.

    No piece is made of sizes and checks alone: a first piece with no work of
    its own before the first point is left out.
    """
    graph = captured.program.graph
    calls = [node for node in graph.nodes if node.target is BLOCK_OP]
    named = {captured.calls[node.args[0]].name: node for node in calls}
    boundaries = [named[name] for name in starts]
    if default and calls:
        after = _first_work_after(graph, calls[-1])
        if after is not None:
            boundaries.append(after)
    work = [node for node in graph.nodes if _is_work(node)]
    if work and work[0] in boundaries:
        boundaries.remove(work[0])
    return boundaries


def _first_work_after(graph: fx.Graph, call: fx.Node) -> fx.Node | None:
    seen = False
    node: fx.Node
    for node in graph.nodes:
        if node is call:
            seen = True
        elif seen and _is_work(node) and not _result_of(node, call):
            return node
    return None


def _result_of(node: fx.Node, call: fx.Node) -> bool:
    return node.target is operator.getitem and node.args[0] is call


def _is_work(node: fx.Node) -> bool:
    """Whether ``node`` computes tensors (not a size, not a check of the capture's own)."""
    if node.op != "call_function" or node.target in DROPPED:
        return False
    return isinstance(node.meta.get("val"), Tensor | list | tuple)


def _device(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.device:
    """The device the capture ran on: of the inputs, else of the parameters."""
    tensors = [leaf for leaf in tree_flatten((args, kwargs))[0] if isinstance(leaf, Tensor)]
    tensors += [*model.parameters(), *model.buffers()]
    return tensors[0].device if tensors else torch.device("cpu")


def _ranges(captured: Captured, found: Variants) -> dict[str, tuple[int, int | None]]:
    """The sizes each free dimension may take; the batch may be 1 where a capture showed it."""
    ranges: dict[str, tuple[int, int | None]] = {}
    for symbol, bounds in captured.program.range_constraints.items():
        # A size made from a value inside a block's failed fake run has no finite lower bound.
        low = int(bounds.lower) if bounds.lower.is_Integer else 0
        high = int(bounds.upper) if bounds.upper.is_Integer else None
        ranges[str(symbol)] = (min(low, 1) if str(symbol) in found.one_row else low, high)
    return ranges


def _mode_checks(nodes: list[fx.Node], model: nn.Module) -> list[ModeCheck]:
    """For code that differs between modes: the modules whose code a piece runs keep their mode."""
    checks: dict[str, ModeCheck] = {}
    for node in nodes:
        if node.op != "call_function" or node.target is BLOCK_OP:
            continue
        name = node_module(node)
        if name not in checks:
            training = training_of(node, model)
            module = model.get_submodule(name)
            checks[name] = ModeCheck(describe_module(name, module), training, training.value())
    return list(checks.values())


def _refuse_meta_apart(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Refuse a model on ``meta`` split on an example that is not, or the other way round.

    The captured code keeps the example's device where it makes tensors (a
    position table, a mask): a model materialised later would meet ``meta``
    tensors in its first step, or real ones in a capture on ``meta``.
    """
    state = [*model.parameters(), *model.buffers()]
    example = [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, Tensor)]
    if not state or not example:
        return
    model_meta = any(t.is_meta for t in state)
    example_meta = all(t.is_meta for t in example)
    if model_meta and not example_meta:
        raise SplitError(
            "the model is on the meta device but the example's tensors are not: split a model "
            "on meta on an example on meta too (torch.empty(shape, dtype=..., device='meta')), "
            "or materialise the model first"
        )
