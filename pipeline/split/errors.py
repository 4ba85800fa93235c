"""SplitError: what ``pipeline.split`` refuses, with the module, the line and what to do.

And how to recognise the failures of torch.export that split explains.
"""

from __future__ import annotations

from typing import Any

__all__ = ["SplitError", "find_cause", "is_data_dependent"]


class SplitError(ValueError):
    """A model that ``pipeline.split`` cannot split; the message says where and what to do."""


def find_cause(error: BaseException, kind: type[BaseException]) -> Any:
    """``error`` or the first exception of ``kind`` it was raised from (None if none)."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        if isinstance(current, kind):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def is_data_dependent(error: BaseException) -> bool:
    """Whether tracing failed on code that depends on a tensor's values (a branch, a shape)."""
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    found = find_cause(error, GuardOnDataDependentSymNode) is not None
    return found or "data-dependent" in str(error)
