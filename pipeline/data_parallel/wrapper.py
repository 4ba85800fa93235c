"""DataParallel: one model replica per process, gradients averaged by bucketed all-reduce."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import record_function

from pipeline.data_parallel.buckets import SignalsPartitionBackward, partition_of_each
from pipeline.data_parallel.reducer import Reducer
from pipeline.data_parallel.replicas import broadcast_from_rank0, check_replicas_match
from pipeline.runtime.buffers import updated_buffers
from pipeline.runtime.module_hooks import call_hook_kinds
from pipeline.runtime.process_group import resolve_group
from pipeline.step.sharded import fsdp_units


@runtime_checkable
class ChecksBeforeSteps(Protocol):
    """A module whose ``step`` runs a wrapper's checks among its own, before any work, and
    over a pipeline of processes inside the step's agreement (``PipeBase.checked_before_step``)."""

    def checked_before_step(
        self,
        check: Callable[[], None],
        ready: Callable[[], None] | None = None,
        replicas: dist.ProcessGroup | None = None,
    ) -> AbstractContextManager[None]:
        """Within the block, each step runs ``check`` among its own checks, then ``ready``
        once they all passed; a refusal is told over ``replicas``."""
        ...


class DataParallel(nn.Module):
    """Data parallelism across replicas of a model (typically a pipeline.Pipe), one per process.

    Every process wraps an identical model; each forward sees that process's
    share of the batch, and after `backward()` every replica's `.grad` holds
    the gradient averaged over all processes, so identical optimizer steps
    keep the replicas equal. Gradients are reduced in buckets while the
    backward pass is still running.

    Args:
        module: the replica. If it implements `register_partition_backward_hook`
            (pipeline.Pipe does), a partition's buckets are reduced as soon as
            the pipeline signals that the partition's gradients are final;
            otherwise each parameter is ready when its gradient is accumulated.
        process_group: the group to average over (default: the default group).
        bucket_cap_mb: size of a gradient bucket in MiB.
        first_bucket_mb: size of the first bucket in MiB, small so that
            communication starts early in the backward pass.
        broadcast_buffers: broadcast rank 0's buffers before each forward that
            records a graph (outside `no_sync`).
        find_unused_parameters: allow parameters that get no gradient in a step;
            their buckets are completed with zeros, and a parameter no rank used
            keeps its `.grad` untouched.
        gradient_as_bucket_view: make each `.grad` a view into its bucket,
            saving one copy of the gradients in memory.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        process_group: dist.ProcessGroup | None = None,
        bucket_cap_mb: float = 25,
        first_bucket_mb: float = 1,
        broadcast_buffers: bool = True,
        find_unused_parameters: bool = False,
        gradient_as_bucket_view: bool = False,
    ) -> None:
        super().__init__()
        named_params = _validate(module, bucket_cap_mb, first_bucket_mb)
        group = resolve_group(process_group)
        # Most options decide the bucket layout (caps, usage flags) or which
        # collectives a forward issues (buffer broadcasts); a rank that differs
        # in any of them was set up by mistake, so all must agree, like the model.
        options = {
            "bucket_cap_mb": bucket_cap_mb,
            "first_bucket_mb": first_bucket_mb,
            "broadcast_buffers": broadcast_buffers,
            "find_unused_parameters": find_unused_parameters,
            "gradient_as_bucket_view": gradient_as_bucket_view,
        }
        check_replicas_match(module, options, group)
        with record_function("dp.broadcast_state"):
            broadcast_from_rank0(
                [*module.parameters(), *module.buffers()], group, "parameters and buffers"
            )

        self.module = module
        self.process_group = group
        self.broadcast_buffers = broadcast_buffers
        self._synced_buffers = list(module.buffers())
        # The parameters when wrapped: the buckets hold these, and average
        # none of those frozen then.
        self._wrapped = list(module.named_parameters())
        averaged = {id(p) for _, p in named_params}
        self._frozen = [(n, p) for n, p in self._wrapped if id(p) not in averaged]
        self._sync = True
        self._find_unused = find_unused_parameters
        partitions = partition_of_each(module, [p for _, p in named_params])
        self.reducer = Reducer(
            named_params,
            partitions,
            group,
            cap_bytes=int(bucket_cap_mb * 2**20),
            first_cap_bytes=int(first_bucket_mb * 2**20),
            find_unused=find_unused_parameters,
            as_view=gradient_as_bucket_view,
        )
        if isinstance(module, SignalsPartitionBackward):
            module.register_partition_backward_hook(self.reducer.on_partition_done)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the replica; when it records a graph, its backward will average gradients."""
        records_graph = torch.is_grad_enabled()
        if records_graph and self._sync:
            self._check_parameters_and_buffers()
            self.reducer.prepare_for_forward()
        if records_graph and self._sync and self.broadcast_buffers:
            self._broadcast_buffers()
        output = self.module(*args, **kwargs)
        if records_graph and self._sync:
            self.reducer.prepare_for_backward(output)
        elif records_graph:
            self.reducer.disarm()
        return output

    def step(self, *args: Any, **kwargs: Any) -> Any:
        """Run the replica's own training step (``Pipe.step``) and average its gradients.

        Each partition's buckets are all-reduced as soon as the Pipe's workers
        finish that partition's last backward (or weight-gradient) action,
        while other partitions still compute; the averages are in ``.grad``
        when this returns::

            loss = model.step(x, y, nn.functional.cross_entropy, schedule="1f1b")
            optimizer.step()
        """
        step = getattr(self.module, "step", None)
        if not (callable(step) and isinstance(self.module, SignalsPartitionBackward)):
            raise TypeError(
                f"DataParallel.step runs the wrapped module's step(); "
                f"{type(self.module).__name__} has none (pipeline.Pipe does): call "
                "model(x) and loss.backward() instead"
            )
        kinds = call_hook_kinds(self)
        if kinds:
            raise ValueError(
                f"DataParallel has {' and '.join(kinds)} registered on itself, which run around "
                "its forward, but DataParallel.step runs the wrapped module's step without "
                "calling it, so they would not run: register them on the layers, or remove them "
                "first"
            )
        # Checked by the module's step, with its own checks: over a DistributedPipe a
        # refusal in one process then fails every process of the pipeline at once.
        # Its buffers are broadcast once they pass too: a refused step changes nothing.
        checked: AbstractContextManager[None] = nullcontext()
        broadcast = self._broadcast_buffers if self._sync and self.broadcast_buffers else None
        if self._sync:
            self._synced_buffers = list(self.module.buffers())
            if isinstance(self.module, ChecksBeforeSteps):
                checked = self.module.checked_before_step(
                    self._checks_before_step, broadcast, self.process_group
                )
                broadcast = None
            else:
                self._checks_before_step()
        if broadcast is not None:
            broadcast()
        if self._sync:
            self.reducer.prepare_for_step()
        else:
            self.reducer.disarm()
        try:
            with checked:
                result = step(*args, **kwargs)
        except BaseException:
            if self._sync:
                self.reducer.step_failed()
            raise
        if self._sync:
            self.reducer.finish_step()
        if self._sync and self.broadcast_buffers:
            self._share_updated_buffers()
        return result

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError(
            "DataParallel cannot be copied or pickled: it holds its process group and the "
            "buckets it all-reduces; copy or save the module it wraps (dp.module), and wrap "
            "the copy again"
        )

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Within this context, backward accumulates gradients locally without communicating.

        The first backward after the context averages everything accumulated.
        """
        previous = self._sync
        self._sync = False
        try:
            yield
        finally:
            self._sync = previous

    def _check_parameters_and_buffers(self) -> None:
        """Refuse parameters that are not those wrapped; take replaced buffers anew (``.to()``
        replaces them, unlike parameters): they are broadcast as they are now."""
        self._check_parameters()
        self._synced_buffers = list(self.module.buffers())

    def _check_parameters(self) -> None:
        """Refuse parameters that are not those wrapped, or not trained as when wrapped.

        A parameter replaced, added or removed since wrapping, or frozen then
        and requiring grad now, would keep each replica's own gradient (DDP's
        too), and the replicas would drift apart. One trained then and frozen
        now gets no gradient, which only ``find_unused_parameters=True`` lets
        a step leave unreduced.
        """
        now = list(self.module.named_parameters())
        name = _first_changed(now, self._wrapped)
        if name is not None:
            raise RuntimeError(
                f"DataParallel: parameter '{name}' is not the one DataParallel was built with "
                f"(replaced, added or removed since: {len(self._wrapped)} parameters then, "
                f"{len(now)} now), so its gradients would not be averaged and the replicas "
                "would drift apart; change parameters in place (param.data.copy_, "
                "load_state_dict), or wrap the model again"
            )
        unfrozen = [name for name, p in self._frozen if p.requires_grad]
        if unfrozen:
            raise RuntimeError(
                f"DataParallel: parameter '{unfrozen[0]}' requires grad now but did not when "
                "DataParallel was built, so its gradients would not be averaged and the "
                "replicas would drift apart; set requires_grad before wrapping (or wrap again)"
            )
        then = {name for name, _ in self._frozen}
        frozen = [name for name, p in self._wrapped if not p.requires_grad and name not in then]
        if frozen and not self._find_unused:
            raise RuntimeError(
                f"DataParallel: parameter '{frozen[0]}' was trained when DataParallel was built "
                "and is frozen now (requires_grad=False), so it gets no gradient to average; "
                "pass find_unused_parameters=True to let a step leave parameters without one, "
                "or wrap the model again"
            )

    def _checks_before_step(self) -> None:
        # In the module's checks: over a DistributedPipe, every process refuses at once.
        self.reducer.check_in_step()
        self._check_parameters()

    def share_rank0_buffers(self) -> None:
        """Copy rank 0's buffers to every replica now (collective over the replicas): what
        the next synced forward would do. ``save_checkpoint`` calls it, so that a
        checkpoint taken after ``dp(x)`` and its backward, while each replica still holds
        the statistics of its own rows, keeps what the next step would have used. Not
        between a forward and its backward, which reads what BatchNorm saved."""
        if self.broadcast_buffers and not self.reducer.awaits_backward:
            self._synced_buffers = list(self.module.buffers())
            self._broadcast_buffers()

    def _broadcast_buffers(self) -> None:
        if self._synced_buffers:
            with record_function("dp.broadcast_buffers"):
                broadcast_from_rank0(self._synced_buffers, self.process_group, "buffers")

    def _share_updated_buffers(self) -> None:
        """Rank 0's values of the buffers the step just updated from each replica's rows
        (BatchNorm's statistics), on every replica: a checkpoint or an evaluation before the
        next step sees one model, not a replica's own. (Not after a forward: its backward
        reads the statistics BatchNorm saved, which a copy into them would change.)"""
        updated = updated_buffers(self.module)
        if updated:
            with record_function("dp.broadcast_buffers"):
                broadcast_from_rank0(updated, self.process_group, "updated buffers")


def _first_changed(
    now: list[tuple[str, nn.Parameter]], then: list[tuple[str, nn.Parameter]]
) -> str | None:
    """The name of the first parameter not the same object in ``now`` as in ``then``."""
    for (name, ours), (_, theirs) in zip(now, then, strict=False):
        if ours is not theirs:
            return name
    if len(now) == len(then):
        return None
    return (now if len(now) > len(then) else then)[min(len(now), len(then))][0]


def _validate(
    module: nn.Module, bucket_cap_mb: float, first_bucket_mb: float
) -> list[tuple[str, nn.Parameter]]:
    """Reject bad arguments before any communication; return the trainable parameters."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"DataParallel wraps an nn.Module, got {type(module).__name__}")
    for name, value in (("bucket_cap_mb", bucket_cap_mb), ("first_bucket_mb", first_bucket_mb)):
        if not value > 0:
            raise ValueError(f"{name} must be a positive number of MiB, got {value!r}")
    for name, sub in module.named_modules():
        if getattr(sub, "sparse", False) is True:
            raise ValueError(
                f"DataParallel averages dense gradients only, but '{name}' "
                f"({type(sub).__name__}) produces sparse ones; construct it with sparse=False"
            )
    _refuse_fsdp(module)
    named_params = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
    if not named_params and not isinstance(module, SignalsPartitionBackward):
        raise ValueError(
            f"DataParallel: the {type(module).__name__} has no parameters that require grad, "
            "so there are no gradients to average; train it without DataParallel or "
            "unfreeze some parameters"
        )
    return named_params


def _refuse_fsdp(module: nn.Module) -> None:
    """Refuse FSDP2 units: they reduce their gradients over their own mesh, and DataParallel's
    broadcast and all-reduce would see their shards as whole parameters."""
    units = fsdp_units(module)
    if units:
        names = {id(m): name or "the module itself" for name, m in module.named_modules()}
        raise ValueError(
            f"DataParallel cannot replicate a module sharded with FSDP2 (fully_shard): "
            f"{len(units)} of its modules are FSDP2 units ('{names[id(units[0])]}' first), "
            "and FSDP already reduces their gradients over its mesh. "
            "Leave DataParallel out; to replicate the shards as well, give fully_shard an "
            "HSDP mesh (a 2-D mesh of replicate x shard dimensions)"
        )
