"""Which phase a layer runs in: the forward of a checkpointed task, or its recomputation.

Thread-local flags, set by the Pipe around a checkpointed task and carried to
the workers of a Pipe nested in it (``threadstate.py``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal

__all__ = ["is_checkpointing", "is_recomputing", "phase"]

Phase = Literal["checkpointing", "recomputing"]

_flags = threading.local()


def is_checkpointing() -> bool:
    """Whether the calling layer runs in the forward pass of a checkpointed task.

    A layer with side effects (statistics, counters) can skip them here or in
    recomputation so that they happen once::

        if not is_recomputing():
            self.calls += 1
    """
    return bool(getattr(_flags, "checkpointing", False))


def is_recomputing() -> bool:
    """Whether the calling layer runs in the recomputation of a checkpointed task."""
    return bool(getattr(_flags, "recomputing", False))


@contextmanager
def phase(name: Phase, on: bool = True) -> Iterator[None]:
    """Set flag ``name`` (to ``on``) on this thread for the block."""
    previous = getattr(_flags, name, False)
    setattr(_flags, name, on)
    try:
        yield
    finally:
        setattr(_flags, name, previous)
