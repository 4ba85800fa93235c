"""Refusals: what a captured model does that its pieces could not do the same way.

Each check raises ``SplitError`` naming the module and the source line, and
saying what to do, before any piece exists:

- the captured code changes a parameter, a buffer, an argument, or a value
  that another piece made, in place (the piece would change a copy, or
  change it twice when recomputed);
- the captured code assigns a module attribute (``self.ema = ...``): the
  pieces would never assign it (``attributes.py`` records assignments);
- a region of code that the pieces cannot run (``torch.cond``, a block
  called under ``torch.no_grad()`` inside the captured code);
- a split point called twice, or never, on the example.
"""

from __future__ import annotations

import operator
from collections import Counter

import torch
from torch import fx
from torch.export.graph_signature import InputKind

from pipeline.split.attributes import Recorded, held_changes
from pipeline.split.build import BLOCK_OP, GRAD_REGION
from pipeline.split.capture import Captured
from pipeline.split.errors import SplitError
from pipeline.split.where import WRAPPED, describe_module, node_location, node_module

__all__ = ["check_calls", "check_inputs", "check_mutations", "check_regions", "check_writes"]


def check_inputs(captured: Captured) -> None:
    """Refuse inputs other than arguments, parameters, buffers and constants."""
    for spec in captured.program.graph_signature.input_specs:
        if spec.kind in (InputKind.CUSTOM_OBJ, InputKind.TOKEN):
            raise SplitError(
                f"the captured model uses {spec.kind.name.lower()} {spec.target} (a "
                "TorchScript object or an effectful op), which a piece cannot run; keep the "
                "module that uses it inside a block (name it in points)"
            )


def check_calls(captured: Captured, points: list[str]) -> None:
    """Each block runs once per forward; each point at least and at most once."""
    counts = Counter(call.name for call in captured.calls)
    for name, count in counts.items():
        if count > 1:
            raise SplitError(
                f"module {name!r} is called {count} times in one forward; a module kept whole "
                "must run once: name a module that contains every call in points, or name "
                "points that leave this one out"
            )
    missing = [point for point in points if point not in counts]
    if missing:
        raise SplitError(
            f"points {missing} did not run when the model was called on the example; a piece "
            "starts where its point runs: name modules that run on these inputs"
        )


def check_writes(recorded: Recorded) -> None:
    """Refuse the captured code's assignments of module attributes (``self.ema = ...``),
    and of the attributes of the objects modules hold (``self.config.problem_type = ...``)."""
    changed = held_changes(recorded)
    if changed:
        read, now = changed[0]
        path = f"{recorded.held[id(read.owner)]}.{read.attribute}"
        raise SplitError(
            f"the model's code changed {path} from {read.value!r} to {now!r} during the "
            "example's call, in code that split captures: the pieces would not change it, and "
            "the code read one value before the change and another after. Set it before "
            "splitting, as the model's first call would (transformers' classifiers set "
            "config.problem_type from the labels)"
        )
    if not recorded.writes:
        return
    write = recorded.writes[0]
    module = write.module
    what = (
        "buffer"
        if write.attribute in module._buffers
        else "parameter"
        if write.attribute in module._parameters
        else "attribute"
    )
    owner = describe_module(recorded.modules[module], module)
    raise SplitError(
        f"the model's code at {write.location} assigns {what} {write.attribute!r} of {owner}, "
        "in code that split captures as torch ops: the pieces only run those ops, would never "
        "make the assignment, and the attribute would keep its value of split time. Move the "
        "update into a module of its own and name that module in points (a point runs as "
        "itself, its Python code too), or into a block"
    )


def check_regions(captured: Captured) -> None:
    """Refuse higher-order ops other than grad-mode regions, and blocks inside regions."""
    root = captured.program.graph_module
    for node in root.graph.nodes:
        if node.op != "call_function" or not isinstance(
            node.target, torch._ops.HigherOrderOperator
        ):
            continue
        if node.target is not GRAD_REGION:
            raise SplitError(
                f"{_at(node)} uses {node.target.name()}, which a piece cannot run yet; keep "
                "that code inside a block (name its module in points)"
            )
        body = getattr(root, str(node.args[1].target))
        if any(inner.target is BLOCK_OP for inner in body.graph.nodes):
            raise SplitError(
                f"{_at(node)} calls a block inside torch.no_grad() or torch.enable_grad(); "
                "split cannot cut inside such a region: name the module that contains the "
                "region in points, or move the grad-mode change into the block"
            )


def check_mutations(captured: Captured, piece_of: dict[fx.Node, int]) -> None:
    """Refuse in-place changes of inputs, parameters, buffers and other pieces' values."""
    bases: dict[fx.Node, fx.Node] = {}
    kinds = {
        spec.arg.name: (spec.kind, spec.target)
        for spec in captured.program.graph_signature.input_specs
    }
    arguments = dict(zip(captured.inputs(), captured.names, strict=True))
    nodes = [node for node in captured.program.graph.nodes if node.op == "call_function"]
    for node in nodes:
        for argument in _written(node):
            _refuse_change(node, bases.get(argument, argument), kinds, arguments, piece_of)
        aliased = _aliased(node)
        if aliased is not None:
            bases[node] = bases.get(aliased, aliased)
    for node in nodes:
        if node.target is BLOCK_OP:
            _refuse_shared_change(node, captured, bases)


def _refuse_shared_change(node: fx.Node, captured: Captured, bases: dict[fx.Node, fx.Node]) -> None:
    """A block may change its input in place only if nothing else reads that memory.

    As a layer of a Sequential may: whatever else read it would see the
    change in the plain model, and might not in a pipeline (a copy on
    another device, a recomputation).
    """
    call = captured.calls[node.args[0]]  # type: ignore[index]
    tensors = node.args[1]
    assert isinstance(tensors, list | tuple)
    for index in call.done.written:
        changed = tensors[index]
        assert isinstance(changed, fx.Node)
        base = bases.get(changed, changed)
        sharing = [n for n, b in bases.items() if b is base] + [base]
        readers = {user for n in sharing for user in n.users} - {node, *sharing}
        if base.op == "placeholder" or readers:
            raise SplitError(
                f"block {call.name} ({type(call.module).__name__}) changes its input tensor "
                f"{index} in place, and the model reads that tensor elsewhere too (made at "
                f"{node_location(base)}); a piece cannot promise every reader the same value. "
                "Make the block work on a copy, or keep the change and its readers in one "
                "block (name a module that contains them in points)"
            )


def _refuse_change(
    node: fx.Node,
    base: fx.Node,
    kinds: dict[str, tuple[InputKind, str | None]],
    arguments: dict[fx.Node, str],
    piece_of: dict[fx.Node, int],
) -> None:
    if base.op == "placeholder":
        kind, target = kinds[base.name]
        name = (target or "").removeprefix(WRAPPED + ".")
        what = {
            InputKind.USER_INPUT: f"its argument {arguments.get(base)!r}",
            InputKind.PARAMETER: f"parameter {name!r}",
            InputKind.BUFFER: f"buffer {name!r}",
        }.get(kind, f"constant {name!r}")
        # A new value bound to a buffer is refused too (check_writes): only a point helps.
        other = " (move it into a module of its own)" if kind != InputKind.USER_INPUT else ""
        instead = ", or compute a new value instead" if kind == InputKind.USER_INPUT else ""
        raise SplitError(
            f"{_at(node)} changes {what} in place, which a piece cannot do the same way (it "
            "would change it again when recomputed, or change a copy on another device): "
            f"name the module that does it in points so that it runs as itself{other}{instead}"
        )
    if piece_of.get(base) != piece_of.get(node):
        raise SplitError(
            f"{_at(node)} changes in place a value that an earlier piece made (at "
            f"{node_location(base)}); that piece may already have sent it on. Choose points "
            "so that the change and the value are in one piece, or compute a new value"
        )


def _written(node: fx.Node) -> list[fx.Node]:
    """The node arguments that ``node``'s op writes to."""
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.is_mutable:
        return []
    written = []
    for i, argument in enumerate(schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = node.args[i] if i < len(node.args) else node.kwargs.get(argument.name)
        if isinstance(value, fx.Node):
            written.append(value)
    return written


def _aliased(node: fx.Node) -> fx.Node | None:
    """The argument whose memory ``node``'s result shares (a view, an in-place op, getitem)."""
    if node.target is operator.getitem:
        # An item of a view op's list (split, unbind) shares memory; a block's or a
        # region's outputs are new tensors.
        source = node.args[0]
        fresh = isinstance(source, fx.Node) and source.target in (BLOCK_OP, GRAD_REGION)
        return source if isinstance(source, fx.Node) and not fresh else None
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.returns or schema.returns[0].alias_info is None:
        return None
    alias = schema.returns[0].alias_info.before_set
    for i, argument in enumerate(schema.arguments):
        if argument.alias_info is not None and argument.alias_info.before_set & alias:
            value = node.args[i] if i < len(node.args) else node.kwargs.get(argument.name)
            return value if isinstance(value, fx.Node) else None
    return None


def _at(node: fx.Node) -> str:
    name = node_module(node)
    module = "the model" if not name else f"module {name!r}"
    return f"{module} at {node_location(node)}"
