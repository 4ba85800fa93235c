"""GPipe-style pipeline parallelism for PyTorch: wrap an nn.Sequential, get a pipeline."""

from pipeline import skip
from pipeline.batchnorm import DeferredBatchNorm
from pipeline.distributed import DataParallel, DistributedPipe
from pipeline.microbatch import NoChunk
from pipeline.migration import from_partitioned_state_dict
from pipeline.phase import is_checkpointing, is_recomputing
from pipeline.pipe import BalanceError, Pipe, PositionalSequential
from pipeline.split import split
from pipeline.trace import Trace, trace

__all__ = [
    "BalanceError",
    "DataParallel",
    "DeferredBatchNorm",
    "DistributedPipe",
    "NoChunk",
    "Pipe",
    "PositionalSequential",
    "Trace",
    "from_partitioned_state_dict",
    "is_checkpointing",
    "is_recomputing",
    "skip",
    "split",
    "trace",
]
