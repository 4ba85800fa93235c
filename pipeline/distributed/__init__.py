"""Stages in processes: DistributedPipe, the P2P transport it sends on, DCP checkpoints.

The torchrun helpers (``pipeline/runtime/process_group.py``) and ``DataParallel``
(``pipeline/data_parallel/``) are importable from here too, as before.
"""

from pipeline.data_parallel import DataParallel
from pipeline.distributed.checkpoints import load_checkpoint, save_checkpoint
from pipeline.distributed.p2p import PeerError
from pipeline.distributed.pipe import DistributedPipe
from pipeline.runtime.process_group import (
    TorchrunEnv,
    init_process_group_from_env,
    read_torchrun_env,
)
from pipeline.step.reports import DistributedStepReport

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
