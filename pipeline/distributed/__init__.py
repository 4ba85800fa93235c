"""Stages in processes: DistributedPipe, the P2P transport it sends on, DCP checkpoints.

The torchrun helpers (``pipeline/runtime/process_group.py``) and ``DataParallel``
(``pipeline/data_parallel/``) are importable from here too, as before.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from pipeline.data_parallel import DataParallel
from pipeline.distributed.p2p import PeerError
from pipeline.distributed.pipe import DistributedPipe
from pipeline.runtime.process_group import (
    TorchrunEnv,
    init_process_group_from_env,
    read_torchrun_env,
)
from pipeline.step.reports import DistributedStepReport

if TYPE_CHECKING:
    from pipeline.distributed.checkpoints import load_checkpoint, save_checkpoint

__all__ = [
    "DataParallel",
    "DistributedPipe",
    "DistributedStepReport",
    "PeerError",
    "TorchrunEnv",
    "init_process_group_from_env",
    "load_checkpoint",
    "read_torchrun_env",
    "save_checkpoint",
]


def __getattr__(name: str) -> Any:
    # torch.distributed.checkpoint takes seconds to import (DTensor, sympy): loaded on first use.
    if name in ("load_checkpoint", "save_checkpoint"):
        return getattr(importlib.import_module("pipeline.distributed.checkpoints"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
