"""One gradient bucket: a flat tensor holding several parameters' gradients, reduced at once."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import record_function


class GradBucket:
    """The flat gradient buffer of a few parameters of one dtype and device.

    Each parameter owns a slot (a view of `flat` shaped like the parameter).
    Gradients are divided by the world size as they are loaded, so the sum
    all-reduce leaves the average (gloo has no average reduction; dividing
    first also keeps low-precision sums in range, and doing it during the copy
    saves a pass over memory). With `track_use`, `flat` ends with one flag per
    parameter, 1 where this rank produced a gradient: the flags ride along in
    the same all-reduce, so afterwards a zero flag means no rank used the
    parameter and its `.grad` is left alone, as if it had not been wrapped.
    """

    def __init__(
        self,
        index: int,
        params: list[nn.Parameter],
        *,
        world_size: int,
        track_use: bool,
        as_view: bool,
    ) -> None:
        self.index = index
        self.params = params
        self._scale = 1.0 / world_size
        self._as_view = as_view
        sizes = [p.numel() for p in params]
        total = sum(sizes)
        self.nbytes = total * params[0].element_size()
        self.flat = torch.zeros(
            total + (len(params) if track_use else 0),
            dtype=params[0].dtype,
            device=params[0].device,
        )
        self._slots = [
            part.view_as(p) for p, part in zip(params, self.flat[:total].split(sizes), strict=True)
        ]
        self._used = self.flat[total:] if track_use else None
        self._pending = len(params)
        self._work: dist.Work | None = None
        if as_view:
            self._adopt_existing_grads()

    def describe(self) -> str:
        """How error messages name this bucket."""
        size = f"{len(self.params)} parameters, {self.nbytes / 2**20:.2f} MiB"
        return f"gradient bucket {self.index} ({size})"

    @property
    def full(self) -> bool:
        """Whether every parameter's gradient has been loaded since the last reset."""
        return self._pending == 0

    def reset(self) -> None:
        """Forget the last iteration: no gradient loaded, no all-reduce in flight."""
        self._pending = len(self.params)
        self._work = None

    @torch.no_grad()
    def load(self, slot: int) -> None:
        """Put parameter `slot`'s final gradient, divided by the world size, in its slot."""
        param, view = self.params[slot], self._slots[slot]
        grad = param.grad
        if grad is None:
            view.zero_()
        elif grad.data_ptr() == view.data_ptr():
            view.mul_(self._scale)
        else:
            torch.mul(grad, self._scale, out=view)
            if self._as_view:
                # The optimizer's zero_grad(set_to_none=True) dropped the view,
                # so autograd stored a fresh tensor: point .grad back at the slot.
                param.grad = view
        if self._used is not None:
            self._used[slot] = 0.0 if grad is None else 1.0
        self._pending -= 1

    def launch(self, group: dist.ProcessGroup) -> None:
        """Start the asynchronous all-reduce that turns the bucket into the average."""
        with record_function(f"dp.allreduce[bucket={self.index}]"):
            self._work = dist.all_reduce(self.flat, group=group, async_op=True)

    @property
    def launched(self) -> bool:
        """Whether this iteration's all-reduce has been started."""
        return self._work is not None

    def wait(self) -> None:
        """Block until the all-reduce is done (bounded by the process group's timeout)."""
        assert self._work is not None, "wait() before launch()"
        with record_function(f"dp.wait[bucket={self.index}]"):
            self._work.wait()

    @torch.no_grad()
    def store(self) -> bool:
        """Hand every parameter that any rank used its averaged gradient; False if none was used."""
        used = self._used.tolist() if self._used is not None else [1.0] * len(self.params)
        for param, view, flag in zip(self.params, self._slots, used, strict=True):
            if flag == 0.0:
                continue
            if self._as_view:
                param.grad = view
            elif param.grad is None:
                param.grad = view.clone()
            else:
                param.grad.copy_(view)
        return any(flag != 0.0 for flag in used)

    @torch.no_grad()
    def _adopt_existing_grads(self) -> None:
        """Move gradients that already exist into their slots, and make `.grad` the slot."""
        for param, view in zip(self.params, self._slots, strict=True):
            if param.grad is not None:
                view.copy_(param.grad)
                param.grad = view
