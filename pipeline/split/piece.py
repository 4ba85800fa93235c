"""Piece: one layer of a split model, running its glue and calling its blocks.

A piece is a skippable layer (``pipeline.skip``): what a later piece needs
and the next one does not travel as a skip, stashed here and popped there.
It runs the model's own modules without registering them, so that the
parameters keep the model's names in the split model (which registers the
model's children) and in a Pipe built on it. It still answers for them:

- ``named_modules()`` (and so ``parameters()``, ``buffers()``,
  ``named_parameters()``) lists the blocks it calls, whole, and the modules
  whose parameters or buffers its glue reads, alone (not their children);
  a Pipe checks sharing between partitions and balance counts parameters
  through it; ``modules_read()`` tells the modules only read apart;
- ``_apply`` (``.to(device)``, ``.double()``, a Pipe's placement) applies to
  those same tensors and no others.

Every piece first checks that the model still runs as it was captured
(``watch.py``: attributes the code read, hooks, replaced modules). The
first piece takes the model's arguments and checks them
(``signature.py``); the last returns what the model returns (a
``ModelOutput`` too); the others take and return a tuple of values.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import TreeSpec, tree_unflatten

from pipeline.skip.namespace import Namespace
from pipeline.skip.skippable import Skippable, pop, stash
from pipeline.split.build import Built
from pipeline.split.instructions import Training, first_device, load
from pipeline.split.signature import Signature
from pipeline.split.watch import Watch

__all__ = ["ModeCheck", "Piece"]


class ModeCheck:
    """The mode a module must be in for a piece whose captured code depends on it."""

    def __init__(self, name: str, training: Training, expected: bool) -> None:
        self.name, self.training, self.expected = name, training, expected

    def check(self) -> None:
        if self.training.value() != self.expected:
            mode = "training" if self.expected else "eval"
            raise RuntimeError(
                f"the model was split in {mode} mode, and its captured code differs between "
                f"training and eval (not only in dropout); {self.name} is no longer in {mode} "
                f"mode: put it back, or split the model again in the mode you run it in"
            )


class Output:
    """How the last piece rebuilds the model's output (a tuple, a ``ModelOutput``) from slots."""

    def __init__(self, template: Any, spec: TreeSpec) -> None:
        self.template, self.spec = template, spec

    def build(self, env: list[Any], here: torch.device) -> Any:
        return tree_unflatten(load(self.template, env, here), self.spec)

    def __deepcopy__(self, memo: dict[int, Any]) -> Output:
        return self  # slots, constants and a structure: nothing a copy would change


class Piece(Skippable):
    """Layer ``index`` of a split model: from ``start`` (a module name) to the next piece."""

    def __init__(
        self,
        index: int,
        start: str,
        built: Built,
        blocks: list[tuple[str, nn.Module]],
        owners: list[tuple[str, nn.Module]],
        namespace: Namespace,
        signature: Signature | None,
        out_spec: TreeSpec | None,
        modes: list[ModeCheck],
        watch: Watch,
    ) -> None:
        super().__init__()
        self.index = index
        self.start = start
        self.instructions = built.instructions
        self.receives = built.receives
        self.pops = built.pops
        self.stashes = built.stashes
        self.sends = built.sends
        self.signature = signature
        self.output = None if out_spec is None else Output(built.output, out_spec)
        self.modes = modes
        self.watch = watch
        self.trainings = [*built.trainings, *(mode.training for mode in modes)]
        self.blocks = blocks
        self.owners = owners
        self.stashable_names = tuple(name for name, _ in built.stashes)
        self.poppable_names = tuple(name for name, _ in built.pops)
        self.isolate(namespace)
        if list(built.constants.buffers()):
            self.constants = built.constants

    # What the piece runs: a generator forward, as skippable layers have.

    def _generator_forward(self, *args: Any, **kwargs: Any) -> Generator[Any, Any, Any]:
        self.watch.check()
        if self.signature is not None:
            inputs = self.signature.bind(args, kwargs)
        else:
            inputs = self._received(args, kwargs)
        env: list[Any] = [None] * self.instructions.slots
        env[: len(inputs)] = inputs
        for name, slot in self.pops:
            env[slot.index] = yield pop(name)
        for mode in self.modes:
            mode.check()
        here = self._device(env)
        self.instructions.run(env, here)
        for name, slot in self.stashes:
            yield stash(name, env[slot.index])
        if self.output is None:
            return tuple(env[slot.index] for slot in self.sends)
        return self.output.build(env, here)

    def _received(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
        # One tuple in a Pipe's 'tuple' call style (and in the split model), its
        # items as positional arguments in the 'positional' style.
        values = args[0] if len(args) == 1 and type(args[0]) is tuple else args
        if kwargs or len(values) != self.receives:
            given = f"{len(values)} values" + (f" and keywords {list(kwargs)}" if kwargs else "")
            raise TypeError(
                f"piece {self.index} of a split model takes the {self.receives} values that "
                f"piece {self.index - 1} returns, got {given}"
            )
        return list(values)

    def _device(self, env: list[Any]) -> torch.device:
        found = first_device(env[: self.receives + len(self.pops)])
        if found is None:
            found = first_device([*self.parameters(), *self.buffers()])
        return found if found is not None else torch.device("cpu")

    # The modules it uses, answered for as if they were its own.

    def named_modules(
        self,
        memo: set[nn.Module] | None = None,
        prefix: str = "",
        remove_duplicate: bool = True,
    ) -> Iterator[tuple[str, nn.Module]]:
        if memo is None:
            memo = set()
        yield from super().named_modules(memo, prefix, remove_duplicate)
        for name, module in self.blocks:
            yield from module.named_modules(memo, _join(prefix, name), remove_duplicate)
        for name, module in self.owners:
            if module not in memo or not remove_duplicate:
                if remove_duplicate:
                    memo.add(module)
                yield _join(prefix, name), module

    def modules_read(self) -> list[nn.Module]:
        """The modules whose tensors its glue reads and which it does not call (its owners).

        ``pipeline.runtime.layers.ReadsModules``: a Pipe lets partitions on
        different devices hold such a module (a tied head read by the first
        and the last piece), as each read moves the tensor to the piece's
        device (``instructions.Fetch``).
        """
        called = {id(m) for _, block in self.blocks for m in block.modules()}
        return [module for _, module in self.owners if id(module) not in called]

    def modes_read(self) -> list[nn.Module]:
        """The modules whose mode its code reads, beyond those it runs (``named_modules()``).

        A dropout's module, or the model and its children for code of the
        model's own forward; a pipe holding this piece keeps their mode too.
        """
        found: dict[int, nn.Module] = {}
        for training in self.trainings:
            found.update((id(module), module) for module in training.modules())
        return list(found.values())

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> Piece:
        super()._apply(fn, recurse)
        if recurse:
            for _, module in self.blocks:
                module._apply(fn)
            for _, module in self.owners:
                module._apply(fn, recurse=False)
        return self

    def extra_repr(self) -> str:
        parts = [f"{self.index}: from {self.start or 'the start'}"]
        if self.blocks:
            parts.append(f"blocks {[name for name, _ in self.blocks]}")
        if self.pops:
            parts.append(f"pops {len(self.pops)}")
        if self.stashes:
            parts.append(f"stashes {len(self.stashes)}")
        return ", ".join(parts)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix and name else prefix or name
