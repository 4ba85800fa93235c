"""Split points: the modules where pieces start, and the blocks kept whole.

By default the blocks are the children of the model's stacks: the repeated
``nn.ModuleList`` or ``nn.Sequential`` holding the most parameters (GPT-2's
``transformer.h``, Llama's ``model.layers``), and every other one holding at
least a quarter as many (an encoder-decoder model's second stack: T5's
``decoder.block``, BART's ``model.decoder.layers``): one piece per block,
plus what comes before, between and after. A repeated list inside another
(a mixture of experts' ``experts`` inside its layers) is part of its block.
Given ``points``, a piece starts at each of them; the default blocks that
neither contain nor sit inside a point are still kept whole (called as
themselves), within the pieces.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence

from torch import nn

from pipeline.split.errors import SplitError

__all__ = ["default_blocks", "kept_whole", "resolve_points"]


def default_blocks(model: nn.Module) -> list[str]:
    """The names of the children of the model's stacks, in the model's order ([] if none).

    A stack is a ModuleList or Sequential of two children or more, all of
    one class, inside no other (a block's own list of experts is part of the
    block); those holding at least a quarter of the parameters of the
    largest are taken (an encoder's and a decoder's; not a list of small
    heads). Without one, the list of a single child holding the most
    parameters is the stack (a model built with one block).
    """
    lists: dict[str, tuple[int, int]] = {}
    for name, module in model.named_modules():
        children = list(module.children())
        if (
            isinstance(module, nn.ModuleList | nn.Sequential)
            and children
            and len({type(child) for child in children}) == 1
        ):
            lists[name] = (len(children), sum(p.numel() for p in module.parameters()))
    repeated = [name for name, (count, _) in lists.items() if count > 1]
    stacks = {
        name: lists[name][1]
        for name in repeated
        if not any(_inside(name, outer) for outer in repeated)
    }
    if not stacks and lists:
        single = max(lists, key=lambda name: lists[name][1])
        stacks = {single: lists[single][1]}
    if not stacks:
        return []
    most = max(stacks.values())
    return [
        f"{stack}.{child}" if stack else child
        for stack, size in stacks.items()  # in the model's order
        if 4 * size >= most
        for child, _ in model.get_submodule(stack).named_children()
    ]


def resolve_points(model: nn.Module, points: Sequence[str] | None) -> tuple[list[str], bool]:
    """The names of the split points, and whether they are the default ones.

    Raises ``TypeError`` or ``ValueError`` for names that are not modules of
    the model, the model itself, or points nested in one another.
    """
    if points is None:
        found = default_blocks(model)
        if not found:
            raise SplitError(
                f"{type(model).__name__} has no nn.ModuleList or nn.Sequential of repeated "
                "blocks to split at; pass points=[...], the names of the modules where pieces "
                f"start (its children: {[name for name, _ in model.named_children()]})"
            )
        return found, True
    if isinstance(points, str) or not all(isinstance(p, str) for p in points):
        raise TypeError(f"points must be a list of module names, got {points!r}")
    names = dict(model.named_modules())
    for point in points:
        if point not in names:
            close = difflib.get_close_matches(point, list(names), n=3)
            hint = f"; did you mean {close}?" if close else ""
            raise ValueError(f"points names {point!r}, which is not a module of the model{hint}")
        if point == "":
            raise ValueError("points names the model itself (''); name modules inside it")
    if len(set(points)) != len(points):
        raise ValueError(f"points names a module twice: {list(points)}")
    for point in points:
        for other in points:
            if other != point and other.startswith(point + "."):
                raise ValueError(
                    f"points names {other!r} inside {point!r}; a point runs whole, so a piece "
                    "cannot start inside another point: name one of them"
                )
    return list(points), False


def kept_whole(model: nn.Module, points: list[str]) -> dict[nn.Module, str]:
    """The modules called as themselves: the points, and default blocks apart from them."""
    whole = dict.fromkeys(points)
    for block in default_blocks(model):
        if not any(_nested(block, point) for point in points):
            whole[block] = None
    return {model.get_submodule(name): name for name in whole}


def _inside(name: str, outer: str) -> bool:
    """Whether module ``name`` sits inside module ``outer`` ('' is the model)."""
    return name != outer and (outer == "" or name.startswith(outer + "."))


def _nested(a: str, b: str) -> bool:
    return a == b or a.startswith(b + ".") or b.startswith(a + ".")
