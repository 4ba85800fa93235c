"""DataParallel scenarios, run by every rank of a small gloo process group.

Started by tests/gloo_groups.py's run_group as `python dp_scenarios.py OUT.json
PG_TIMEOUT_S NAME...` with torchrun's environment variables and
SCENARIO_BACKEND (gloo unless set) set; each rank runs the named scenarios in
order and writes {name: "ok" or the traceback} to OUT.json. With
SCENARIO_WITHOUT_NUMPY=1 NumPy cannot be imported, as on a machine that does
not have it.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any, cast

if os.environ.get("SCENARIO_WITHOUT_NUMPY") == "1":
    sys.modules["numpy"] = None  # type: ignore[assignment]

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint

import pipeline
from pipeline import DataParallel, Pipe
from pipeline.runtime.process_group import collective_device
from tests import gloo_groups
from tests.gloo_groups import (
    SimulatedCrashError,
    assert_same_buffers,
    breaks_group,
    expect_error,
    main,
    rank,
    scenario,
    world,
)
from tests.split.split_models import EarlyLate

# Caps of a few KiB, so the small test models still span several buckets.
SMALL_BUCKETS = {"bucket_cap_mb": 2e-3, "first_bucket_mb": 5e-4}
WIDTH = 16


def mlp(seed: int, depth: int = 4) -> nn.Sequential:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
    layers.append(nn.Linear(WIDTH, 1))
    return nn.Sequential(*layers)


def global_batch(step: int, rows_per_rank: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """The same full batch on every rank; each rank trains on its shard()."""
    gen = torch.Generator().manual_seed(1000 + step)
    rows = rows_per_rank * world()
    return torch.randn(rows, WIDTH, generator=gen), torch.randn(rows, 1, generator=gen)


def shard(tensor: torch.Tensor, of_rank: int | None = None) -> torch.Tensor:
    return tensor.chunk(world())[rank() if of_rank is None else of_rank]


def grads(model: nn.Module) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def assert_grads_close(actual: nn.Module, expected: nn.Module, what: str) -> None:
    for (name, a), b in zip(actual.named_parameters(), expected.parameters(), strict=True):
        assert (a.grad is None) == (b.grad is None), f"{what}: {name} grad presence differs"
        if a.grad is not None and b.grad is not None:
            torch.testing.assert_close(a.grad, b.grad, msg=lambda m, n=name: f"{what}: {n}: {m}")


def assert_params_close(actual: nn.Module, expected: nn.Module, what: str) -> None:
    for (name, a), b in zip(actual.named_parameters(), expected.parameters(), strict=True):
        torch.testing.assert_close(a, b, msg=lambda m, n=name: f"{what}: {n}: {m}")


def assert_equal_on_all_ranks(tensors: list[torch.Tensor], what: str) -> None:
    for index, tensor in enumerate(tensors):
        gathered = [torch.empty_like(tensor) for _ in range(world())]
        dist.all_gather(gathered, tensor.detach().contiguous())
        for other, value in enumerate(gathered):
            assert torch.equal(value, gathered[0]), f"{what} #{index}: rank {other} != rank 0"


# ---------------------------------------------------------------- plain models


@scenario
def matches_ddp_and_full_batch() -> None:
    model = mlp(seed=0)
    full_batch, ddp_model = copy.deepcopy(model), copy.deepcopy(model)
    dp = DataParallel(model, **SMALL_BUCKETS)
    ddp = DistributedDataParallel(ddp_model, bucket_cap_mb=SMALL_BUCKETS["bucket_cap_mb"])
    assert len(dp.reducer.buckets) >= 3, "the test model should span several buckets"

    x, y = global_batch(0)
    F.mse_loss(dp(shard(x)), shard(y)).backward()
    F.mse_loss(ddp(shard(x)), shard(y)).backward()
    F.mse_loss(full_batch(x), y).backward()
    assert_grads_close(model, ddp_model, "DataParallel vs DDP")
    assert_grads_close(model, full_batch, "DataParallel vs full batch")


@dataclasses.dataclass
class Prediction:
    value: torch.Tensor


class Hidden:
    """An output object DataParallel cannot look into."""

    def __init__(self, value: torch.Tensor) -> None:
        self.value = value


class Returning(nn.Module):
    def __init__(self, wrap: Callable[[torch.Tensor], Any]) -> None:
        super().__init__()
        self.body = mlp(seed=0)
        self.wrap = wrap

    def forward(self, x: torch.Tensor) -> Any:
        return self.wrap(self.body(x))


@scenario
def a_dataclass_output_is_averaged_like_ddp() -> None:
    # The backward's end is hooked on the output's tensors: found inside a dataclass too.
    model, ddp_model = Returning(Prediction), Returning(Prediction)
    ddp_model.load_state_dict(model.state_dict())
    dp = DataParallel(model, **SMALL_BUCKETS)
    ddp = DistributedDataParallel(ddp_model, bucket_cap_mb=SMALL_BUCKETS["bucket_cap_mb"])
    x, y = global_batch(0)
    F.mse_loss(dp(shard(x)).value, shard(y)).backward()
    F.mse_loss(ddp(shard(x)).value, shard(y)).backward()
    assert_grads_close(model, ddp_model, "DataParallel vs DDP, a dataclass output")
    hidden = DataParallel(Returning(Hidden))
    expect_error(TypeError, lambda: hidden(shard(x)), "returned Hidden", "found no tensor")


@scenario
def a_parameter_unfrozen_or_replaced_after_wrapping_is_refused() -> None:
    model = mlp(seed=0)
    model[0].weight.requires_grad_(False)
    dp = DataParallel(model)
    x, y = global_batch(0)
    F.mse_loss(dp(shard(x)), shard(y)).backward()  # frozen as when wrapped: fine
    model[0].weight.requires_grad_(True)
    expect_error(RuntimeError, lambda: dp(shard(x)), "'0.weight' requires grad now")
    model[0].weight.requires_grad_(False)
    model[2].bias.requires_grad_(False)  # trained when wrapped: it would get no gradient
    expect_error(RuntimeError, lambda: dp(shard(x)), "'2.bias' was trained when DataParallel")
    model[2].bias.requires_grad_(True)
    # Replaced: its buckets average the old parameter's stale .grad, each
    # replica kept its own gradient of the new one (0.18 apart), silently.
    model[2].weight = nn.Parameter(model[2].weight.detach().clone())
    expect_error(RuntimeError, lambda: dp(shard(x)), "parameter '2.weight' is not the one")
    # Through a Pipe's step the check runs among the step's own, and the buffers are
    # broadcast only once they pass: refused, each replica's running mean as it was.
    norm = nn.BatchNorm1d(1)
    pipe = Pipe(nn.Sequential(mlp(seed=0), norm), [1, 1], devices=["cpu"] * 2, chunks=2)
    dp = DataParallel(pipe)
    with torch.no_grad():
        norm.running_mean.fill_(rank() + 1.0)
    pipe[0][2].weight.requires_grad_(False)
    refused = lambda: dp.step(shard(x), shard(y), F.mse_loss)  # noqa: E731
    expect_error(RuntimeError, refused, "'0.2.weight' was trained when DataParallel")
    assert norm.running_mean.eq(rank() + 1.0).all(), norm.running_mean


class BackwardFailedError(Exception):
    pass


class FailsInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise BackwardFailedError("a backward that fails on every replica")


class ArmedToFail(nn.Module):
    armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cast(torch.Tensor, FailsInBackward.apply(x)) if self.armed else x


@scenario
def a_backward_failing_on_every_replica_leaves_the_next_averages_right() -> None:
    # The failed backward had launched the later partition's all-reduces; the next
    # iteration dropped them in flight, and they wrote into its buckets (8 of 20 runs
    # wrong by up to 0.18, silently).
    model = mlp(seed=3)
    model.insert(1, ArmedToFail())
    pipe = Pipe(model, [3, 7], devices=["cpu"] * 2, chunks=4)
    dp = DataParallel(pipe, bucket_cap_mb=0.0001, first_bucket_mb=0.0001)  # one per parameter
    x, y = global_batch(0)
    plain = copy.deepcopy(model)
    F.mse_loss(plain(x), y).backward()
    for _ in range(6):
        model[1].armed = True
        expect_error(BackwardFailedError, lambda: F.mse_loss(dp(shard(x)), shard(y)).backward())
        model[1].armed = False
        dp.zero_grad(set_to_none=True)
        F.mse_loss(dp(shard(x)), shard(y)).backward()
        for (name, p), q in zip(pipe.named_parameters(), plain.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, msg=name)


@scenario
def hooks_on_the_wrapper_are_refused_by_step() -> None:
    # step runs the pipe's step, never DataParallel's forward: its hooks would not run.
    dp = DataParallel(Pipe(mlp(seed=0), [5, 4], devices=["cpu"] * 2, chunks=2))
    handle = dp.register_forward_hook(lambda module, args, output: output * 3)
    x, y = global_batch(0)
    step = lambda: dp.step(shard(x), shard(y), F.mse_loss)  # noqa: E731
    expect_error(ValueError, step, "DataParallel.step runs the wrapped module's step")
    assert all(p.grad is None for p in dp.parameters())
    handle.remove()
    step()
    expect_error(TypeError, lambda: copy.deepcopy(dp), "DataParallel cannot be copied")


@scenario
def a_second_backward_through_one_forward_is_refused() -> None:
    # The first backward averaged; the second would add each replica's own (DDP: silently).
    for module in (mlp(seed=0), Pipe(mlp(seed=0), [5, 4], devices=["cpu"] * 2, chunks=2)):
        dp = DataParallel(module)
        x, y = global_batch(0)
        loss = F.mse_loss(dp(shard(x)), shard(y))
        loss.backward(retain_graph=True)
        averaged = [p.grad.clone() for p in dp.parameters() if p.grad is not None]
        # A forward failing alike on both between the two begins a step of its own.
        expect_error(RuntimeError, lambda wrapped=dp: wrapped(torch.ones(2, 3)))
        expect_error(RuntimeError, loss.backward, "a second backward through the output")
        after = [p.grad for p in dp.parameters() if p.grad is not None]
        assert all(torch.equal(a, b) for a, b in zip(averaged, after, strict=True))
        F.mse_loss(dp(shard(x)), shard(y)).backward()  # a forward per backward: fine again


class ReplicaFailureError(Exception):
    pass


def steps_until_refused(step: Callable[[torch.Tensor, torch.Tensor], Any]) -> list[str]:
    """Rank 0 steps once, rank 1 twice (its first fails): what each step came to."""
    outcomes = []
    for k in range(1 + rank()):
        x, y = global_batch(k)
        try:
            step(shard(x), shard(y))
            outcomes.append("averaged")
        except ReplicaFailureError:
            outcomes.append("failed")
        except RuntimeError as error:
            assert "averaged the gradients of different steps" in str(error), error
            outcomes.append("refused")
    return outcomes


@scenario
def a_replica_that_fails_a_step_and_goes_on_is_caught_at_the_next_average() -> None:
    # Rank 1's first step raises before any backward; it goes on to its second, whose
    # all-reduces meet rank 0's first: both ranks raise instead of averaging two steps.
    dp = DataParallel(Pipe(mlp(seed=0), [5, 4], devices=["cpu"] * 2, chunks=2))
    calls = [0]

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        if rank() == 1 and calls[0] == 1:
            raise ReplicaFailureError("a replica's own failure")
        return F.mse_loss(output, target)

    outcomes = steps_until_refused(lambda x, y: dp.step(x, y, loss_fn))
    assert outcomes == (["refused"] if rank() == 0 else ["failed", "refused"]), outcomes


@scenario
def sgd_keeps_replicas_identical() -> None:
    # Different initialisation per rank: construction must broadcast rank 0's.
    model = mlp(seed=1 + rank())
    full_batch = mlp(seed=1)
    dp = DataParallel(model, **SMALL_BUCKETS)
    opt = torch.optim.SGD(dp.parameters(), lr=0.05, momentum=0.9)
    full_opt = torch.optim.SGD(full_batch.parameters(), lr=0.05, momentum=0.9)
    for step in range(4):
        x, y = global_batch(step)
        opt.zero_grad()
        F.mse_loss(dp(shard(x)), shard(y)).backward()
        opt.step()
        full_opt.zero_grad()
        F.mse_loss(full_batch(x), y).backward()
        full_opt.step()
    assert_equal_on_all_ranks(list(model.parameters()), "parameter after 4 steps")
    assert_params_close(model, full_batch, "4 SGD steps vs full batch")


@scenario
def trace_names_the_work() -> None:
    dp = DataParallel(mlp(seed=11), **SMALL_BUCKETS)
    x, y = global_batch(0)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        F.mse_loss(dp(shard(x)), shard(y)).backward()
    names = {event.name for event in prof.events()}
    expected = {f"dp.allreduce[bucket={k}]" for k in range(len(dp.reducer.buckets))}
    expected |= {"dp.wait[bucket=0]", "dp.finish_backward", "dp.rebuild_buckets"}
    assert expected <= names, f"missing from the trace: {sorted(expected - names)}"


class RegisteredBackwards(nn.Module):
    """Registers `late` before `early` but runs `early` first, so readiness order differs."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.late = nn.Linear(WIDTH, 1)
        self.early = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.late(self.early(x).tanh())


@scenario
def buckets_rebuilt_in_ready_order() -> None:
    model = RegisteredBackwards()
    full_batch = copy.deepcopy(model)
    dp = DataParallel(model, bucket_cap_mb=1e-4, first_bucket_mb=1e-4)
    late = {id(p) for p in model.late.parameters()}
    # Initial order: reverse registration, so `early` (registered last) comes first.
    assert id(dp.reducer.buckets[0].params[0]) not in late
    for step in range(2):
        x, y = global_batch(step)
        dp.zero_grad()
        full_batch.zero_grad()
        F.mse_loss(dp(shard(x)), shard(y)).backward()
        F.mse_loss(full_batch(x), y).backward()
        assert_grads_close(model, full_batch, f"step {step}")
        # `late` runs last in forward, so its gradients are ready first.
        assert id(dp.reducer.buckets[0].params[0]) in late, "buckets not rebuilt"


@scenario
def no_sync_accumulates_locally() -> None:
    model = mlp(seed=3)
    full_batch, local = copy.deepcopy(model), copy.deepcopy(model)
    dp = DataParallel(model)
    batches = [global_batch(step) for step in range(3)]
    with dp.no_sync():
        for x, y in batches[:2]:
            F.mse_loss(dp(shard(x)), shard(y)).backward()
            F.mse_loss(local(shard(x)), shard(y)).backward()
    assert_grads_close(model, local, "inside no_sync (no communication)")
    x, y = batches[2]
    F.mse_loss(dp(shard(x)), shard(y)).backward()
    for x, y in batches:
        F.mse_loss(full_batch(x), y).backward()
    assert_grads_close(model, full_batch, "two no_sync steps then a synced one")


class TwoHeads(nn.Module):
    """A trunk and two heads, of which each forward uses one."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(4)
        self.trunk = nn.Linear(WIDTH, WIDTH)
        self.head_a = nn.Linear(WIDTH, 1)
        self.head_b = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor, use_b: bool = False) -> torch.Tensor:
        hidden = self.trunk(x).tanh()
        return self.head_b(hidden) if use_b else self.head_a(hidden)


@scenario
def unused_parameter_without_flag_raises() -> None:
    dp = DataParallel(TwoHeads())
    x, y = global_batch(0)
    loss = F.mse_loss(dp(shard(x)), shard(y))
    expect_error(RuntimeError, loss.backward, "'head_b.weight'", "find_unused_parameters=True")


@scenario
def unused_parameter_with_flag() -> None:
    model = TwoHeads()
    replicas = [copy.deepcopy(model) for _ in range(world())]
    dp = DataParallel(model, find_unused_parameters=True, **SMALL_BUCKETS)
    x, y = global_batch(0)
    # Only rank 0 takes head_b: its gradient is rank 0's share of the average.
    F.mse_loss(dp(shard(x), use_b=rank() == 0), shard(y)).backward()
    for r, replica in enumerate(replicas):
        F.mse_loss(replica(shard(x, r), use_b=r == 0), shard(y, r)).backward()
    for name, param in model.named_parameters():
        shares = [dict(rep.named_parameters())[name].grad for rep in replicas]
        expected = sum(torch.zeros_like(param) if g is None else g for g in shares) / world()
        assert param.grad is not None, f"{name} has no gradient"
        torch.testing.assert_close(param.grad, expected, msg=lambda m, n=name: f"{n}: {m}")

    # When no rank uses head_b, its .grad is left untouched (None after zero_grad).
    dp.zero_grad()
    F.mse_loss(dp(shard(x)), shard(y)).backward()
    assert model.head_b.weight.grad is None and model.head_b.bias.grad is None
    assert model.head_a.weight.grad is not None


class Shifted(nn.Module):
    """A linear layer plus a buffer that the forward adds to its output."""

    def __init__(self, offset: float) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.linear = nn.Linear(WIDTH, 1)
        self.register_buffer("offset", torch.full((1,), offset))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) + self.offset


@scenario
def buffers_broadcast() -> None:
    x, _ = global_batch(0)
    model = Shifted(offset=10.0 + rank())
    dp = DataParallel(model)
    assert model.offset.item() == 10.0, "construction must broadcast rank 0's buffers"

    model.offset.fill_(float(rank()))
    dp(shard(x))
    assert model.offset.item() == 0.0, "forward must first broadcast rank 0's buffers"

    model.offset.fill_(float(rank()))
    with torch.no_grad():
        dp(shard(x))
    assert model.offset.item() == float(rank()), "an evaluation forward must not communicate"

    model.offset = torch.full((1,), float(rank()))  # replaced, as .to() replaces buffers
    dp(shard(x))
    assert model.offset.item() == 0.0, "a replaced buffer must be broadcast too"

    kept = Shifted(offset=0.0)
    dp_kept = DataParallel(kept, broadcast_buffers=False)
    kept.offset.fill_(float(rank()))
    dp_kept(shard(x))
    assert kept.offset.item() == float(rank()), "broadcast_buffers=False must keep local buffers"


def normalised() -> nn.Sequential:
    """A model whose BatchNorm updates its statistics from each replica's rows."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.BatchNorm1d(WIDTH), nn.Tanh(),
                         nn.Linear(WIDTH, 1))  # fmt: skip


@scenario
def statistics_a_step_updates_are_rank_0s_on_every_replica_after_it() -> None:
    # Each replica's BatchNorm updated its statistics from its own rows, and they stayed
    # apart until the next pass broadcast rank 0's: a checkpoint saved between steps kept
    # one replica's (replica 1's, in a grid), and a resumed run went another way, silently.
    x, y = global_batch(0)
    model = normalised()
    for deferred in (False, True):
        pipe = Pipe(copy.deepcopy(model), [2, 2], chunks=2, deferred_batch_norm=deferred)
        first = Pipe(copy.deepcopy(model), [2, 2], chunks=2, deferred_batch_norm=deferred)
        DataParallel(pipe).step(shard(x), shard(y), F.mse_loss)
        first.step(shard(x, 0), shard(y, 0), F.mse_loss)  # rank 0's rows, on every rank
        assert_same_buffers(pipe, first, f"deferred={deferred}")
        pipe.close()
        first.close()


@scenario
def a_checkpoint_after_a_forward_and_backward_keeps_rank_0s_statistics() -> None:
    # After dp(x) and its backward each replica holds the statistics of its own rows until
    # the next forward broadcasts rank 0's; DCP saved whichever replica's it kept (0.49 off
    # rank 0's), and a resumed run went another way, silently.
    x, y = global_batch(0)
    model = normalised()
    pipe = Pipe(copy.deepcopy(model), [2, 2], chunks=2)
    first = Pipe(copy.deepcopy(model), [2, 2], chunks=2)
    dp = DataParallel(pipe)
    from pipeline.distributed import load_checkpoint, save_checkpoint

    path = Path(tempfile.gettempdir()) / f"dp-checkpoint-{os.environ['MASTER_PORT']}"
    loss = F.mse_loss(dp(shard(x)), shard(y))
    save_checkpoint(path, dp)  # between a forward and its backward: the buffers left alone
    loss.backward()
    first(shard(x, 0))  # rank 0's rows, on every rank
    save_checkpoint(path, dp)
    loaded = copy.deepcopy(model)
    load_checkpoint(path, loaded)
    assert_same_buffers(loaded, first, "loaded")
    dist.barrier()
    if rank() == 0:
        shutil.rmtree(path)
    pipe.close()
    first.close()


@scenario
def a_save_by_one_replica_alone_exchanges_nothing_with_the_others() -> None:
    # The buffers were broadcast over the replicas whatever group the save was given:
    # replica 0, saving alone, waited for replica 1 until the group's timeout.
    from pipeline.distributed import save_checkpoint

    x, y = global_batch(0)
    dp = DataParallel(Pipe(normalised(), [2, 2], chunks=2))
    F.mse_loss(dp(shard(x)), shard(y)).backward()
    alone = dist.new_group([0])
    path = Path(tempfile.gettempdir()) / f"dp-alone-{os.environ['MASTER_PORT']}"
    if rank() == 0:
        save_checkpoint(path, dp, process_group=alone)
        shutil.rmtree(path)
    dist.barrier()
    dist.destroy_process_group(alone)


@scenario
def gradient_as_bucket_view() -> None:
    model = mlp(seed=6)
    full_batch = copy.deepcopy(model)
    dp = DataParallel(model, gradient_as_bucket_view=True, **SMALL_BUCKETS)
    opt = torch.optim.SGD(dp.parameters(), lr=0.05)
    full_opt = torch.optim.SGD(full_batch.parameters(), lr=0.05)
    for step in range(3):
        x, y = global_batch(step)
        # Step 1 keeps the views alive (zeros); the others drop them (None).
        opt.zero_grad(set_to_none=step != 1)
        full_opt.zero_grad()
        F.mse_loss(dp(shard(x)), shard(y)).backward()
        F.mse_loss(full_batch(x), y).backward()
        assert_grads_close(model, full_batch, f"step {step}")
        storages = {b.flat.untyped_storage().data_ptr() for b in dp.reducer.buckets}
        for name, param in model.named_parameters():
            assert param.grad is not None
            assert param.grad.untyped_storage().data_ptr() in storages, f"{name} is no view"
        opt.step()
        full_opt.step()


class WaitsInBackward(torch.autograd.Function):
    """On rank 1, while armed, its backward waits for rank 0 at a barrier of ``group``."""

    group: dist.ProcessGroup | None = None

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        if WaitsInBackward.group is not None and rank() == 1:
            dist.barrier(group=WaitsInBackward.group)
        return grad


class Waits(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cast(torch.Tensor, WaitsInBackward.apply(x))


@scenario
def a_backward_failing_alike_with_bucket_views_leaves_the_next_averages_right() -> None:
    # Rank 0's backward launched the later partition's all-reduce, failed, and returned;
    # rank 1 joined that all-reduce only once rank 0 had zeroed its gradients (a retry
    # loop's zero_grad(set_to_none=False)), so the average landed in rank 0's .grad, the
    # bucket's views, after; the retried step added to it, 4.9e-2 off, silently.
    side = dist.new_group(backend="gloo")
    model = mlp(seed=7)
    model.insert(1, ArmedToFail())
    model.insert(3, Waits())
    pipe = Pipe(model, [3, 8], devices=["cpu"] * 2, chunks=1)
    dp = DataParallel(pipe, gradient_as_bucket_view=True, bucket_cap_mb=1)
    plain = copy.deepcopy(model)
    x, y = global_batch(0)
    model[1].armed, WaitsInBackward.group = True, side
    expect_error(BackwardFailedError, lambda: F.mse_loss(dp(shard(x)), shard(y)).backward())
    model[1].armed, WaitsInBackward.group = False, None
    dp.zero_grad(set_to_none=False)
    if rank() == 0:
        dist.barrier(group=side)  # rank 1 joins the all-reduce now, after this zero_grad
    F.mse_loss(dp(shard(x)), shard(y)).backward()
    F.mse_loss(plain(x), y).backward()
    for (name, p), q in zip(pipe.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    dist.destroy_process_group(side)


class FailsOnceLaunched(torch.autograd.Function):
    """Its backward raises once ``reducer`` has launched an all-reduce (60 s at most)."""

    reducer: Any = None

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        deadline = time.monotonic() + 60
        while not any(b.launched for b in FailsOnceLaunched.reducer.buckets):
            assert time.monotonic() < deadline, "the later partition launched nothing"
            time.sleep(0.01)
        raise BackwardFailedError("a backward that fails on every replica")


class FailsLast(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cast(torch.Tensor, FailsOnceLaunched.apply(x))


@scenario
def a_step_failing_after_its_partitions_launched_all_reduces_refuses_the_next() -> None:
    # Partitions end on their own threads: replicas failing alike had launched different
    # all-reduces (one had partition 1's, the other not yet), and the retried step's
    # met the leftovers: gloo aborted the process on the sizes.
    model = mlp(seed=5)
    model.insert(1, FailsLast())
    pipe = Pipe(model, [3, 7], devices=["cpu"] * 2, chunks=1)
    dp = DataParallel(pipe)
    FailsOnceLaunched.reducer = dp.reducer
    x, y = global_batch(0)
    expect_error(BackwardFailedError, lambda: dp.step(shard(x), shard(y), F.mse_loss))
    for retry in (
        lambda: dp.step(shard(x), shard(y), F.mse_loss),
        lambda: dp(shard(x)),
    ):
        expect_error(RuntimeError, retry, "an earlier step raised on this replica", "End the job")
    for bucket in dp.reducer.buckets:  # partition 1's, launched alike on both: paired
        if bucket.launched:
            bucket.wait()


@scenario
def a_replica_whose_forward_fails_and_goes_on_is_caught_at_the_next_average() -> None:
    # The count of steps began after the forward: rank 1's forward raised, its next step
    # then carried the count of rank 0's current one, and both returned averages of two
    # steps (1.2 off), silently.
    model = mlp(seed=0)
    model.insert(1, RaisesOnRank1Once())
    dp = DataParallel(Pipe(model, [5, 5], devices=["cpu"] * 2, chunks=2))
    outcomes = steps_until_refused(lambda x, y: F.mse_loss(dp(x), y).backward())
    assert outcomes == (["refused"] if rank() == 0 else ["failed", "refused"]), outcomes


class RaisesOnRank1Once(nn.Module):
    calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        RaisesOnRank1Once.calls += 1
        if rank() == 1 and RaisesOnRank1Once.calls == 1:
            raise ReplicaFailureError("a replica's own failure, in its forward")
        return x


@scenario
def mismatched_replicas_raise() -> None:
    out_features = 4 if rank() == 0 else 5
    model = nn.Sequential(nn.Linear(WIDTH, 8), nn.Linear(8, out_features))
    expect_error(
        ValueError,
        lambda: DataParallel(model),
        "'1.weight'",
        "shape",
        "rank 0",
        "rank 1",
    )


@scenario
def different_find_unused_parameters_raise() -> None:
    expect_error(
        ValueError,
        lambda: DataParallel(mlp(seed=12), find_unused_parameters=rank() == 0),
        "find_unused_parameters is True on rank 0 but False on rank 1",
        "same options",
    )


@scenario
def different_bucket_caps_raise() -> None:
    expect_error(
        ValueError,
        lambda: DataParallel(mlp(seed=12), bucket_cap_mb=25 if rank() == 0 else 10),
        "bucket_cap_mb is 25 on rank 0 but 10 on rank 1",
        "same options",
    )


def check_autograd_grad_raises(find_unused: bool) -> None:
    """autograd.grad through DataParallel fails on every rank, and the next step works."""
    pipe, plain = pipe_and_plain(seed=13, checkpoint="except_last")
    for model in (pipe, mlp(seed=13)):
        full_batch = copy.deepcopy(plain if model is pipe else model)
        dp = DataParallel(model, find_unused_parameters=find_unused)
        x, y = global_batch(0)
        loss = F.mse_loss(dp(shard(x)), shard(y))
        expect_error(
            RuntimeError,
            lambda loss=loss, dp=dp: torch.autograd.grad(loss, list(dp.parameters())),
            "no parameter received a gradient",
            "torch.autograd.grad() through DataParallel is not supported",
            "loss.backward()",
        )
        F.mse_loss(dp(shard(x)), shard(y)).backward()
        F.mse_loss(full_batch(x), y).backward()
        assert_grads_close(model, full_batch, f"{type(model).__name__}: backward after the error")


@scenario
def autograd_grad_without_find_unused_raises() -> None:
    check_autograd_grad_raises(find_unused=False)


@scenario
def autograd_grad_with_find_unused_raises() -> None:
    check_autograd_grad_raises(find_unused=True)


class Bypass(nn.Module):
    """A linear layer, or on request a path from the input to the output that skips it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(14)
        self.linear = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor, bypass: bool = False) -> torch.Tensor:
        return x.mean(dim=1, keepdim=True) if bypass else self.linear(x)


@scenario
def rank_without_any_gradient_with_flag() -> None:
    # Rank 1's loss depends on no parameter: legitimate with the flag, so no
    # rank may take it for torch.autograd.grad.
    model = Bypass()
    replicas = [copy.deepcopy(model) for _ in range(world())]
    dp = DataParallel(model, find_unused_parameters=True)
    x, y = global_batch(0)
    inputs = shard(x).requires_grad_()
    F.mse_loss(dp(inputs, bypass=rank() == 1), shard(y)).backward()
    assert inputs.grad is not None
    for r, replica in enumerate(replicas):
        F.mse_loss(replica(shard(x, r).requires_grad_(), bypass=r == 1), shard(y, r)).backward()
    for name, param in model.named_parameters():
        shares = [dict(rep.named_parameters())[name].grad for rep in replicas]
        expected = sum(torch.zeros_like(param) if g is None else g for g in shares) / world()
        assert param.grad is not None, f"{name} has no gradient"
        torch.testing.assert_close(param.grad, expected, msg=lambda m, n=name: f"{n}: {m}")


# ------------------------------------------------- partitioned ("pipeline") models


class PartitionDone(torch.autograd.Function):
    """Identity whose backward reports that a partition finished one micro-batch."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, signal: Callable[[], None]) -> torch.Tensor:
        ctx.signal = signal
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.signal()
        return grad, None


class MicroBatched(nn.Module):
    """Runs partitions over micro-batches, each checkpointed like a pipeline does.

    With reentrant checkpointing each micro-batch's backward is a backward of
    its own, so every parameter's gradient accumulator runs `chunks` times.
    """

    def __init__(self, partitions: list[nn.Sequential], chunks: int) -> None:
        super().__init__()
        self.partitions = nn.ModuleList(partitions)
        self.chunks = chunks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outputs = []
        for micro_batch in x.chunk(self.chunks):
            hidden = micro_batch
            for j, part in enumerate(self.partitions):
                hidden = PartitionDone.apply(hidden, partial(self.micro_batch_done, j))
                hidden = (
                    checkpoint(part, hidden, use_reentrant=True)
                    if hidden.requires_grad
                    else part(hidden)
                )
            outputs.append(hidden)
        return torch.cat(outputs)

    def micro_batch_done(self, partition: int) -> None:
        """Called after each micro-batch's backward through `partition`."""


def two_partitions(seed: int) -> list[nn.Sequential]:
    layers = list(mlp(seed))
    return [nn.Sequential(*layers[:4]), nn.Sequential(*layers[4:])]


def pipe_and_plain(seed: int, checkpoint: str) -> tuple[Pipe, nn.Sequential]:
    """A two-partition CPU Pipe and, with equal weights, the plain Sequential it wraps."""
    torch.manual_seed(seed)
    layers = [nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, 1)]
    plain = nn.Sequential(*copy.deepcopy(layers))
    pipe = Pipe(
        nn.Sequential(*layers),
        balance=[2, 2],
        devices=["cpu", "cpu"],
        chunks=4,
        checkpoint=checkpoint,
    )
    return pipe, plain


@scenario
def pipe_step_matches_full_batch() -> None:
    # Every schedule, with a partition backward hook that signals from the workers.
    for schedule in ("gpipe", "1f1b", "zb-h1"):
        for mode in ("always", "never"):
            pipe, full_batch = pipe_and_plain(seed=19, checkpoint=mode)
            dp = DataParallel(pipe, **SMALL_BUCKETS)
            launched: list[int] = []
            pipe.register_partition_backward_hook(launched.append)
            for step in range(2):
                x, y = global_batch(step)
                dp.step(shard(x), shard(y), F.mse_loss, schedule=schedule)
                F.mse_loss(full_batch(x), y).backward()
            assert sorted(launched) == [0, 0, 1, 1], launched
            assert_grads_close(pipe, full_batch, f"DataParallel(Pipe).step, {schedule}, {mode}")
    with no_sync_of(DataParallel(pipe_and_plain(seed=19, checkpoint="never")[0])) as dp:
        x, y = global_batch(0)
        dp.step(shard(x), shard(y), F.mse_loss)
    expect_error(
        TypeError,
        lambda: DataParallel(mlp(seed=19)).step(x, y, F.mse_loss),
        "has none (pipeline.Pipe does)",
    )


class TiedOut(nn.Module):
    """An output layer that reads another layer's weight (tied), as a language model's head."""

    def __init__(self, tied: nn.Linear) -> None:
        super().__init__()
        self.weight = tied.weight

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return (h @ self.weight).sum(dim=1, keepdim=True)


@scenario
def a_weight_tied_across_devices_is_reduced_once_and_matches_full_batch() -> None:
    # cpu:0 and cpu:1 are two devices to the Pipe: the head borrows the first layer's weight.
    for schedule in ("1f1b", "zb-h1", None):
        torch.manual_seed(23)
        first = nn.Linear(WIDTH, WIDTH)
        model = nn.Sequential(first, nn.Tanh(), nn.Linear(WIDTH, WIDTH), TiedOut(first))
        plain = copy.deepcopy(model)
        pipe = Pipe(model, [2, 2], devices=["cpu:0", "cpu:1"], chunks=4, checkpoint="except_last")
        dp = DataParallel(pipe, **SMALL_BUCKETS)
        optimizer = torch.optim.SGD(dp.parameters(), lr=0.1)
        plain_optimizer = torch.optim.SGD(plain.parameters(), lr=0.1)
        for step in range(2):
            x, y = global_batch(step)
            optimizer.zero_grad()
            plain_optimizer.zero_grad()
            if schedule is None:
                F.mse_loss(dp(shard(x)), shard(y)).backward()
            else:
                dp.step(shard(x), shard(y), F.mse_loss, schedule=schedule)
            F.mse_loss(plain(x), y).backward()
            assert_grads_close(pipe, plain, f"tied across devices, {schedule}, step {step}")
            optimizer.step()
            plain_optimizer.step()
        assert pipe[3].weight is pipe[0].weight
        assert_params_close(pipe, plain, f"tied across devices, {schedule}, after SGD")
        assert_equal_on_all_ranks(list(pipe.parameters()), f"tied across devices, {schedule}")
        pipe.close()


@scenario
def a_mean_over_every_replicas_tokens_with_a_divisor() -> None:
    # Replicas holding different numbers of tokens: each divides its summed
    # loss by the global count over the number of replicas, which averaging
    # turns into the plain model's mean over every token.
    torch.manual_seed(20)
    layers = [nn.Embedding(5, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, 5)]
    full_batch = nn.Sequential(*copy.deepcopy(layers))
    dp = DataParallel(Pipe(nn.Sequential(*layers), [2, 2], devices=["cpu"] * 2, chunks=2))
    gen = torch.Generator().manual_seed(21)
    tokens = torch.randint(0, 5, (4 * world(), 3), generator=gen)
    targets = torch.randint(0, 5, (4 * world(), 3), generator=gen)
    targets[: 2 * world(), 1:] = -100  # rank 0's shard keeps the fewest
    count = (shard(targets) != -100).sum()
    dist.all_reduce(count)

    def summed(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output.flatten(0, 1), target.flatten(), reduction="sum")

    loss = dp.step(
        shard(tokens), shard(targets), summed, loss_reduction="sum", loss_divisor=count / world()
    )
    expected = F.cross_entropy(full_batch(tokens).flatten(0, 1), targets.flatten())
    expected.backward()
    dist.all_reduce(loss)
    torch.testing.assert_close(loss / world(), expected.detach())
    assert_grads_close(dp.module, full_batch, "the mean over every replica's tokens")


@scenario
def pipe_of_a_split_model_matches_full_batch() -> None:
    """A model with its own forward (early values used at the end), split, in DataParallel."""
    torch.manual_seed(23)
    model = EarlyLate(width=WIDTH)
    full_batch = copy.deepcopy(model)
    x, _ = global_batch(0)
    pipe = Pipe(pipeline.split(model, (x[:4],)), [2, 4], devices=["cpu", "cpu"], chunks=2)
    dp = DataParallel(pipe, **SMALL_BUCKETS)
    for step, schedule in enumerate(("1f1b", "gpipe", "call")):
        x, _ = global_batch(step)
        y = torch.sin(x[:, :3])
        if schedule == "call":
            F.mse_loss(dp(shard(x)), shard(y)).backward()
        else:
            dp.step(shard(x), shard(y), F.mse_loss, schedule=schedule)
        F.mse_loss(full_batch(x), y).backward()
        assert_grads_close(pipe, full_batch, f"DataParallel(Pipe(split model)), {schedule}")
    assert [name for name, _ in pipe.named_parameters()] == [
        name for name, _ in full_batch.named_parameters()
    ]


@contextmanager
def no_sync_of(dp: DataParallel) -> Iterator[DataParallel]:
    """``dp`` inside its no_sync(): its step must leave local, unaveraged gradients."""
    with dp.no_sync():
        yield dp
    local = [p.grad.clone() for p in dp.parameters() if p.grad is not None]
    assert local, "no_sync step left no gradient"
    other = [g.clone() for g in local]
    for g in other:
        dist.broadcast(g, 0)
    differs = any(not torch.equal(a, b) for a, b in zip(local, other, strict=True))
    assert differs or rank() == 0, "no_sync step averaged the gradients"


@scenario
def torch_ddp_wraps_a_checkpointed_pipe() -> None:
    # Each parameter's gradient is accumulated once per backward inside a Pipe.
    for mode in ("always", "except_last", "never"):
        pipe, full_batch = pipe_and_plain(seed=17, checkpoint=mode)
        ddp = DistributedDataParallel(pipe)
        for step in range(2):
            x, y = global_batch(step)
            F.mse_loss(ddp(shard(x)), shard(y)).backward()
            F.mse_loss(full_batch(x), y).backward()
        assert_grads_close(pipe, full_batch, f"torch DDP around a Pipe, {mode}")


def check_pipe(checkpoint: str, as_view: bool) -> None:
    pipe, full_batch = pipe_and_plain(seed=7, checkpoint=checkpoint)
    dp = DataParallel(pipe, gradient_as_bucket_view=as_view, **SMALL_BUCKETS)
    what = f"checkpoint={checkpoint} as_view={as_view}"

    owner = {id(p): j for j, part in enumerate(pipe.partitions) for p in part.parameters()}
    for bucket in dp.reducer.buckets:
        assert len({owner[id(p)] for p in bucket.params}) == 1, f"{what}: a bucket spans partitions"
    launched_when_signalled: dict[int, list[bool]] = {}
    pipe.register_partition_backward_hook(
        lambda j: launched_when_signalled.setdefault(
            j, [b.launched for b in dp.reducer.buckets if owner[id(b.params[0])] == j]
        )
    )
    opt = torch.optim.SGD(dp.parameters(), lr=0.05)
    full_opt = torch.optim.SGD(full_batch.parameters(), lr=0.05)
    for step in range(3):
        x, y = global_batch(step)
        opt.zero_grad()
        full_opt.zero_grad()
        F.mse_loss(dp(shard(x)), shard(y)).backward()
        F.mse_loss(full_batch(x), y).backward()
        assert_grads_close(pipe, full_batch, f"{what} step {step}")
        opt.step()
        full_opt.step()
    signalled = launched_when_signalled.get(1)
    assert signalled and all(signalled), f"{what}: partition 1 not reduced when signalled"
    assert 0 not in launched_when_signalled, f"{what}: partition 0's input needs no grad"
    assert_equal_on_all_ranks(list(pipe.parameters()), f"{what}: parameter after 3 steps")


@scenario
def pipe_matches_full_batch() -> None:
    check_pipe(checkpoint="except_last", as_view=False)
    check_pipe(checkpoint="always", as_view=True)
    check_pipe(checkpoint="never", as_view=False)


@scenario
def pipe_two_forwards_one_backward_raises() -> None:
    pipe, _ = pipe_and_plain(seed=10, checkpoint="except_last")
    dp = DataParallel(pipe)
    x, y = global_batch(0)
    loss = F.mse_loss(dp(shard(x)), shard(y)) + F.mse_loss(dp(shard(x)), shard(y))
    expect_error(RuntimeError, loss.backward, "signalled the end of its backward twice", "no_sync")


@scenario
def repeated_accumulation_without_protocol_raises() -> None:
    model = MicroBatched(two_partitions(seed=8), chunks=2)
    dp = DataParallel(model)
    x, y = global_batch(0)
    loss = F.mse_loss(dp(shard(x)), shard(y))
    expect_error(RuntimeError, loss.backward, "twice", "register_partition_backward_hook")


@scenario
def different_balance_raises() -> None:
    torch.manual_seed(15)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(4)])
    balance = [2, 2] if rank() == 0 else [1, 3]
    expect_error(
        ValueError,
        lambda: DataParallel(Pipe(model, balance, devices=["cpu", "cpu"], chunks=2)),
        "parameter '1.weight' is in pipeline partition 0 on rank 0 but pipeline partition 1 "
        "on rank 1",
        "same balance",
    )


class HalfUsed(nn.Module):
    """A layer with a spare linear layer that its forward never uses."""

    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(WIDTH, WIDTH)
        self.spare = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


@scenario
def pipe_unused_parameter_without_flag_raises() -> None:
    torch.manual_seed(16)
    layers = [nn.Linear(WIDTH, WIDTH), nn.Tanh(), HalfUsed(), nn.Linear(WIDTH, 1)]
    pipe = Pipe(nn.Sequential(*layers), balance=[2, 2], devices=["cpu", "cpu"], chunks=2)
    dp = DataParallel(pipe)
    x, y = global_batch(0)
    loss = F.mse_loss(dp(shard(x)), shard(y))
    expect_error(RuntimeError, loss.backward, "'2.spare.weight'", "find_unused_parameters=True")


# ---------------------------------------------------------------------- NCCL


@scenario
def nccl_step_on_the_current_gpu() -> None:
    # NCCL moves CUDA tensors only: the replica check must gather on this
    # rank's GPU, the one init_process_group_from_env selected.
    group = dist.group.WORLD
    assert group is not None
    assert collective_device(group) == torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    model = mlp(seed=17).cuda()
    full_batch = copy.deepcopy(model)
    dp = DataParallel(model, **SMALL_BUCKETS)
    x, y = (t.cuda() for t in global_batch(0))
    F.mse_loss(dp(shard(x)), shard(y)).backward()
    F.mse_loss(full_batch(x), y).backward()
    assert_grads_close(model, full_batch, "NCCL DataParallel vs full batch")


# --------------------------------------------------------------------- faults


@scenario
@breaks_group
def peer_dies_mid_step() -> None:
    dp = DataParallel(mlp(seed=9))
    x, y = global_batch(0)
    loss = F.mse_loss(dp(shard(x)), shard(y))
    if rank() == 1:
        raise SimulatedCrashError
    expect_error(RuntimeError, loss.backward, "all-reduce of gradient bucket", "rank 0")


@scenario
@breaks_group
def peer_stalls_mid_step() -> None:
    dp = DataParallel(mlp(seed=9))
    x, y = global_batch(0)
    loss = F.mse_loss(dp(shard(x)), shard(y))
    if rank() == 1:
        # Alive but silent for longer than the process group's timeout.
        time.sleep(gloo_groups.PG_TIMEOUT_S + 1)
        return
    expect_error(RuntimeError, loss.backward, "all-reduce of gradient bucket", "rank 0")


@scenario
@breaks_group
def peer_stalls_before_the_count_of_steps() -> None:
    # The gradients averaged, one replica silent before the all-reduce of the replicas'
    # step counts: its peer's error names that all-reduce (it was gloo's bare timeout).
    dp = DataParallel(mlp(seed=9))
    x, y = global_batch(0)
    loss = F.mse_loss(dp(shard(x)), shard(y))
    if rank() == 1:
        dp.reducer._check_same_step = lambda: time.sleep(gloo_groups.PG_TIMEOUT_S + 1)  # type: ignore[method-assign]
        expect_error(RuntimeError, loss.backward, "DataParallel: ")  # its peer left meanwhile
        return
    expect_error(RuntimeError, loss.backward, "all-reduce of the replicas' counts of steps")


if __name__ == "__main__":
    main()
