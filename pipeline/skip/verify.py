"""verify_skippables: check that every skip of a model is stashed once and popped once, in order."""

from __future__ import annotations

import inspect

from torch import nn

from pipeline.skip.skippable import Skippable
from pipeline.skip.tracker import SkipKey

__all__ = ["verify_skippables"]


def verify_skippables(module: nn.Module) -> None:
    """Raise a ``TypeError`` listing every skip of ``module`` that cannot work.

    Layers are taken in registration order, the order ``nn.Sequential`` runs
    them. Reported: a skip stashed but never popped, popped but never
    stashed, popped before its stash, stashed or popped twice in a namespace,
    and a layer whose forward is a generator but which is not ``@skippable``.
    A Pipe runs this check when it is built::

        verify_skippables(nn.Sequential(Down(), Up(), Down(), Up()))
        # TypeError: ... 'skip' (default) stashed by both layer '0' (Down) and layer '2' ...
    """
    problems: list[str] = []
    stashers: dict[SkipKey, str] = {}
    poppers: dict[SkipKey, str] = {}
    popped_before_stash: list[SkipKey] = []
    for path, layer in module.named_modules(remove_duplicate=False):
        who = _describe(path, layer)
        if not isinstance(layer, Skippable):
            if inspect.isgeneratorfunction(type(layer).forward):
                problems.append(
                    f"{who} has a generator forward but is not skippable; decorate its class "
                    "with @skippable(stash=[...], pop=[...])"
                )
            continue
        for key in layer.stashable():
            _claim(stashers, key, who, "stashed", problems)
        for key in layer.poppable():
            if _claim(poppers, key, who, "popped", problems) and key not in stashers:
                popped_before_stash.append(key)

    for key in popped_before_stash:
        if key in stashers:
            problems.append(
                f"{_skip(key)} popped by {poppers[key]} before {stashers[key]} stashes it; a pop "
                "must come after its stash"
            )
        else:
            problems.append(f"{_skip(key)} popped by {poppers[key]} is never stashed")
    problems += [
        f"{_skip(key)} stashed by {who} is never popped"
        for key, who in stashers.items()
        if key not in poppers
    ]
    if problems:
        listed = "\n".join(f"  - {p}" for p in problems)
        raise TypeError(f"the skip connections of this model do not match:\n{listed}")


def _claim(
    owners: dict[SkipKey, str], key: SkipKey, who: str, verb: str, problems: list[str]
) -> bool:
    """Record ``who`` as the one layer that stashes (or pops) ``key``; False if taken."""
    first = owners.setdefault(key, who)
    if first == who:
        return True
    problems.append(
        f"{_skip(key)} {verb} by both {first} and {who}; give each use of a repeated "
        "block its own namespace: layer.isolate(Namespace())"
    )
    return False


def _describe(path: str, layer: nn.Module) -> str:
    kind = type(layer).__name__
    return f"layer {path!r} ({kind})" if path else f"the module ({kind})"


def _skip(key: SkipKey) -> str:
    ns, name = key
    return f"{name!r} ({ns.label})"
