"""Build: the instructions of each piece from its graph nodes (``instructions.py`` runs them).

Slots are numbered in the order a piece fills them: what it receives on the
main path, what it pops, then one per node it computes. A parameter or
buffer becomes a ``Fetch`` from its module just before its first use; a
constant the capture lifted out of the code (``torch.tensor([...])`` in a
forward) is held by the piece itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from pipeline.split.cut import PieceNodes
from pipeline.split.instructions import (
    HERE,
    Attribute,
    Block,
    Fetch,
    Grad,
    Instruction,
    Instructions,
    Op,
    Slot,
    Training,
)
from pipeline.split.opaque import BlockCall
from pipeline.split.where import node_module

__all__ = [
    "BLOCK_OP",
    "DROPOUTS",
    "DROPPED",
    "GRAD_REGION",
    "Built",
    "Sources",
    "build_piece",
    "training_of",
]

BLOCK_OP = torch.ops.pipegrad.block.default
GRAD_REGION = torch.ops.higher_order.wrap_with_set_grad_enabled
DROPOUTS = {
    torch.ops.aten.dropout.default,
    torch.ops.aten.feature_dropout.default,
    torch.ops.aten.alpha_dropout.default,
    torch.ops.aten.feature_alpha_dropout.default,
    torch.ops.aten.native_dropout.default,
}
# Checks of the capture's own dtypes and devices; a split's input check replaces them.
DROPPED = {torch.ops.aten._assert_tensor_metadata.default}


@dataclass
class Sources:
    """What the nodes of the captured graph refer to, shared by every piece of one split."""

    model: nn.Module
    root: fx.GraphModule
    calls: list[BlockCall]
    # placeholder -> (module, attribute) of a parameter or buffer, or a lifted constant
    state: dict[fx.Node, tuple[nn.Module, str] | torch.Tensor]
    device: torch.device
    dropouts_follow_mode: bool


@dataclass
class Built:
    """A piece's instructions and the slots of what it exchanges."""

    instructions: Instructions
    receives: int
    pops: list[tuple[str, Slot]]
    stashes: list[tuple[str, Slot]]
    sends: list[Slot]
    output: Any
    constants: nn.Module
    fetched: list[tuple[nn.Module, str]]
    # The mode of each dropout in its code, read from the model at run time.
    trainings: list[Training]
    # The module attributes its code reads again at every call (a dropout's p).
    follows: list[tuple[nn.Module, str]]


def build_piece(piece: PieceNodes, sources: Sources, output: fx.Node | None) -> Built:
    """The instructions of ``piece``; ``output`` is the graph's output node for the last piece."""
    builder = _Builder(sources)
    for node in piece.receives:
        builder.allocate(node)
    pops = [(name, builder.allocate(node)) for name, node in piece.pops]
    for node in piece.nodes:
        builder.add(node)
    stashes = [(name, builder.slot(node)) for name, node in piece.stashes]
    sends = [builder.slot(node) for node in piece.sends]
    result = None if output is None else builder.template(output.args[0])
    instructions = Instructions(
        builder.instructions, builder.count, len(piece.receives), (sends, stashes, result)
    )
    return Built(
        instructions,
        len(piece.receives),
        pops,
        stashes,
        sends,
        result,
        builder.constants,
        builder.fetched,
        builder.trainings,
        builder.follows,
    )


def training_of(node: fx.Node, model: nn.Module) -> Training:
    """The mode that ``node``'s module is in at run time."""
    name = node_module(node)
    module = model.get_submodule(name)
    return Training(module, list(model.children()) if not name else [])


class _Builder:
    def __init__(self, sources: Sources, parent: _Builder | None = None) -> None:
        self.sources = sources
        self.instructions: list[Instruction] = []
        self.slots: dict[fx.Node, Slot] = {}
        self.count = 0
        # A region's body is part of its piece: what it reads belongs to the piece.
        self.constants: nn.Module = nn.Module() if parent is None else parent.constants
        self.fetched: list[tuple[nn.Module, str]] = [] if parent is None else parent.fetched
        self.trainings: list[Training] = [] if parent is None else parent.trainings
        self.follows: list[tuple[nn.Module, str]] = [] if parent is None else parent.follows

    def allocate(self, node: fx.Node) -> Slot:
        slot = self.slots[node] = Slot(self.count)
        self.count += 1
        return slot

    def slot(self, node: fx.Node) -> Slot:
        found = self.slots.get(node)
        if found is not None:
            return found
        state = self.sources.state[node]
        slot = self.allocate(node)
        dtype = node.meta["val"].dtype
        if isinstance(state, torch.Tensor):
            name = f"constant_{len(list(self.constants.buffers()))}"
            self.constants.register_buffer(name, state, persistent=False)
            self.instructions.append(Fetch(slot.index, self.constants, name, dtype))
        else:
            self.fetched.append(state)
            self.instructions.append(Fetch(slot.index, *state, dtype))
        return slot

    def template(self, value: Any) -> Any:
        """``value`` (node arguments) with slots for nodes and ``HERE`` for the capture's device."""
        if isinstance(value, fx.Node):
            return self.slot(value)
        if isinstance(value, tuple | list):
            # fx keeps arguments in immutable subclasses; ops want plain ones.
            items = [self.template(item) for item in value]
            return items if isinstance(value, list) else tuple(items)
        if isinstance(value, dict):
            return {key: self.template(item) for key, item in value.items()}
        if isinstance(value, torch.device) and value == self.sources.device:
            return HERE
        return value

    def add(self, node: fx.Node) -> None:
        if node.op == "get_attr" or node.target in DROPPED:
            return
        if node.op != "call_function":
            raise AssertionError(f"unexpected {node.op} node {node.name} in a piece")
        step = self._instruction(node)
        # After the arguments: reading them may fetch parameters into new slots.
        step.out = self.allocate(node).index
        self.instructions.append(step)

    def _instruction(self, node: fx.Node) -> Instruction:
        target = node.target
        if target is BLOCK_OP:
            call, tensors, sizes = node.args
            assert isinstance(call, int)
            record = self.sources.calls[call]
            return Block(-1, record, self.template(tensors), self.template(sizes))
        if target is GRAD_REGION:
            enabled, body, *inputs = node.args
            assert isinstance(body, fx.Node) and isinstance(enabled, bool)
            region = getattr(self.sources.root, str(body.target))
            return Grad(-1, enabled, _region(region, self), self.template(inputs))
        args = self.template(node.args)
        if target in DROPOUTS:
            args = self._dropout(node, args)
        return Op(-1, _callable(target), args, self.template(node.kwargs))

    def _dropout(self, node: fx.Node, args: tuple[Any, ...]) -> tuple[Any, ...]:
        """A dropout's arguments ``(input, p, train)``: ``p`` from its module, the mode too."""
        module = self.sources.model.get_submodule(node_module(node))
        if isinstance(module, nn.modules.dropout._DropoutNd) and args[1] == module.p:
            self.follows.append((module, "p"))
            args = (args[0], Attribute(module, "p"), *args[2:])
        if self.sources.dropouts_follow_mode and len(args) > 2:
            training = training_of(node, self.sources.model)
            self.trainings.append(training)
            args = (*args[:2], training, *args[3:])
        return args


def _region(module: fx.GraphModule, parent: _Builder) -> Instructions:
    """The instructions of a region's subgraph: its placeholders are its inputs."""
    builder = _Builder(parent.sources, parent)
    inputs = [node for node in module.graph.nodes if node.op == "placeholder"]
    for node in inputs:
        builder.allocate(node)
    output = None
    for node in module.graph.nodes:
        if node.op == "output":
            output = node
        elif node.op != "placeholder":
            builder.add(node)
    assert output is not None
    return Instructions(
        builder.instructions, builder.count, len(inputs), builder.template(output.args[0])
    )


def _callable(target: Any) -> Callable[..., Any]:
    if not callable(target):
        raise AssertionError(f"node target {target!r} is not callable")
    return target  # type: ignore[no-any-return]
