"""DistributedPipe stages sharded by torch's FSDP2 and tensor parallelism, in 4 gloo processes.

Started by tests/gloo_groups.py's run_group with ``script=sharded_scenarios.py``
and ``world_size=4``. A (dp=2, pp=2) mesh for FSDP2, a (pp=2, tp=2) mesh for
tensor parallelism; each case trains the pipe and the plain model side by
side in float64: two accumulated steps, an evaluation, an optimizer step,
then the next case, so that a case that goes wrong shows in every later one.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from pipeline import DataParallel, Pipe, plan, split
from pipeline.arguments import CheckpointMode
from pipeline.distributed import DistributedPipe, load_checkpoint, save_checkpoint
from pipeline.plan import PlanError
from pipeline.schedules import Interleaved1F1B, Programs, Schedule
from tests.distributed.checkpoint_scenarios import (
    MLPS,
    SAVED_AFTER,
    Uninterrupted,
    adamw,
    assert_resumes,
    each_process_alone,
    grid,
    refused_untouched,
    shared_directory,
    train,
    uninterrupted,
)
from tests.gloo_groups import (
    assert_same_buffers,
    calls_counted,
    expect_error,
    main,
    rank,
    scenario,
)

WIDTH = 6
ROWS = 8  # per step and replica: 4 micro-batches of 2 rows
COLLECTIVES = ("reduce_scatter_single", "all_gather_single", "all_reduce")

# Zero-bubble's split with every weight gradient after every input gradient on stage 0.
LATE_WEIGHTS = Programs(
    [
        "0F0 0F1 0F2 0F3 0I3 0I2 0I1 0I0 0W0 0W1 0W2 0W3",
        "1F0 1F1 1F2 1F3 1I3 1W3 1I2 1W2 1I1 1W1 1I0 1W0",
    ]
)


@functools.cache
def fsdp_mesh() -> DeviceMesh:
    """Ranks 0, 1 and 2, 3 are the pipelines; 0, 2 and 1, 3 shard the same stage."""
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))


@functools.cache
def tp_mesh() -> DeviceMesh:
    """Ranks 0, 2 and 1, 3 are the pipelines; 0, 1 and 2, 3 split each stage's layers."""
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))


def blocks(count: int, dropout: float = 0.0) -> nn.Sequential:
    torch.manual_seed(0)
    layers = [
        nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Dropout(dropout)) for _ in range(count)
    ]
    return nn.Sequential(*layers).double()


def mlps(count: int) -> nn.Sequential:
    torch.manual_seed(0)
    layers = [
        nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.Tanh(), nn.Linear(2 * WIDTH, WIDTH))
        for _ in range(count)
    ]
    return nn.Sequential(*layers).double()


def shard_layers(pipe: DistributedPipe, mesh: DeviceMesh, nested: bool = False) -> int:
    """fully_shard on each layer of this process's stages (and each stage, if nested).

    Returns the units holding parameters (a stage over sharded layers holds none).
    """
    units = 0
    for s in pipe.local_stages:
        for layer in pipe.partitions[s]:
            fully_shard(layer, mesh=mesh)
            units += 1
        if nested:
            fully_shard(pipe.partitions[s], mesh=mesh)
    return units


def split_layers(pipe: DistributedPipe) -> None:
    """Megatron's MLP split over the tp dimension, on each layer of this process's stages."""
    plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
    for s in pipe.local_stages:
        for layer in pipe.partitions[s]:
            parallelize_module(layer, tp_mesh()["tp"], plan)


def full(tensor: Tensor) -> Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


@dataclass
class Case:
    schedule: str | Schedule
    checkpoint: CheckpointMode = "except_last"
    divided: bool = False  # a 'sum' loss and a loss_divisor
    scaled: bool = False  # a ShardedGradScaler
    measured: bool = False  # measure_memory=True


class SideBySide:
    """A pipe and the plain model, trained alike; ``replicas`` data-parallel copies of the pipe."""

    def __init__(self, pipe: DistributedPipe, plain: nn.Module, replica: int, replicas: int):
        self.pipe, self.plain = pipe, plain
        self.replica, self.replicas = replica, replicas
        self.optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1)
        self.plain_optimizer = torch.optim.SGD(plain.parameters(), lr=0.1)
        self.generator = torch.Generator().manual_seed(3)

    def batch(self) -> tuple[Tensor, Tensor]:
        """The whole batch, the same on every process."""
        rows = ROWS * self.replicas
        x = torch.randn(rows, WIDTH, generator=self.generator, dtype=torch.double)
        return x, torch.randn(rows, WIDTH, generator=self.generator, dtype=torch.double)

    def mine(self, tensor: Tensor) -> Tensor:
        return tensor[self.replica * ROWS : (self.replica + 1) * ROWS]

    def run(self, case: Case, counts: list[dict[str, int]] | None = None) -> None:
        """Two accumulated steps, an evaluation, an optimizer step; each equal to the plain's."""
        self.pipe.checkpoint = case.checkpoint
        self.optimizer.zero_grad()
        self.plain_optimizer.zero_grad()
        scaler = ShardedGradScaler("cpu", init_scale=2.0**10) if case.scaled else None
        for _ in range(2):
            x, y = self.batch()
            with counting(counts):
                self.pipe_step(case, x, y, scaler)
            F.mse_loss(self.plain(x), y).backward()
        if scaler is not None:
            scaler.unscale_(self.optimizer)
        self.assert_grads(case)
        x, y = self.batch()
        loss, out = self.pipe.evaluate(self.mine(x), self.mine(y), F.mse_loss, return_outputs=True)
        with torch.no_grad():
            plain_out = self.plain(self.mine(x))
            expected = F.mse_loss(plain_out, self.mine(y))
        torch.testing.assert_close(loss, expected, msg=f"{case}: the evaluated loss")
        # The last stage's processes: every micro-batch's rows (a tensor-parallel last
        # layer's outputs have no memory of their own, and micro-batch 0's alone came back).
        if out is not None:
            torch.testing.assert_close(out, plain_out, msg=f"{case}: the evaluated output")
        if scaler is None:
            self.optimizer.step()
        else:
            scaler.step(self.optimizer)
        self.plain_optimizer.step()
        self.assert_parameters(case)

    def pipe_step(
        self, case: Case, x: Tensor, y: Tensor, scaler: ShardedGradScaler | None = None
    ) -> None:
        x, y = self.mine(x), self.mine(y)
        options: dict[str, Any] = {"schedule": case.schedule, "grad_scaler": scaler}
        options["measure_memory"] = case.measured
        loss_fn: Callable[[Tensor, Tensor], Tensor] = F.mse_loss
        if case.divided:
            # The replicas' gradients are averaged: each divides by the whole batch's
            # count over the number of replicas.
            options.update(loss_reduction="sum", loss_divisor=x.numel() * self.replicas)
            options["loss_divisor"] /= self.replicas
            loss_fn = functools.partial(F.mse_loss, reduction="sum")
        self.pipe.step(x, y, loss_fn, **options)

    def assert_grads(self, case: Case) -> None:
        reference = dict(self.plain.named_parameters())
        names = []
        for name, param in self.pipe.named_parameters():
            assert param.grad is not None, f"{case}: {name} has no gradient"
            grad = full(param.grad)
            torch.testing.assert_close(grad, reference[name].grad, msg=f"{case}: {name}")
            names.append(name)
        assert names, "this process holds no parameter"

    def assert_parameters(self, case: Case) -> None:
        reference = dict(self.plain.named_parameters())
        for name, param in self.pipe.named_parameters():
            assert isinstance(param, DTensor), f"{case}: {name} is left unsharded"
            torch.testing.assert_close(full(param.detach()), reference[name], msg=name)


@contextlib.contextmanager
def counting(counts: list[dict[str, int]] | None) -> Iterator[None]:
    """Count torch.distributed's calls of ``COLLECTIVES`` in the block, into a new entry."""
    if counts is None:
        yield
        return
    with calls_counted(COLLECTIVES) as count:
        try:
            yield
        finally:
            counts.append(count)


def fsdp_side_by_side(
    model: nn.Sequential, balance: list[int], nested: bool = False
) -> tuple[SideBySide, int]:
    mesh = fsdp_mesh()
    group = mesh["pp"].get_group()
    pipe = DistributedPipe(copy.deepcopy(model), balance, chunks=4, group=group)
    units = shard_layers(pipe, mesh["dp"], nested)
    replica = mesh["dp"].get_local_rank()
    return SideBySide(pipe, model, replica, replicas=2), units


def assert_once_per_step(counts: list[dict[str, int]], what: Case, **expected: int) -> None:
    """Each step made ``expected`` calls of each collective (none that is not named)."""
    expected = dict.fromkeys(COLLECTIVES, 0) | expected
    for count in counts:
        assert count == expected, f"{what}: {count} collectives in a step, expected {expected}"


@scenario
def fsdp_stages_equal_the_plain_model_in_every_schedule() -> None:
    side, units = fsdp_side_by_side(blocks(4), [2, 2])
    cases = [
        Case("gpipe"),
        Case("1f1b"),
        Case("zb-h1"),
        Case(LATE_WEIGHTS, "always"),
        Case("zb-h1", "always"),
        Case("1f1b", "never", divided=True),
        Case("zb-h1", scaled=True),
    ]
    for case in cases:
        counts: list[dict[str, int]] = []
        side.run(case, counts)
        # Each unit reduce-scatters once and all-gathers once (a root unit keeps them).
        assert_once_per_step(counts, case, reduce_scatter_single=units, all_gather_single=units)
    assert_activations_unsharded(side)
    # A step that fails midway strands the pipe: another pipeline's collectives may wait
    # for this one's (where it did not fail, or failed elsewhere), and a next step's would
    # meet them. Its later calls are refused before any collective, on every process.
    x, y = side.batch()
    expect_error(
        Exception,
        lambda: side.pipe.step(side.mine(x), side.mine(y), failing(), schedule="1f1b"),
        "a loss that fails",
    )
    for call in (lambda: side.pipe.step(x, y, F.mse_loss), lambda: side.pipe.evaluate(x)):
        expect_error(RuntimeError, call, "failed midway", "resume it from a checkpoint")
    side.pipe.close()


def assert_activations_unsharded(side: SideBySide) -> None:
    """``measure_memory`` counts a sharded stage's activations alone, as a Pipe's stage.

    It failed on the sharded parameters' storages, then counted the gathered ones."""
    x, y = side.batch()
    x, y = side.mine(x), side.mine(y)
    pipe = Pipe(copy.deepcopy(side.plain), list(side.pipe.balance), devices=["cpu"] * 2,
                chunks=side.pipe.chunks)  # fmt: skip
    for schedule in ["1f1b", "zb-h1"]:
        side.pipe.step(x, y, F.mse_loss, schedule=schedule, measure_memory=True)
        pipe.step(x, y, F.mse_loss, schedule=schedule, measure_memory=True)
        assert pipe.last_step is not None and side.pipe.last_step is not None
        expected = {p.partition: p.peak_activation_bytes for p in pipe.last_step.partitions}
        for measured in side.pipe.last_step.partitions:
            assert measured.peak_activation_bytes == expected[measured.partition], schedule
    pipe.close()
    side.optimizer.zero_grad()


def failing() -> Any:
    """A loss that raises on its third micro-batch."""
    calls = [0]

    def loss(output: Tensor, target: Tensor) -> Tensor:
        calls[0] += 1
        if calls[0] == 3:
            raise ValueError("a loss that fails")
        return F.mse_loss(output, target)

    return loss


@scenario
def nested_fsdp_units_equal_the_plain_model() -> None:
    # torchtitan's layout: each layer a unit, and the stage the root over them.
    # The layer units, under a root, stay gathered from their first forward to their
    # stage's end; a unit chosen to reshard after forward gathers again for backwards.
    side, units = fsdp_side_by_side(blocks(4), [2, 2], nested=True)
    for case in [Case("zb-h1"), Case("1f1b", "always"), Case("gpipe", "never")]:
        counts: list[dict[str, int]] = []
        side.run(case, counts)
        assert_once_per_step(counts, case, reduce_scatter_single=units, all_gather_single=units)
    chosen = cast(FSDPModule, side.pipe.partitions[side.pipe.local_stages[0]][0])
    chosen.set_reshard_after_forward(True)
    for case in [Case("1f1b"), Case("zb-h1")]:
        counts = []
        side.run(case, counts)
        for count in counts:
            assert count["reduce_scatter_single"] == units, f"{case}: {count}"
            assert count["all_gather_single"] > units, f"{case}: {count}, the choice ignored"
    side.pipe.close()


@scenario
def interleaved_fsdp_stages_equal_the_plain_model() -> None:
    side, units = fsdp_side_by_side(blocks(4), [1, 1, 1, 1])
    interleaved = Interleaved1F1B(virtual=2)
    for case in [Case(interleaved), Case(interleaved, "always")]:
        counts: list[dict[str, int]] = []
        side.run(case, counts)
        assert_once_per_step(counts, case, reduce_scatter_single=units, all_gather_single=units)
    side.pipe.close()


@scenario
def dropout_under_fsdp_is_the_unsharded_pipes() -> None:
    # The plain model draws other masks: the reference is the same pipe unsharded,
    # its replicas' gradients averaged by hand.
    mesh = fsdp_mesh()
    group, dp = mesh["pp"].get_group(), mesh["dp"].get_group()
    model = blocks(4, dropout=0.3)
    sharded = DistributedPipe(copy.deepcopy(model), [2, 2], chunks=4, group=group)
    shard_layers(sharded, mesh["dp"])
    plain = DistributedPipe(copy.deepcopy(model), [2, 2], chunks=4, group=group)
    replica = mesh["dp"].get_local_rank()
    gen = torch.Generator().manual_seed(5)
    for schedule, mode in [("zb-h1", "always"), ("1f1b", "except_last")]:
        sharded.checkpoint = plain.checkpoint = mode
        x = torch.randn(2 * ROWS, WIDTH, generator=gen, dtype=torch.double)
        y = torch.randn(2 * ROWS, WIDTH, generator=gen, dtype=torch.double)
        rows = slice(replica * ROWS, (replica + 1) * ROWS)
        for pipe in (sharded, plain):
            torch.manual_seed(7)  # each step draws its seed from the CPU generator
            pipe.step(x[rows], y[rows], F.mse_loss, schedule=schedule)
        reference = dict(plain.named_parameters())
        for name, param in sharded.named_parameters():
            expected = reference[name].grad
            assert param.grad is not None and expected is not None, name
            dist.all_reduce(expected, group=dp)
            torch.testing.assert_close(full(param.grad), expected / 2, msg=f"{schedule}: {name}")
            param.grad = None
            reference[name].grad = None
    sharded.close()
    plain.close()


@scenario
def batch_norm_statistics_of_fsdp_stages_are_the_first_replicas_on_every_replica() -> None:
    # FSDP2 leaves buffers whole on each replica, which updated them from its own rows: the
    # replicas' running statistics drifted apart (0.34 apart after a step), silently. Each
    # replica now holds the first's after a step, as DataParallel's broadcast_buffers gives:
    # the statistics of an unsharded pipe that every replica steps on the first's rows.
    hsdp = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("replicate", "shard", "pp"))
    for mesh, over, replica in [
        (fsdp_mesh(), ("dp",), "dp"),
        (hsdp, ("replicate", "shard"), "replicate"),  # over each of its two dimensions
    ]:
        rows = slice(
            mesh[replica].get_local_rank() * ROWS, (mesh[replica].get_local_rank() + 1) * ROWS
        )
        _first_replicas_statistics(mesh["pp"].get_group(), mesh[over], rows)


def _first_replicas_statistics(group: dist.ProcessGroup, shards: DeviceMesh, rows: slice) -> None:
    first = slice(0, ROWS)
    torch.manual_seed(0)
    layers = [nn.Linear(WIDTH, WIDTH), nn.BatchNorm1d(WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH)]
    model = nn.Sequential(*layers, nn.BatchNorm1d(WIDTH)).double()
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2 * ROWS, WIDTH, generator=gen, dtype=torch.double)
    y = torch.randn(2 * ROWS, WIDTH, generator=gen, dtype=torch.double)
    for deferred in (False, True):
        sharded, unsharded = (
            DistributedPipe(copy.deepcopy(model), [3, 2], chunks=4, group=group,
                            deferred_batch_norm=deferred)
            for _ in range(2)
        )  # fmt: skip
        for s in sharded.local_stages:
            fully_shard(sharded.partitions[s], mesh=shards)
        for schedule in ("1f1b", "zb-h1"):
            sharded.step(x[rows], y[rows], F.mse_loss, schedule=schedule)
            unsharded.step(x[first], y[first], F.mse_loss, schedule=schedule)
            assert_same_buffers(sharded, unsharded, f"deferred={deferred}, {schedule}")
        sharded.close()
        unsharded.close()


@scenario
def tensor_parallel_stages_equal_the_plain_model() -> None:
    mesh = tp_mesh()
    model = mlps(4)
    pipe = DistributedPipe(copy.deepcopy(model), [2, 2], chunks=4, group=mesh["pp"].get_group())
    split_layers(pipe)
    side = SideBySide(pipe, model, replica=0, replicas=1)  # every tp rank takes the whole batch
    # Measured, the meter read a saved DTensor's storage, which it has none of, and failed.
    for case in [Case("gpipe"), Case("1f1b", "always"), Case("zb-h1", measured=True)]:
        side.run(case)
    assert pipe.last_step is not None
    assert all(p.peak_activation_bytes for p in pipe.last_step.partitions)
    pipe.close()


@scenario
def a_refusal_in_one_pipeline_is_heard_by_every_pipeline_sharding_its_stages() -> None:
    # A hook on rank 0's pipe alone: only rank 0's pipeline refused. The other ran the
    # step and waited in FSDP2's reduce-scatter (a hang), or met rank 0's next step in
    # tensor parallelism's all-reduces: gradients of two batches mixed, silently.
    fsdp, _ = fsdp_side_by_side(blocks(4), [2, 2])
    model = mlps(4)
    pipe = DistributedPipe(
        copy.deepcopy(model), [2, 2], chunks=4, group=tp_mesh()["pp"].get_group()
    )
    split_layers(pipe)
    tp = SideBySide(pipe, model, replica=0, replicas=1)
    # FSDP2's pipelines are ranks 0, 1 and 2, 3; tensor parallelism's 0, 2 and 1, 3.
    for side, pipeline_peer in [(fsdp, 1), (tp, 2)]:
        hook = side.pipe.register_forward_pre_hook(lambda *_: None) if rank() == 0 else None
        x, y = side.batch()
        words = (
            "registered on itself" if rank() == 0
            else "rank 0 of the pipeline refused" if rank() == pipeline_peer
            else "a process of another pipeline that shards these stages"
        )  # fmt: skip
        step = functools.partial(side.pipe.step, side.mine(x), side.mine(y), F.mse_loss)
        expect_error(Exception, step, words)
        assert all(p.grad is None for p in side.pipe.parameters())
        if hook is not None:
            hook.remove()
        side.run(Case("1f1b"))
        side.pipe.close()


@scenario
def replicas_sharding_their_stages_differently_are_refused_by_every_process() -> None:
    # Replicas of one stage whose units differed (resharded after forward in one and not
    # the other: gradients 1.3 to 1.5 off, silently; a unit per layer beside one per
    # stage: gloo aborted the process). Both are refused on every process, before any work.
    mesh = fsdp_mesh()
    first = mesh["dp"].get_local_rank() == 0
    for differs in ("reshard", "units"):
        model = blocks(4)
        pipe = DistributedPipe(copy.deepcopy(model), [2, 2], chunks=4, group=mesh["pp"].get_group())
        for s in pipe.local_stages:
            layers = list(pipe.partitions[s])
            for k, layer in enumerate(layers if differs == "reshard" or first else []):
                fully_shard(layer, mesh=mesh["dp"], reshard_after_forward=first and k == 0)
            fully_shard(pipe.partitions[s], mesh=mesh["dp"])
        side = SideBySide(pipe, model, mesh["dp"].get_local_rank(), replicas=2)
        x, y = side.batch()
        step = functools.partial(pipe.step, side.mine(x), side.mine(y), F.mse_loss)
        expect_error(ValueError, step, "shard their stages differently")
        assert all(p.grad is None for p in pipe.parameters()), f"{differs}: a refused step ran"
        pipe.close()


@scenario
def hsdp_stages_all_reduce_once_per_step() -> None:
    # Two replicas, each sharded over one process (four processes): FSDP's all-reduce.
    mesh = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("replicate", "shard", "pp"))
    model = blocks(4)
    pipe = DistributedPipe(copy.deepcopy(model), [2, 2], chunks=4, group=mesh["pp"].get_group())
    units = shard_layers(pipe, mesh["replicate", "shard"])
    side = SideBySide(pipe, model, mesh["replicate"].get_local_rank(), replicas=2)
    for case in [Case("zb-h1"), Case("1f1b", "always")]:
        counts: list[dict[str, int]] = []
        side.run(case, counts)
        assert_once_per_step(counts, case, all_reduce=units)
    pipe.close()


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.token = nn.Embedding(11, WIDTH)

    def forward(self, x: Tensor) -> Tensor:
        return cast(Tensor, self.token(x))


class Head(nn.Module):
    """The output layer, tied to the embedding's weight."""

    def __init__(self, token: nn.Embedding) -> None:
        super().__init__()
        self.token = token

    def forward(self, h: Tensor) -> Tensor:
        return h @ self.token.weight.t()


@scenario
def sharding_a_step_would_get_wrong_is_refused_by_every_process() -> None:
    mesh = fsdp_mesh()
    group = mesh["pp"].get_group()
    x, y = (
        torch.randn(ROWS, WIDTH, dtype=torch.double),
        torch.randn(ROWS, WIDTH, dtype=torch.double),
    )

    def step(pipe: DistributedPipe) -> Callable[[], object]:
        return lambda: pipe.step(x, y, F.mse_loss)

    # fully_shard on the pipe: one unit over both of a process's stages.
    pipe = DistributedPipe(blocks(4), [1, 1, 1, 1], chunks=4, group=group)
    fully_shard(pipe, mesh=mesh["dp"])
    expect_error(ValueError, step(pipe), "fully_shard was applied to the", "shard each stage")
    pipe.close()
    # One fully_shard call over this process's two stages.
    pipe = DistributedPipe(blocks(4), [1, 1, 1, 1], chunks=4, group=group)
    fully_shard([pipe.partitions[s] for s in pipe.local_stages], mesh=mesh["dp"])
    expect_error(ValueError, step(pipe), "one fully_shard call holds modules of stage")
    pipe.close()
    # A trainable layer left out of the units: its gradient would be its replica's.
    pipe = DistributedPipe(blocks(4), [2, 2], chunks=4, group=group)
    for s in pipe.local_stages:
        fully_shard(pipe.partitions[s][0], mesh=mesh["dp"])
    expect_error(ValueError, step(pipe), "parameter", "is in no FSDP2 unit", "fully_shard")
    pipe.close()
    # Stage 0 sharded, stage 1 not.
    pipe = DistributedPipe(blocks(4), [2, 2], chunks=4, group=group)
    if 0 in pipe.local_stages:
        shard_layers(pipe, mesh["dp"])
    expect_error(ValueError, step(pipe), "shard their stages differently", "shard every stage")
    pipe.close()
    # A weight tied across processes, sharded.
    torch.manual_seed(0)
    embed = Embed()
    tied = nn.Sequential(embed, nn.Linear(WIDTH, WIDTH), nn.Tanh(), Head(embed.token)).double()
    pipe = DistributedPipe(tied, [2, 2], chunks=4, group=group)
    shard_layers(pipe, mesh["dp"])
    tokens = torch.randint(0, 11, (ROWS,))
    expect_error(
        ValueError,
        lambda: pipe.step(tokens, tokens, F.cross_entropy),
        "tied across processes",
        "replaced after the DistributedPipe was built",
    )
    pipe.close()
    # A weight tied between stages 0 and 2, both this process's: a copy per stage
    # trained apart (gradients 0.03 off), silently.
    local = blocks(4)
    local[2][0].weight = local[0][0].weight
    pipe = DistributedPipe(local, [1, 1, 1, 1], chunks=4, group=group)
    shard_layers(pipe, mesh["dp"])
    interleaved = lambda: pipe.step(x, y, F.mse_loss, schedule="interleaved")  # noqa: E731
    if 0 in pipe.local_stages:
        expect_error(ValueError, interleaved, "tied between stages of this", "no longer one")
    else:
        expect_error(ValueError, interleaved, "rank 0 of the pipeline refused")
    pipe.close()
    # BatchNorm's statistics in a stage whose units hold no parameter: no mesh to give its
    # replicas the first's over (they drifted 0.11 apart, silently); in eval mode, taken.
    torch.manual_seed(0)
    norm = nn.BatchNorm1d(WIDTH, affine=False)
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), norm, nn.Tanh()).double()
    for training in (True, False):
        pipe = DistributedPipe(copy.deepcopy(model).train(training), [2, 2], chunks=4, group=group)
        shard_layers(pipe, mesh["dp"])
        pipe.evaluate(x, y, F.mse_loss)  # in eval mode: no statistics to share
        if not training:
            step(pipe)()
        elif 1 in pipe.local_stages:
            expect_error(ValueError, step(pipe), "FSDP2 units that hold no parameter")
        else:
            expect_error(ValueError, step(pipe), "rank 1 of the pipeline refused")
        pipe.close()
    # A torch whose FSDP2 lacks what the step reads.
    pipe = DistributedPipe(blocks(2), [1, 1], chunks=4, group=group)
    shard_layers(pipe, mesh["dp"])
    unit = cast(FSDPModule, pipe.partitions[pipe.local_stages[0]][0])
    groups = unit._get_fsdp_state()._fsdp_param_groups
    saved = groups[0].reduce_grads
    del groups[0].reduce_grads
    expect_error(RuntimeError, step(pipe), "FSDPParamGroup.reduce_grads", "torch version")
    groups[0].reduce_grads = saved
    pipe.close()


@scenario
def a_pipe_in_one_process_refuses_fsdp_units_before_any_work() -> None:
    mesh = fsdp_mesh()
    pipe = Pipe(blocks(2), [1, 1], devices=["cpu", "cpu"], chunks=2)
    fully_shard(pipe.partitions[1][0], mesh=mesh["dp"])
    x = torch.randn(ROWS, WIDTH, dtype=torch.double)
    for call in (lambda: pipe(x), lambda: pipe.step(x, x, F.mse_loss), lambda: pipe.evaluate(x)):
        expect_error(ValueError, call, "sharded with FSDP2", "DistributedPipe")
    assert all(p.grad is None for p in pipe.parameters())
    pipe.close()


# Checkpoints across layouts: MLPS (4 MLP blocks) in float64, AdamW, from
# checkpoint_scenarios.py: saved after 2 steps, loaded, 2 more steps equal to
# the plain model's 4.


@dataclass
class Layout:
    """A layout of MLPS trained by this process: its module, its share of each batch."""

    name: str
    module: nn.Module
    pipe: DistributedPipe
    replica: int = 0
    replicas: int = 1


def fsdp_layout(balance: list[int], seed: int, model: nn.Sequential | None = None) -> Layout:
    """pp=2 x fsdp=2: each block a unit sharded over the dp dimension."""
    mesh = fsdp_mesh()
    model = MLPS.build(seed) if model is None else model
    pipe = DistributedPipe(model, balance, chunks=2, group=mesh["pp"].get_group())
    shard_layers(pipe, mesh["dp"])
    return Layout(f"pp=2 x fsdp=2 {balance}", pipe, pipe, mesh["dp"].get_local_rank(), 2)


def tp_layout(balance: list[int], seed: int) -> Layout:
    """pp=2 x tp=2: each block's Linear layers split column- then row-wise."""
    pipe = DistributedPipe(MLPS.build(seed), balance, chunks=2, group=tp_mesh()["pp"].get_group())
    split_layers(pipe)
    return Layout(f"pp=2 x tp=2 {balance}", pipe, pipe)


def grid_layout(balance: list[int], seed: int) -> Layout:
    """pp=2 x dp=2: DataParallel over the DistributedPipe, replicated."""
    trainer, replica = grid(MLPS, balance, seed)
    assert isinstance(trainer.module, DistributedPipe)
    return Layout(f"pp=2 x dp=2 {balance}", trainer, trainer.module, replica, 2)


def four_stages(balance: list[int], seed: int) -> Layout:
    pipe = DistributedPipe(MLPS.build(seed), [1, 1, 1, 1], chunks=2)
    return Layout("pp=4", pipe, pipe)


def trained(layout: Layout) -> torch.optim.Optimizer:
    """The layout's AdamW, after the steps before the save."""
    optimizer = adamw(layout.module)
    for step in range(SAVED_AFTER):
        train(MLPS, layout.module, optimizer, step, layout.replica, layout.replicas)
    return optimizer


def loads_and_resumes(
    reference: Uninterrupted, layout: Layout, path: Path, resave: Path | None = None
) -> None:
    """The layout loads ``path`` (saves it again in ``resave``), trains on as the plain model."""
    optimizer = adamw(layout.module)
    load_checkpoint(path, layout.module, optimizer)
    if resave is not None:
        save_checkpoint(resave, layout.module, optimizer)
    what = f"{layout.name} from {path.name}"
    assert_resumes(MLPS, reference, layout.module, optimizer, what, layout.replica, layout.replicas)
    layout.pipe.close()


def refused_in_a_sharded_layout(path: Path, alone: dist.ProcessGroup) -> None:
    """A shape one rank finds and a group without the shards' mesh: refused by every process."""
    wider = MLPS.build(7)
    width = wider[3][0].in_features
    wider[3][0], wider[3][2] = nn.Linear(width, 32).double(), nn.Linear(32, width).double()
    layout = fsdp_layout([2, 2], seed=7, model=wider)
    optimizer = trained(layout)
    refused_untouched(
        lambda: load_checkpoint(path, layout.module, optimizer),
        layout.module,
        optimizer,
        "shapes differ on rank 1: model.3.0.bias is (16,) in the checkpoint, (32,) in the model",
    )
    for call in (load_checkpoint, save_checkpoint):
        expect_error(
            ValueError,
            lambda call=call: call(path, layout.module, optimizer, process_group=alone),
            f"{call.__name__}: ",
            "is sharded over ranks",
            "pass a process_group holding them all",
        )
    layout.pipe.close()


@scenario
def sharded_stages_save_and_load_across_layouts() -> None:
    reference = uninterrupted(MLPS)
    first, other, pipe_balance = MLPS.balances
    alone = each_process_alone()
    with (
        shared_directory("fsdp") as fsdp,
        shared_directory("tp") as tp,
        shared_directory("dp") as dp,
    ):
        saving = fsdp_layout(first, seed=0)
        save_checkpoint(fsdp, saving.module, trained(saving))
        saving.pipe.close()
        refused_in_a_sharded_layout(fsdp, alone)
        loads_and_resumes(reference, tp_layout(other, seed=7), fsdp, resave=tp)
        loads_and_resumes(reference, fsdp_layout(other, seed=7), tp)
        loads_and_resumes(reference, grid_layout(first, seed=7), tp, resave=dp)
        loads_and_resumes(reference, fsdp_layout(first, seed=7), dp)
        loads_and_resumes(reference, four_stages(first, seed=7), fsdp)
        if rank() in (0, 1):  # one process of another job each, from the sharded layouts
            module: nn.Module = MLPS.build(7)
            if rank() == 0:
                module = Pipe(module, pipe_balance, devices=["cpu"] * 2, chunks=2)
            for path in (fsdp, tp):
                optimizer = adamw(module)
                load_checkpoint(path, module, optimizer, process_group=alone)
                what = f"rank {rank()} alone from {path.name}"
                assert_resumes(MLPS, reference, module, optimizer, what)
            if isinstance(module, Pipe):
                module.close()


@scenario
def data_parallel_over_fsdp_stages_is_refused_before_any_work() -> None:
    layout = fsdp_layout([2, 2], seed=0)
    expect_error(
        ValueError,
        lambda: DataParallel(layout.pipe, process_group=fsdp_mesh()["dp"].get_group()),
        "DataParallel cannot replicate a module sharded with FSDP2",
        "2 of its modules are FSDP2 units",
        "HSDP mesh",
    )
    layout.pipe.close()
    # A parameter of stage 1 frozen after DataParallel was built: its processes raised at
    # the step's end, and those of stage 0 returned, their optimizers free to step alone.
    trainer, replica = grid(MLPS, [2, 2], seed=0)
    assert isinstance(trainer.module, DistributedPipe)
    for name, param in trainer.module.named_parameters():
        param.requires_grad_(not name.startswith("3."))
    optimizer = adamw(trainer)
    frozen = "'3.0.weight' was trained when DataParallel was built and is frozen now"
    refused = "rank 1 of the pipeline refused this step's arguments"
    expect_error(
        RuntimeError if rank() % 2 else ValueError,
        lambda: train(MLPS, trainer, optimizer, 0, replica, replicas=2),
        frozen if rank() % 2 else refused,
    )
    assert all(p.grad is None for p in trainer.parameters())
    trainer.module.close()


def storage_bytes(tensors: list[Tensor]) -> int:
    """Bytes of the storages of ``tensors`` (a DTensor's shard), each storage once."""
    local = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in local}
               .values())  # fmt: skip


@scenario
def a_plan_for_sharded_stages_is_one_plan_that_predicts_each_term() -> None:
    mesh = fsdp_mesh()
    model = mlps(4)
    generator = torch.Generator().manual_seed(4)
    x, y = (torch.randn(2 * ROWS, WIDTH, generator=generator, dtype=torch.double) for _ in "xy")
    replica = mesh["dp"].get_local_rank()
    mine = slice(replica * ROWS, (replica + 1) * ROWS)
    for wrong, error, words in [
        ({"mesh": tp_mesh()}, ValueError, "two dimensions named 'dp' and 'pp'"),
        ({"mesh": mesh, "group": mesh["pp"].get_group()}, TypeError, "mesh= or group="),
        ({"mesh": mesh, "processes": 4}, ValueError, "'pp' dimension has 2 processes"),
    ]:
        call = functools.partial(plan, model, x, y, F.mse_loss, batch_size=ROWS, **wrong)
        expect_error(error, functools.partial(call, memory_limit=2**30), words)
    tied = mlps(2)
    tied[1][2].weight = tied[0][2].weight  # some balances would tie it across processes
    call = functools.partial(plan, tied, x[mine], y[mine], F.mse_loss, batch_size=ROWS, mesh=mesh)
    expect_error(ValueError, functools.partial(call, memory_limit=2**30), "hold one parameter")
    planned = plan(copy.deepcopy(model), x[mine], y[mine], F.mse_loss, mesh=mesh,
                   batch_size=ROWS, memory_limit=2**30, chunks=[2, 4], schedules=["1f1b"],
                   checkpoints=["never"], optimizer_bytes_per_param=16, repeats=1)  # fmt: skip
    # One plan in every process: the replicas measured apart, and take the first's figures.
    every: list[Any] = [None] * 4
    dist.all_gather_object(every, (repr(planned), [s.total for s in planned.chosen.memory]))
    assert all(theirs == every[0] for theirs in every), every
    assert "stages sharded 2 ways (FSDP2)" in str(planned)
    pipe = planned.distributed()
    (stage,) = pipe.local_stages
    units = [m for m in pipe.partitions[stage].modules() if isinstance(m, FSDPModule)]
    assert len(units) == len(pipe.partitions[stage]) + 1  # each layer, and the stage
    gathered: dict[int, int] = {}

    def held(module: nn.Module, args: Any, output: Any) -> None:
        gathered[id(module)] = storage_bytes(list(module.parameters()))

    for s in pipe.local_stages:
        for layer in pipe.partitions[s]:
            layer.register_forward_hook(held)
    optimizer = torch.optim.AdamW(pipe.parameters())
    pipe.step(x[mine], y[mine], F.mse_loss, schedule=planned.schedule, measure_memory=True)
    F.mse_loss(model(x), y).backward()
    for name, param in pipe.named_parameters():
        torch.testing.assert_close(full(param.grad), model.get_parameter(name).grad, msg=name)
    optimizer.step()
    check = planned.check(pipe)
    assert check.measured_activations == check.predicted_activations
    predicted = planned.chosen.memory[stage]
    params = list(pipe.parameters())
    assert predicted.parameters == storage_bytes(params)
    assert predicted.gathered == sum(gathered.values())
    state = [v for s in optimizer.state.values() for k, v in s.items() if k != "step"]
    assert predicted.optimizer == storage_bytes(state)
    # The unsharded gradients (the gathered parameters' size), then their reduced shards.
    shards = storage_bytes([p.grad for p in params if p.grad is not None])
    assert predicted.gradients == predicted.gathered + shards
    tight = functools.partial(
        plan, copy.deepcopy(model), x[mine], y[mine], F.mse_loss, mesh=mesh, batch_size=ROWS,
        chunks=[2], repeats=1, schedules=["1f1b"], checkpoints=["never"], contention=1.0,
    )  # fmt: skip
    expect_error(PlanError, functools.partial(tight, memory_limit=4096), "gathered")
    pipe.close()


class Tokens(nn.Module):
    """Embedding, two blocks and a head: split by default, the embedding and head are glue."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, WIDTH)
        self.blocks = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(2))
        self.head = nn.Linear(WIDTH, 11)

    def forward(self, ids: Tensor) -> Tensor:
        h = self.embed(ids)
        for block in self.blocks:
            h = torch.tanh(block(h))
        return self.head(h)


@scenario
def a_module_only_read_by_a_split_models_code_is_refused_in_a_sharded_stage() -> None:
    mesh = fsdp_mesh()
    ids = torch.randint(0, 11, (ROWS, 3))
    seq = split(Tokens().double(), (ids,))
    pipe = DistributedPipe(seq, [2, 2], chunks=4, group=mesh["pp"].get_group())
    for s in pipe.local_stages:
        fully_shard(pipe.partitions[s], mesh=mesh["dp"])
    loss = lambda out, t: F.cross_entropy(out.flatten(0, 1), t.flatten())  # noqa: E731
    expect_error(
        ValueError,
        lambda: pipe.step(ids, ids, loss),
        "read by the split model's captured code",
        "give pipeline.split a point at that module",
    )
    assert all(p.grad is None for p in pipe.parameters())
    pipe.close()


@scenario
def clip_grad_norm_over_sharded_stages_equals_the_plain_models() -> None:
    # FSDP2 (each dp rank on half the batch) and tensor parallelism (the whole batch).
    # A Linear(WIDTH, 1) leaves one dp rank empty shards, whose inf norm torch refuses
    # (no identity): that rank raised, and the others failed in gloo.
    fsdp, tp = fsdp_mesh(), tp_mesh()
    narrow = nn.Sequential(*blocks(3), nn.Linear(WIDTH, 1)).double()
    for mesh, model, shard, rows in (
        (fsdp, blocks(4), lambda pipe: shard_layers(pipe, fsdp["dp"]), fsdp["dp"]),
        (fsdp, narrow, lambda pipe: shard_layers(pipe, fsdp["dp"]), fsdp["dp"]),
        (tp, mlps(4), split_layers, None),
    ):
        plain = copy.deepcopy(model)
        pipe = DistributedPipe(copy.deepcopy(model), [2, 2], chunks=4, group=mesh["pp"].get_group())
        shard(pipe)
        gen = torch.Generator().manual_seed(9)  # the same batch on every process
        x = torch.randn(2 * ROWS, WIDTH, dtype=torch.double, generator=gen)
        y = torch.randn(2 * ROWS, WIDTH, dtype=torch.double, generator=gen)
        y = y[:, : model[-1].out_features] if isinstance(model[-1], nn.Linear) else y
        if rows is None:
            pipe.step(x, y, F.mse_loss)
        else:
            half = rows.get_local_rank()
            pipe.step(x.chunk(2)[half], y.chunk(2)[half], F.mse_loss)
        F.mse_loss(plain(x), y).backward()
        for norm_type in (2.0, float("inf"), -float("inf")):
            expected = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.05, norm_type)
            norm = pipe.clip_grad_norm_(0.05, norm_type)
            torch.testing.assert_close(norm, expected, rtol=1e-12, atol=0)
        reference = dict(plain.named_parameters())
        for name, param in pipe.named_parameters():
            assert param.grad is not None, name
            torch.testing.assert_close(full(param.grad), reference[name].grad, msg=name)
        pipe.close()


if __name__ == "__main__":
    main()
