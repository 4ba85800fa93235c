"""CUDA streams with a CPU fallback, so the pipeline code has one path.

On CUDA a ``Stream`` is a ``torch.cuda.Stream``. On any other device it is
``CPUStream``, a stand-in on which every operation here is a no-op: CPU work
is ordered by the threads that run it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import TypeAlias

import torch

__all__ = [
    "CPUStream",
    "Stream",
    "copy_to",
    "current_stream",
    "get_device",
    "new_stream",
    "record_stream",
    "synchronize",
    "use_device",
    "use_stream",
    "wait_stream",
]


class CPUStream:
    """The stream of every non-CUDA device."""

    device = torch.device("cpu")

    def __repr__(self) -> str:
        return "CPUStream"


CPU_STREAM = CPUStream()
_NO_STREAM = contextlib.nullcontext()

Stream: TypeAlias = torch.cuda.Stream | CPUStream


def new_stream(device: torch.device) -> Stream:
    """A fresh stream on ``device`` (the CPU stand-in off CUDA)."""
    if device.type != "cuda":
        return CPU_STREAM
    return torch.cuda.Stream(device)


def current_stream(device: torch.device) -> Stream:
    """The stream the calling thread uses on ``device``."""
    if device.type != "cuda":
        return CPU_STREAM
    return torch.cuda.current_stream(device)


def get_device(stream: Stream) -> torch.device:
    if isinstance(stream, CPUStream):
        return torch.device("cpu")
    return stream.device


@contextlib.contextmanager
def use_device(device: torch.device) -> Iterator[None]:
    """Make ``device`` the current CUDA device (no-op off CUDA)."""
    if device.type != "cuda":
        yield
        return
    with torch.cuda.device(device):
        yield


def use_stream(stream: Stream) -> AbstractContextManager[object]:
    """Make ``stream`` current on its device (no-op for the CPU stand-in)."""
    if isinstance(stream, CPUStream):
        # Entered once per task: a shared no-op beats a generator context.
        return _NO_STREAM
    return torch.cuda.stream(stream)


def wait_stream(waiter: Stream, waitee: Stream) -> None:
    """Make work later queued on ``waiter`` wait for what ``waitee`` has queued."""
    if isinstance(waiter, CPUStream) or isinstance(waitee, CPUStream):
        return
    waiter.wait_stream(waitee)


def synchronize(stream: Stream) -> None:
    """Wait, on this thread, until ``stream`` has done what it has queued (no-op off CUDA)."""
    if not isinstance(stream, CPUStream):
        stream.synchronize()


def record_stream(tensor: torch.Tensor, stream: Stream) -> None:
    """Keep ``tensor``'s memory from being reused before ``stream`` is done with it."""
    if isinstance(stream, CPUStream) or not tensor.is_cuda:
        return
    tensor.record_stream(stream)


def copy_to(
    tensor: torch.Tensor, device: torch.device, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """``tensor`` on ``device``: queued on the current stream into a GPU, done into the CPU.

    A non-blocking copy from a GPU into the CPU returns before the copy is
    done (torch pins the result to allow it), and no stream orders the CPU's
    reads after the copy: they would read what the memory held before. Into
    a GPU, the copy is ordered on the current stream like any kernel.
    """
    return tensor.to(device, dtype, non_blocking=device.type == "cuda")
