"""GPipe-style pipeline parallelism for PyTorch: wrap an nn.Sequential, get a pipeline."""

from pipeline import skip
from pipeline.batchnorm import DeferredBatchNorm
from pipeline.checkpoint import is_checkpointing, is_recomputing
from pipeline.distributed import DataParallel
from pipeline.microbatch import NoChunk
from pipeline.pipe import BalanceError, Pipe
from pipeline.rng import mark_random
from pipeline.trace import Trace, trace

__all__ = [
    "BalanceError",
    "DataParallel",
    "DeferredBatchNorm",
    "NoChunk",
    "Pipe",
    "Trace",
    "is_checkpointing",
    "is_recomputing",
    "mark_random",
    "skip",
    "trace",
]
