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
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import Protocol, runtime_checkable

from torch import nn

__all__ = ["Layered", "named_layers", "register_names"]


@runtime_checkable
class Layered(Protocol):
    """A Sequential whose layers are not (all) its children: it lists them itself."""

    def named_layers(self) -> OrderedDict[str, nn.Module]: ...


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
    pipe holding some of them keeps (a ``DistributedPipe``, its stages'). Every
    name is checked either way, so that a clash is refused wherever the layer
    is held.
    """
    for name in [*module._modules, *module._parameters, *module._buffers]:
        if hasattr(owner, name):
            raise ValueError(
                f"layer name {name!r} clashes with a {type(owner).__name__} attribute; rename "
                "the layer in the nn.Sequential"
            )
    if held is not None:
        for name in held:
            owner.add_module(name, module._modules[name])
        return
    for name, child in module._modules.items():
        if child is not None:
            owner.add_module(name, child)
    for name, parameter in module._parameters.items():
        owner.register_parameter(name, parameter)
    for name, buffer in module._buffers.items():
        persistent = name not in module._non_persistent_buffers_set
        owner.register_buffer(name, buffer, persistent=persistent)
