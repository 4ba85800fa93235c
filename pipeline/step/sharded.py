"""FSDP2 units in a step's stages: each reduces its gradients once, after its stage's last backward.

torch's ``fully_shard`` makes a module an FSDP2 *unit*: it all-gathers its
parameters before it runs, and after each backward through it,
reduce-scatters the gradients of the unsharded parameters into the sharded
ones (``.grad`` of the parameters the optimizer holds). A step runs a
stage's backward once per micro-batch, and ``zb-h1`` splits it in two
(``backward_in_two.py``): I, whose end is where FSDP reduces, then W, which
computes the weights' gradients afterwards, so FSDP would reduce before they
exist and they would never reach the sharded parameters. Hence, for the
units of the stages run here::

    step begins         every unit: no gradient sync, no reshard after backward,
                        not the last backward (FSDPModule's own setters); no reshard
                        after forward either, unless you chose it
    F, B, I, W          the unsharded parameters' .grad sums the micro-batches
    stage j's end       its summed gradients reach .grad (gradients.py); its units
                        get their own settings back and run FSDP's post-backward:
                        one reduce-scatter per unit and step (an HSDP all-reduce too),
                        the reshard, the end of the backward
    the step fails      the units not reduced yet get their settings back and drop
                        this step's gradients (the sharded ones keep what they held)

FSDP2 has no public call for its post-backward (torch's own pipelining calls
the same internals for its ``REDUCE_GRAD`` action), nor getters for the
settings; ``missing_internals`` names those this torch lacks, so that a step
refuses FSDP2 stages on a torch where this would not hold.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, cast

from torch import Tensor, nn

from pipeline.runtime.lazy import instance_of

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule

__all__ = ["ShardedUnits", "fsdp_units", "missing_internals", "resharded_after"]

_FSDP = "torch.distributed.fsdp"  # imported by whoever shards: never here (seconds)
# What this module reads of FSDP2's state, group and parameter objects.
_STATE = (
    "_fsdp_param_groups",
    "_state_ctx",
    "_is_root",
    "_modules",
    "_auto_reshard_after_forward",
    "_root_post_backward_final_callback",
)
_GROUP = (
    "fsdp_params",
    "post_backward",
    "reduce_grads",
    "all_reduce_grads",
    "reshard_after_backward",
    "post_forward_mesh_info",
)


def fsdp_units(module: nn.Module) -> list[FSDPModule]:
    """The FSDP2 modules in ``module`` (itself included), in ``modules()`` order.

    None, at no cost, where FSDP was never imported (nothing can be sharded).
    """
    if _FSDP not in sys.modules:
        return []
    return [cast("FSDPModule", m) for m in module.modules() if instance_of(m, _FSDP, "FSDPModule")]


def missing_internals(units: Iterable[FSDPModule]) -> list[str]:
    """What a step reads of FSDP2 and this torch's units lack (empty if nothing)."""
    missing: set[str] = set()
    for unit in units:
        state = getattr(unit, "_get_fsdp_state", lambda: None)()
        if state is None:
            missing.add("FSDPModule._get_fsdp_state")
            continue
        missing |= {f"FSDPState.{name}" for name in _STATE if not hasattr(state, name)}
        if not hasattr(getattr(state, "_state_ctx", None), "is_last_backward"):
            missing.add("FSDPStateContext.is_last_backward")
        for group in getattr(state, "_fsdp_param_groups", ()):
            missing |= {f"FSDPParamGroup.{name}" for name in _GROUP if not hasattr(group, name)}
    return sorted(missing)


class _Unit:
    """One FSDP2 state (the modules of one ``fully_shard`` call) and its saved settings."""

    __slots__ = ("groups", "module", "saved", "state")

    def __init__(self, module: FSDPModule) -> None:
        self.module = module
        self.state: Any = module._get_fsdp_state()
        self.groups: list[Any] = list(self.state._fsdp_param_groups)
        self.saved: list[tuple[bool, bool, bool, Any]] = []

    def defer(self) -> None:
        """Keep the gradients unreduced and the parameters unsharded until ``reduce``.

        Unsharded after each forward too, unless ``reshard_after_forward`` was
        chosen (``fully_shard``'s argument, ``set_reshard_after_forward``):
        left to FSDP, a unit under a root would gather its parameters again
        for every micro-batch's forward and backward.
        """
        self.saved = [
            (g.reduce_grads, g.all_reduce_grads, g.reshard_after_backward, g.post_forward_mesh_info)
            for g in self.groups
        ]
        self.module.set_requires_gradient_sync(False, recurse=False)
        self.module.set_reshard_after_backward(False, recurse=False)
        if self.state._auto_reshard_after_forward:
            for group in self.groups:
                group.post_forward_mesh_info = None

    def restore(self) -> None:
        """The settings ``defer`` found (a root's own: FSDP keeps a root gathered after forward)."""
        for group, (reduce, all_reduce, reshard, forward) in zip(
            self.groups, self.saved, strict=True
        ):
            group.reduce_grads, group.all_reduce_grads = reduce, all_reduce
            group.reshard_after_backward = reshard
            if not self.state._is_root:
                group.post_forward_mesh_info = forward

    def unsharded(self) -> list[Tensor]:
        """The parameters autograd sees while the unit runs (once it has run)."""
        return [
            p._unsharded_param
            for group in self.groups
            for p in group.fsdp_params
            if hasattr(p, "_unsharded_param")
        ]

    def post_backward(self) -> None:
        """FSDP's post-backward: the reduction (by the unit's settings) and the reshard."""
        for group in reversed(self.groups):
            group.post_backward()

    def drop(self) -> None:
        """Forget this step's unreduced gradients (FSDP keeps them for its next reduction)."""
        for group in self.groups:
            for param in group.fsdp_params:
                param.unsharded_accumulated_grad = None
                if hasattr(param, "_unsharded_param"):
                    param._unsharded_param.grad = None


class ShardedUnits:
    """The FSDP2 units of the stages a step runs here, by stage."""

    def __init__(self, partitions: Sequence[nn.Module], stages: Iterable[int]) -> None:
        self._units: dict[int, list[_Unit]] = {}
        for j in stages:
            units = _distinct(fsdp_units(partitions[j]))
            if units:
                self._units[j] = units
        self._pending: list[_Unit] = []
        self._lock = threading.Lock()  # a Pipe's stages end on their own threads
        # Per state context (shared by the units under one root once it ran), what
        # the user had set: the last backward's end is the step's, not each micro-batch's.
        self._last_backward: dict[int, tuple[Any, bool]] = {}

    @contextmanager
    def deferred(self) -> Iterator[None]:
        """Around a step's run: each unit reduces at its stage's end (``reduce``), once.

        If the step fails, the units it did not reduce drop this step's
        unreduced gradients and reshard: their settings are given back.
        """
        units = [unit for units in self._units.values() for unit in units]
        for unit in units:
            context = unit.state._state_ctx
            self._last_backward.setdefault(id(context), (context, context.is_last_backward))
        for unit in units:
            unit.defer()
            unit.state._state_ctx.is_last_backward = False
        self._pending = units
        try:
            yield
        except BaseException:
            failed = list(self._pending)
            for unit in failed:
                unit.drop()
            self._settle(failed)
            for unit in self._roots(failed):
                unit.module.reset_iter_state()  # reshards: the next forward gathers anew
            raise
        finally:
            self._settle(self._pending)
            self._pending = []

    def unsharded(self, j: int) -> list[Tensor]:
        """Stage ``j``'s unsharded parameters: their gradients are final at its end."""
        return [p for unit in self._units.get(j, ()) for p in unit.unsharded()]

    def reduce(self, j: int) -> None:
        """Stage ``j`` ended and its gradients are in ``.grad``: its units reduce them now."""
        units = self._units.get(j, [])
        if not units:
            return
        self._settle(units)
        for unit in reversed(units):
            unit.post_backward()
        for unit in self._roots(units):
            unit.state._root_post_backward_final_callback()

    def _settle(self, units: list[_Unit]) -> None:
        """Give ``units`` back what the user had set (once per unit and step)."""
        with self._lock:
            for unit in units:
                if unit in self._pending:
                    unit.restore()
                    context = unit.state._state_ctx
                    _, value = self._last_backward.get(id(context), (context, True))
                    context.is_last_backward = value
            self._pending = [unit for unit in self._pending if unit not in units]

    @staticmethod
    def _roots(units: list[_Unit]) -> list[_Unit]:
        """The units that ran as FSDP roots: each ends the backward of the units under it."""
        return [unit for unit in units if unit.state._is_root]


def _distinct(modules: list[FSDPModule]) -> list[_Unit]:
    """One ``_Unit`` per FSDP state (a ``fully_shard([a, b])`` call makes one for both)."""
    units: dict[int, _Unit] = {}
    for module in modules:
        state = module._get_fsdp_state()
        if id(state) not in units:
            units[id(state)] = _Unit(module)
    return list(units.values())


@contextmanager
def resharded_after(modules: Iterable[nn.Module]) -> Iterator[None]:
    """Within the block, a forward-only pass; after it, the FSDP2 units in ``modules`` resharded.

    A root unit keeps its parameters unsharded after a forward (FSDP expects
    the backward next); an evaluation has none, so they would stay unsharded
    and the next forward would run on them even after an optimizer step had
    changed the sharded ones.
    """
    try:
        yield
    finally:
        for module in modules:
            for unit in fsdp_units(module):
                unit.reshard()
