"""Stages sharded with FSDP2: what a shard holds, what its collectives cost, the sharding.

Planned with ``mesh=`` (``pipeline.plan``), a ``DistributedPipe`` runs on
the mesh's "pp" dimension and each of its stages is sharded over the "dp"
dimension as docs/distributed_pipe.md's recipe shards it
(``shard_stages``): an FSDP2 unit per layer that holds parameters, under a
root unit per stage. Each data-parallel replica steps on its own batch of
``batch_size`` rows. What that changes in a stage, per step
(``pipeline/step/sharded.py``: the units stay gathered from their first
forward to the stage's end, and reduce once there)::

    memory       parameters    each one's shard: dim 0 padded to a multiple of
                               the shards, as FSDP2 pads it (buffers whole)
                 gathered      the units' unsharded parameters, from the first
                               forward to the stage's end
                 gradients     the unsharded ones summed over the micro-batches,
                               and the shard the reduce-scatter writes beside them
                 optimizer     the state of the shard alone
    time         all-gather    one per unit, inside the stage's first forward
                 reduce-scatter  one per unit, inside its last action

Each collective costs ``latency + bytes x seconds per byte`` (bytes of the
whole unit), measured on the "dp" group (``measure_collectives``); the
activations are the unsharded stage's, for the replica's micro-batches.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor, nn

from pipeline.plan.agreement import from_rank_zero, largest
from pipeline.plan.links import LARGE_BYTES, SMALL_BYTES, Link
from pipeline.plan.memory import LayerParameters, TensorBytes, by_layer
from pipeline.runtime.process_group import collective_device

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from pipeline.distributed import DistributedPipe

__all__ = [
    "Collectives",
    "LayerCollectives",
    "Sharding",
    "layer_collectives",
    "mesh_dimensions",
    "refuse_unshardable",
    "shard_bytes",
    "shard_stages",
    "sharded_parameters",
    "stage_collectives",
]


# Per layer: the seconds of its unit's all-gather, and of its reduce-scatter, in a step.
LayerCollectives = tuple[tuple[float, ...], tuple[float, ...]]


# The least runs of each size timed: a message's latency on a loaded machine is noisy.
_LEAST_RUNS = 5


@dataclass(frozen=True)
class Collectives:
    """What a unit's all-gather (its parameters) and reduce-scatter (its gradients) cost."""

    gather: Link
    reduce: Link


@dataclass(frozen=True)
class Sharding:
    """Stages sharded over ``mesh``'s "dp" dimension, whose collectives cost ``collectives``."""

    mesh: DeviceMesh
    collectives: Collectives

    @property
    def shards(self) -> int:
        return int(self.mesh["dp"].size())


def mesh_dimensions(mesh: DeviceMesh, processes: int | None) -> tuple[int, int]:
    """The pipeline's processes and the shards of a ``(dp, pp)`` mesh, checked.

    Raises ValueError for a mesh without exactly the dimensions "dp" and
    "pp", or ``processes`` that is not its "pp" size.
    """
    names = tuple(mesh.mesh_dim_names or ())
    if sorted(names) != ["dp", "pp"]:
        raise ValueError(
            f"mesh= needs two dimensions named 'dp' and 'pp' (the stages shard over 'dp', the "
            f"pipeline runs on 'pp'), got {names or 'no names'}: make it with "
            "init_device_mesh(device, (dp, pp), mesh_dim_names=('dp', 'pp'))"
        )
    stages, shards = int(mesh["pp"].size()), int(mesh["dp"].size())
    if processes is not None and processes != stages:
        raise ValueError(
            f"processes={processes} but the mesh's 'pp' dimension has {stages} processes: "
            "leave processes out (the mesh gives it), or pass the same"
        )
    return stages, shards


def refuse_unshardable(model: nn.Sequential) -> None:
    """Refuse, before any work, a model whose layers the recipe cannot shard: a parameter
    held by two layers (a weight tied across processes is not supported with sharded
    stages, docs/distributed_pipe.md), a 0-dimensional one, or a layer of two dtypes
    (``fully_shard`` refuses both, in the processes holding them alone)."""
    first: dict[int, int] = {}
    for index, layer in enumerate(model):
        params = list(layer.parameters())
        dtypes = sorted({str(p.dtype) for p in params})
        if len(dtypes) > 1:
            raise ValueError(
                f"layer {index} ({type(layer).__name__}) holds parameters of {len(dtypes)} "
                f"dtypes ({', '.join(dtypes)}), which an FSDP2 unit cannot gather together: "
                "give them one dtype to plan with mesh="
            )
        for param in params:
            if param.dim() == 0:
                raise ValueError(
                    f"layer {index} ({type(layer).__name__}) holds a 0-dimensional parameter, "
                    "which fully_shard does not shard: make it of shape (1,) to plan with mesh="
                )
            held = first.setdefault(id(param), index)
            if held != index:
                raise ValueError(
                    f"layers {held} and {index} hold one parameter (of shape "
                    f"{tuple(param.shape)}), a weight that some balances would tie across "
                    "processes, which a DistributedPipe whose stages are sharded with FSDP2 "
                    "does not support yet: untie it to plan with mesh=, or plan the pipeline "
                    "alone (processes=N) and replicate it with pipeline.DataParallel"
                )


def shard_bytes(tensor: Tensor, shards: int) -> int:
    """Bytes of one shard of ``tensor``: dim 0 split ``shards`` ways, rounded up as FSDP2
    pads it (every rank's shard takes that storage).

    >>> shard_bytes(torch.zeros(7, 5, dtype=torch.float64), 2)
    160
    """
    if tensor.dim() == 0:
        return tensor.element_size()
    rows = -(-tensor.shape[0] // shards)
    return rows * (tensor.numel() // max(tensor.shape[0], 1)) * tensor.element_size()


def sharded_parameters(
    model: nn.Sequential, optimizer_bytes_per_param: int, shards: int
) -> LayerParameters:
    """Each layer's terms with its parameters sharded ``shards`` ways: shards and whole
    buffers, gathered parameters, unsharded gradients and their shards, the optimizer's
    state of the shards."""

    def terms(tensor: Tensor) -> TensorBytes:
        if not isinstance(tensor, nn.Parameter):
            return TensorBytes(tensor.numel() * tensor.element_size(), 0, 0)
        shard = shard_bytes(tensor, shards)
        # Gathered whole into a buffer of every shard's padded size, as FSDP2 gathers it.
        if not tensor.requires_grad:
            return TensorBytes(shard, 0, 0, shard * shards)
        whole = tensor.numel() * tensor.element_size()
        optimizer = shard // tensor.element_size() * optimizer_bytes_per_param
        return TensorBytes(shard, whole + shard, optimizer, shard * shards)

    return by_layer(model, terms)


def layer_collectives(model: nn.Sequential, collectives: Collectives) -> LayerCollectives:
    """Per layer, the seconds of its unit's all-gather and reduce-scatter in a step (none for
    a layer without parameters of its own, which is no unit)."""
    seen: set[int] = set()
    gather, reduce = [], []
    for layer in model:
        fresh = [p for p in layer.parameters() if id(p) not in seen]
        seen.update(id(p) for p in fresh)
        whole = sum(p.numel() * p.element_size() for p in fresh)
        learnt = sum(p.numel() * p.element_size() for p in fresh if p.requires_grad)
        gather.append(collectives.gather.seconds(whole) if whole else 0.0)
        reduce.append(collectives.reduce.seconds(learnt) if learnt else 0.0)
    return tuple(gather), tuple(reduce)


def measure_collectives(pipeline: dist.ProcessGroup, mesh: DeviceMesh, repeats: int) -> Collectives:
    """The "dp" group's all-gather and reduce-scatter (a collective of every process of
    ``mesh``): each the median of ``repeats`` (at least ``_LEAST_RUNS``) of a ``SMALL_BYTES``
    collective as its latency, the fastest of a ``LARGE_BYTES`` one over the fastest small
    one, per byte of the whole tensor, for its bytes; the largest over the ``pipeline``
    group's, so the same everywhere."""
    group = mesh["dp"].get_group()
    runs = max(repeats, _LEAST_RUNS)
    numbers: list[float] = []
    for collective in (_all_gather, _reduce_scatter):
        small = _timed(group, collective, SMALL_BYTES, runs)
        large = _timed(group, collective, LARGE_BYTES, runs)

        def measured(small: list[float] = small, large: list[float] = large) -> list[float]:
            extra = max(min(large) - min(small), 0.0)
            return [statistics.median(small), extra / (LARGE_BYTES - SMALL_BYTES)]

        numbers += [largest(pipeline, v) for v in from_rank_zero(group, 2, measured)]
    return Collectives(Link(numbers[0], numbers[1]), Link(numbers[2], numbers[3]))


def _all_gather(group: dist.ProcessGroup, whole: Tensor) -> None:
    # torch 2.13 names FSDP2's collectives so; older ones, as before.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(whole, whole[: whole.numel() // dist.get_world_size(group)].clone(), group=group)


def _reduce_scatter(group: dist.ProcessGroup, whole: Tensor) -> None:
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    shard = torch.empty_like(whole[: whole.numel() // dist.get_world_size(group)])
    scatter(shard, whole, group=group)


def _timed(
    group: dist.ProcessGroup,
    collective: Callable[[dist.ProcessGroup, Tensor], None],
    nbytes: int,
    repeats: int,
) -> list[float]:
    """Seconds of ``repeats`` runs of ``collective`` over a tensor of ``nbytes`` (whole), after
    one that warms up."""
    shards = dist.get_world_size(group)
    whole = torch.zeros(-(-nbytes // shards) * shards, dtype=torch.uint8,
                        device=collective_device(group))  # fmt: skip
    times = []
    for run in range(repeats + 1):
        start = time.perf_counter()
        collective(group, whole)
        if run:
            times.append(time.perf_counter() - start)
    return times


def shard_stages(pipe: DistributedPipe, mesh: DeviceMesh) -> None:
    """Shard this process's stages of ``pipe`` over ``mesh`` (1-D) as the recipe does: a unit
    per layer holding parameters, then a root unit per stage."""
    from torch.distributed.fsdp import fully_shard

    for s in pipe.local_stages:
        for layer in pipe.partitions[s]:
            if any(True for _ in layer.parameters()):
                fully_shard(layer, mesh=mesh)
        fully_shard(pipe.partitions[s], mesh=mesh)


def stage_collectives(
    per_layer: LayerCollectives | None, spans: Sequence[tuple[int, int]]
) -> list[tuple[float, float]] | None:
    """Per stage of layers ``spans``: the seconds of its units' all-gathers and reduce-scatters."""
    if per_layer is None:
        return None
    gather, reduce = per_layer
    return [(sum(gather[a:b]), sum(reduce[a:b])) for a, b in spans]
