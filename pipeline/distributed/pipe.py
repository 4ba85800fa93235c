"""DistributedPipe: a pipeline whose stages are processes on a torch.distributed process group.

The same ``nn.Sequential`` and ``balance`` as ``pipeline.Pipe``, and the same
``step(input, target, loss_fn, schedule=...)``, but stage ``s`` runs in the
process of group rank ``s % size`` (one stage per process, or ``v`` of them
with the interleaved schedule), which keeps only the layers of its own
stages: a model built on the ``meta`` device is materialised stage by stage,
so no process ever holds the whole model. Each process runs its part of the
schedule's programs on its own thread (``pipeline/step/stage.py``, as ``Pipe.step`` does),
exchanging activations, gradients and skip tensors with the others by
point-to-point sends (``p2p.py``).

Weights tied across stages (an embedding and the output head) live in each
process that uses them, made equal at construction and kept equal by
summing each step's gradients of them over those processes, as Megatron's
embedding group does. The processes compare the arguments that must agree
(``stage_arguments.py``) when the pipe is built, and each step's before it
runs, so that a mismatch or a refusal raises on every process.

Wrapped in ``pipeline.DataParallel`` (over the replicas of the same stage),
each stage's gradients are averaged across replicas as soon as its last
backward ends: a pp x dp grid in one ``torchrun`` job.
"""

from __future__ import annotations

import itertools
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import timedelta
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from pipeline.arguments import CallStyle, CheckpointMode, LossReduction
from pipeline.distributed.agreement import camps, fingerprint, gather_rows, ranks_text, refused_text
from pipeline.distributed.p2p import P2PTransport
from pipeline.distributed.stage_arguments import StageArguments, check_alone, disagreement
from pipeline.runtime.batchnorm import DeferredBatchNorm, statistics_of_one_pass
from pipeline.runtime.microbatch import Batch, Value, check_input, gather, scatter, to_device
from pipeline.runtime.partitions import Hook, PartitionRuntime, PositionalSequential
from pipeline.runtime.process_group import collective_device, resolve_group
from pipeline.skip.layout import SkipLayout, inspect_skip_layout
from pipeline.step.actions import Program
from pipeline.step.reports import DistributedStepReport
from pipeline.step.runner import StepRun, checkpointed_tasks, loss_scales
from pipeline.step.schedules import Schedule, resolve_schedule
from pipeline.step.simulate import Simulation, validate

__all__ = ["DistributedPipe"]

# Long enough for a slow step; a stalled or dead peer fails the others after it.
DEFAULT_TIMEOUT_S = 300.0
# For the message group's blocking receives, which wait between steps too.
_NEVER = timedelta(days=365)
_LOSS_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


class DistributedPipe(nn.Module):
    """One process's stages of a pipeline over the processes of ``group``.

    Every process of ``group`` builds it with the same module and balance,
    and every process of the job builds its own at the same point (each
    pipeline makes process groups of its own, which is collective)::

        dist.init_process_group("gloo")       # torchrun sets the environment
        pipe = DistributedPipe(model, balance=[3, 3], chunks=8)
        loss = pipe.step(x, y, F.cross_entropy, schedule="1f1b")  # every process
        optimizer.step()                       # over pipe.parameters(): this stage's

    Args:
        module: the whole ``nn.Sequential`` (on the ``meta`` device, or any).
            This process keeps the layers of its stages, moved to ``device``;
            layers on ``meta`` get storage there and their modules'
            ``reset_parameters`` (children first); a module holding tensors
            on ``meta`` without one is refused.
        balance: layers per stage; ``len(balance)`` must be a multiple of the
            group's size (stage ``s`` runs in group rank ``s % size``).
        group: the processes of one pipeline (default: the default group).
        device: this process's device (default: the current CUDA device with
            NCCL, else the CPU).
        chunks, checkpoint, deferred_batch_norm, call_style: as ``Pipe``'s.
        timeout: seconds an action waits for a message before it fails,
            naming the peer (a stalled or dead process).
    """

    def __init__(
        self,
        module: nn.Sequential,
        balance: Sequence[int] | None = None,
        *,
        group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
        chunks: int = 1,
        checkpoint: CheckpointMode = "except_last",
        deferred_batch_norm: bool = False,
        call_style: CallStyle = "tuple",
        timeout: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        super().__init__()
        self.group = resolve_group(group)
        self.size = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        arguments, pipelines = self._agree_to_build(
            module, balance, chunks, checkpoint, call_style, deferred_batch_norm, device, timeout
        )
        self.balance = arguments.balance
        self.chunks = arguments.chunks
        self.checkpoint = arguments.checkpoint
        self.call_style = arguments.call_style
        n = len(self.balance)
        self.owner = [s % self.size for s in range(n)]
        self.local_stages = [s for s in range(n) if self.owner[s] == self.rank]
        if deferred_batch_norm:
            DeferredBatchNorm.convert(module)
        layers = OrderedDict((name, layer) for name, layer in module._modules.items() if layer)
        sequential = PositionalSequential if call_style == "positional" else nn.Sequential
        every = _partitions(layers, self.balance, sequential)
        self.skip_layout = inspect_skip_layout(every, [self.device] * n)
        tied = _tied_parameters(every, self.owner)
        self.partitions = [
            _materialized(p, self.device) if self.owner[s] == self.rank else nn.Sequential()
            for s, p in enumerate(every)
        ]
        for s in self.local_stages:
            for name, layer in self.partitions[s]._modules.items():
                self.add_module(name, layer)
        self._runtime = PartitionRuntime(
            self.partitions,
            [self.device] * n,
            positional=call_style == "positional",
            deferred_batch_norm=deferred_batch_norm,
        )
        self._deferred_batch_norms = [m for m in self.modules() if isinstance(m, DeferredBatchNorm)]
        self._ties = self._resolve_ties(tied, pipelines)
        self._tied_stages = {
            s
            for s in self.local_stages
            for occurrences in tied.values()
            for o in occurrences
            if any(stage == s for stage, _ in o)
        }
        self._synchronize_ties()
        peers = _peers(self.local_stages, self.owner, self.skip_layout)
        self._transport = P2PTransport(
            self.group, _wire_groups(pipelines), self.owner, peers, [self.device] * n, timeout
        )
        self._finalizer = weakref.finalize(self, self._transport.close)
        self._completion_hooks: OrderedDict[int, Hook] = OrderedDict()
        self._validated: dict[tuple[str, int], tuple[list[Program], Simulation]] = {}
        self.last_step: DistributedStepReport | None = None

    def _agree_to_build(
        self,
        module: nn.Sequential,
        balance: Sequence[int] | None,
        chunks: int,
        checkpoint: CheckpointMode,
        call_style: CallStyle,
        deferred_batch_norm: bool,
        device: torch.device | str | None,
        timeout: float,
    ) -> tuple[StageArguments, list[list[int]]]:
        """The arguments, once every process of the job agrees to build; and every pipeline.

        What one process can check alone is checked first but raised only
        after the comparison, in which the others would otherwise wait: every
        process of the job raises, or none does, before anything is built.
        """
        refusal: Exception | None = None
        arguments: StageArguments | None = None
        try:
            arguments = check_alone(
                module, balance, chunks, checkpoint, call_style, deferred_batch_norm, self.size
            )
            if not timeout > 0:
                raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
            self.device = (
                torch.device(device) if device is not None else collective_device(self.group)
            )
            _meta_resets(module)  # every process refuses a model it could not materialise
        except Exception as error:
            refusal, arguments = error, None
        # Every process compares, a refusing one too: the others wait for it.
        disagreed = disagreement(module, arguments, self.group)
        problem = refusal or disagreed
        pipelines, stopped = _every_pipeline(self.group, refused=problem is not None)
        if problem is not None:
            raise problem
        if stopped:
            raise ValueError(
                f"the pipeline of (global) ranks {stopped} refused its arguments (its processes' "
                "errors say why); no pipeline of the job was built"
            )
        assert arguments is not None, "built with no refusal and no disagreement"
        return arguments, pipelines

    # Training

    def step(
        self,
        input: Value | None,
        target: Value | None,
        loss_fn: Callable[[Value, Value], Tensor],
        *,
        schedule: str | Schedule = "1f1b",
        loss_reduction: LossReduction = "mean",
        return_outputs: bool = False,
    ) -> Tensor | tuple[Tensor, Value | None]:
        """Run a training step over every process; see ``Pipe.step``.

        Every process of the group calls it. ``input`` is needed only where
        stage 0 runs and ``target`` only where the last stage runs (pass
        ``None`` elsewhere). Each process's gradients accumulate into its own
        parameters' ``.grad``; the loss is returned on every process, on its
        device (and the output, with ``return_outputs``, where the last stage
        runs, ``None`` elsewhere).
        """
        first, last = 0 in self.local_stages, len(self.balance) - 1 in self.local_stages
        # A refusal is raised only after the agreement, which the other
        # processes would otherwise wait in until their group's timeout.
        refusal: Exception | None = None
        chosen: Schedule | None = None
        batches: list[Batch] = []
        targets: list[Batch] = []
        try:
            chosen = self._check_step(loss_fn, schedule, loss_reduction)
            batches = self._scatter(input, "input", needed=first)
            targets = self._scatter(target, "target", needed=last)
        except Exception as error:
            refusal = error
        choice = None if chosen is None else f"{chosen!r} {loss_reduction}"
        rows = self._agree(batches, targets, choice, refusal)
        assert chosen is not None, "the agreement raises on every process if one refused"
        programs, simulation = self._programs(chosen, len(rows))
        scales = loss_scales(rows, loss_reduction)
        run = StepRun(
            self._runtime,
            self.skip_layout,
            batches,
            targets,
            loss_fn,
            scales,
            checkpointed_tasks(programs, len(rows), self.checkpoint, self.training),
            [self._stage_done],
            keep_outputs=return_outputs,
            transport=self._transport,
            stages=self.local_stages,
        )

        def run_here() -> None:
            self._transport.begin_step()
            run.run_here(programs[self.rank])
            self._transport.end_step()

        with statistics_of_one_pass(self._deferred_batch_norms, self.training):
            self._summing_tied_gradients(run_here)
        self.last_step = DistributedStepReport(
            chosen, simulation, run.peak_in_flight, self._transport.received()
        )
        loss = self._loss_everywhere(run.loss() if last else None)
        if not return_outputs:
            return loss
        return loss, gather(run.outputs) if last else None

    def _check_step(self, loss_fn: Any, schedule: str | Schedule, loss_reduction: Any) -> Schedule:
        """The step's schedule, once this process's own arguments pass (as far as it can tell)."""
        if not self._finalizer.alive:
            raise RuntimeError("this DistributedPipe is closed; create a new one to train")
        if not torch.is_grad_enabled() or torch.is_inference_mode_enabled():
            raise RuntimeError(
                "DistributedPipe.step computes gradients, but grad mode is off here "
                "(torch.no_grad() or inference mode)"
            )
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable(output, target), got {loss_fn!r}")
        if loss_reduction not in ("mean", "sum"):
            raise ValueError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")
        chosen = resolve_schedule(schedule)
        workers = chosen.workers(len(self.balance))
        if workers != self.size:
            raise ValueError(
                f"{chosen!r} runs {len(self.balance)} stages on {workers} workers, but the "
                f"group has {self.size} processes: use a schedule with one worker per process"
            )
        return chosen

    def _scatter(self, value: Value | None, what: str, needed: bool) -> list[Batch]:
        if not needed:
            return []
        if value is None:
            raise ValueError(
                f"this process runs stage {0 if what == 'input' else len(self.balance) - 1}, "
                f"so its step() needs the {what}; pass it here (other processes may pass None)"
            )
        check_input(value)
        return scatter(to_device(value, self.device), self.chunks)

    def _agree(
        self,
        batches: list[Batch],
        targets: list[Batch],
        choice: str | None,
        refusal: Exception | None,
    ) -> list[int]:
        """The micro-batches' sizes, as stage 0's process split them, known to every process.

        Before any work: if a process refused its arguments, every process
        raises (that one its own error); so does every process if they chose
        different schedules, or if the target and the input split differently.
        """
        m = self.chunks
        # Every process's row has 2 + 2 (m + 1) entries, m being the chunks
        # that every process agreed on when the pipe was built
        # (stage_arguments.py): the rows cannot differ in length, which would
        # make gloo abort a process.
        row = [int(refusal is not None), 0 if choice is None else fingerprint(choice)]
        for split in (batches, targets):
            row += [len(split), *(b.rows() for b in split), *[0] * (m - len(split))]
        rows = gather_rows(row, self.group)
        if refusal is not None:
            raise refusal
        refused = [r for r, theirs in enumerate(rows) if theirs[0]]
        if refused:
            raise ValueError(
                f"{refused_text(refused)} of the pipeline refused this step's arguments (its "
                "error says why); no process ran anything"
            )
        choices = camps([theirs[1] for theirs in rows])
        if len(choices) > 1:
            raise ValueError(
                "the processes of the pipeline chose different schedules or loss reductions for "
                f"this step: {ranks_text(choices)} chose differently (this process, rank "
                f"{self.rank}: {choice}); every process must call step() with the same ones"
            )
        input_rows = _split_sizes(rows[self.owner[0]][2:])
        target_rows = _split_sizes(rows[self.owner[-1]][3 + m :])
        if input_rows != target_rows:
            raise ValueError(
                f"the target splits into micro-batches of {target_rows} rows but the input into "
                f"{input_rows}: give the target the input's batch size (dim 0)"
            )
        return input_rows

    def _programs(self, schedule: Schedule, m: int) -> tuple[list[Program], Simulation]:
        key = (repr(schedule), m)
        found = self._validated.get(key)
        if found is None:
            programs = schedule.programs(m, len(self.balance))
            found = self._validated[key] = (programs, validate(programs, m, len(self.balance)))
        return found

    def _resolve_ties(
        self, tied: dict[tuple[int, ...], list[list[tuple[int, str]]]], pipelines: list[list[int]]
    ) -> dict[tuple[int, ...], tuple[dist.ProcessGroup, list[nn.Parameter]]]:
        """This process's tied parameters, by the processes holding them, with their group."""
        groups = _tie_groups(pipelines, list(tied), self.rank)
        found = {}
        for holders, subgroup in groups.items():
            params = []
            for occurrences in tied[holders]:
                stage, name = next((s, n) for s, n in occurrences if s in self.local_stages)
                params.append(self.partitions[stage].get_parameter(name))
            found[holders] = (subgroup, params)
        return found

    def _stage_done(self, j: int) -> None:
        # A stage with tied weights is final only once their gradients are
        # summed over the processes that hold them, after the step.
        if j not in self._tied_stages:
            for hook in self._completion_hooks.values():
                hook(j)

    def _summing_tied_gradients(self, run_step: Callable[[], None]) -> None:
        """Run the step, then sum its gradients of tied weights over the processes holding them.

        Only this step's: ``.grad`` may hold earlier steps' too (gradient
        accumulation, ``DataParallel.no_sync``), summed when they were made;
        summing them again would count them once more per holder. They are
        set aside while the step runs and get the sum added in place, so
        that ``.grad`` stays the tensor it was (``DataParallel`` with
        ``gradient_as_bucket_view`` made it a view into its bucket). A step
        that fails leaves them as they were.
        """
        params = [p for _, tied in self._ties.values() for p in tied]
        earlier = [p.grad for p in params]
        for param in params:
            param.grad = None
        try:
            run_step()
            for group, tied in self._ties.values():
                for param in tied:
                    fresh = param.grad if param.grad is not None else torch.zeros_like(param)
                    dist.all_reduce(fresh, group=group)
                    param.grad = fresh
        except BaseException:
            for param, grad in zip(params, earlier, strict=True):
                param.grad = grad
            raise
        with torch.no_grad():
            for param, grad in zip(params, earlier, strict=True):
                if grad is not None:
                    param.grad = grad.add_(cast(Tensor, param.grad))
        for j in sorted(self._tied_stages):
            for hook in self._completion_hooks.values():
                hook(j)

    def _synchronize_ties(self) -> None:
        """Tied weights start equal: the first process holding them sends its values."""
        with torch.no_grad():
            for group, params in self._ties.values():
                for param in params:
                    dist.broadcast(param, group=group, group_src=0)

    def _loss_everywhere(self, total: Tensor | None) -> Tensor:
        """The step's loss, sent by the last stage's process to the others, in its dtype."""
        message = torch.zeros(2, dtype=torch.float64)
        if total is not None:
            message[0], message[1] = total.double(), _LOSS_DTYPES.index(total.dtype)
        message = message.to(collective_device(self.group))
        dist.broadcast(message, group=self.group, group_src=self.owner[-1])
        value, dtype = message.tolist()
        return torch.tensor(value, dtype=_LOSS_DTYPES[int(dtype)], device=self.device)

    # Module protocol

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Refused: this process holds only some stages; ``step`` runs the whole model."""
        raise RuntimeError(
            "a DistributedPipe holds only this process's stages, so it cannot be called like "
            "the model: train with pipe.step(input, target, loss_fn) on every process; to "
            "evaluate or predict, save_shard() on every process and load_shards() into the "
            "plain model or a pipeline.Pipe"
        )

    def register_partition_backward_hook(self, hook: Hook) -> RemovableHandle:
        """Call ``hook(j)`` once per step when stage ``j`` (one of this process's) is final."""
        handle = RemovableHandle(self._completion_hooks)
        self._completion_hooks[handle.id] = hook
        return handle

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        """Load this process's layers from a whole model's state dict (other keys are skipped).

        ``strict`` still requires every key of this process's layers.
        """
        own = set(self.state_dict())
        mine = OrderedDict((k, v) for k, v in state_dict.items() if k in own)
        return super().load_state_dict(mine, strict=strict, assign=assign)

    def close(self) -> None:
        """Stop listening to the peers (garbage collection and exit do it otherwise)."""
        self._finalizer()

    def __iter__(self) -> Iterator[nn.Module]:
        for s in self.local_stages:
            yield from self.partitions[s]


def _split_sizes(split: list[int]) -> list[int]:
    """The micro-batches' sizes in an agreement row's part ``[count, size, size, ...]``."""
    return split[1 : 1 + split[0]]


def _partitions(
    layers: OrderedDict[str, nn.Module], balance: list[int], sequential: type[nn.Sequential]
) -> list[nn.Sequential]:
    items = list(layers.items())
    bounds = [sum(balance[:j]) for j in range(len(balance) + 1)]
    return [sequential(OrderedDict(items[a:b])) for a, b in itertools.pairwise(bounds)]


def _materialized(partition: nn.Sequential, device: torch.device) -> nn.Sequential:
    """``partition`` on ``device``; layers on ``meta`` get storage and their initial values.

    Every module with tensors on ``meta`` (its own or its children's) is
    reset by its ``reset_parameters`` (or ``_reset_parameters``, as
    ``nn.MultiheadAttention`` names it), children before their parents, so
    that a parent's own initialisation of its children wins; layers not on
    ``meta`` keep their values. A module holding tensors on ``meta`` with
    neither method is refused: its values would be whatever the new storage
    held.
    """
    resets = _meta_resets(partition)
    partition._apply(lambda t: torch.empty_like(t, device=device) if t.is_meta else t.to(device))
    with torch.no_grad():
        for reset in reversed(resets):
            reset()
    return partition


def _meta_resets(module: nn.Module) -> list[Callable[[], None]]:
    """The resets that give ``module``'s tensors on ``meta`` values, parents first.

    Raises ``ValueError`` for a module holding tensors on ``meta`` without one.
    """
    resets = []
    for name, child in module.named_modules():
        reset = _reset_of(child)
        if reset is None and any(t.is_meta for t in _tensors(child, recurse=False)):
            raise ValueError(
                f"layer {name} ({type(child).__name__}) holds tensors on the meta device but "
                "has no reset_parameters() to give them values after materialisation: give it "
                "one, or build the model on a real device"
            )
        if reset is not None and any(t.is_meta for t in _tensors(child, recurse=True)):
            resets.append(reset)
    return resets


def _tensors(module: nn.Module, recurse: bool) -> list[Tensor]:
    return [*module.parameters(recurse=recurse), *module.buffers(recurse=recurse)]


def _reset_of(module: nn.Module) -> Callable[[], None] | None:
    for name in ("reset_parameters", "_reset_parameters"):
        reset = getattr(module, name, None)
        if callable(reset):
            return cast(Callable[[], None], reset)
    return None


def _tied_parameters(
    partitions: list[nn.Sequential], owner: list[int]
) -> dict[tuple[int, ...], list[list[tuple[int, str]]]]:
    """Parameters used by stages of different processes, by the processes holding them.

    Each parameter is listed as its (stage, name) occurrences, in registration
    order: the same in every process, which builds the whole module.
    """
    occurrences: dict[int, list[tuple[int, str]]] = {}
    for s, partition in enumerate(partitions):
        for name, param in partition.named_parameters(remove_duplicate=False):
            occurrences.setdefault(id(param), []).append((s, name))
    tied: dict[tuple[int, ...], list[list[tuple[int, str]]]] = {}
    for found in occurrences.values():
        holders = tuple(sorted({owner[s] for s, _ in found}))
        if len(holders) > 1:
            tied.setdefault(holders, []).append(found)
    return tied


def _tie_groups(
    pipelines: list[list[int]], ties: list[tuple[int, ...]], rank: int
) -> dict[tuple[int, ...], dist.ProcessGroup]:
    """A process group per set of tied processes; those this process belongs to.

    ``new_subgroups_by_enumeration`` is collective over the whole job, so the
    groups of the other pipeline replicas are made too.
    """
    found: dict[tuple[int, ...], dist.ProcessGroup] = {}
    for holders in ties:
        enumeration = [[ranks[h] for h in holders] for ranks in pipelines]
        subgroup, _ = dist.new_subgroups_by_enumeration(enumeration)
        if rank in holders:
            assert subgroup is not None, "every process is in one of the enumerated groups"
            found[holders] = subgroup
    return found


def _wire_groups(pipelines: list[list[int]]) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """Two groups of this pipeline's processes for its messages alone, one per direction.

    Each process listens to its peers with a blocking receive between steps
    too, for as long as the pipeline lives; a receive that times out closes
    the connection (gloo), so these groups never time out and must not be
    the user's, whose collectives keep their own timeout. A stalled peer is
    caught by the transport's own ``timeout`` instead.
    """
    wires = []
    for _ in ("down", "up"):
        wire, _ = dist.new_subgroups_by_enumeration(pipelines, timeout=_NEVER)
        assert wire is not None, "every process is in one of the pipelines"
        wires.append(cast(dist.ProcessGroup, wire))
    return wires[0], wires[1]


def _every_pipeline(
    group: dist.ProcessGroup, refused: bool
) -> tuple[list[list[int]], list[int] | None]:
    """The global ranks of every pipeline (a process group like ``group``) in the job.

    A collective over the whole job: every process builds its pipeline
    together. Also the global ranks of a pipeline that ``refused`` to be
    built (a process of it says so), or None: then none is built.
    """
    device = collective_device(group)
    ranks = dist.get_process_group_ranks(group)
    mine = torch.tensor([*ranks, int(refused)], dtype=torch.int64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    rows = [[int(v) for v in t.tolist()] for t in gathered]
    stopped = next((row[:-1] for row in rows if row[-1]), None)
    return [list(p) for p in sorted({tuple(row[:-1]) for row in rows})], stopped


def _peers(local: list[int], owner: list[int], layout: SkipLayout) -> set[int]:
    """The processes this one exchanges messages with: neighbours, and skip partners."""
    n = len(owner)
    peers = {owner[t] for s in local for t in (s - 1, s + 1) if 0 <= t < n}
    for route in layout.routes():
        if owner[route.source] in {owner[s] for s in local}:
            peers.add(owner[route.target])
        if owner[route.target] in {owner[s] for s in local}:
            peers.add(owner[route.source])
    return peers
