"""Compare two captures of one model: did its code take the same path both times?

A capture records one path through the model's Python code. Two questions
need a second capture to answer:

- Does the code differ between training and eval mode beyond the dropouts'
  ``train`` flag? If not, one graph serves both modes, each dropout
  following its module's mode at run time; if so, the split model runs in
  the captured mode only, and says so.
- Does a batch of one row take the same path as the example? The capture
  assumes a free size is never 1 (torch.export's 0/1 specialisation); a
  capture on a one-row example shows whether the code branches on it.

Graphs are compared node by node in order: same op, same constants, and
the same inputs. Sizes are wildcards (a free size in one capture is a
fixed 1 in the other), and so are dropout flags when modes are compared.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

from pipeline.split.build import BLOCK_OP, DROPOUTS
from pipeline.split.capture import Captured

__all__ = ["first_difference"]

_SIZE = "<size>"
_FLAG = "<train>"
_ASSERTS = {torch.ops.aten._assert_tensor_metadata.default, torch.ops.aten._assert_scalar.default}


def first_difference(a: Captured, b: Captured, *, modes: bool) -> fx.Node | None:
    """The first node of ``a`` that ``b`` does not match (None if they match).

    ``modes``: dropout flags may differ. A difference in the call structure
    of blocks, inputs or outputs shows as the output node.
    """
    records_a, nodes_a = _records(a.program.graph_module, a, modes)
    records_b, _ = _records(b.program.graph_module, b, modes)
    for record_a, record_b, node in zip(records_a, records_b, nodes_a, strict=False):
        if not _same(record_a, record_b):
            return node
    if len(records_a) != len(records_b) or a.program.call_spec != b.program.call_spec:
        return nodes_a[-1]
    return None


def _records(
    module: fx.GraphModule, captured: Captured, modes: bool
) -> tuple[list[Any], list[fx.Node]]:
    """One record per node that does work, and those nodes."""
    index: dict[fx.Node, Any] = {}
    records: list[Any] = []
    nodes: list[fx.Node] = []
    inputs = 0
    for node in module.graph.nodes:
        if node.op == "placeholder":
            index[node] = ("input", inputs)
            inputs += 1
            continue
        if node.op == "get_attr":
            body = getattr(module, str(node.target))
            index[node] = ("region", *_records(body, captured, modes)[0])
            continue
        if _is_size(node):
            index[node] = _SIZE
            continue
        if node.target in _ASSERTS:
            continue
        if _is_whole_slice(node):
            # A capture with fixed sizes leaves out slices that take everything.
            source = node.args[0]
            assert isinstance(source, fx.Node)
            index[node] = index[source]
            continue
        args = fx.node.map_aggregate(node.args, lambda x: index[x] if isinstance(x, fx.Node) else x)
        kwargs = fx.node.map_aggregate(
            node.kwargs, lambda x: index[x] if isinstance(x, fx.Node) else x
        )
        if modes and node.target in DROPOUTS and len(args) > 2:
            args = (*args[:2], _FLAG, *args[3:])
        if node.target is BLOCK_OP:
            call = captured.calls[args[0]]
            args = (call.name, call.leaves, call.done.spec, call.done.outputs, *args[1:])
        index[node] = ("node", len(records))
        records.append((node.op, str(node.target), args, kwargs))
        nodes.append(node)
    return records, nodes


def _is_whole_slice(node: fx.Node) -> bool:
    if node.target is not torch.ops.aten.slice.Tensor:
        return False
    start, end, step = [*node.args[2:], None, None, None][:3]
    return (
        start in (None, 0)
        and (end is None or (isinstance(end, int) and end >= 2**62))
        and step in (None, 1)
    )


def _is_size(node: fx.Node) -> bool:
    value = node.meta.get("val")
    return isinstance(value, torch.SymInt | torch.SymBool | torch.SymFloat | int | bool | float)


def _same(a: Any, b: Any) -> bool:
    if a == _SIZE or b == _SIZE:
        return a == b or isinstance(a if b == _SIZE else b, int)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return bool(a == b)
