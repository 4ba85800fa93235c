"""The layers of an nn.Sequential that a pipeline partitions, and the names it keeps.

A plain ``nn.Sequential``'s layers are its children, and its names are
theirs. A Sequential may instead list its layers itself (``Layered``): a
split model (``pipeline.split``) registers the model's own children,
parameters and buffers, so that every name is the model's, and lists its
pieces, which are not its children, through ``named_layers()``. A pipeline
asks here for both, so it partitions the pieces and keeps the model's names::

    seq = pipeline.split(model, (x,))
    named_layers(seq)          # {'0': Piece, '1': Piece, ...}
    register_names(pipe, seq)  # pipe.state_dict() keys == model.state_dict() keys

A pipe holding some of the layers (a ``DistributedPipe``'s stages) keeps
the names of what they use. Of a split model, that is part of the model's
tree: the modules its pieces use whole, and where they use only some of a
module, a ``Part`` of it under the module's name. GPT-2's pieces on two
processes::

    the model               process 0: pieces 0-2        process 1: pieces 3-4
    transformer             transformer (Part)           transformer (Part)
      wte, wpe, drop          wte, wpe, drop               wte (tied to lm_head)
      h: 0, 1, 2              h (Part): 0, 1               h (Part): 2
      ln_f                                                 ln_f
    lm_head                 lm_head                      lm_head
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from itertools import chain
from typing import Protocol, runtime_checkable

from torch import nn

__all__ = ["Layered", "Part", "ReadsModules", "modules_only_read", "named_layers", "register_names"]


@runtime_checkable
class Layered(Protocol):
    """A Sequential whose layers are not (all) its children: it lists them itself."""

    def named_layers(self) -> OrderedDict[str, nn.Module]:
        """The layers, in order, by name."""

    def modes_read(self, layer: str) -> list[nn.Module]:
        """The modules whose training mode layer ``layer`` reads, beyond its own modules."""


@runtime_checkable
class ReadsModules(Protocol):
    """A layer that reads some modules' parameters and buffers without calling the modules.

    A split model's piece reads tensors of the modules its glue uses (GPT-2's
    embedding piece and head piece both read ``lm_head.weight``, the tied
    weight). Such a module may be held by partitions on different devices:
    nothing of it runs there, and its parameters are read where they are
    (``arguments.check_sharing``, ``runtime/borrowed.py``).
    """

    def modules_read(self) -> list[nn.Module]:
        """The modules whose tensors this layer only reads (it calls none of them)."""


def modules_only_read(layers: Iterable[nn.Module]) -> set[int]:
    """The ids of the modules that ``layers`` only read tensors of, none of them calling it."""
    read: set[int] = set()
    run: set[int] = set()
    for layer in layers:
        own = {id(m) for m in layer.modules_read()} if isinstance(layer, ReadsModules) else set()
        read |= own
        run.update(id(m) for m in layer.modules() if id(m) not in own)
    return read - run


def named_layers(module: nn.Sequential) -> OrderedDict[str, nn.Module]:
    """The layers a pipeline partitions, in order, by name."""
    if isinstance(module, Layered):
        return module.named_layers()
    # _modules, unlike named_children(), keeps a layer listed twice.
    return OrderedDict(
        (name, layer) for name, layer in module._modules.items() if layer is not None
    )


def register_names(
    owner: nn.Module, module: nn.Sequential, held: Iterable[str] | None = None
) -> None:
    """Register ``module``'s children, parameters and buffers on ``owner`` under their names.

    ``owner.state_dict()`` and ``owner.named_parameters()`` then have the
    keys of ``module``'s (the plain model's), for the same objects. With
    ``held``, only the children of those names are registered: the layers a
    pipe holding some of them keeps (a ``DistributedPipe``, its stages'); of a
    ``Layered`` module, what those layers use, under the names ``module``
    has for it (every name of a tied tensor). Every name is checked either
    way, so that a clash is refused wherever the layer is held.
    """
    for name in [*module._modules, *module._parameters, *module._buffers]:
        if hasattr(owner, name):
            raise ValueError(
                f"layer name {name!r} clashes with a {type(owner).__name__} attribute; rename "
                "the layer in the nn.Sequential"
            )
    if held is None:
        _adopt(owner, module)
    elif isinstance(module, Layered):
        layers = named_layers(module)
        used = _Used()
        for name in held:
            used.add(layers[name], module.modes_read(name))
        _adopt(owner, used.prune(module))
    else:
        for name in held:
            owner.add_module(name, module._modules[name])


def _adopt(owner: nn.Module, module: nn.Module) -> None:
    """Register ``module``'s children, parameters and buffers on ``owner``."""
    for name, child in module._modules.items():
        if child is not None:
            owner.add_module(name, child)
    _adopt_tensors(owner, module, kept=None)


def _adopt_tensors(owner: nn.Module, module: nn.Module, kept: set[int] | None) -> None:
    """Register ``module``'s own parameters and buffers (those ``kept``, or all) on ``owner``."""
    for name, parameter in module._parameters.items():
        if parameter is not None and (kept is None or id(parameter) in kept):
            owner.register_parameter(name, parameter)
    for name, buffer in module._buffers.items():
        if buffer is not None and (kept is None or id(buffer) in kept):
            persistent = name not in module._non_persistent_buffers_set
            owner.register_buffer(name, buffer, persistent=persistent)


class Part(nn.Module):
    """Some of a model's module, under its name: the children and tensors a pipe holds of it.

    Never called: it gives a pipe holding part of a model the model's names
    (``state_dict()``, ``named_parameters()``) for what it holds and nothing
    else. ``train()`` and ``eval()`` set the mode of the module it stands for
    too, whose code may read it (a split model runs the model's own code).
    """

    _of: nn.Module

    def __init__(self, of: nn.Module) -> None:
        super().__init__()
        self.__dict__["_of"] = of  # not a child: the whole module holds more than this part

    def train(self, mode: bool = True) -> Part:
        self._of.training = mode
        return super().train(mode)

    def extra_repr(self) -> str:
        return f"part of {type(self._of).__name__}"


class _Used:
    """The tensors and modules that some layers use, found by identity in the model."""

    def __init__(self) -> None:
        self.tensors: set[int] = set()
        self.modules: set[int] = set()

    def add(self, layer: nn.Module, modes: list[nn.Module]) -> None:
        self.tensors.update(id(t) for t in chain(layer.parameters(), layer.buffers()))
        self.modules.update(id(m) for m in chain(layer.modules(), modes))

    def prune(self, module: nn.Module) -> nn.Module:
        """``module``, whole if everything in it is used, else a ``Part`` of what is used.

        Only for a module in which something is used (``_keeps``).
        """
        if self._complete(module):
            return module
        part = Part(module)
        for name, child in module._modules.items():
            if child is not None and self._keeps(child):
                part.add_module(name, self.prune(child))
        _adopt_tensors(part, module, kept=self.tensors)
        return part

    def _keeps(self, module: nn.Module) -> bool:
        return id(module) in self.modules or any(
            id(t) in self.tensors for t in chain(module.parameters(), module.buffers())
        )

    def _complete(self, module: nn.Module) -> bool:
        own = chain(module._parameters.values(), module._buffers.values())
        return all(t is None or id(t) in self.tensors for t in own) and all(
            child is None or self._complete(child) for child in module._modules.values()
        )
