"""GPipe-style pipeline parallelism for PyTorch."""

from pipeline.distributed import DataParallel

__all__ = ["DataParallel"]
