"""Namespace: keeps the skip names of one block apart from those of its twins.

A skippable class names its skips once (``stash=['skip']``), but a model may
use the class many times, one per U-Net level say. Each use that needs its
own skip gets its own namespace, ``layer.isolate(Namespace())``, so that the
``'skip'`` stashed at level 1 is popped at level 1 and nowhere else.
"""

from __future__ import annotations

import itertools
from typing import Any

__all__ = ["DEFAULT_NAMESPACE", "Namespace"]

_numbers = itertools.count()


class Namespace:
    """A scope for skip names; two namespaces are equal only if they are the same object.

    ``label`` only shows in messages and in ``Pipe.skip_layout``::

        level1 = Namespace("level1")
        down, up = Down().isolate(level1), Up().isolate(level1)
    """

    __slots__ = ("label",)

    def __init__(self, label: str | None = None) -> None:
        self.label = label if label is not None else f"#{next(_numbers)}"

    def __repr__(self) -> str:
        return f"Namespace({self.label!r})"

    # A namespace names a place, like a constant: a copied layer stays in it
    # (a deep copy of a whole model maps it to itself too, harmlessly).
    def __copy__(self) -> Namespace:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> Namespace:
        return self

    def __reduce__(self) -> str | tuple[type[Namespace], tuple[str]]:
        # Layers that never called isolate() look up the module's default
        # namespace itself: an unpickled one must be that very object. Any
        # other namespace comes back as one new object per pickle, shared by
        # every layer and layout pickled with it.
        if self is DEFAULT_NAMESPACE:
            return "DEFAULT_NAMESPACE"
        return Namespace, (self.label,)


DEFAULT_NAMESPACE = Namespace("default")
