"""Instructions: a piece's glue run on real tensors, its blocks called as themselves.

A piece does not keep the captured graph (its nodes hold fake tensors and
reach the whole model); it keeps instructions that name what they read by slot::

    slot 0  input_ids                       (received)
    slot 1  Fetch  transformer.wte.weight   (read from the module at each call)
    slot 2  Op     aten.embedding(1, 0)
    slot 3  Block  transformer.h.0 (2, mask=None)  -> the module itself is called
    slot 4  Op     getitem(3, 0)

An op instruction calls the aten op, so autograd records it as it would the model's
own code, and the pipeline's per-op random seeding sees every random op. A
block instruction rebuilds the block's arguments from its ``BlockCall`` record and
calls the module: its hooks fire, a compiled block runs compiled, randomness
inside it is the pipeline's. Three things captured as constants follow the
piece instead: the capture's device becomes the device the piece runs on
(``HERE``), and a dropout's ``train`` flag becomes its module's mode at run
time (``Training``); a dropout module's ``p`` is read from it at every call
(``Attribute``). Other values the code read are checked (``watch.py``). A
slot is emptied after its last use.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor, nn

from pipeline.split.opaque import BlockCall

__all__ = [
    "HERE",
    "Attribute",
    "Block",
    "Fetch",
    "Grad",
    "Instruction",
    "Instructions",
    "Op",
    "Slot",
    "Training",
]


@dataclass(frozen=True)
class Slot:
    """Where a instruction reads a value that an earlier instruction (or the piece's input) put."""

    index: int


class _Here:
    """The device the piece runs on, where the capture had its own device."""

    def __repr__(self) -> str:
        return "HERE"

    def __deepcopy__(self, memo: dict[int, Any]) -> _Here:
        return self

    def __reduce__(self) -> str:
        return "HERE"  # the one instance, which ``load`` recognises by identity


HERE = _Here()


class Training:
    """A dropout's ``train`` flag: the mode of the module that called it, at run time.

    The model itself is not part of a split model (its children are), so the
    model's own mode is the one its children agree on (``seq.train()``,
    ``pipe.eval()`` set them all); where they disagree, some were set one by
    one, and the model's own flag is what its code reads, as in eager mode.
    """

    __slots__ = ("children", "module")

    def __init__(self, module: nn.Module, children: Sequence[nn.Module]) -> None:
        self.module = module
        self.children = list(children)

    def __repr__(self) -> str:
        return f"Training({type(self.module).__name__})"

    def modules(self) -> list[nn.Module]:
        """The modules whose mode it reads."""
        return [self.module, *self.children]

    def value(self) -> bool:
        if not self.children:
            return self.module.training
        modes = {child.training for child in self.children}
        return modes.pop() if len(modes) == 1 else self.module.training


class Attribute:
    """A value the captured code read from a module, read from it again at every call.

    A dropout's ``p`` (``model.transformer.drop.p = 0`` after the split).
    """

    __slots__ = ("attribute", "module")

    def __init__(self, module: nn.Module, attribute: str) -> None:
        self.module, self.attribute = module, attribute

    def __repr__(self) -> str:
        return f"Attribute({type(self.module).__name__}.{self.attribute})"

    def value(self) -> Any:
        return getattr(self.module, self.attribute)


class Instruction(ABC):
    """One node of the graph: reads slots, writes slot ``out``, then empties ``frees``."""

    out: int
    frees: tuple[int, ...] = ()

    @abstractmethod
    def run(self, env: list[Any], here: torch.device) -> Any:
        """This node's value, from the slots of ``env`` it reads (``here``: the piece's device)."""


class Fetch(Instruction):
    """A parameter or buffer, read from its module at every call (so moves and loads show).

    The code around it was captured for its dtype: a changed one is refused.
    One held on another device than the piece's (a weight tied across a
    Pipe's devices, kept on its first user's) is moved here by a
    differentiable copy, so its gradient reaches the one parameter.
    """

    def __init__(self, out: int, module: nn.Module, attribute: str, dtype: torch.dtype) -> None:
        self.out, self.module, self.attribute, self.dtype = out, module, attribute, dtype

    def run(self, env: list[Any], here: torch.device) -> Any:
        tensor = getattr(self.module, self.attribute)
        if tensor.dtype != self.dtype:
            raise RuntimeError(
                f"{self.attribute!r} of {type(self.module).__name__} is {tensor.dtype}, but the "
                f"model was split with it in {self.dtype}, and the code around it was captured "
                "for that dtype: split the model again after changing dtypes"
            )
        return tensor if tensor.device == here else tensor.to(here)


class Op(Instruction):
    """A call of a torch op (or of a Python function on sizes) with its captured arguments."""

    def __init__(self, out: int, target: Callable[..., Any], args: Any, kwargs: Any) -> None:
        self.out, self.target, self.args, self.kwargs = out, target, args, kwargs

    def run(self, env: list[Any], here: torch.device) -> Any:
        return self.target(*load(self.args, env, here), **load(self.kwargs, env, here))

    def __repr__(self) -> str:
        return f"Op({self.target})"

    def __getstate__(self) -> dict[str, Any]:
        # A torch op does not pickle (torch.save of a split model); its name does.
        state = self.__dict__.copy()
        if isinstance(self.target, torch._ops.OpOverload):
            state["target"] = _OpName(self.target.name())
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        if isinstance(state["target"], _OpName):
            state["target"] = state["target"].op()
        self.__dict__.update(state)


@dataclass(frozen=True)
class _OpName:
    """A torch op by its qualified name, ``aten::add.Tensor``, as a pickle keeps it."""

    name: str

    def op(self) -> Callable[..., Any]:
        namespace, _, name = self.name.partition("::")
        packet, _, overload = name.partition(".")
        found = getattr(getattr(getattr(torch.ops, namespace), packet), overload or "default")
        return cast(Callable[..., Any], found)


class Block(Instruction):
    """A call of a block module, as the captured call made it."""

    def __init__(self, out: int, call: BlockCall, tensors: Any, sizes: Any) -> None:
        self.out, self.call, self.tensors, self.sizes = out, call, tensors, sizes

    def run(self, env: list[Any], here: torch.device) -> Any:
        return self.call.call(load(self.tensors, env, here), load(self.sizes, env, here))


class Grad(Instruction):
    """A region of the model's code under ``torch.no_grad()`` (or ``enable_grad``)."""

    def __init__(self, out: int, enabled: bool, body: Instructions, inputs: Any) -> None:
        self.out, self.enabled, self.body, self.inputs = out, enabled, body, inputs

    def run(self, env: list[Any], here: torch.device) -> Any:
        with torch.set_grad_enabled(self.enabled):
            return self.body.call(load(self.inputs, env, here), here)


class Instructions:
    """Steps run in order on an environment of ``slots`` values; ``results`` are returned."""

    def __init__(
        self, instructions: list[Instruction], slots: int, inputs: int, results: Any
    ) -> None:
        self.instructions = instructions
        self.slots = slots
        self.inputs = inputs
        self.results = results
        self._free_dead_slots()

    def run(self, env: list[Any], here: torch.device) -> None:
        """Run every instruction on ``env`` (its first ``inputs`` slots filled)."""
        for instruction in self.instructions:
            env[instruction.out] = instruction.run(env, here)
            for slot in instruction.frees:
                env[slot] = None

    def call(self, inputs: Sequence[Any], here: torch.device) -> Any:
        """Run on ``inputs`` and return ``results`` with their values."""
        env: list[Any] = [None] * self.slots
        env[: len(inputs)] = inputs
        self.run(env, here)
        return load(self.results, env, here)

    def _free_dead_slots(self) -> None:
        kept = set(_slots_in(self.results))
        last: dict[int, Instruction] = {}
        for instruction in self.instructions:
            for slot in _slots_in(_reads(instruction)):
                last[slot] = instruction
        for slot, instruction in last.items():
            if slot not in kept:
                instruction.frees = (*instruction.frees, slot)


def load(template: Any, env: list[Any], here: torch.device) -> Any:
    """``template`` with each slot replaced by its value, ``HERE`` by the device, flags resolved."""
    kind = type(template)
    if kind is Slot:
        return env[cast(Slot, template).index]
    if kind is tuple or kind is list:
        return kind(load(item, env, here) for item in template)
    if kind is dict:
        return {key: load(item, env, here) for key, item in template.items()}
    if template is HERE:
        return here
    if kind is Training or kind is Attribute:
        return cast(Training | Attribute, template).value()
    return template


def _reads(instruction: Instruction) -> Any:
    if isinstance(instruction, Op):
        return (instruction.args, instruction.kwargs)
    if isinstance(instruction, Block):
        return (instruction.tensors, instruction.sizes)
    if isinstance(instruction, Grad):
        return instruction.inputs
    return ()


def _slots_in(template: Any) -> list[int]:
    if isinstance(template, Slot):
        return [template.index]
    if isinstance(template, tuple | list):
        return [slot for item in template for slot in _slots_in(item)]
    if isinstance(template, dict):
        return [slot for item in template.values() for slot in _slots_in(item)]
    return []


def first_device(values: Sequence[Any]) -> torch.device | None:
    """The device of the first tensor among ``values`` (None if there is none)."""
    for value in values:
        if isinstance(value, Tensor):
            return value.device
    return None
