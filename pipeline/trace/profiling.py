"""pipeline.profile(): torch.profiler.profile that records a Pipe's worker threads too.

A Pipe runs its tasks on a thread per partition. ``torch.profiler.profile()``
records the thread that started it (and autograd's threads, which inherit
its state), no thread that Python started: on torch 2.13 a thread's events
are recorded by callbacks of that thread, installed only on the profiling
thread. torch offers no public way for another thread to join
(its C++ ``enableProfilerInChildThread`` has no Python binding, and replaces
the profiling thread's callback handle, so that later sessions record that
thread's ops twice). What works is the private option to record every
thread, ``_ExperimentalConfig(profile_all_threads=True)``, which torch's own
``torch.distributed.debug`` uses; this module is the one place that sets it::

    with pipeline.profile() as prof:          # torch.profiler.profile's arguments
        loss = pipe.step(x, y, loss_fn)
    prof.export_chrome_trace("pipe.json")     # pipe.forward[mb=3,part=1] on its worker

A Pipe run under a profiler that records only the caller's thread warns
once, naming ``pipeline.profile``. A ``DistributedPipe`` runs its actions on
the calling thread: ``torch.profiler.profile()`` sees them.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch._C._profiler import _ExperimentalConfig
from torch.autograd import profiler as _profiler

__all__ = ["profile", "warn_if_workers_unseen"]

# Profilers whose events are recorded by callbacks of the profiling thread.
_THREAD_LOCAL = (
    torch._C._profiler.ActiveProfilerType.KINETO,
    torch._C._profiler.ActiveProfilerType.LEGACY,
)
_warned = False


def profile(**kwargs: Any) -> torch.profiler.profile:
    """``torch.profiler.profile(**kwargs)``, recording every thread: a Pipe's workers too.

    Takes every argument of ``torch.profiler.profile`` but
    ``experimental_config``, which it sets itself (torch cannot merge two)::

        with pipeline.profile(record_shapes=True) as prof:
            pipe(x).sum().backward()
        print(prof.key_averages().table(sort_by="cpu_time_total"))
    """
    if "experimental_config" in kwargs:
        raise TypeError(
            "pipeline.profile() sets experimental_config itself, to record every thread; pass "
            "the other arguments of torch.profiler.profile, or call torch.profiler.profile "
            "with an _ExperimentalConfig of yours that has profile_all_threads=True"
        )
    try:
        config = _ExperimentalConfig(profile_all_threads=True)
    except TypeError:
        raise RuntimeError(
            f"pipeline.profile() needs torch >= 2.7, whose profiler can record every thread "
            f"(this is torch {torch.__version__}); torch.profiler.profile() here records only "
            "the thread that starts it, not the Pipe's workers"
        ) from None
    return torch.profiler.profile(experimental_config=config, **kwargs)


def warn_if_workers_unseen(stacklevel: int = 1) -> None:
    """Warn once per process if a profiler that records only this thread is running.

    Called by the Pipe on the caller's thread before it runs tasks on its
    workers; ``stacklevel`` as ``warnings.warn``'s, from the function calling
    this one. Without a profiler it costs a check of two flags.
    """
    if _profiler._is_profiler_enabled and not _warned:
        _warn_if_this_thread_only(stacklevel + 2)


def _warn_if_this_thread_only(stacklevel: int) -> None:
    global _warned
    # Every torch profiler sets the Python flag; one recording every thread
    # leaves this thread's own state off.
    autograd = torch._C._autograd
    if autograd._profiler_enabled() and autograd._profiler_type() in _THREAD_LOCAL:
        _warned = True
        warnings.warn(
            "torch.profiler records the thread that started it, but a Pipe runs its tasks on "
            "worker threads, whose events it does not record: profile with "
            "`with pipeline.profile() as prof:` (torch.profiler.profile's arguments) to see them",
            stacklevel=stacklevel,
        )
