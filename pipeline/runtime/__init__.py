"""What every engine uses: the partitions and how to call them, worker threads, micro-batches,
randomness, thread state, streams, buffers, BatchNorm, phase, recomputation, process groups.

No imports here on purpose: import the module you mean (``pipeline.runtime.rng``), so that no
package initialiser pulls one part of the library into another.
"""
