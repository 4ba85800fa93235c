"""DataParallel: one replica of a model per process, gradients averaged while backward runs.

Read ``wrapper.py`` first (the module a script wraps its replica in), then ``reducer.py`` (when a
gradient is final, bucket by bucket), ``buckets.py`` (which gradients share a flat buffer, and the
buffer) and ``replicas.py`` (every rank the same: checked, and broadcast from rank 0).
"""

from pipeline.data_parallel.wrapper import DataParallel

__all__ = ["DataParallel"]
