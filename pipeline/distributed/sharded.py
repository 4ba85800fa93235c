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
- a trainable parameter outside every FSDP2 unit in a process whose stages
  have units, or processes of which some shard their stages and some do not
  (``sharding_kind``, agreed with the step's arguments): that parameter's
  gradient would be its replica's alone, never averaged with the others';
- a weight tied across processes whose parameter ``fully_shard`` or
  ``parallelize_module`` replaced after the pipe was built: the pipe sums the
  gradients of the tensor it found at construction;
- a weight tied between stages of one process (interleaved) that they
  replaced stage by stage: each stage then trains a copy of its own;
- a module that a split model's captured code reads without calling it, in
  a sharded stage: FSDP2's gathering and reduction follow module calls;
- a torch whose FSDP2 lacks what the step reads of it.

FSDP2 shards parameters, not buffers: each replica of a stage keeps whole
buffers, and a layer that updates its own in training (BatchNorm's running
statistics) updates them from its replica's share of the batch, so the
replicas' statistics drift apart. After each step, ``share_first_replicas_buffers``
gives them the first replica's, as ``DataParallel``'s ``broadcast_buffers``
does (``docs/distributed_pipe.md``).

Sharded stages run collectives with other pipelines' processes (FSDP2's
over "dp", tensor parallelism's over "tp"), which the pipeline's own
agreement does not reach. So a refusal in one process is told over those
groups too (``told_over``), before any work: a pipeline that went on would
wait in a collective its peer never starts, or, worse, meet the peer's next
step's and compute with it, silently. And once a step failed midway, the
peers' collectives may still wait for this process's: its later steps would
meet them, and are refused (``DistributedPipe``'s ``_refuse_if_stranded``).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, cast

import torch.distributed as dist
from torch import nn

from pipeline.data_parallel.replicas import broadcast_from_rank0
from pipeline.runtime.agreement import gather_rows, refusal_texts
from pipeline.runtime.buffers import updated_buffers, updated_in_forward
from pipeline.runtime.layers import modules_only_read
from pipeline.runtime.lazy import instance_of
from pipeline.step.sharded import fsdp_units, missing_internals

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FSDPModule

__all__ = [
    "check_sharding",
    "local_ties",
    "sharding_groups",
    "sharding_kind",
    "share_first_replicas_buffers",
    "told_over",
    "unit_layout",
]

_RECIPE = (
    "shard each stage on its own: fully_shard(layer, mesh=mesh['dp']) for the layers of "
    "pipe.partitions[s], then fully_shard(pipe.partitions[s], mesh=mesh['dp']) if you like, "
    "for each stage s of this process (docs/distributed_pipe.md, 'Sharded stages')"
)


def local_ties(
    partitions: Sequence[nn.Module], stages: Iterable[int]
) -> list[list[tuple[int, str]]]:
    """The parameters that several of ``stages`` use, each as its (stage, name) uses."""
    uses: dict[int, list[tuple[int, str]]] = {}
    for s in stages:
        for name, param in partitions[s].named_parameters(remove_duplicate=False):
            uses.setdefault(id(param), []).append((s, name))
    return [found for found in uses.values() if len({s for s, _ in found}) > 1]


def check_sharding(
    pipe: nn.Module,
    partitions: Sequence[nn.Module],
    stages: Iterable[int],
    tied: Iterable[nn.Parameter],
    ties_here: Sequence[Sequence[tuple[int, str]]] = (),
    training: bool = True,
) -> None:
    """Refuse a step (``training``) or evaluation over stages sharded in a way it would get
    wrong."""
    stages = list(stages)
    if instance_of(pipe, "torch.distributed.fsdp", "FSDPModule"):
        raise ValueError(
            f"fully_shard was applied to the {type(pipe).__name__} itself, which holds several "
            "stages: FSDP would reduce their gradients together, before the later stages' "
            f"backwards have run; {_RECIPE}"
        )
    units = {s: fsdp_units(partitions[s]) for s in stages}
    if any(units.values()):
        _check_units(partitions, units)
        if training:  # an evaluation runs in eval mode: it updates no buffer
            _check_updated_buffers_shared(partitions, units)
    _check_ties_kept(partitions, stages, tied)
    _check_ties_here_kept(partitions, ties_here)


def _check_ties_here_kept(
    partitions: Sequence[nn.Module], ties_here: Sequence[Sequence[tuple[int, str]]]
) -> None:
    """Every weight tied between this process's stages (``local_ties`` at construction) is
    still one parameter."""
    for uses in ties_here:
        held = [
            dict(partitions[s].named_parameters(remove_duplicate=False)).get(n) for s, n in uses
        ]
        if any(p is not held[0] for p in held[1:]):
            names = ", ".join(f"'{n}' of stage {s}" for s, n in uses)
            raise ValueError(
                f"a weight tied between stages of this process ({names}) is no longer one "
                "parameter: fully_shard or parallelize_module made a copy of it per stage, "
                "and each stage would train its own. Weights tied between stages cannot be "
                "sharded yet: untie it, or leave these stages unsharded (with tensor "
                "parallelism, the layers holding it out of parallelize_module)"
            )


def _check_units(partitions: Sequence[nn.Module], units: dict[int, list[FSDPModule]]) -> None:
    """This process's FSDP2 units: FSDP as the step reads it, each within a stage, covering all."""
    missing = missing_internals(u for found in units.values() for u in found)
    if missing:
        raise RuntimeError(
            f"DistributedPipe.step defers each FSDP2 unit's gradient reduction to its stage's "
            f"last backward through FSDP's internals, and this torch's FSDP lacks "
            f"{', '.join(missing)}: a step would reduce each micro-batch's gradients apart "
            "(zb-h1's not at all). Use a torch version this release supports, or a stage "
            "replicated with pipeline.DataParallel instead of fully_shard"
        )
    _check_units_within_stages(partitions, units)
    _check_all_sharded(partitions, units)
    _check_none_only_read(partitions, units)


def _check_updated_buffers_shared(
    partitions: Sequence[nn.Module], units: dict[int, list[FSDPModule]]
) -> None:
    """A stage whose layers update buffers in training has units that tell its replicas'
    mesh: their parameters' (``share_first_replicas_buffers`` broadcasts over it)."""
    for s, found in units.items():
        training = any(
            m.training and updated_in_forward(m) is not None for m in partitions[s].modules()
        )
        if found and training and not _meshes(found):
            raise ValueError(
                f"stage {s} has layers that update buffers in training (BatchNorm's running "
                "statistics), which each replica updates from its own rows, and FSDP2 units "
                "that hold no parameter: nothing tells over which mesh its replicas lie, to "
                "give them the first replica's statistics after a step, and they would drift "
                "apart. Give the stage a unit with a parameter (BatchNorm's own affine "
                "parameters will do), or keep those layers in eval mode"
            )


def _check_units_within_stages(
    partitions: Sequence[nn.Module], units: dict[int, list[FSDPModule]]
) -> None:
    """Every FSDP2 unit of this process's stages lies within one stage."""
    stage_of: dict[int, int] = {}
    for s in units:
        for module in partitions[s].modules():
            stage_of.setdefault(id(module), s)
    for s, found in units.items():
        for unit in found:
            spans = sorted({stage_of.get(id(m), -1) for m in _modules_of(unit)})
            if spans != [s]:
                where = ", ".join(f"stage {t}" if t >= 0 else "elsewhere" for t in spans)
                raise ValueError(
                    f"one fully_shard call holds modules of {where}: FSDP reduces a unit's "
                    "gradients together, which must wait for its stage's last backward; "
                    f"{_RECIPE}"
                )


def sharding_groups(
    partitions: Sequence[nn.Module], stages: Iterable[int]
) -> list[dist.ProcessGroup]:
    """The groups the parameters of ``stages`` are sharded over (each dimension of their
    DTensors' meshes), in one order that every process takes: by their ranks."""
    found: dict[tuple[int, ...], dist.ProcessGroup] = {}
    for s in stages:
        for param in partitions[s].parameters():
            mesh = getattr(param, "device_mesh", None)
            if mesh is None or not instance_of(param, "torch.distributed.tensor", "DTensor"):
                continue
            for dim in range(mesh.ndim):
                group = mesh.get_group(dim)
                found.setdefault(tuple(dist.get_process_group_ranks(group)), group)
    return [found[ranks] for ranks in sorted(found, key=lambda ranks: (len(ranks), ranks))]


_SHARDING = "another pipeline that shards these stages with this one (FSDP2, tensor parallelism)"


def share_first_replicas_buffers(partitions: Sequence[nn.Module], stages: Iterable[int]) -> None:
    """Give the buffers that layers of this process's FSDP2-sharded stages update in training
    (``updated_buffers``) the values of the stages' first replica, on every replica.

    Over each dimension of the units' mesh, last first, from the rank first
    in it: a replica then holds, at each dimension, what the first held once
    the later dimensions were done, so every one ends with the first's.
    """
    for s in stages:
        units = fsdp_units(partitions[s])
        buffers = updated_buffers(partitions[s])
        if not units or not buffers:
            continue
        for mesh in _meshes(units):
            for dim in reversed(range(mesh.ndim)):
                broadcast_from_rank0(
                    buffers, mesh.get_group(dim), f"stage {s}'s buffers", who="DistributedPipe"
                )


def _meshes(units: Iterable[FSDPModule]) -> list[DeviceMesh]:
    """The meshes the units' parameters are sharded over, each once, in one order for all."""
    found: dict[tuple[int, ...], DeviceMesh] = {}
    for unit in units:
        for param in cast(nn.Module, unit).parameters():
            mesh = getattr(param, "device_mesh", None)
            if mesh is not None:
                found.setdefault(tuple(mesh.mesh.flatten().tolist()), mesh)
    return [found[ranks] for ranks in sorted(found)]


def told_over(
    groups: Sequence[dist.ProcessGroup],
    error: Exception | None,
    who: str = _SHARDING,
    layout: int = 0,
) -> Exception | None:
    """``error``, or one saying that a process of ``groups`` (of ``who``) refused, or that
    their ``layout``s (``unit_layout``) differ (each group a collective).

    A round over every group (in one order: no two processes wait for each
    other), two where there are several: a mesh of pipelines sharded over
    one or two more dimensions (dp, tp) then hears from every process of it.
    """
    heard = error is not None
    differs = False
    said = "" if error is None else described(error)
    for _ in range(min(len(groups), 2)):
        for group in groups:
            rows = gather_rows([int(bool(said)) + 2 * int(heard), layout], group)
            differs = differs or len({row[1] for row in rows}) > 1
            heard = any(row[0] for row in rows) or heard or differs
            if any(row[0] % 2 for row in rows):  # the refusals' texts travel, passed on
                texts = refusal_texts(said, group)  # a collective: every process calls it
                said = said or next((t for t in texts if t), "")
    if error is None and differs:
        return ValueError(
            f"this pipeline and {who} shard their stages differently (other fully_shard "
            "units, or units resharded after forward in one and not the other): FSDP2 "
            "would gather and reduce one process's unit with another's, silently; shard "
            f"every replica's stages alike: {_RECIPE}"
        )
    if error is None and heard:
        why = f"({said})" if said else "(its error says why)"
        return RuntimeError(f"a process of {who} refused this call {why}: no process ran anything")
    return error


def described(error: BaseException) -> str:
    """``ValueError: what was wrong``; the kind alone where there is no text (^C)."""
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


def unit_layout(partitions: Sequence[nn.Module], stages: Iterable[int]) -> int:
    """A digest of how ``stages`` are sharded, alike in every process that shards them with
    this one: each FSDP2 unit's place in its stage, its parameters' names and (global)
    shapes, and whether it reshards after forward."""
    described = []
    for s in stages:
        names = {id(m): name for name, m in partitions[s].named_modules()}
        for unit in fsdp_units(partitions[s]):
            module = cast(nn.Module, unit)
            # Read with care: on a torch lacking these, the step's own check refuses, after
            # this digest has travelled (a process raising here would leave its peers waiting).
            state = getattr(unit, "_get_fsdp_state", lambda: None)()
            groups = getattr(state, "_fsdp_param_groups", ())
            resharded = [getattr(g, "post_forward_mesh_info", None) is not None for g in groups]
            shapes = [(n, tuple(p.shape)) for n, p in module.named_parameters()]
            described.append((s, names.get(id(module)), shapes, resharded))
    return zlib.crc32(repr(described).encode())


def sharding_kind(partitions: Sequence[nn.Module], stages: Iterable[int]) -> str:
    """How this process's stages are sharded, as the processes of a pipeline must agree."""
    units = any(fsdp_units(partitions[s]) for s in stages)
    return "stages sharded by FSDP2" if units else "stages not sharded by FSDP2"


def _check_all_sharded(partitions: Sequence[nn.Module], units: dict[int, list[FSDPModule]]) -> None:
    """With FSDP2 units in this process's stages, every trainable parameter is in one."""
    covered = {
        id(m)
        for found in units.values()
        for unit in found
        for root in _modules_of(unit)
        for m in root.modules()
    }
    for s in units:
        for name, module in partitions[s].named_modules():
            if id(module) in covered:
                continue
            for key, param in module.named_parameters(recurse=False):
                if param.requires_grad:
                    where = f"{name}.{key}" if name else key
                    raise ValueError(
                        f"stage {s}'s parameter {where!r} is in no FSDP2 unit while other "
                        "parameters of this process's stages are: its gradient would be this "
                        f"replica's alone, never averaged with the other replicas'; {_RECIPE}"
                    )


def _check_none_only_read(
    partitions: Sequence[nn.Module], units: dict[int, list[FSDPModule]]
) -> None:
    """No sharded stage has a trainable module that its split pieces' captured code only reads.

    FSDP2 gathers and reduces a module's parameters around the module's own
    calls; captured code reads the tensors without calling it, and such weights
    trained wrong, silently (an embedding and a head under a root unit).
    """
    for s in units:
        read = modules_only_read(partitions[s].children())
        for name, module in partitions[s].named_modules():
            trained = any(p.requires_grad for p in module.parameters(recurse=False))
            if id(module) in read and trained:
                raise ValueError(
                    f"stage {s}'s module {name!r} ({type(module).__name__}) is read by the "
                    "split model's captured code, not called, so FSDP2 cannot gather and "
                    "reduce its parameters around a call: give pipeline.split a point at that "
                    "module (points=[...]) so that it runs as itself, then shard it "
                    "(docs/distributed_pipe.md, 'Sharded stages')"
                )


def _check_ties_kept(
    partitions: Sequence[nn.Module], stages: list[int], tied: Iterable[nn.Parameter]
) -> None:
    """Every weight tied across processes is still the parameter its stage registers."""
    tied = list(tied)
    if not tied:
        return
    held = {
        id(p) for s in stages for _, p in partitions[s].named_parameters(remove_duplicate=False)
    }
    replaced = [p for p in tied if id(p) not in held]
    if replaced:
        shape = tuple(replaced[0].shape)
        raise ValueError(
            f"{len(replaced)} weight(s) tied across processes (the first of shape {shape}) "
            "were replaced after the DistributedPipe was built (untied by assigning a new "
            "parameter, or sharded by fully_shard or parallelize_module): the pipe sums the "
            "gradients of the tied parameters it found at construction, which the layers no "
            "longer use. To untie them, build a new DistributedPipe from the untied model. "
            "Weights tied across processes cannot be sharded yet: leave the layers holding "
            "them out of parallelize_module (with fully_shard, every stage must be sharded: "
            "replicate the stages with pipeline.DataParallel instead)"
        )


def _modules_of(unit: FSDPModule) -> tuple[nn.Module, ...]:
    """The modules of the ``fully_shard`` call that made ``unit`` (itself, or a list)."""
    modules: tuple[nn.Module, ...] = unit._get_fsdp_state()._modules
    return modules
