"""Beyond one process: DataParallel over replicas, and pipelines whose stages are processes."""

from pipeline.distributed.data_parallel import DataParallel
from pipeline.distributed.p2p import PeerError
from pipeline.distributed.process_group import (
    TorchrunEnv,
    init_process_group_from_env,
    read_torchrun_env,
)
from pipeline.distributed.shards import load_shards, save_shard
from pipeline.distributed.stage_pipe import DistributedPipe, DistributedStepReport

__all__ = [
    "DataParallel",
    "DistributedPipe",
    "DistributedStepReport",
    "PeerError",
    "TorchrunEnv",
    "init_process_group_from_env",
    "load_shards",
    "read_torchrun_env",
    "save_shard",
]
