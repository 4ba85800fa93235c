"""Thread-local state that must follow a task from the caller to a worker.

Grad mode, inference mode, autocast and the current CUDA device are
thread-local in PyTorch, and so are the checkpointing phase flags (a Pipe
nested in a checkpointed task recomputes when the outer task does). So are
the caller's context variables, where torch keeps the settings made to
``torch._dynamo.config``, ``torch._inductor.config`` and
``torch._functorch.config``: compiled layers on a worker must see them. A
worker thread starts with the defaults, so the caller's state is captured
once per forward and applied around every task, and each task runs in a copy
of the caller's context (``run``).

So is, in part, the number of intra-op threads: ``torch.set_num_threads``
records it for all threads but sets OpenMP's and MKL's own counts for the
calling thread only. A worker whose first matrix product goes to MKL before
anything has set them there builds an OpenMP team of the machine's size,
whose threads spin beside every other thread's: with a few workers on a
2-core machine, kernels took five to ten times as long. ``run`` sets the
caller's count on the worker, once per thread and whenever it changes.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import ParamSpec, TypeVar

import torch

from pipeline.runtime.phase import is_checkpointing, is_recomputing, phase

__all__ = ["ThreadState"]

_P = ParamSpec("_P")
_R = TypeVar("_R")


def _autocast_device_types() -> tuple[str, ...]:
    candidates = ["cpu", "cuda", "xpu", "mps", "hpu", "xla", "mtia", "maia"]
    candidates.append(torch._C._get_privateuse1_backend_name())
    return tuple(t for t in dict.fromkeys(candidates) if torch.amp.is_autocast_available(t))


_AUTOCAST_DEVICE_TYPES = _autocast_device_types()


# What ``ThreadState.run`` has set on this thread.
_this_thread = threading.local()


@dataclass(frozen=True)
class Autocast:
    device_type: str
    dtype: torch.dtype
    cache_enabled: bool

    def applied(self) -> torch.autocast:
        return torch.autocast(self.device_type, dtype=self.dtype, cache_enabled=self.cache_enabled)


@dataclass(frozen=True)
class ThreadState:
    """The caller's thread-local state, to be applied on another thread."""

    grad_enabled: bool
    inference_mode: bool
    autocasts: tuple[Autocast, ...]
    cuda_device: int | None
    checkpointing: bool = False
    recomputing: bool = False
    context: contextvars.Context = field(default_factory=contextvars.Context, compare=False)
    intra_op_threads: int = field(default_factory=torch.get_num_threads)

    @classmethod
    def capture(cls) -> ThreadState:
        cache = torch.is_autocast_cache_enabled()
        autocasts = tuple(
            Autocast(t, torch.get_autocast_dtype(t), cache)
            for t in _AUTOCAST_DEVICE_TYPES
            if torch.is_autocast_enabled(t)
        )
        cuda_device = torch.cuda.current_device() if torch.cuda.is_initialized() else None
        return cls(
            grad_enabled=torch.is_grad_enabled(),
            inference_mode=torch.is_inference_mode_enabled(),
            autocasts=autocasts,
            cuda_device=cuda_device,
            checkpointing=is_checkpointing(),
            recomputing=is_recomputing(),
            context=contextvars.copy_context(),
        )

    def run(self, function: Callable[_P, _R], *args: _P.args, **kwargs: _P.kwargs) -> _R:
        """Call ``function`` in a copy of the caller's context variables (torch's config).

        A copy per call: threads cannot enter one context at once. The
        thread uses the caller's number of intra-op threads.
        """
        if getattr(_this_thread, "intra_op_threads", None) != self.intra_op_threads:
            torch.set_num_threads(self.intra_op_threads)
            _this_thread.intra_op_threads = self.intra_op_threads
        return self.context.copy().run(function, *args, **kwargs)

    @contextlib.contextmanager
    def autocast_off(self) -> Iterator[None]:
        """The caller's own thread without its autocast: each task applies it where it belongs.

        A process that runs its stages on the caller's thread (DistributedPipe)
        would otherwise run their backward inside it too, which the plain
        model's ``loss.backward()`` (and a worker thread) does not.
        """
        with contextlib.ExitStack() as stack:
            for autocast in self.autocasts:
                stack.enter_context(torch.autocast(autocast.device_type, enabled=False))
            yield

    def applied(self, device: torch.device) -> AbstractContextManager[object]:
        """Apply the state for a task on ``device`` (which becomes the current CUDA device)."""
        if self.only_grad_mode(device):
            # Entered once per task: the common case skips the general exit stack.
            return torch.set_grad_enabled(self.grad_enabled)
        return self._applied_in_full(device)

    def only_grad_mode(self, device: torch.device) -> bool:
        """Whether a task on ``device`` needs the grad mode and nothing else."""
        return not (
            self.inference_mode
            or self.autocasts
            or device.type == "cuda"
            or self.cuda_device is not None
            or self.checkpointing
            or self.recomputing
        )

    @contextlib.contextmanager
    def _applied_in_full(self, device: torch.device) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            if self.inference_mode:
                stack.enter_context(torch.inference_mode())
            else:
                stack.enter_context(torch.set_grad_enabled(self.grad_enabled))
            if self.checkpointing:
                stack.enter_context(phase("checkpointing"))
            if self.recomputing:
                stack.enter_context(phase("recomputing"))
            self._enter_device_and_autocast(stack, device)
            yield

    @contextlib.contextmanager
    def autocast_applied(self, device: torch.device) -> Iterator[None]:
        """Apply autocast and the CUDA device only (recomputation sets grad mode itself)."""
        with contextlib.ExitStack() as stack:
            self._enter_device_and_autocast(stack, device)
            yield

    def _enter_device_and_autocast(self, stack: contextlib.ExitStack, device: torch.device) -> None:
        if device.type == "cuda":
            stack.enter_context(torch.cuda.device(device))
        elif self.cuda_device is not None:
            stack.enter_context(torch.cuda.device(self.cuda_device))
        for autocast in self.autocasts:
            stack.enter_context(autocast.applied())
