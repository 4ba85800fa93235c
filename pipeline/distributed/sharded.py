"""Stages sharded by torch's own FSDP2 or tensor parallelism: what a step refuses.

The recipe (docs/distributed_pipe.md): build the ``DistributedPipe`` on the
pp dimension of a ``DeviceMesh``, then apply ``fully_shard`` and/or
``parallelize_module`` to this process's stage modules (``pipe.partitions[s]``
and the layers in them) before the first step. The step engine reduces each
FSDP2 unit once per step (``pipeline/step/sharded.py``). This module refuses,
on every process and before any work (the step's agreement), what it could
not make equal to the plain model:

- an FSDP2 unit holding modules of several stages (``fully_shard`` on the
  pipe, or one call over two partitions): its reduction must wait for its
  stage's last backward;
- a weight tied across processes whose parameter ``fully_shard`` or
  ``parallelize_module`` replaced after the pipe was built: the pipe sums the
  gradients of the tensor it found at construction;
- a torch whose FSDP2 lacks what the step reads of it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from torch import nn
from torch.distributed.fsdp import FSDPModule

from pipeline.step.sharded import fsdp_units, missing_internals

__all__ = ["check_sharding"]

_RECIPE = (
    "shard each stage on its own: fully_shard(layer, mesh=mesh['dp']) for the layers of "
    "pipe.partitions[s], then fully_shard(pipe.partitions[s], mesh=mesh['dp']) if you like, "
    "for each stage s of this process (docs/distributed_pipe.md, 'Sharded stages')"
)


def check_sharding(
    pipe: nn.Module,
    partitions: Sequence[nn.Module],
    stages: Iterable[int],
    tied: Iterable[nn.Parameter],
) -> None:
    """Refuse a step or evaluation over stages sharded in a way it would get wrong."""
    stages = list(stages)
    if isinstance(pipe, FSDPModule):
        raise ValueError(
            f"fully_shard was applied to the {type(pipe).__name__} itself, which holds several "
            "stages: FSDP would reduce their gradients together, before the later stages' "
            f"backwards have run; {_RECIPE}"
        )
    _check_units_within_stages(partitions, stages)
    missing = missing_internals(u for s in stages for u in fsdp_units(partitions[s]))
    if missing:
        raise RuntimeError(
            f"DistributedPipe.step defers each FSDP2 unit's gradient reduction to its stage's "
            f"last backward through FSDP's internals, and this torch's FSDP lacks "
            f"{', '.join(missing)}: a step would reduce each micro-batch's gradients apart "
            "(zb-h1's not at all). Use a torch version this release supports, or a stage "
            "replicated with pipeline.DataParallel instead of fully_shard"
        )
    _check_ties_kept(partitions, stages, tied)


def _check_units_within_stages(partitions: Sequence[nn.Module], stages: list[int]) -> None:
    """Every FSDP2 unit of this process's stages lies within one stage."""
    stage_of: dict[int, int] = {}
    for s in stages:
        for module in partitions[s].modules():
            stage_of.setdefault(id(module), s)
    for s in stages:
        for unit in fsdp_units(partitions[s]):
            modules = getattr(unit._get_fsdp_state(), "_modules", (unit,))
            spans = sorted({stage_of.get(id(m), -1) for m in modules})
            if spans != [s]:
                where = ", ".join(f"stage {t}" if t >= 0 else "elsewhere" for t in spans)
                raise ValueError(
                    f"one fully_shard call holds modules of {where}: FSDP reduces a unit's "
                    "gradients together, which must wait for its stage's last backward; "
                    f"{_RECIPE}"
                )


def _check_ties_kept(
    partitions: Sequence[nn.Module], stages: list[int], tied: Iterable[nn.Parameter]
) -> None:
    """Every weight tied across processes is still the parameter its stage registers."""
    held = {
        id(p) for s in stages for _, p in partitions[s].named_parameters(remove_duplicate=False)
    }
    replaced = [p for p in tied if id(p) not in held]
    if replaced:
        shape = tuple(replaced[0].shape)
        raise ValueError(
            f"{len(replaced)} weight(s) tied across processes (the first of shape {shape}) "
            "were replaced after the DistributedPipe was built, by fully_shard or "
            "parallelize_module: the pipe sums the gradients of the tied parameters it found "
            "at construction, which the layers no longer use. Weights tied across processes "
            "cannot be sharded yet: leave the layers holding them unsharded (shard the others), "
            "or untie them"
        )
