"""GPipe-style pipeline parallelism for PyTorch: wrap an nn.Sequential, get a pipeline.

The code's layout: docs/architecture.md.
"""

from pipeline import skip
from pipeline.data_parallel import DataParallel
from pipeline.distributed import DistributedPipe
from pipeline.migration import from_partitioned_state_dict
from pipeline.pipe import BalanceError, Pipe, PositionalSequential
from pipeline.plan import plan
from pipeline.runtime.batchnorm import DeferredBatchNorm
from pipeline.runtime.microbatch import NoChunk
from pipeline.runtime.phase import is_checkpointing, is_recomputing
from pipeline.split import split
from pipeline.trace import Trace, profile, trace

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
    "plan",
    "profile",
    "skip",
    "split",
    "trace",
]
