"""DeferredBatchNorm: running statistics over the whole mini-batch, not per micro-batch.

In a pipeline, a BatchNorm layer sees one micro-batch at a time. Normalising
with the micro-batch's statistics is what the layer would do under gradient
accumulation, but its running mean and variance would be updated once per
micro-batch, with noisier estimates and ``m`` momentum steps per mini-batch.
``DeferredBatchNorm`` accumulates the sums over every micro-batch of a
forward pass and updates the running statistics once, when the Pipe commits
them after its last micro-batch, exactly as BatchNorm would on the whole
mini-batch. A forward pass starts from empty sums, so one that failed or was
interrupted leaves nothing behind.

The Pipe converts the BatchNorm layers of the module it is given, in place.
Run outside a Pipe's tasks (the user's own module, called directly), a
``DeferredBatchNorm`` is an ordinary BatchNorm: it updates its running
statistics at every call.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from pipeline.runtime.phase import is_recomputing
from pipeline.runtime.rng import inside_a_checkpoint_of_its_own

__all__ = [
    "DeferredBatchNorm",
    "DeferredBatchNorm1d",
    "DeferredBatchNorm2d",
    "DeferredBatchNorm3d",
    "deferred_norms",
    "deferring_batch_norm",
    "statistics_of_one_pass",
]

_local = threading.local()
_OWN_CHECKPOINT = (
    "a {} runs inside a torch.utils.checkpoint of a layer's own: torch recomputes it in the "
    "backward, outside the pipe's deferral, where it would update its statistics once per "
    "micro-batch more; let the pipe recompute instead (checkpoint=...), or keep this layer a "
    "BatchNorm (deferred_batch_norm=False)"
)
_TWICE = (
    "a {} ran twice in one micro-batch's forward: its statistics are deferred to one update "
    "per mini-batch, where the plain model's BatchNorm updates them at every call; give each "
    "call a BatchNorm of its own, or keep this layer a BatchNorm (deferred_batch_norm=False, "
    "and no DeferredBatchNorm.convert)"
)
_merging = threading.Lock()


def deferring_batch_norm(on: bool) -> AbstractContextManager[None]:
    """Within the block (a Pipe task), DeferredBatchNorm layers defer their updates if ``on``."""
    return _Deferring(on)


class _Deferring:
    """Sets this thread's deferral for a block (entered once per task: a class, not a generator).

    While deferring, ``_local.deferring`` holds the layers that accumulated in
    this task: each may run once per micro-batch.
    """

    __slots__ = ("on", "previous")

    def __init__(self, on: bool) -> None:
        self.on = on
        self.previous: set[int] | None = None

    def __enter__(self) -> None:
        self.previous = getattr(_local, "deferring", None)
        _local.deferring = set() if self.on else None

    def __exit__(self, *exc_info: object) -> None:
        _local.deferring = self.previous


class DeferredBatchNorm(_BatchNorm):
    """A BatchNorm whose running statistics are updated per mini-batch."""

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats=True)
        self._start_accumulating()

    def _start_accumulating(self) -> None:
        # An attribute, not buffers: the state_dict, named_buffers() and
        # DataParallel's broadcast see what the plain model's BatchNorm has.
        self._pass = _Moments()

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: Tensor) -> Tensor:
        self._check_input_dim(input)
        if not self.training:
            return F.batch_norm(
                input,
                self.running_mean,
                self.running_var,
                self.weight,
                self.bias,
                training=False,
                momentum=0.0,
                eps=self.eps,
            )
        ran: set[int] | None = getattr(_local, "deferring", None)
        if ran is None:
            return super().forward(input)
        if not is_recomputing():
            if id(self) in ran:
                raise RuntimeError(_TWICE.format(type(self).__name__))
            if inside_a_checkpoint_of_its_own():
                raise RuntimeError(_OWN_CHECKPOINT.format(type(self).__name__))
            ran.add(id(self))
            self._accumulate(input)
        return F.batch_norm(
            input, None, None, self.weight, self.bias, training=True, momentum=0.0, eps=self.eps
        )

    def _accumulate(self, input: Tensor) -> None:
        dims = [d for d in range(input.dim()) if d != 1]
        dtype = torch.promote_types(cast(Tensor, self.running_mean).dtype, torch.float32)
        with torch.no_grad():
            x = input.detach().to(dtype)
            # Each micro-batch's own mean and squared deviations, merged
            # (Chan et al.): a mean far from zero cancels nothing, as it would
            # in the sum of squares less the squared mean.
            mean = x.mean(dims)
            deviations = (x - mean.view(_channel_shape(input))).square().sum(dims)
            with _merging:  # one layer may run in the tasks of several partitions
                self._pass.add(input.numel() // input.size(1), mean, deviations)

    def commit(self) -> None:
        """Fold the accumulated mini-batch statistics into the running ones."""
        moments = self.reset_accumulators()
        if moments.count == 0:
            return
        assert moments.mean is not None and moments.deviations is not None
        count = moments.count
        with torch.no_grad():
            unbiased = moments.deviations / max(count - 1, 1)
            tracked = cast(Tensor, self.num_batches_tracked)
            tracked += 1
            factor = 1.0 / float(tracked) if self.momentum is None else self.momentum
            running_mean = cast(Tensor, self.running_mean)
            running_var = cast(Tensor, self.running_var)
            running_mean.mul_(1 - factor).add_(moments.mean.to(running_mean.dtype), alpha=factor)
            running_var.mul_(1 - factor).add_(unbiased.to(running_var.dtype), alpha=factor)

    def reset_accumulators(self) -> _Moments:
        """Forget the micro-batches not committed (a failed or interrupted pass); return them."""
        with _merging:
            moments, self._pass = self._pass, _Moments()
        return moments

    @classmethod
    def convert(cls, module: nn.Module) -> nn.Module:
        """Make every BatchNorm in ``module`` a DeferredBatchNorm, in place; return ``module``.

        Each ``BatchNorm1d``, ``2d`` and ``3d`` that tracks running statistics
        changes class (to ``DeferredBatchNorm1d``, ...), not object, as
        torch's parametrizations do: its hooks, parameters, buffers and mode,
        and a reference kept to it, stay its own. One that cannot defer is
        refused before any is changed: a subclass of its own (its forward
        would be lost), ``SyncBatchNorm``, a layer not yet materialised
        (``LazyBatchNorm``), and one layer in two places of the model (its
        statistics would be updated once for both uses, where BatchNorm
        updates them per use).
        """
        where: dict[int, list[str]] = {}
        layers: dict[int, _BatchNorm] = {}
        for name, child in module.named_modules(remove_duplicate=False):
            if isinstance(child, _BatchNorm) and child.track_running_stats:
                where.setdefault(id(child), []).append(name or type(child).__name__)
                layers[id(child)] = child
        for key, bn in layers.items():
            _check_convertible(bn, where[key])
        for bn in layers.values():
            if not isinstance(bn, DeferredBatchNorm):
                bn.__class__ = _DEFERRED[type(bn)]
                cast(DeferredBatchNorm, bn)._start_accumulating()
        return module


class DeferredBatchNorm1d(DeferredBatchNorm, nn.BatchNorm1d):
    """A ``BatchNorm1d`` whose running statistics are updated per mini-batch."""

    _check_input_dim = nn.BatchNorm1d._check_input_dim


class DeferredBatchNorm2d(DeferredBatchNorm, nn.BatchNorm2d):
    """A ``BatchNorm2d`` whose running statistics are updated per mini-batch."""

    _check_input_dim = nn.BatchNorm2d._check_input_dim


class DeferredBatchNorm3d(DeferredBatchNorm, nn.BatchNorm3d):
    """A ``BatchNorm3d`` whose running statistics are updated per mini-batch."""

    _check_input_dim = nn.BatchNorm3d._check_input_dim


_DEFERRED: dict[type[nn.Module], type[DeferredBatchNorm]] = {
    nn.BatchNorm1d: DeferredBatchNorm1d,
    nn.BatchNorm2d: DeferredBatchNorm2d,
    nn.BatchNorm3d: DeferredBatchNorm3d,
}


def _check_convertible(bn: _BatchNorm, names: list[str]) -> None:
    """Raise ValueError unless ``bn`` (at ``names`` in the model) can defer its statistics."""
    what = f"the BatchNorm at {names[0]!r} ({type(bn).__name__})"
    if len(names) > 1:
        raise ValueError(
            f"{what} is one layer at {names}: deferred, its running statistics would be "
            "updated once for every use, where BatchNorm updates them per use; give each "
            "place a layer of its own, or pass deferred_batch_norm=False"
        )
    if isinstance(bn, DeferredBatchNorm):
        return
    if any(isinstance(p, nn.parameter.UninitializedParameter) for p in bn.parameters()) or any(
        isinstance(b, nn.parameter.UninitializedBuffer) for b in bn.buffers()
    ):
        raise ValueError(
            f"{what} is not materialised yet: run the model once (or build the layer with "
            "its number of features) before deferring its statistics"
        )
    if type(bn) not in _DEFERRED:
        raise ValueError(
            f"deferred_batch_norm=True converts BatchNorm1d, 2d and 3d, but {what} is of "
            "another class (a SyncBatchNorm synchronises its statistics itself; a subclass's "
            "own code would be lost): make it a pipeline.DeferredBatchNorm yourself, or pass "
            "deferred_batch_norm=False"
        )


class _Moments:
    """A pass's rows so far, per channel: their count, mean and summed squared deviations."""

    __slots__ = ("count", "deviations", "mean")

    def __init__(self) -> None:
        self.count = 0
        self.mean: Tensor | None = None
        self.deviations: Tensor | None = None

    def add(self, count: int, mean: Tensor, deviations: Tensor) -> None:
        """Merge ``count`` more rows, of mean ``mean`` and squared deviations ``deviations``."""
        if count == 0:
            return
        if self.mean is None or self.deviations is None:
            self.count, self.mean, self.deviations = count, mean, deviations
            return
        total = self.count + count
        delta = mean - self.mean
        self.mean = self.mean + delta * (count / total)
        between = delta.square() * (self.count * count / total)
        self.deviations = self.deviations + deviations + between
        self.count = total


def _channel_shape(input: Tensor) -> list[int]:
    """The shape that broadcasts a per-channel vector over ``input`` (channels in dim 1)."""
    return [1, input.size(1)] + [1] * (input.dim() - 2)


def deferred_norms(module: nn.Module, converted: bool) -> list[DeferredBatchNorm]:
    """The DeferredBatchNorm layers ``module`` holds now.

    ``converted``: its BatchNorm layers were converted (``deferred_batch_norm=True``),
    so a training BatchNorm that is not deferred came in after that, and is
    refused: it would update its statistics once per micro-batch, where the
    pipe promised once per mini-batch.
    """
    norms = []
    for name, layer in module.named_modules():
        if isinstance(layer, DeferredBatchNorm):
            norms.append(layer)
        elif converted and _updates_statistics(layer):
            raise ValueError(
                f"the layer {name!r} is a {type(layer).__name__} put in after the pipe "
                "converted its BatchNorm layers (deferred_batch_norm=True): it would update "
                "its running statistics once per micro-batch; convert it too "
                "(DeferredBatchNorm.convert(layer)) before the next step"
            )
    return norms


def _updates_statistics(layer: nn.Module) -> bool:
    return isinstance(layer, _BatchNorm) and layer.training and layer.track_running_stats


@contextmanager
def statistics_of_one_pass(norms: list[DeferredBatchNorm]) -> Iterator[None]:
    """Around a pass: its micro-batches' statistics, committed only if it completes.

    A failed or interrupted pass commits nothing; the next pass starts afresh.
    Each layer in training mode commits, whatever the pipe's mode (a layer
    not training accumulates nothing).
    """
    for bn in norms:
        bn.reset_accumulators()
    yield
    for bn in norms:
        bn.commit()
