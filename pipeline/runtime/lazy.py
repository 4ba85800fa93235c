"""Classes of heavy torch modules, checked for without importing those modules.

``torch.distributed.fsdp`` and ``torch.distributed.checkpoint`` each take
seconds to import (DTensor, sympy). An object can only be an instance of a
class whose module has been imported, so ``isinstance`` against a module not
imported yet is False without importing it, and ``import pipeline`` stays
close to ``import torch``.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["instance_of"]


def instance_of(value: Any, module: str, name: str) -> bool:
    """Whether ``value`` is an instance of ``module.name``, importing nothing.

    >>> instance_of(3, "torch.distributed.fsdp", "FSDPModule")
    False
    """
    loaded = sys.modules.get(module)
    cls = getattr(loaded, name, None) if loaded is not None else None
    return isinstance(cls, type) and isinstance(value, cls)
