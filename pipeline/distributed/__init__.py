"""Data parallelism across pipeline replicas: DataParallel and process-group helpers."""

from pipeline.distributed.data_parallel import DataParallel
from pipeline.distributed.process_group import (
    TorchrunEnv,
    init_process_group_from_env,
    read_torchrun_env,
)

__all__ = ["DataParallel", "TorchrunEnv", "init_process_group_from_env", "read_torchrun_env"]
