"""Capture: ``model(*args, **kwargs)`` as a torch.export graph in which each block is one node.

``torch.export`` in non-strict mode runs the model's Python code on fake
tensors and records the aten ops it calls. That traces what plain
``torch.fx`` symbolic tracing cannot (transformers' ``**kwargs`` forwards,
code that asks a tensor for its shape), keeps the names of parameters and
buffers, and makes every dimension of every input symbolic (``Dim.AUTO``),
so the graph holds for any batch size and sequence length that took the same
path through the code; a dimension the code fixes stays fixed, and the
input check of the first piece says so at call time (``signature.py``).

The blocks are not traced into: each of their calls is one opaque node
(``opaque.py``). What cannot be captured raises ``SplitError`` naming the
module and the line, and saying what to do.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, is_dataclass
from typing import Any

import torch
from torch import Tensor, fx, nn
from torch.export import Dim, ExportedProgram
from torch.export.graph_signature import InputKind
from torch.utils._pytree import TreeSpec, tree_leaves, tree_map

from pipeline.split.errors import SplitError, find_cause, is_data_dependent
from pipeline.split.opaque import BlockCall, opaque_blocks
from pipeline.split.where import WRAPPED, argument_names, failure_location

__all__ = ["Captured", "capture", "modes_set", "unaliased"]


@dataclass
class Captured:
    """The exported program of one call, the record of each block call, the arguments' names."""

    program: ExportedProgram
    calls: list[BlockCall]
    training: bool
    names: list[str]

    @property
    def spec(self) -> TreeSpec:
        """The structure of the call's ``(args, kwargs)``."""
        spec: TreeSpec = self.program.call_spec.in_spec.child(0)
        return spec

    def inputs(self) -> list[fx.Node]:
        """The placeholders of the model's arguments (constants too), in order."""
        specs = self.program.graph_signature.input_specs
        placeholders = self._placeholders()
        return [placeholders[s.arg.name] for s in specs if s.kind == InputKind.USER_INPUT]

    def state(self, model: nn.Module) -> dict[fx.Node, tuple[nn.Module, str] | Tensor]:
        """Where each other placeholder comes from: (module, attribute), or a lifted constant."""
        placeholders = self._placeholders()
        state: dict[fx.Node, tuple[nn.Module, str] | Tensor] = {}
        for spec in self.program.graph_signature.input_specs:
            target = spec.target
            if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER) and target is not None:
                owner, _, attribute = target.removeprefix(WRAPPED + ".").rpartition(".")
                state[placeholders[spec.arg.name]] = (model.get_submodule(owner), attribute)
            elif spec.kind == InputKind.CONSTANT_TENSOR and target is not None:
                constant = self.program.constants[target]
                assert isinstance(constant, Tensor)
                state[placeholders[spec.arg.name]] = constant
        return state

    def _placeholders(self) -> dict[str, fx.Node]:
        return {node.name: node for node in self.program.graph.nodes if node.op == "placeholder"}


def capture(
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    blocks: dict[nn.Module, str],
    names: dict[nn.Module, str],
) -> Captured:
    """Export ``model(*args, **kwargs)`` with every dimension dynamic and ``blocks`` opaque.

    ``blocks`` and ``names`` map modules to their names in the model.
    """
    _check_call(model, args, kwargs)
    unknown: list[type] = []
    with opaque_blocks(blocks) as calls, _quiet():
        try:
            program = torch.export.export(
                _Call(model, unknown),
                (args, kwargs),
                strict=False,
                dynamic_shapes=_every_dim(args, kwargs),
            )
        except Exception as error:
            # The message says where and what to do (and torch.export's first line): the
            # hundreds of lines of torch.export's frames and chain above it are noise.
            refusal = _unknown_output(model, unknown) or _refusal(error, model, names)
            raise refusal.with_traceback(None) from None
    return Captured(program, calls, model.training, argument_names(model, args, kwargs))


def unaliased(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The example with a tensor passed twice (``labels=ids``) cloned after its first place.

    torch.export makes one tensor passed as two arguments one input of the
    graph: the split model would then read the first argument wherever the
    code uses the second, at every later call that passes two different
    tensors (transformers' ``labels=input_ids`` idiom, then labels with
    ``-100``), silently.
    """
    seen: set[int] = set()

    def once(x: Any) -> Any:
        if not isinstance(x, Tensor):
            return x
        if id(x) in seen:
            return x.clone()
        seen.add(id(x))
        return x

    fresh_args, fresh_kwargs = tree_map(once, (args, kwargs))
    return tuple(fresh_args), dict(fresh_kwargs)


class _Call(nn.Module):
    """Calls the model on ``(args, kwargs)``.

    torch.export matches dynamic shapes to a forward's parameters, and fails
    on values in a ``**kwargs`` (transformers' ``return_dict=False``); two
    plain parameters take any call. Names drop the prefix (``where.WRAPPED``).
    """

    def __init__(self, model: nn.Module, unknown: list[type]) -> None:
        super().__init__()
        self.add_module(WRAPPED, model)
        self.unknown = unknown

    def forward(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        output = getattr(self, WRAPPED)(*args, **kwargs)
        # Noted for the message if torch.export cannot take the output apart into tensors;
        # types only: a tensor kept on the module would be taken for a state it changes.
        self.unknown += [type(leaf) for leaf in tree_leaves(output) if _holds_tensors(leaf)]
        return output


@contextmanager
def modes_set(model: nn.Module, training: bool) -> Iterator[None]:
    """Every module of ``model`` in training mode (or eval), each put back as it was after."""
    saved = [(module, module.training) for module in model.modules()]
    model.train(training)
    try:
        yield
    finally:
        for module, mode in saved:
            module.training = mode


@contextmanager
def _quiet() -> Iterator[None]:
    """Keep torch.export's notes on the dimensions it fixes (the example's 1s) out of the log.

    The sizes a capture fixes are checked at call time, with a message.
    """
    logger = logging.getLogger("torch._export")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _every_dim(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """``Dim.AUTO`` for every dimension of every tensor argument."""

    def dims(value: Any) -> Any:
        return dict.fromkeys(range(value.dim()), Dim.AUTO) if isinstance(value, Tensor) else None

    return tree_map(dims, args), tree_map(dims, kwargs)


def _check_call(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Refuse example arguments that ``model.forward`` cannot take, before any tracing."""
    try:
        signature = inspect.signature(model.forward)
    except (TypeError, ValueError):  # a forward Python cannot describe: let the run tell
        return
    try:
        signature.bind(*args, **kwargs)
    except TypeError as error:
        raise SplitError(
            f"{type(model).__name__}.forward cannot be called with the example arguments "
            f"({error}): pass pipeline.split(model, args, kwargs) the arguments of one call "
            "model(*args, **kwargs)"
        ) from None


def _unknown_output(model: nn.Module, unknown: list[type]) -> SplitError | None:
    """The refusal of an output holding an object torch's pytree cannot take apart (a plain
    dataclass), by the types the model's call returned; None if it returned none.

    torch.export fails after the forward, where it flattens the output: the failure's
    place is torch's, and the usual advice (a point there) would not help.
    """
    if not unknown:
        return None
    kind = unknown[0]
    what = "a dataclass" if is_dataclass(kind) else "an object"
    register = (
        f"torch.utils._pytree.register_dataclass({kind.__name__})"
        if is_dataclass(kind)
        else "torch.utils._pytree.register_pytree_node"
    )
    return SplitError(
        f"cannot capture {type(model).__name__}(...): its output holds {kind.__qualname__} "
        f"({what} from {kind.__module__}), a type torch.export cannot take apart into its "
        f"tensors. Register it as a pytree node ({register}, before splitting) or return "
        "a dict, a tuple or a transformers ModelOutput"
    )


def _holds_tensors(leaf: Any) -> bool:
    """Whether an output leaf is an object holding tensors: a dataclass, or attributes."""
    if isinstance(leaf, Tensor | type):
        return False
    if is_dataclass(leaf):
        return True
    return any(isinstance(v, Tensor) for v in getattr(leaf, "__dict__", {}).values())


def _refusal(error: Exception, model: nn.Module, names: dict[nn.Module, str]) -> SplitError:
    """``error`` of torch.export as a ``SplitError`` that says where and what to do."""
    cause = find_cause(error, SplitError)
    if isinstance(cause, SplitError):
        return cause
    module, line = failure_location(error, names)
    where = f"{module} at {line}" if module else f"{line}"
    if is_data_dependent(error):
        # Points cannot help: a point is a block, and every block runs on fake tensors once.
        return SplitError(
            f"cannot capture {where}: the code branches on the value of a tensor (or makes a "
            "shape from one), which a captured graph cannot follow, nor can the run on fake "
            "tensors through which split learns a block's output. Compute it without looking "
            "at tensor contents (torch.where instead of an if, a mask instead of a selection)"
        )
    first = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return SplitError(
        f"cannot capture {type(model).__name__}(...) on these inputs: torch.export failed at "
        f"{where} with {type(error).__name__}: {first}. Add the module that runs that line to "
        "points so that it runs as itself, or check that the model runs on these inputs"
    )
