"""Watch: what every piece checks at every call, that the model still runs as it was captured.

The pieces run the code captured at split time. What they read from the
model at run time follows it: parameters and buffers, the blocks (hooks,
their own attributes, modules replaced inside them), the mode, a dropout's
``p``. Three other things the capture fixed, so each piece refuses a call
after they change, before it computes anything:

- an attribute that the captured code read (``attributes.py``) holds
  another value, or another tensor, an attribute of a module or of an object
  a module holds (``model.config.output_hidden_states``);
- a module whose code is captured got hooks, or a global module hook was
  registered (``hooks.py``, the check ``split`` makes too);
- a captured module or a block was replaced in (or removed from) its
  parent, the split model included (``seq.head = nn.Linear(8, 5)``);
- a parameter or buffer that the split model registered as its own (the
  model's own, ``model.pos``) was replaced: the split model, and a pipe of
  it, would train and save the old one while the pieces read the new;
- weights tied at split time were untied (``head.weight = nn.Parameter(...)``):
  the captured code reads one tensor for both.

Every piece checks all of them, so that each process of a
``DistributedPipe`` checks its own copy of the model.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from torch import Tensor, nn

from pipeline.split.attributes import MISSING, Read, differs
from pipeline.split.hooks import refuse_hooks
from pipeline.split.where import describe_module

__all__ = ["Watch"]

_AGAIN = "split the model again after the change"
# A slot holding a tensor: its module's parameters or buffers, the name there, the full name.
_Holder = tuple[Mapping[str, Tensor | None], str, str]


class Watch:
    """The checks of one split model, shared by its pieces."""

    def __init__(
        self,
        reads: Iterable[Read],
        names: dict[nn.Module, str],
        captured: list[tuple[str, nn.Module]],
        held: dict[int, str],
    ) -> None:
        self.reads = [
            (r.owner, r.attribute, r.value, _describe(r.owner, r.attribute, names, held))
            for r in reads
        ]
        self.captured = captured
        # (the parent's children, the key, the child there at split time, the child's name)
        self.places: list[tuple[dict[str, Any], str, nn.Module, str]] = []
        # (the model's own parameters or buffers, the split model's, a name in both)
        self.own: list[tuple[Mapping[str, Tensor | None], Mapping[str, Tensor | None], str]] = []
        # Each tie the captured code reads as one tensor: (its holders' tensors, the name).
        self.ties: list[list[_Holder]] = []

    def add_tensors(
        self,
        model: nn.Module,
        split: nn.Module,
        fetched: Iterable[tuple[nn.Module, str]],
        blocks: dict[nn.Module, str],
        names: dict[nn.Module, str],
    ) -> None:
        """Check that the model's own tensors stay the ones the ``split`` model registered
        (materialising from ``meta`` replaces both), and that the tensors the captured code
        reads (``fetched``) stay tied where they were.

        A block runs as itself, reading its own attributes: a tie into one is
        followed, unless the captured code reads the tensor by the block's name.
        """
        self.own = [(model._parameters, split._parameters, n) for n in split._parameters]
        self.own += [(model._buffers, split._buffers, n) for n in split._buffers]
        holders: dict[int, list[_Holder]] = {}
        for prefix, module in _outside(model, blocks):
            for tensors in (module._parameters, module._buffers):
                for name, tensor in tensors.items():
                    if tensor is not None:
                        holders.setdefault(id(tensor), []).append((tensors, name, prefix + name))
        self.ties = []
        for module, attribute in dict.fromkeys(fetched):
            tensors = module._parameters if attribute in module._parameters else module._buffers
            # The holder the captured code reads, in a block or not, and the others outside.
            tie: list[_Holder] = [(tensors, attribute, _qualified(names[module], attribute))]
            others = holders.get(id(tensors[attribute]), [])
            tie += [h for h in others if h[0] is not tensors or h[1] != attribute]
            if len(tie) > 1:
                self.ties.append(tie)

    def add_places(self, parents: Iterable[nn.Module], watched: dict[nn.Module, str]) -> None:
        """Check that each child of ``parents`` among ``watched`` stays where it is."""
        for parent in parents:
            for key, child in parent._modules.items():
                if child in watched:
                    self.places.append((parent._modules, key, child, watched[child]))

    def check(self) -> None:
        """Raise ``RuntimeError`` if the model changed in a way the pieces cannot follow."""
        for owner, attribute, value, what in self.reads:
            now = getattr(owner, attribute, MISSING)
            if differs(value, now):
                raise RuntimeError(_changed(what, value, now, isinstance(owner, nn.Module)))
        for children, key, child, name in self.places:
            now = children.get(key)
            if now is not child:
                raise RuntimeError(_replaced(describe_module(name, child), now))
        for tensors, registered, name in self.own:
            now, tensor = tensors.get(name), registered.get(name)
            if now is not tensor:
                raise RuntimeError(_own_replaced(name, tensor, now))
        for held in self.ties:
            first = held[0][0].get(held[0][1])
            for tensors, name, where in held[1:]:
                if tensors.get(name) is not first:
                    raise RuntimeError(_untied(held[0][2], where))
        refuse_hooks(
            self.captured,
            RuntimeError,
            "they were registered after the split; remove them, or split the model again with "
            "the module in points (a point runs as itself, hooks included)",
        )


def _qualified(module: str, attribute: str) -> str:
    return f"{module}.{attribute}" if module else attribute


def _outside(model: nn.Module, blocks: dict[nn.Module, str]) -> list[tuple[str, nn.Module]]:
    """The model's modules outside its blocks, each with its name's prefix (``head.``)."""
    found: list[tuple[str, nn.Module]] = []

    def walk(prefix: str, module: nn.Module) -> None:
        found.append((prefix, module))
        for name, child in module._modules.items():
            if child is not None and child not in blocks:
                walk(f"{prefix}{name}.", child)

    walk("", model)
    return found


def _describe(owner: Any, attribute: str, names: dict[nn.Module, str], held: dict[int, str]) -> str:
    """``attribute 'p' of module 'drop' (Dropout)``, ``model.config.use_cache (GPT2Config)``."""
    if isinstance(owner, nn.Module):
        return f"attribute {attribute!r} of {describe_module(names[owner], owner)}"
    return f"model.{held[id(owner)]}.{attribute} (of a {type(owner).__name__})"


def _changed(what: str, value: Any, now: Any, of_module: bool) -> str:
    if isinstance(value, Tensor):
        return (
            f"{what} is another tensor than at split time (a "
            "tensor that is neither parameter nor buffer, which the captured code holds as a "
            "constant): register it as a buffer (read at every call) or change it in place, or "
            f"{_AGAIN}"
        )
    if not of_module:
        return (
            f"{what} is {now!r}, but the model was split with {value!r}, and the captured "
            f"code holds that value as a constant: set it before splitting and {_AGAIN}, or "
            "pass the setting as the call's argument where the model takes one"
        )
    return (
        f"{what} is {now!r}, but the model was split with "
        f"{value!r}, and the captured code holds that value as a constant: {_AGAIN}, or make "
        "it a tensor (a buffer, read at every call), or move the code that reads it into a "
        "module named in points (a point runs as itself)"
    )


def _replaced(what: str, now: nn.Module | None) -> str:
    change = "removed" if now is None else f"replaced by {type(now).__name__}"
    return (
        f"{what} was {change} after the split; the pieces run the code captured at split time "
        f"with the modules of that time, so the new one would never run: {_AGAIN} (after "
        "adding adapters or a new head)"
    )


def _own_replaced(name: str, tensor: Tensor | None, now: Tensor | None) -> str:
    kind = "parameter" if isinstance(tensor, nn.Parameter) else "buffer"
    if now is not None and tensor is not None and now.dtype != tensor.dtype:
        return (
            f"the model's {kind} {name!r} is {now.dtype}, but the model was split with it in "
            f"{tensor.dtype} (.to(dtype) or .float() replaced it), and the code around it was "
            "captured for that dtype: split the model again after changing dtypes"
        )
    return (
        f"the model's {kind} {name!r} was replaced after the split; the split model (and a "
        "pipe of it) holds the one it was split with, so their parameters(), state_dict() and "
        f"an optimizer of them would miss the new one: copy new values into it in place "
        f"(with torch.no_grad(): model.{name}.copy_(...)), or {_AGAIN}"
    )


def _untied(first: str, other: str) -> str:
    return (
        f"{first!r} and {other!r} were one tensor when the model was split, and are two now; "
        "the captured code reads that one tensor for both: tie them again, or "
        f"{_AGAIN}"
    )
