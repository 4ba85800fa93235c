"""DistributedPipe scenarios: stages in separate processes, run by every rank of a gloo group.

Started by tests/gloo_groups.py's run_group with
``script=stage_scenarios.py``; the runner and its helpers are that module's.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import pickle
import struct
import sys
import time
import warnings
from collections import Counter, namedtuple
from collections.abc import Callable
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from pipeline import DataParallel, DeferredBatchNorm, Pipe
from pipeline.distributed import DistributedPipe, PeerError
from pipeline.migration import from_partitioned_state_dict
from pipeline.schedules import (
    GPipe,
    Interleaved1F1B,
    OneFOneB,
    ProgramError,
    Programs,
    Schedule,
    resolve_schedule,
)
from pipeline.skip import Namespace
from pipeline.step.runner import forward_programs
from tests import gloo_groups
from tests.distributed import (
    checkpoint_scenarios,  # noqa: F401 (its scenarios run here too)
    closing_scenarios,  # noqa: F401 (its scenarios run here too)
)
from tests.gloo_groups import (
    SimulatedCrashError,
    breaks_group,
    calls_counted,
    expect_error,
    main,
    rank,
    scenario,
    world,
)
from tests.helpers import Pop, Stash, shared_skip_model, task_names

WIDTH = 8
MODES = ("always", "except_last", "never")
# The collectives a step could call, counted where a step must call none but its agreement.
COLLECTIVES = ("all_gather", "all_reduce", "broadcast", "barrier", "all_gather_object")


def block() -> nn.Module:
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh())


def blocks(count: int, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*(block() for _ in range(count))).double()


def batch(rows: int = 10, seed: int = 1) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, WIDTH, generator=gen, dtype=torch.double)
    return x, torch.randn(rows, WIDTH, generator=gen, dtype=torch.double)


def assert_grads_equal(pipe: nn.Module, plain: nn.Module, what: str) -> None:
    reference = dict(plain.named_parameters(remove_duplicate=False))
    names = [name for name, _ in pipe.named_parameters()]
    assert names, f"{what}: this process holds no parameter"
    for name, param in pipe.named_parameters():
        assert param.grad is not None, f"{what}: {name} has no gradient"
        torch.testing.assert_close(param.grad, reference[name].grad, msg=f"{what}: {name}")


def schedules(stages: int) -> list[Any]:
    """One stage per process runs the flat schedules; more stages run interleaved."""
    if stages == world():
        return ["gpipe", "1f1b", "zb-h1", "zb-h1-peak"]
    return [Interleaved1F1B(virtual=stages // world())]


def count_calls(pipe: DistributedPipe) -> list[int]:
    """How often the first layer of each of this process's stages runs (recomputation too)."""
    calls = [0] * len(pipe.local_stages)
    for k, s in enumerate(pipe.local_stages):

        def count(*_: Any, k: int = k) -> None:
            calls[k] += 1

        pipe.partitions[s][0].register_forward_hook(count)
    return calls


def check_every_schedule_and_mode(stages: int) -> None:
    plain = blocks(2 * stages)
    x, y = batch()
    expected = F.mse_loss(plain(x), y)
    expected.backward()
    for schedule in schedules(stages):
        for mode in MODES:
            chunks = 4 if isinstance(schedule, str) else 2 * world()
            what = f"{schedule}, {mode}, {stages} stages on {world()} processes"
            pipe = DistributedPipe(blocks(2 * stages), [2] * stages, chunks=chunks, checkpoint=mode)
            calls = count_calls(pipe)
            ends = (0 in pipe.local_stages, stages - 1 in pipe.local_stages)
            loss = pipe.step(
                x if ends[0] else None, y if ends[1] else None, F.mse_loss, schedule=schedule
            )
            torch.testing.assert_close(loss, expected.detach(), msg=what)
            assert_grads_equal(pipe, plain, what)
            recomputed = {"never": [0], "always": [chunks], "except_last": range(chunks)}[mode]
            assert all(c - chunks in recomputed for c in calls), f"{what}: {calls} calls"
            pipe.close()


@scenario
def every_schedule_and_mode_equals_the_plain_model() -> None:
    check_every_schedule_and_mode(stages=world())


@scenario
def interleaved_stages_equal_the_plain_model() -> None:
    check_every_schedule_and_mode(stages=2 * world())


def skipping_model() -> nn.Sequential:
    """A skip from the first stage to the last, and one into the middle (2 per stage)."""
    torch.manual_seed(2)
    outer, inner = Namespace("outer"), Namespace("inner")
    layers: list[nn.Module] = [block() for _ in range(2 * world())]
    layers[0] = nn.Sequential(Stash(WIDTH).isolate(outer), Stash(WIDTH).isolate(inner))
    layers[-1] = nn.Sequential(block(), Pop(WIDTH).isolate(outer))
    layers[2] = nn.Sequential(block(), Pop(WIDTH).isolate(inner))
    return nn.Sequential(*layers).double()


def skip_messages(received: dict[tuple[int, str], int]) -> dict[tuple[int, str], int]:
    return {k: n for k, n in received.items() if k[1].startswith("skip")}


def expected_skip_messages(chunks: int) -> dict[tuple[int, str], int]:
    """The skip tensors (and their gradients) of skipping_model, straight between their ends."""
    inner_pop, outer_pop = 1, world() - 1
    expected: dict[tuple[int, str], int] = {}
    if rank() in (inner_pop, outer_pop):
        expected[0, "skip"] = chunks * ((rank() == inner_pop) + (rank() == outer_pop))
    if rank() == 0:
        expected[inner_pop, "skip-grad"] = chunks
        expected[outer_pop, "skip-grad"] = expected.get((outer_pop, "skip-grad"), 0) + chunks
    return expected


@scenario
def skips_go_straight_to_non_adjacent_processes() -> None:
    plain = skipping_model()
    x, y = batch()
    F.mse_loss(plain(x), y).backward()
    for schedule in ("gpipe", "1f1b", "zb-h1"):
        for mode in ("always", "never"):
            pipe = DistributedPipe(skipping_model(), [2] * world(), chunks=3, checkpoint=mode)
            pipe.step(x, y, F.mse_loss, schedule=schedule)
            assert_grads_equal(pipe, plain, f"skips, {schedule}, {mode}")
            assert pipe.last_step is not None
            assert skip_messages(pipe.last_step.received) == expected_skip_messages(chunks=3)
            pipe.close()


@scenario
def a_model_on_the_meta_device_is_materialised_stage_by_stage() -> None:
    plain = blocks(2 * world(), seed=3)
    with torch.device("meta"):
        meta = blocks(2 * world(), seed=3)
    pipe = DistributedPipe(meta, [2] * world(), chunks=2)
    assert not any(p.is_meta for p in pipe.parameters())
    mine = {2 * rank(), 2 * rank() + 1}
    for index, layer in enumerate(meta):
        held = index in mine
        assert all(p.is_meta != held for p in layer.parameters()), f"layer {index}"
    assert [name for name, _ in pipe.named_parameters()] == [
        name for name, _ in plain.named_parameters() if int(name.split(".")[0]) in mine
    ]
    deeper = {**plain.state_dict(), "99.weight": torch.zeros(1)}  # a key the model lacks
    expect_error(RuntimeError, lambda: pipe.load_state_dict(deeper), "Unexpected key(s)", "99.w")
    # A key of this process's missing, or of another shape: torch's load changed the rest
    # first; here nothing is loaded.
    before = [p.detach().clone() for p in pipe.parameters()]
    last = f"{2 * rank() + 1}.0.bias"
    lacking = {k: v for k, v in plain.state_dict().items() if k != last}
    expect_error(RuntimeError, lambda: pipe.load_state_dict(lacking), "Missing key(s)", last)
    wider = {**plain.state_dict(), last: torch.zeros(WIDTH + 1, dtype=torch.double)}
    expect_error(RuntimeError, lambda: pipe.load_state_dict(wider), "size mismatch", last)
    assert all(torch.equal(a, b) for a, b in zip(before, pipe.parameters(), strict=True))
    pipe.load_state_dict(plain.state_dict())
    x, y = batch()
    pipe.step(x, y, F.mse_loss)
    F.mse_loss(plain(x), y).backward()
    assert_grads_equal(pipe, plain, "from the meta device")
    pipe.close()
    # An init giving weights their values and leaving a BatchNorm's statistics alone: they
    # would hold whatever memory held. Refused where they are, heard by every process.
    with torch.device("meta"):
        normed = nn.Sequential(*blocks(2 * world() - 1), nn.BatchNorm1d(WIDTH).double())
    name = f"{2 * world() - 1}.running_mean"
    heard = [] if rank() == world() - 1 else ["a process of this job refused"]
    build = partial(DistributedPipe, normed, [2] * world(), init=weights_only)
    expect_error(Exception, build, f"{name}, ", *heard)  # the reason, on every process
    # An init raising on one process only: every process hears it (the others waited in
    # the next collective until the group's timeout).
    with torch.device("meta"):
        failing = blocks(2 * world())
    build = partial(DistributedPipe, failing, [2] * world(), init=fails_on_the_last_process)
    expect_error(Exception, build, "no weight here", *heard)
    # Interrupted there (^C), the process living on: the others hear it too.
    with torch.device("meta"):
        failing = blocks(2 * world())
    build = partial(DistributedPipe, failing, [2] * world(), init=interrupted_on_the_last_process)
    if rank() == world() - 1:
        try:
            build()
            raise AssertionError("the interrupt was swallowed")
        except KeyboardInterrupt:
            pass
    else:
        expect_error(RuntimeError, build, "a process of this job refused")


def fails_on_the_last_process(module: nn.Module) -> None:
    if rank() == world() - 1:
        raise AttributeError("no weight here")
    weights_only(module)


def fails_on_rank_0(module: nn.Module) -> None:
    if rank() == 0:
        raise AttributeError("no weight on rank 0")
    weights_only(module)


def interrupted_on_the_last_process(module: nn.Module) -> None:
    if rank() == world() - 1:
        raise KeyboardInterrupt
    weights_only(module)


def weights_only(module: nn.Module) -> None:
    for parameter in module.parameters(recurse=False):
        nn.init.ones_(parameter)


class HalfInit(nn.Module):
    """Initialises its child its own way: its reset must win over the child's."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.constant_(self.linear.weight, 0.5)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear(x)


class Scale(nn.Module):
    """A parameter of its own and no reset_parameters: not materialisable from meta."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(WIDTH))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.scale


@scenario
def meta_layers_get_their_own_reset_and_real_layers_keep_their_values() -> None:
    with torch.device("meta"):
        model = nn.Sequential(*(HalfInit() for _ in range(2 * world())))
    real = nn.Linear(WIDTH, WIDTH)
    model[-1] = real
    kept = real.weight.detach().clone()
    pipe = DistributedPipe(model, [2] * world(), chunks=2)
    for s in pipe.local_stages:
        for layer in pipe.partitions[s]:
            if layer is real:
                assert torch.equal(real.weight, kept), "the real layer lost its values"
            else:
                assert torch.equal(layer.linear.weight, torch.full((WIDTH, WIDTH), 0.5))
    pipe.close()
    with torch.device("meta"):
        unresettable = nn.Sequential(*(Scale() for _ in range(2 * world())))
    expect_error(
        ValueError,
        lambda: DistributedPipe(unresettable, [2] * world()),
        "layer 0 (Scale) holds tensors on the meta device",
        "reset_parameters",
    )


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.token = nn.Embedding(11, WIDTH)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.token(tokens)


class Head(nn.Module):
    def __init__(self, embedding: nn.Embedding) -> None:
        super().__init__()
        self.embedding = embedding

    def forward(self, x: Tensor) -> Tensor:
        return x @ self.embedding.weight.t()


def tied_model() -> nn.Sequential:
    torch.manual_seed(4)
    embed = Embed()
    layers = [embed, *(block() for _ in range(2 * world() - 2)), Head(embed.token)]
    return nn.Sequential(*layers).double()


@scenario
def tied_weights_across_processes_stay_equal_and_train_like_the_plain_model() -> None:
    plain = tied_model()
    pipe = DistributedPipe(tied_model(), [2] * world(), chunks=2)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(5)
    for step in range(3):
        tokens = torch.randint(0, 11, (6,), generator=gen)
        targets = torch.randint(0, 11, (6,), generator=gen)
        plain_opt.zero_grad()
        F.cross_entropy(plain(tokens), targets).backward()
        plain_opt.step()
        opt.zero_grad()
        pipe.step(tokens, targets, F.cross_entropy)
        opt.step()
        reference = dict(plain.named_parameters(remove_duplicate=False))
        for name, param in pipe.named_parameters():
            torch.testing.assert_close(param, reference[name], msg=f"step {step}: {name}")
    check_frozen_tie(plain, pipe, tokens, targets)
    # A state dict whose names of the tied weight hold other values: the plain model
    # loads both into its one tensor, the last stays; so does every holder here.
    state = {key: value.clone() for key, value in plain.state_dict().items()}
    state[next(k for k in state if is_tied(k))] += 1
    plain.load_state_dict(state)
    pipe.load_state_dict(state)
    reference = dict(plain.named_parameters(remove_duplicate=False))
    for name, param in pipe.named_parameters():
        torch.testing.assert_close(param, reference[name], msg=f"loaded: {name}")
    # Untied after the pipe was built, on the last process: refused by every process, with
    # the way out (the pipe sums the tied parameters it found at construction).
    if rank() == world() - 1:
        embedding = pipe.partitions[-1][-1].embedding
        embedding.weight = nn.Parameter(embedding.weight.detach().clone())
    refused = "build a new DistributedPipe from the untied model"
    expect_error(ValueError, lambda: pipe.step(tokens, targets, F.cross_entropy), refused)
    pipe.close()


def check_frozen_tie(plain: nn.Module, pipe: DistributedPipe, tokens: Tensor, y: Tensor) -> None:
    """A tied weight frozen by one holder is refused everywhere; frozen by all, it is frozen."""
    tied = [p for name, p in pipe.named_parameters(remove_duplicate=False) if is_tied(name)]
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    opt.zero_grad()
    for param in tied if rank() == 0 else []:
        param.requires_grad_(False)
    step = lambda: pipe.step(tokens, y, F.cross_entropy)  # noqa: E731
    expect_error(ValueError, step, f"on rank(s) [0] but trained on [{world() - 1}]")
    assert all(p.grad is None for p in pipe.parameters()), "the refused step wrote .grad"
    for param in tied:
        param.requires_grad_(False)
    next(p for name, p in plain.named_parameters() if is_tied(name)).requires_grad_(False)
    plain.zero_grad()
    F.cross_entropy(plain(tokens), y).backward()
    step()
    reference = dict(plain.named_parameters(remove_duplicate=False))
    for name, param in pipe.named_parameters():
        expected = reference[name].grad
        assert (param.grad is None) == (expected is None) == is_tied(name), name
        if expected is not None:
            torch.testing.assert_close(param.grad, expected, msg=f"tie frozen: {name}")
    for param in [*tied, *plain.parameters()]:
        param.requires_grad_(True)


def is_tied(name: str) -> bool:
    """Whether ``name`` is the tied embedding of tied_model (in the first or the last stage)."""
    return name.endswith(("token.weight", "embedding.weight"))


@scenario
def tied_weights_accumulate_over_steps_like_the_plain_model() -> None:
    plain = tied_model()
    model = tied_model()
    raiser = RaiseOnRank(on_rank=world() - 1, error=KeyError("bad batch"))
    raiser.calls = 2  # disarmed: it raises when its count reaches 2
    model.append(raiser)
    balance = [2] * (world() - 1) + [3]
    pipe = DistributedPipe(model, balance, chunks=2, checkpoint="never", timeout=60)
    gen = torch.Generator().manual_seed(18)
    kept: dict[str, Tensor] = {}
    for step in range(3):  # no zero_grad: gradient accumulation
        tokens = torch.randint(0, 11, (6,), generator=gen)
        targets = torch.randint(0, 11, (6,), generator=gen)
        F.cross_entropy(plain(tokens), targets).backward()
        pipe.step(tokens, targets, F.cross_entropy)
        assert_grads_equal(pipe, plain, f"{step + 1} accumulated steps")
        for name, param in pipe.named_parameters():
            if is_tied(name):  # accumulated into, as DataParallel's bucket views need
                assert kept.setdefault(name, cast(Tensor, param.grad)) is param.grad, name
    values = {name: grad.clone() for name, grad in kept.items()}
    raiser.calls = 1  # armed: the next step fails in the last stage
    if rank() == world() - 1:
        expect_error(KeyError, lambda: pipe.step(tokens, targets, F.cross_entropy), "bad batch")
    else:
        expect_error(
            RuntimeError,
            lambda: pipe.step(tokens, targets, F.cross_entropy),
            f"rank {world() - 1} failed",
        )
    for name, param in pipe.named_parameters():
        if is_tied(name):
            assert param.grad is kept[name], f"{name}: the failed step replaced .grad"
            assert torch.equal(param.grad, values[name]), f"{name}: the failed step changed it"
    pipe.close()


@scenario
def clip_grad_norm_clips_by_the_whole_models_norm_counting_tied_weights_once() -> None:
    gen = torch.Generator().manual_seed(6)
    tokens = torch.randint(0, 11, (6,), generator=gen)
    targets = torch.randint(0, 11, (6,), generator=gen)
    # The last balance leaves the last process the tied head alone, counted at the
    # first process: its norm came back in float32 (1.2e-7 off).
    head_alone = [2] * (world() - 2) + [3, 1]
    runs = [(t, [2] * world()) for t in (2.0, 1.0, float("inf"), -float("inf"), 0.0)]
    for norm_type, balance in [*runs, (2.0, head_alone)]:
        plain = tied_model()
        pipe = DistributedPipe(tied_model(), balance, chunks=2)
        F.cross_entropy(plain(tokens), targets).backward()
        pipe.step(tokens, targets, F.cross_entropy)
        expected = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.05, norm_type)
        norm = pipe.clip_grad_norm_(0.05, norm_type)
        assert norm.dtype == expected.dtype, (balance, norm.dtype)
        assert torch.allclose(norm, expected, rtol=1e-12, atol=0), (norm_type, norm, expected)
        assert_grads_equal(pipe, plain, f"clipped by the norm of order {norm_type}")
        pipe.close()
    # Stages of other dtypes: every process reduces its norm in one dtype (bfloat16's
    # and float32's crashed gloo with inf, and clipped by different norms with 2).
    for norm_type in (2.0, float("inf")):
        plain = blocks(2 * world()).float()
        plain[:2].to(torch.bfloat16)  # stage 0, on rank 0
        pipe = DistributedPipe(copy.deepcopy(plain), [2] * world(), chunks=2)
        for model in (plain, pipe):
            for p in model.parameters():
                p.grad = torch.full_like(p, 0.1 + p.numel() % 7)  # grads of their own dtypes
        expected = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.05, norm_type)
        norm = pipe.clip_grad_norm_(0.05, norm_type)
        torch.testing.assert_close(norm, expected, msg=str(norm_type))
        pipe.close()
    # Arguments that differ between the processes: each clipped by its own factor (or
    # reduced its norm with another collective), silently. Refused on every process.
    pipe = DistributedPipe(blocks(2 * world()), [2] * world(), chunks=2)
    x, y = batch()
    pipe.step(x, y, F.mse_loss)
    before = [p.grad.clone() for p in pipe.parameters() if p.grad is not None]
    for max_norm, norm_type in ((0.05 if rank() else 0.02, 2.0), (0.05, 2.0 if rank() else 1.0)):
        expect_error(
            ValueError,
            lambda: pipe.clip_grad_norm_(max_norm, norm_type),  # noqa: B023
            "clip_grad_norm_ was called with different arguments",
            "ranks [0] and ranks",
            "nothing was clipped",
        )
    after = [p.grad for p in pipe.parameters() if p.grad is not None]
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True)), "clipped"
    pipe.close()


def step_in_backward(model: nn.Module) -> dict[int, list[Tensor]]:
    """PyTorch's optimizer-step-in-backward recipe (Adam per parameter): each call's gradient."""
    seen: dict[int, list[Tensor]] = {}
    for param in model.parameters():
        optimizer = torch.optim.Adam([param], lr=0.01)

        def hook(p: Tensor, optimizer: Any = optimizer) -> None:
            seen.setdefault(id(p), []).append(cast(Tensor, p.grad).clone())
            optimizer.step()
            optimizer.zero_grad()

        param.register_post_accumulate_grad_hook(hook)
    return seen


@scenario
def hooks_of_one_backward_fire_once_per_step_with_the_whole_gradient() -> None:
    # Tied across processes too: the hook sees the gradient summed over its holders.
    x, y = batch()
    tokens = torch.randint(0, 11, (6,), generator=torch.Generator().manual_seed(2))
    every = [(s, mode) for s in schedules(world()) for mode in MODES]
    cases: list[tuple[Any, Any, Any, list[tuple[Any, str]]]] = [
        (lambda: blocks(2 * world()), x, y, every),
        (tied_model, tokens, tokens, [("1f1b", "except_last"), ("zb-h1", "always")]),
    ]
    for model_of, inputs, targets, runs in cases:
        loss_fn = F.mse_loss if inputs is x else F.cross_entropy
        plain = model_of()
        seen = step_in_backward(plain)
        loss_fn(plain(inputs), targets).backward()
        reference = dict(plain.named_parameters(remove_duplicate=False))
        for schedule, mode in runs:
            what = f"{schedule}, {mode}"
            pipe = DistributedPipe(model_of(), [2] * world(), chunks=4, checkpoint=mode)
            found = step_in_backward(pipe)
            ends = (0 in pipe.local_stages, world() - 1 in pipe.local_stages)
            pipe.step(
                inputs if ends[0] else None,
                targets if ends[1] else None,
                loss_fn,
                schedule=schedule,
            )
            for name, param in pipe.named_parameters():
                calls, expected = found[id(param)], seen[id(reference[name])]
                assert len(calls) == len(expected) == 1, f"{what}: {name}: {len(calls)} calls"
                torch.testing.assert_close(calls[0], expected[0], msg=f"{what}: {name}")
                torch.testing.assert_close(param, reference[name], msg=f"{what}: {name}")
            pipe.close()


def noisy_model(dtype: torch.dtype, dropout: float = 0.0) -> nn.Sequential:
    """BatchNorm, and dropout if asked, in every stage."""
    torch.manual_seed(14)
    layers: list[nn.Module] = []
    for _ in range(world()):
        layers += [
            nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.BatchNorm1d(WIDTH)),
            nn.Dropout(dropout),
        ]
    return nn.Sequential(*layers).to(dtype)


@scenario
def batch_norm_and_autocast_match_the_single_process_pipe() -> None:
    # Without dropout: a process draws from generators of its own, in its own
    # order, so its masks are not the single-process Pipe's.
    for mode in MODES:
        for autocast in (False, True):
            what = f"{mode}, autocast {autocast}"
            dtype = torch.float32 if autocast else torch.float64  # autocast leaves float64 be
            x, y = (t.to(dtype) for t in batch(rows=12))
            local = Pipe(noisy_model(dtype), [2] * world(), devices=["cpu"] * world(), chunks=3,
                         checkpoint=mode, deferred_batch_norm=True)  # fmt: skip
            # Converted by the pipe, or by the user before it (a pipe defers what it holds).
            given = noisy_model(dtype)
            given = given if autocast else DeferredBatchNorm.convert(given)
            pipe = DistributedPipe(given, [2] * world(), chunks=3, checkpoint=mode,
                                   deferred_batch_norm=autocast)  # fmt: skip
            computed: list[torch.dtype] = []
            backward_autocast: list[bool] = []  # backward runs outside it, as loss.backward()

            def seen(
                module: nn.Module,
                input: object,
                out: torch.Tensor,
                computed: list[torch.dtype] = computed,
                backward: list[bool] = backward_autocast,
            ) -> None:
                computed.append(out.dtype)
                if out.requires_grad:
                    out.register_hook(lambda g: backward.append(torch.is_autocast_enabled("cpu")))

            pipe.partitions[pipe.local_stages[0]][0][0].register_forward_hook(seen)
            for model in (local, pipe):
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                    model.step(x, y, F.mse_loss)
            assert set(computed) == {torch.bfloat16 if autocast else dtype}, what
            assert backward_autocast and not any(backward_autocast), what
            assert_grads_equal(pipe, local, what)
            reference = local.state_dict()
            for key, value in pipe.state_dict().items():
                torch.testing.assert_close(value, reference[key], msg=f"{what}: {key}")
            # A plain dict without num_batches_tracked, which torch's load fills in itself.
            older = {k: v for k, v in reference.items() if not k.endswith("num_batches_tracked")}
            pipe.load_state_dict(older)
            local.close()
            pipe.close()


@scenario
def dropout_is_replayed_exactly_in_every_checkpoint_mode() -> None:
    # A process runs its stages on one thread: it owns its generators and
    # draws with no seeding mode, replaying a checkpointed task's draws from
    # the states it captured.
    x, y = batch(rows=12)
    for schedule in ("gpipe", "1f1b", "zb-h1"):
        found = {}
        for mode in MODES:
            pipe = DistributedPipe(noisy_model(torch.float64, dropout=0.5), [2] * world(),
                                   chunks=3, checkpoint=mode)  # fmt: skip
            torch.manual_seed(15 + rank())
            pipe.step(x, y, F.mse_loss, schedule=schedule)
            found[mode] = {name: p.grad for name, p in pipe.named_parameters()}
            pipe.close()
        for mode in ("always", "except_last"):
            for name, grad in found["never"].items():
                assert torch.equal(found[mode][name], grad), f"{schedule}, {mode}: {name}"


class CompiledBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(self.linear(x))


@scenario
def compiled_stages_compile_and_give_the_plain_models_gradients() -> None:
    import torch._dynamo

    def model() -> nn.Sequential:
        torch.manual_seed(17)
        return nn.Sequential(*(CompiledBlock() for _ in range(2 * world()))).double()

    plain = model()
    x, y = batch()
    F.mse_loss(plain(x), y).backward()
    compiled = model()
    for layer in compiled:
        layer.compile(backend="aot_eager")
    pipe = DistributedPipe(compiled, [2] * world(), chunks=2)
    before = torch._dynamo.utils.counters["frames"]["ok"]
    for schedule in ("gpipe", "1f1b", "zb-h1"):
        pipe.zero_grad()
        pipe.step(x, y, F.mse_loss, schedule=schedule)
        assert_grads_equal(pipe, plain, schedule)
    assert torch._dynamo.utils.counters["frames"]["ok"] > before
    pipe.close()


class Fork(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: Tensor) -> tuple[Tensor, dict[str, Any]]:
        return self.linear(x), {"scale": torch.tanh(x), "times": 3}


class Join(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, pair: tuple[Tensor, dict[str, Any]]) -> Tensor:
        x, extra = pair
        return self.linear(x * extra["scale"]) * extra["times"]


def structured_model() -> nn.Sequential:
    """Each stage ends in a Fork and the next begins with a Join: structures cross processes."""
    torch.manual_seed(16)
    layers: list[nn.Module] = [block(), Fork()]
    for _ in range(world() - 1):
        layers += [Join(), Fork()]
    layers[-1] = block()
    return nn.Sequential(*layers).double()


@scenario
def tuples_dicts_and_plain_values_cross_processes() -> None:
    plain = structured_model()
    x, y = batch()
    F.mse_loss(plain(x), y).backward()
    for schedule in ("gpipe", "1f1b", "zb-h1"):
        pipe = DistributedPipe(structured_model(), [2] * world(), chunks=3, checkpoint="always")
        pipe.step(x, y, F.mse_loss, schedule=schedule)
        assert_grads_equal(pipe, plain, f"structures, {schedule}")
        pipe.close()


@scenario
def every_action_of_step_and_evaluate_shows_under_the_plain_profiler() -> None:
    # On the calling thread: each process runs its actions there.
    pipe = DistributedPipe(blocks(2 * world()), [2] * world(), chunks=3)
    x, y = batch()
    runs = [
        (f"step {schedule}", partial(pipe.step, schedule=schedule), program)
        for schedule in ("1f1b", "zb-h1")
        for program in [resolve_schedule(schedule).programs(3, world())[rank()]]
    ]
    runs.append(("evaluate", pipe.evaluate, forward_programs(3, world(), world())[rank()]))
    for what, run, program in runs:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # nor a warning of threads it cannot see
            with torch.profiler.profile() as prof, torch.profiler.record_function("caller"):
                run(x, y, F.mse_loss)
        threads: dict[str, set[int]] = {}
        for event in prof.events():
            threads.setdefault(event.name, set()).add(event.thread)
        expected = task_names(program)
        assert expected <= threads.keys(), f"{what}: {sorted(expected - threads.keys())}"
        assert set().union(*(threads[name] for name in expected)) == threads["caller"], what
    pipe.close()


@scenario
def a_pause_longer_than_the_group_timeout_and_new_shapes_are_harmless() -> None:
    plain = blocks(2 * world(), seed=12)
    pipe = DistributedPipe(blocks(2 * world(), seed=12), [2] * world(), chunks=2)
    x, y = batch()
    pipe.step(x, y, F.mse_loss)
    time.sleep(gloo_groups.PG_TIMEOUT_S + 1)  # the peers' listeners wait all along
    smaller_x, smaller_y = batch(rows=7, seed=2)  # other shapes: nothing declared up front
    pipe.step(smaller_x, smaller_y, F.mse_loss)
    F.mse_loss(plain(x), y).backward()
    F.mse_loss(plain(smaller_x), smaller_y).backward()
    assert_grads_equal(pipe, plain, "two steps of other shapes with a pause between them")
    dist.barrier()  # the user's group still works
    pipe.close()


class Wrapped(Schedule):
    """A schedule of one's own without a __repr__: every instance prints alike."""

    def __init__(self, inner: Schedule) -> None:
        self.inner = inner

    def programs(self, m: int, stages: int) -> Any:
        return self.inner.programs(m, stages)


@scenario
def bad_arguments_are_refused_by_every_process_before_any_work() -> None:
    expect_error(ValueError, lambda: DistributedPipe(blocks(3), [1, 1, 1]), "multiple of")
    expect_error(ValueError, lambda: DistributedPipe(blocks(2), [1, 1], timeout=0), "timeout")
    # A layer updating state in its forward, in two processes' stages: each kept its own
    # running statistics (0.024 and 0.054 off the plain model's), or vectors.
    for shared in (nn.BatchNorm1d(WIDTH), nn.utils.parametrizations.spectral_norm(block()[0])):
        layers = nn.Sequential(shared, *blocks(2 * world() - 2), shared).double()
        expect_error(
            ValueError,
            partial(DistributedPipe, layers, [1] * (world() - 1) + [world() + 1]),
            f"run by stages of processes [0, {world() - 1}]",
        )
    pipe = DistributedPipe(blocks(2 * world(), seed=13), [2] * world(), chunks=2)
    x, y = batch()
    expect_error(RuntimeError, lambda: pipe(x), "train with pipe.step", "pipe.evaluate(input)")
    expect_error(TypeError, lambda: copy.deepcopy(pipe), "cannot be copied or pickled")
    expect_error(TypeError, lambda: pickle.dumps(pipe), "cannot be copied or pickled")
    message = expect_error(ValueError, lambda: pipe.step(None if rank() == 0 else x, y, F.mse_loss))
    assert ("needs the input" if rank() == 0 else "rank 0 of the pipeline refused") in message
    expect_error(ValueError, lambda: pipe.step(x, y[:-2], F.mse_loss), "target splits into")
    mine = "gpipe" if rank() == 0 else "1f1b"
    expect_error(
        ValueError,
        lambda: pipe.step(x, y, F.mse_loss, schedule=mine),
        "chose different schedules",
        f"ranks [0] and ranks {list(range(1, world()))} chose differently",
        f"this process, rank {rank()}: {'GPipe' if rank() == 0 else 'OneFOneB'}() mean",
    )
    # Schedules of one's own that print alike ("Wrapped()") are told apart by their programs.
    wrapped = Wrapped(GPipe() if rank() == 0 else OneFOneB())
    expect_error(
        ValueError,
        lambda: pipe.step(x, y, F.mse_loss, schedule=wrapped),
        "chose different schedules",
        "Wrapped() (programs for 2 micro-batches: #",
    )
    # A refusal whose text holds a lone surrogate (a file name from os.fsdecode) on one
    # process: it raises its own error, the others hear it (its encoding failed, and they
    # waited for its text until the group's timeout).
    unreadable = FileNamed(os.fsdecode(b"/data/programs\xff.txt"))
    heard = "no programs in /data/programs" if rank() == 0 else "rank 0 of the pipeline refused"
    schedule = unreadable if rank() == 0 else "1f1b"
    expect_error(ValueError, lambda: pipe.step(x, y, F.mse_loss, schedule=schedule), heard)
    # Programs whose stages are not their processes' (program r runs in process r).
    swapped = Programs([f"{s}F0 {s}F1 {s}B0 {s}B1" for s in reversed(range(world()))])
    expect_error(
        ProgramError, lambda: pipe.step(x, y, F.mse_loss, schedule=swapped), "runs in process"
    )
    # A hook on the pipe itself (rank 0's), or a layer set on it (the last rank's): a step
    # runs neither, so every process refuses it.
    hook = pipe.register_forward_hook(lambda module, args, output: output) if rank() == 0 else None
    refused = "registered on itself" if rank() == 0 else "rank 0 of the pipeline refused"
    expect_error(ValueError, lambda: pipe.step(x, y, F.mse_loss), refused)
    hook.remove() if hook is not None else None
    last, name = rank() == world() - 1, str(2 * world() - 1)
    held = getattr(pipe, name) if last else None
    setattr(pipe, name, block().double()) if last else None
    refused = "changed after it was built" if last else f"rank {world() - 1} of the pipeline"
    expect_error(Exception, lambda: pipe.step(x, y, F.mse_loss), refused)
    setattr(pipe, name, held) if last else None
    assert all(p.grad is None for p in pipe.parameters()), "a refused step computed something"
    pipe.step(x, y, F.mse_loss)
    plain = blocks(2 * world(), seed=13)
    F.mse_loss(plain(x), y).backward()
    assert_grads_equal(pipe, plain, "the step after refused ones")
    pipe.close()
    # Forwards out of micro-batch order, where the last stage's BatchNorm would take its
    # updates in that order: refused there, in the agreement, so by every process.
    # Checked on the step's own programs: a schedule reordering them only for fewer
    # micro-batches than chunks (a batch of 4 rows in 2) passed, checked for chunks.
    norm = nn.BatchNorm1d(WIDTH).double()
    layers = nn.Sequential(*blocks(2 * world() - 1, seed=14), norm)
    ordered = DistributedPipe(layers, [2] * world(), chunks=3)
    refused = "runs the forward of micro-batch" if last else f"rank {world() - 1} of the pipeline"
    for schedule, rows in ((Programs(reordered_programs(3)), 10), (ReorderedWhenFewer(), 4)):
        expect_error(Exception, partial(ordered.step, x[:rows], y[:rows], F.mse_loss,
                                        schedule=schedule), refused)  # fmt: skip
        assert all(p.grad is None for p in ordered.parameters()), "a refused step computed"
        assert not (last and norm.num_batches_tracked.item()), "a refused step updated statistics"
    ordered.close()
    # A BatchNorm put in after deferred_batch_norm=True converted the model's, on the last
    # process alone: it would update once per micro-batch; refused by every process.
    layers = blocks(2 * world(), seed=15)
    deferring = DistributedPipe(layers, [2] * world(), chunks=2, deferred_batch_norm=True)
    layers[-1].append(nn.BatchNorm1d(WIDTH).double()) if last else None
    refused = "is a BatchNorm1d put in after" if last else f"rank {world() - 1} of the pipeline"
    expect_error(ValueError, lambda: deferring.step(x, y, F.mse_loss), refused)
    assert all(p.grad is None for p in deferring.parameters()), "a refused step computed"
    deferring.close()


class FileNamed(OneFOneB):
    """A schedule of one's own that refuses, naming a file."""

    def __init__(self, path: str) -> None:
        self.path = path

    def workers(self, stages: int) -> int:
        raise ValueError(f"no programs in {self.path}")


def reordered_programs(m: int) -> list[str]:
    """Programs running each stage's forwards in reverse micro-batch order."""
    return [
        " ".join([*(f"{s}F{i}" for i in reversed(range(m))), *(f"{s}B{i}" for i in range(m))])
        for s in range(world())
    ]


class ReorderedWhenFewer(Schedule):
    """GPipe's programs for 3 micro-batches; for fewer, each stage's forwards reversed."""

    def programs(self, m: int, stages: int) -> Any:
        if m >= 3:
            return GPipe().programs(m, stages)
        return reordered_programs(m)  # as texts, which a schedule may give


class Scores(nn.Module):
    """Ends a model: a dict of a tensor and a plain value."""

    def forward(self, x: Tensor) -> dict[str, Any]:
        return {"logits": x, "kind": "scores"}


def evaluated_model(stages: int) -> nn.Sequential:
    """BatchNorm (running statistics) and dropout in every stage; a structured output."""
    torch.manual_seed(22)
    layers: list[nn.Module] = []
    for _ in range(stages):
        layers += [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.BatchNorm1d(WIDTH)), nn.Dropout(0.3)]
    layers[-1] = Scores()
    return nn.Sequential(*layers).double()


def summed_logits(output: dict[str, Any], target: Tensor) -> Tensor:
    return F.mse_loss(output["logits"], target, reduction="sum")


@scenario
def evaluate_returns_loss_and_outputs_on_every_process() -> None:
    x, y = batch(rows=11)
    for stages in (world(), 2 * world()):
        plain = evaluated_model(stages).eval()
        with torch.no_grad():
            expected = plain(x)
        pipe = DistributedPipe(evaluated_model(stages), [2] * stages, chunks=3)
        first, last = 0 in pipe.local_stages, stages - 1 in pipe.local_stages
        pipe.partitions[pipe.local_stages[0]][0][1].eval()  # mixed modes
        for param in pipe.parameters():
            param.grad = torch.ones_like(param)
        modes = [m.training for m in pipe.modules()]
        state = {k: v.clone() for k, v in pipe.state_dict().items()}
        generator = torch.get_rng_state()
        what = f"{stages} stages"

        outputs = pipe.evaluate(x if first else None)
        assert outputs["kind"] == "scores", what
        torch.testing.assert_close(outputs["logits"], expected["logits"], msg=what)
        loss, again = pipe.evaluate(
            x if first else None, y if last else None, summed_logits, loss_reduction="sum",
            loss_divisor=11 * WIDTH, return_outputs=True,
        )  # fmt: skip
        torch.testing.assert_close(loss, F.mse_loss(expected["logits"], y), msg=what)
        torch.testing.assert_close(again["logits"], expected["logits"], msg=what)

        assert [m.training for m in pipe.modules()] == modes, what
        assert all(torch.equal(p.grad, torch.ones_like(p)) for p in pipe.parameters()), what
        assert all(torch.equal(v, state[k]) for k, v in pipe.state_dict().items()), what
        assert torch.equal(torch.get_rng_state(), generator), what
        pipe.close()


@scenario
def evaluate_arguments_are_agreed_by_every_process() -> None:
    pipe = DistributedPipe(blocks(2 * world(), seed=23), [2] * world(), chunks=2)
    x, y = batch()
    odd, last = rank() == 1, rank() == world() - 1
    start = time.monotonic()
    expect_error(
        ValueError,
        lambda: pipe.evaluate(x, y if odd else None, F.mse_loss if odd else None),
        "chose different schedules, loss arguments",
        split_at_rank_1(),
    )
    refused_last = f"rank {world() - 1} of the pipeline refused"
    expect_error(
        ValueError,
        lambda: pipe.evaluate(x, None if last else y, F.mse_loss),
        "needs the target" if last else refused_last,
    )
    expect_error(
        ValueError,
        lambda: pipe.evaluate(
            x, y, nn.MSELoss(reduction="sum"), loss_reduction="mean" if odd else None
        ),
        "has reduction='sum'" if odd else "rank 1 of the pipeline refused",
    )
    assert time.monotonic() - start < 15, "a refusal took the group's timeout"
    plain = blocks(2 * world(), seed=23).eval()
    torch.testing.assert_close(pipe.evaluate(x, y, F.mse_loss), F.mse_loss(plain(x), y).detach())
    pipe.close()


def token_model(stages: int) -> nn.Sequential:
    """An embedding, then 2 layers a stage, ending in a head over the vocabulary (5)."""
    torch.manual_seed(24)
    layers: list[nn.Module] = [nn.Embedding(5, WIDTH), nn.Tanh()]
    for _ in range(stages - 1):
        layers += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
    layers[-1] = nn.Linear(WIDTH, 5)
    return nn.Sequential(*layers).double()


def summed_tokens(output: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(output.reshape(-1, 5), target.reshape(-1), reduction="sum")


@scenario
def loss_reductions_and_divisors_equal_the_plain_model() -> None:
    x, y = batch()
    plain = blocks(2 * world(), seed=25)
    loss_fn = nn.MSELoss(reduction="sum")
    expected = loss_fn(plain(x), y)
    expected.backward()
    pipe = DistributedPipe(blocks(2 * world(), seed=25), [2] * world(), chunks=4)
    torch.testing.assert_close(pipe.step(x, y, loss_fn), expected.detach())
    assert_grads_equal(pipe, plain, "a loss module's sum")
    pipe.close()

    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 5, (4, 5), generator=gen)
    targets = torch.randint(0, 5, (4, 5), generator=gen)
    for row, kept in enumerate([5, 1, 3, 2]):  # micro-batches of unequal token counts
        targets[row, kept:] = -100
    plain = token_model(world())
    expected = F.cross_entropy(plain(tokens).reshape(-1, 5), targets.reshape(-1))
    expected.backward()
    pipe = DistributedPipe(token_model(world()), [2] * world(), chunks=4)
    count = (targets != -100).sum()
    loss = pipe.step(tokens, targets, summed_tokens, loss_reduction="sum", loss_divisor=count)
    torch.testing.assert_close(loss, expected.detach())
    assert_grads_equal(pipe, plain, "the mean over tokens")
    pipe.close()


@scenario
def a_grad_scaler_must_agree_on_infs_across_processes() -> None:
    x, y = batch()
    pipe = DistributedPipe(blocks(2 * world(), seed=26).float(), [2] * world(), chunks=2)
    alone, _ = dist.new_subgroups(group_size=1)
    for scaler, fragment in [
        (torch.amp.GradScaler("cpu"), "a GradScaler decides on each process alone"),
        (ShardedGradScaler("cpu", process_group=alone), "lacks the pipeline's (global) ranks"),
    ]:
        expect_error(
            ValueError,
            lambda scaler=scaler: pipe.step(x.float(), y.float(), F.mse_loss, grad_scaler=scaler),
            fragment,
            "ShardedGradScaler(device, process_group=...)",
        )
    # Scales that differ (a state loaded on one process): the last stage's scales the
    # loss, each process unscales by its own; one disabled: the others wait for it.
    for scale, enabled in [(2.0 ** (10 + (rank() == 1)), True), (2.0**10, rank() != 1)]:
        differing = ShardedGradScaler("cpu", init_scale=scale, enabled=enabled)
        expect_error(
            ValueError,
            lambda s=differing: pipe.step(x.float(), y.float(), F.mse_loss, grad_scaler=s),
            "chose differently",
            "grad_scaler ",
        )
    assert all(p.grad is None for p in pipe.parameters())

    plain = blocks(2 * world(), seed=26).float()
    scalers = [
        ShardedGradScaler("cpu", init_scale=2.0**10, growth_interval=2),
        torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2),
    ]
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (pipe, plain)]
    reference = dict(plain.named_parameters())
    for step in range(3):
        for optimizer in optimizers:
            optimizer.zero_grad()
        loss = pipe.step(x.float(), y.float(), F.mse_loss, grad_scaler=scalers[0])
        expected = F.mse_loss(plain(x.float()), y.float())
        scalers[1].scale(expected).backward()
        torch.testing.assert_close(loss, expected.detach())
        if step == 1:  # an overflow in stage 0's gradients only: every process skips
            reference["0.0.weight"].grad[0] = float("inf")  # type: ignore[index]
            if rank() == 0:
                dict(pipe.named_parameters())["0.0.weight"].grad[0] = float("inf")  # type: ignore[index]
        for scaler, optimizer in zip(scalers, optimizers, strict=True):
            scaler.step(optimizer)
            scaler.update()
        assert scalers[0].get_scale() == scalers[1].get_scale(), f"step {step}"
        for name, param in pipe.named_parameters():
            torch.testing.assert_close(param, reference[name], msg=f"step {step}: {name}")
    pipe.close()


@scenario
def a_sent_message_is_let_go_of_once_the_next_to_its_peer_is_posted() -> None:
    # A stage's output, kept for its send alone, lived until the step's end
    # (issue 28): in gpipe every micro-batch's output at once.
    pipe = DistributedPipe(blocks(2 * world()), [2] * world(), chunks=4, checkpoint="never")
    transport = pipe._transport
    post = transport._post
    held: list[int] = []

    def counting(peer: int, *args: Any) -> None:
        post(peer, *args)
        with transport._pending_lock:
            held.append(len(transport._pending.get(peer, [])))

    transport._post = counting  # type: ignore[method-assign]
    x, y = batch()
    first, last = 0 in pipe.local_stages, world() - 1 in pipe.local_stages
    pipe.step(x if first else None, y if last else None, F.mse_loss, schedule="gpipe")
    # Four messages went to the peer, one after another; after each post only
    # its own parts (an envelope, maybe a description, a tensor) are pending.
    assert len(held) >= 4 and max(held) <= 3, held
    pipe.close()


class Multiply(nn.Module):
    """Multiplies by one learned number: activations of any width, without a weight matrix."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.tensor(1.5, dtype=torch.double))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.weight


@scenario
def the_loss_comes_down_with_the_last_gradients_in_its_dtype_and_no_collective() -> None:
    # Every process returns the plain model's loss, in the loss's dtype, and the step's
    # only collective is its agreement at its start (its end is agreed on by messages):
    # the loss rides in the last gradients' message down the stages (through every
    # middle process), where a broadcast once followed.
    for dtype, schedule, stages in [
        (torch.float32, "1f1b", world()),
        (torch.float64, "zb-h1", world()),
        (torch.float32, Interleaved1F1B(virtual=2), 2 * world()),
        (torch.float64, "gpipe", world()),
    ]:
        what = f"{schedule}, {dtype}, {stages} stages"
        plain = blocks(stages).to(dtype)
        x, y = (t.to(dtype) for t in batch(rows=4 * world()))
        expected = F.mse_loss(plain(x), y).detach()
        pipe = DistributedPipe(copy.deepcopy(plain), [1] * stages, chunks=2 * world())
        for _ in range(2):  # the second step's messages fit the rooms the first one left
            with calls_counted(COLLECTIVES) as counts:
                loss = pipe.step(x, y, F.mse_loss, schedule=schedule)
            assert loss.dtype == dtype and loss.dim() == 0, f"{what}: {loss!r}"
            torch.testing.assert_close(loss, expected, msg=what)
            called = {name: n for name, n in counts.items() if n}
            assert called == {"all_gather": 1}, f"{what}: {called} collectives in a step"
        dist.barrier()
        pipe.close()


def sends_per_step(width: int, steps: int) -> list[int]:
    """How many sends this process posted to its peers in each of ``steps`` gpipe steps of 4
    micro-batches, activations of ``width`` float64 per row, 2 rows each."""
    model = nn.Sequential(*(Multiply() for _ in range(world())))
    pipe = DistributedPipe(model, [1] * world(), chunks=4)
    transport = pipe._transport
    wire = transport._wire
    sent: list[int] = []

    class Counting:
        def __init__(self, group: dist.ProcessGroup) -> None:
            self.group = group

        def send(self, tensors: list[Tensor], peer: int, tag: int) -> Any:
            sent.append(1)
            return self.group.send(tensors, peer, tag)

    def counted(sender: int, receiver: int) -> Any:
        group = wire(sender, receiver)
        return Counting(group) if sender == transport.me else group

    transport._wire = counted  # type: ignore[method-assign]
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(8, width, generator=gen, dtype=torch.double)
    plain = nn.Sequential(*(Multiply() for _ in range(world())))
    counts = []
    for _ in range(steps):
        before = len(sent)
        pipe.step(x, x, F.mse_loss, schedule="gpipe")
        counts.append(len(sent) - before)
        F.mse_loss(plain(x), x).backward()
    assert_grads_equal(pipe, plain, f"width {width}")
    dist.barrier()  # else a peer's close could come first, and this process's answering stop
    pipe.close()
    return counts


@scenario
def a_message_that_fits_the_room_its_peer_posted_travels_in_one_send() -> None:
    # Each process sends 4 messages a step (activations down, gradients up; the first
    # and last process one way only, with two processes), and one at the step's end
    # (rank 0's up, rank 1's back down), which leaves the room as the stages' made it.
    assert world() == 2
    # 128 bytes of activation (width 8): in the 1 KiB envelope from the first message on.
    # 4 KiB (256): the first message sends its tensor apart (a send more), and the room
    # its peer posts next is its size, so every later one, the next step's too, fits whole.
    # 2 MiB (2**17), over the most a receiver posts ahead (1 MiB): a send each for the
    # envelope and the tensor, every time.
    for width, steps, expected in [(8, 1, [5]), (256, 2, [6, 5]), (2**17, 2, [9, 9])]:
        sent = sends_per_step(width, steps)
        assert sent == expected, f"width {width}: {sent} sends per step, not {expected}"


@scenario
def a_message_that_could_not_go_leaves_both_ends_with_one_room() -> None:
    # 4 KiB activations make the room 4 KiB; then a small message's post fails (the
    # process's abort follows it to the peer). The next 4 KiB message must be framed for
    # the room its peer posted: were the two ends' rooms apart, its tensor would be read
    # from an envelope that does not hold it, or a send would overflow its receive.
    assert world() == 2
    model = nn.Sequential(*(Multiply() for _ in range(world())))
    plain = copy.deepcopy(model)
    pipe = DistributedPipe(model, [1] * world(), chunks=1)
    gen = torch.Generator().manual_seed(6)
    large = torch.randn(2, 256, generator=gen, dtype=torch.double)
    small = torch.randn(2, 8, generator=gen, dtype=torch.double)
    pipe.step(large, large, F.mse_loss)
    transport = pipe._transport
    wait = transport._wait_for_sends

    def failing_once(seconds: float, peers: Any = None) -> None:
        transport._wait_for_sends = wait  # type: ignore[method-assign]
        raise RuntimeError("a send that did not complete (injected)")

    if rank() == 0:
        transport._wait_for_sends = failing_once  # type: ignore[method-assign]
    expect_error(RuntimeError, lambda: pipe.step(small, small, F.mse_loss), "(injected)")
    pipe.zero_grad()
    loss = pipe.step(large, large, F.mse_loss)
    expected = F.mse_loss(plain(large), large)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach())
    assert_grads_equal(pipe, plain, "the step after a message that could not go")
    dist.barrier()
    pipe.close()


@scenario
def last_step_reports_this_process_stages() -> None:
    x, y = batch()
    pipe = DistributedPipe(blocks(4 * world()), [2] * (2 * world()), chunks=2 * world())
    pipe.step(x, y, F.mse_loss, schedule=Interleaved1F1B(virtual=2), measure_memory=True)
    report = pipe.last_step
    assert report is not None
    assert [p.partition for p in report.partitions] == pipe.local_stages
    assert {r.action.stage for r in report.actions} == set(pipe.local_stages)
    assert all(r.worker == rank() for r in report.actions)
    assert report.peak_in_flight == {
        s: report.simulation.peak_in_flight[s] for s in pipe.local_stages
    }
    assert all(p.peak_activation_bytes for p in report.partitions)
    # Only the stages' messages: each stage's activations from the one before it and
    # gradients from the one after, none of the step's own sums and agreements.
    expected: Counter[tuple[int, str]] = Counter()
    last = 2 * world() - 1
    for stage in pipe.local_stages:
        if stage > 0:
            expected[(stage - 1) % world(), "act"] += 2 * world()
        if stage < last:
            expected[(stage + 1) % world(), "grad"] += 2 * world()
    assert report.received == dict(expected)
    # The call holds the actions, and the agreement before them and the end's messages after.
    assert report.call_duration > report.duration > 0
    text = repr(report)
    assert text.startswith(f"DistributedStepReport(rank {rank()}: Interleaved1F1B(virtual=2)")
    assert "\n" not in text and "received" in text
    shape = f"balance={[2] * (2 * world())}, stages={pipe.local_stages} of rank {rank()}/{world()}"
    assert repr(pipe).startswith(f"DistributedPipe(\n  {shape}, device='cpu', chunks={2 * world()}")
    pipe.close()


def split_at_rank_1() -> str:
    """How errors name the ranks when rank 1 alone was given another value."""
    return f"ranks {[r for r in range(world()) if r != 1]} and ranks [1]"


@scenario
def arguments_that_differ_between_processes_are_refused_by_every_process_at_construction() -> None:
    odd = rank() == 1  # the process given other arguments
    wider = blocks(2 * world())
    if odd:  # layer 1 a Linear wider inside
        wider[1] = nn.Sequential(
            nn.Linear(WIDTH, WIDTH + 1), nn.Tanh(), nn.Linear(WIDTH + 1, WIDTH)
        ).double()
    balance = [1, 3] + [2] * (world() - 2) if odd else [2] * world()
    cases: list[tuple[dict[str, Any], list[str]]] = [
        ({"balance": balance}, ["balance differs", f"has {balance}", "broadcast it"]),
        (
            {"module": wider},
            [
                "the model differs between the processes of the pipeline at layer 1",
                f"has '1': Sequential, parameter 0.weight ({WIDTH + odd}, {WIDTH}) torch.float64",
                "build the same model on every process",
            ],
        ),
        ({"checkpoint": "always" if odd else "never"}, ["checkpoint differs"]),
        ({"call_style": "positional" if odd else "tuple"}, ["call_style differs"]),
        ({"deferred_batch_norm": odd}, ["deferred_batch_norm differs", f"has {odd}"]),
    ]
    for arguments, fragments in cases:
        given = {"module": blocks(2 * world()), "balance": [2] * world(), **arguments}
        expect_error(
            ValueError,
            lambda given=given: DistributedPipe(**given),
            *fragments,
            "between the processes of the pipeline",
            split_at_rank_1(),
            f"this process (rank {rank()})",
        )
    refused = ["timeout must be"] if odd else ["rank 1 of the pipeline refused its DistributedPipe"]
    timeout = 0 if odd else 60
    expect_error(ValueError, lambda: DistributedPipe(blocks(2), [1, 1], timeout=timeout), *refused)
    pipe = DistributedPipe(blocks(2 * world(), seed=19), [2] * world(), chunks=2)
    x, y = batch()
    pipe.step(x, y, F.mse_loss)  # every process goes on
    plain = blocks(2 * world(), seed=19)
    F.mse_loss(plain(x), y).backward()
    assert_grads_equal(pipe, plain, "after refused constructions")
    pipe.close()


@scenario
def chunks_that_differ_on_one_process_are_refused_by_every_process_and_the_group_goes_on() -> None:
    chunks = 2 if rank() == 1 else 4
    expect_error(
        ValueError,
        lambda: DistributedPipe(blocks(2 * world()), [2] * world(), chunks=chunks),
        "chunks differs between the processes of the pipeline",
        split_at_rank_1(),
        f"this process (rank {rank()}) has {chunks}",
    )
    pipe = DistributedPipe(blocks(2 * world(), seed=20), [2] * world(), chunks=4)
    x, y = batch()
    # Changed afterwards on one process: gloo aborted a process (the agreement's rows
    # were as long as the chunks), another blamed the target's batch size.
    pipe.chunks = chunks
    for run in (lambda: pipe.step(x, y, F.mse_loss), lambda: pipe.evaluate(x)):
        expect_error(ValueError, run, "chose different", "chunks (pipe.chunks)", f"{chunks} chunks")
    pipe.chunks = 4
    pipe.step(x, y, F.mse_loss)
    plain = blocks(2 * world(), seed=20)
    F.mse_loss(plain(x), y).backward()
    assert_grads_equal(pipe, plain, "after chunks that differed")
    dist.barrier()  # the user's group still works
    pipe.close()


@scenario
def an_argument_refused_on_one_process_fails_every_process_within_seconds() -> None:
    assert gloo_groups.PG_TIMEOUT_S >= 60, "the bound below must be far under the group's timeout"
    odd = rank() == 1  # the process whose arguments are refused
    pipe = DistributedPipe(blocks(2 * world(), seed=21), [2] * world(), chunks=2)
    plain = blocks(2 * world(), seed=21)
    x, y = batch()
    F.mse_loss(plain(x), y).backward()

    def step(
        schedule: Any = "1f1b", loss_reduction: Any = "mean", loss_fn: Any = F.mse_loss
    ) -> None:
        pipe.step(x, y, loss_fn, schedule=schedule, loss_reduction=loss_reduction)

    def without_grad() -> None:
        with torch.no_grad():
            step()

    cases: list[tuple[str, Any, type[Exception], str]] = [
        ("a schedule name with a typo", lambda: step("1F1B " if odd else "1f1b"), ValueError,
         "schedule must be one of"),
        ("a bad loss_reduction", lambda: step(loss_reduction="bogus" if odd else "mean"),
         ValueError, "loss_reduction must be"),
        ("grad mode off", without_grad if odd else step, RuntimeError, "grad mode is off"),
        ("a loss_fn that is not callable", lambda: step(loss_fn="mse" if odd else F.mse_loss),
         TypeError, "loss_fn must be callable"),
        ("a flag given as text", lambda: pipe.step(x, y, F.mse_loss, return_outputs="no" if odd
         else False), TypeError, "return_outputs must be True or False"),
        ("a schedule of one worker", lambda: step(Interleaved1F1B(world()) if odd else "1f1b"),
         ValueError, "use a schedule with one worker per process"),
    ]  # fmt: skip
    for what, run, kind, fragment in cases:
        start = time.monotonic()
        if odd:
            expect_error(kind, run, fragment)
        else:
            expect_error(ValueError, run, "rank 1 of the pipeline refused this step's arguments")
        assert time.monotonic() - start < 15, f"{what}: the others waited for the group's timeout"
        assert all(p.grad is None for p in pipe.parameters()), f"{what}: a refused step ran"
        step()
        assert_grads_equal(pipe, plain, f"the step after {what}")
        pipe.zero_grad()
    pipe.close()


@scenario
def a_pipe_closed_right_after_construction_lets_its_peers_close_at_once() -> None:
    for _ in range(100):  # one STOP in about 30 went missing before the fix
        pipe = DistributedPipe(blocks(2 * world()), [2] * world(), timeout=60)
        start = time.monotonic()
        pipe.close()
        assert time.monotonic() - start < 10, "close() waited for a peer's STOP"
        del pipe  # at once: a STOP still being sent must not go with it


@scenario
def a_step_after_every_peer_closed_is_refused_at_once() -> None:
    # Rank 0 closes its pipe and lives on; rank 1's step would wait for it in the
    # step's agreement for the whole group timeout.
    pipe = DistributedPipe(blocks(2 * world()), [2] * world(), timeout=60)
    if rank() == 0:
        pipe.close()
        dist.barrier()
        return
    deadline = time.monotonic() + 60
    while not pipe._transport.alone() and time.monotonic() < deadline:
        time.sleep(0.05)  # the stop's arrival, filed by the listener
    x, y = batch()
    start = time.monotonic()
    expect_error(PeerError, lambda: pipe.step(x, y, F.mse_loss), "rank 0 closed its pipeline")
    assert time.monotonic() - start < 10, "the step waited for a process that had closed"
    pipe.close()
    dist.barrier()


class RaiseOnRank(nn.Module):
    """Raises ``error`` in the forward of its second call, on the rank it is told."""

    def __init__(self, on_rank: int, error: BaseException) -> None:
        super().__init__()
        self.on_rank = on_rank
        self.error = error
        self.calls = 0

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        if rank() == self.on_rank and self.calls == 2:
            raise self.error
        return x


@scenario
def an_interrupted_process_stops_the_others_and_the_next_step_is_right() -> None:
    model = blocks(2 * world(), seed=17)
    model.insert(2, RaiseOnRank(on_rank=1, error=KeyboardInterrupt()))
    balance = [2, 3] + [2] * (world() - 2)
    pipe = DistributedPipe(model, balance, chunks=4, checkpoint="always", timeout=60)
    x, y = batch()
    if rank() == 1:
        try:
            pipe.step(x, y, F.mse_loss)
        except KeyboardInterrupt:
            pass
        else:
            raise AssertionError("the interruption did not reach the caller")
    else:
        expect_error(RuntimeError, lambda: pipe.step(x, y, F.mse_loss), "rank 1 failed")
    pipe.zero_grad()
    pipe.step(x, y, F.mse_loss)
    plain = blocks(2 * world(), seed=17)
    F.mse_loss(plain(x), y).backward()
    reference = {name: p for name, p in plain.named_parameters()}
    for name, param in pipe.named_parameters():
        index, rest = name.split(".", 1)
        shifted = f"{int(index) - (int(index) > 2)}.{rest}"  # RaiseOnRank is layer 2
        assert param.grad is not None, name
        torch.testing.assert_close(param.grad, reference[shifted].grad, msg=name)
    pipe.close()


@scenario
def a_failure_in_a_backward_with_tied_weights_fails_every_holder_at_once() -> None:
    # The holders that were done entered the tied weights' all-reduce, which the failed
    # process never joined: they waited the group's timeout (70 s), and the pipeline was
    # dead after.
    pipe = DistributedPipe(tied_model(), [2] * world(), chunks=2, timeout=60)
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 11, (6,), generator=gen)
    targets = torch.randint(0, 11, (6,), generator=gen)
    if rank() == 0:

        def refuse(parameter: Tensor) -> None:
            raise ValueError("this gradient is refused")

        handle = pipe.get_parameter("1.0.weight").register_post_accumulate_grad_hook(refuse)
        expect_error(ValueError, lambda: pipe.step(tokens, targets, F.cross_entropy), "refused")
        handle.remove()
    else:
        start = time.monotonic()
        expect_error(RuntimeError, lambda: pipe.step(tokens, targets, F.cross_entropy), "rank 0")
        assert time.monotonic() - start < 30, "a holder waited for the failed process"
    next_step_is_right(pipe, tokens, targets, tied_model(), F.cross_entropy)


@scenario
def pipelines_of_several_sizes_with_tied_weights_are_refused_by_every_process() -> None:
    # world 3: ranks 0 and 1 tie a weight, rank 2 alone: the tied weights' groups, made
    # over the job for pipelines alike, failed (an IndexError on some ranks, a hang after).
    group, _ = dist.new_subgroups_by_enumeration([[0, 1], [2]])
    stages = dist.get_world_size(group)
    model = tied_model_for(stages)
    expect_error(
        ValueError,
        lambda: DistributedPipe(model, [2] * stages, group=group),
        "pipelines have several sizes",
    )


def next_step_is_right(
    pipe: DistributedPipe,
    x: Tensor,
    y: Tensor,
    plain: nn.Module | None = None,
    loss_fn: Any = F.mse_loss,
) -> None:
    """After a failed step: the next one gives the plain model's gradients (``plain``, by
    default blocks of seed 7)."""
    plain = blocks(2 * world(), seed=7) if plain is None else plain
    pipe.zero_grad()
    pipe.step(x, y, loss_fn)
    loss_fn(plain(x), y).backward()
    assert_grads_equal(pipe, plain, "the step after a failure")
    pipe.close()


@scenario
def a_failing_process_makes_the_others_fail_at_once_naming_it() -> None:
    model = blocks(2 * world(), seed=7)
    model.append(RaiseOnRank(on_rank=world() - 1, error=KeyError("bad batch")))
    balance = [2] * (world() - 1) + [3]
    pipe = DistributedPipe(model, balance, chunks=4, checkpoint="never", timeout=60)
    x, y = batch()
    start = time.monotonic()
    if rank() == world() - 1:
        expect_error(KeyError, lambda: pipe.step(x, y, F.mse_loss), "bad batch")
    else:
        expect_error(
            RuntimeError,
            lambda: pipe.step(x, y, F.mse_loss),
            f"rank {world() - 1} failed: KeyError: 'bad batch' (raised in action {world() - 1}F1",
        )
    assert time.monotonic() - start < 30, "the failure took the timeout to reach this process"
    next_step_is_right(pipe, x, y)


class SlowBackward(torch.autograd.Function):
    """The identity, whose backward takes ``SECONDS``: stage 0's last backwards, slow."""

    SECONDS = 1.5

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        time.sleep(SlowBackward.SECONDS)
        return grad


class Slow(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return cast(Tensor, SlowBackward.apply(x))


@scenario
def a_step_whose_last_backwards_outlast_the_groups_timeout_ends_whole() -> None:
    # The step's end was a collective on the pipe's group, bounded by its timeout (2 s
    # here) rather than the pipe's: the last stage's process gave up while stage 0 ran
    # its last two backwards (3 s), and both failed a step the plain model trains.
    group = dist.new_group(list(range(world())), timeout=timedelta(seconds=2))
    dist.barrier()  # the processes start together: the group's own collectives are quick
    layers = nn.Sequential(Slow(), *blocks(2 * world() - 1, seed=4))
    pipe = DistributedPipe(layers, [2] * world(), group=group, chunks=2, timeout=60)
    plain = nn.Sequential(nn.Identity(), *blocks(2 * world() - 1, seed=4))
    x, y = batch()
    loss = pipe.step(x, y, F.mse_loss, schedule="gpipe")
    expected = F.mse_loss(plain(x), y)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach())
    assert_grads_equal(pipe, plain, "a slow stage 0")
    pipe.close()


@scenario
def a_failure_after_the_other_processes_are_done_fails_them_too() -> None:
    # Stage 0's last backward comes after every other stage's: a hook that
    # raises at its end fails the step when the others' stages are done, and
    # they must not return as if it were whole (their optimizer would step alone).
    pipe = DistributedPipe(blocks(2 * world(), seed=7), [2] * world(), chunks=4, timeout=60)
    x, y = batch()
    if rank() == 0:

        def refuse(parameter: Tensor) -> None:
            raise ValueError("this gradient is refused")

        handle = next(pipe.parameters()).register_post_accumulate_grad_hook(refuse)
        expect_error(ValueError, lambda: pipe.step(x, y, F.mse_loss), "is refused")
        handle.remove()
    else:
        expect_error(
            RuntimeError,
            lambda: pipe.step(x, y, F.mse_loss),
            "failed in another process of the pipeline after this process's stages were done",
            "rank 0 failed: ValueError: this gradient is refused",
        )
    next_step_is_right(pipe, x, y)


def die_now(name: str) -> None:
    """End this process at once, as a crash would, reporting ``name`` as done."""
    Path(sys.argv[1]).write_text(json.dumps({name: "ok"}))
    os._exit(0)


@breaks_group
@scenario
def a_dead_process_makes_the_others_fail_naming_it() -> None:
    class DieOnRank1(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            if rank() == 1:  # mid-step, telling no one
                die_now("a_dead_process_makes_the_others_fail_naming_it")
            return x

    model = blocks(2 * world(), seed=8)
    model.insert(2, DieOnRank1())
    balance = [2, 3] + [2] * (world() - 2)
    pipe = DistributedPipe(model, balance, chunks=2, checkpoint="never", timeout=60)
    x, y = batch()
    start = time.monotonic()
    expect_error(RuntimeError, lambda: pipe.step(x, y, F.mse_loss), "rank 1")
    assert time.monotonic() - start < 30


@breaks_group
@scenario
def a_stalled_process_makes_the_others_fail_after_the_timeout() -> None:
    # Rank 1 stalls until the others have given up on it, and only they have a
    # short timeout: however slow the machine, they are the ones that time
    # out, and on what rank 1 owes them (no sleep is tuned to the machine).
    stalling = rank() == 1

    class StallOnRank1(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            if stalling:
                until_aborted(pipe)
            return x

    model = blocks(2 * world(), seed=9)
    model.insert(2, StallOnRank1())
    balance = [2, 3] + [2] * (world() - 2)
    timeout = 120 if stalling else 2
    pipe = DistributedPipe(model, balance, chunks=2, checkpoint="never", timeout=timeout)
    x, y = batch()
    if stalling:
        expect_error(RuntimeError, lambda: pipe.step(x, y, F.mse_loss), "rank 0 failed")
    else:
        expect_error(
            PeerError, lambda: pipe.step(x, y, F.mse_loss), "waited 2 s for", "(rank 1)", "stalled"
        )


def until_aborted(pipe: DistributedPipe) -> None:
    """Wait until another process's failure reaches ``pipe``; then raise it, as a wait would."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        pipe._transport.check()  # raises AbortedError once a peer's abort has come
        time.sleep(0.01)
    raise AssertionError("no abort came within 60 s")


@scenario
def a_pp_by_dp_grid_equals_single_process_training_on_the_full_batch() -> None:
    # world 4: pipelines {0, 1} and {2, 3}; stage s of each is averaged with its twin.
    pp, dp = 2, world() // 2
    pipelines = [list(range(d * pp, (d + 1) * pp)) for d in range(dp)]
    replicas = [[d * pp + s for d in range(dp)] for s in range(pp)]
    pp_group, _ = dist.new_subgroups_by_enumeration(pipelines)
    dp_group, _ = dist.new_subgroups_by_enumeration(replicas)
    assert pp_group is not None and dp_group is not None
    replica = rank() // pp
    for as_view in (False, True):
        full = tied_model_for(pp)
        model = DataParallel(
            DistributedPipe(copy.deepcopy(full), [2] * pp, group=pp_group, chunks=2),
            process_group=dp_group,
            gradient_as_bucket_view=as_view,
        )
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        full_optimizer = torch.optim.SGD(full.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(10)
        for step in range(3):
            # With bucket views, .grad stays the view into DataParallel's bucket.
            optimizer.zero_grad(set_to_none=not as_view)
            full_optimizer.zero_grad()
            for accumulated in range(2):  # the first without averaging (no_sync)
                tokens = torch.randint(0, 11, (8,), generator=gen)
                targets = torch.randint(0, 11, (8,), generator=gen)
                shard = slice(replica * 4, replica * 4 + 4)
                with model.no_sync() if accumulated == 0 else contextlib.nullcontext():
                    model.step(tokens[shard], targets[shard], F.cross_entropy)
                F.cross_entropy(full(tokens), targets).backward()
            assert_grads_equal(model.module, full, f"bucket views {as_view}, step {step}")
            optimizer.step()
            full_optimizer.step()
            reference = dict(full.named_parameters(remove_duplicate=False))
            for name, param in model.module.named_parameters():
                torch.testing.assert_close(param, reference[name], msg=name)
        model.module.close()
    # A stage without parameters has nothing to average: DataParallel refused it on
    # its replicas alone, and the other stages' processes failed their next build.
    plain = nn.Sequential(nn.Tanh(), blocks(1, seed=3)).double()
    paramless = DistributedPipe(copy.deepcopy(plain), [1, 1], group=pp_group, chunks=2)
    model = DataParallel(paramless, process_group=dp_group)
    x, y = batch(8)
    model.step(x[replica * 4 : replica * 4 + 4], y[replica * 4 : replica * 4 + 4], F.mse_loss)
    F.mse_loss(plain(x), y).backward()
    if rank() % pp == 0:
        assert not list(paramless.parameters())
    else:
        assert_grads_equal(paramless, plain, "after a stage without parameters")
    paramless.close()
    # A step refused in one pipeline (rank 3's target of another batch size) is refused
    # by the other too, at once: its processes waited for rank 2's and 3's in their
    # buffer broadcasts and all-reduces until the group's timeout.
    pipe = DistributedPipe(blocks(4, seed=4), [2, 2], group=pp_group, chunks=2, timeout=60)
    model = DataParallel(pipe, process_group=dp_group)
    rows = 3 if rank() == 3 else 4
    started = time.monotonic()
    refused = "batch size" if replica == 1 else "another pipeline that replicates these stages"
    expect_error(Exception, lambda: model.step(x[:4], y[:rows], F.mse_loss), refused)
    assert time.monotonic() - started < 30, "the refusal took the timeout to reach this process"
    assert all(p.grad is None for p in pipe.parameters()), "a refused step computed something"
    # Refused after the arguments passed: replica 0's 3 micro-batches, which interleaved's 2
    # stages per process cannot take; replica 1 ran its step, then waited in its all-reduce.
    interleaved = DistributedPipe(blocks(4, seed=4), [1, 1, 1, 1], group=pp_group, chunks=4)
    replicated = DataParallel(interleaved, process_group=dp_group)
    rows = 3 if replica == 0 else 4
    started = time.monotonic()
    refused = "multiple of" if replica == 0 else "another pipeline that replicates these stages"
    expect_error(Exception, lambda: replicated.step(x[:rows], y[:rows], F.mse_loss,
                                                   schedule="interleaved"), refused)  # fmt: skip
    assert time.monotonic() - started < 30, "the refusal took the timeout to reach this process"
    assert all(p.grad is None for p in interleaved.parameters()), "a refused step ran"
    interleaved.close()
    model.step(x[replica * 4 : replica * 4 + 4], y[replica * 4 : replica * 4 + 4], F.mse_loss)
    plain = blocks(4, seed=4)
    F.mse_loss(plain(x), y).backward()
    assert_grads_equal(pipe, plain, "the step after one refused in one pipeline")
    pipe.close()


@scenario
def a_pipeline_refused_in_a_grid_stops_every_pipeline() -> None:
    # world 4: pipelines {0, 1} and {2, 3}; rank 3 (rank 1 of the second) has another balance.
    pipelines = [[0, 1], [2, 3]]
    pp_group, _ = dist.new_subgroups_by_enumeration(pipelines)
    balance = [1, 3] if rank() == 3 else [2, 2]
    fragments = (
        ["balance differs", "ranks [0] and ranks [1]"]
        if rank() in pipelines[1]
        else ["the pipeline of (global) ranks [2, 3] refused its arguments"]
    )
    expect_error(
        ValueError, lambda: DistributedPipe(blocks(4), balance, group=pp_group), *fragments
    )
    # An init failing in one process of one pipeline, on meta: every pipeline hears it
    # (the other pipeline built, and its groups' count drifted from the failed one's).
    with torch.device("meta"):
        failing = blocks(4)
    build = partial(DistributedPipe, failing, [2, 2], group=pp_group, init=fails_on_rank_0)
    heard = [] if rank() == 0 else ["a process of this job refused", "no weight on rank 0"]
    expect_error(Exception, build, "no weight on rank 0", *heard)
    # A failure names the failed process by its rank in the pipeline and in the job.
    model = blocks(4)
    model.append(RaiseOnRank(on_rank=3, error=KeyError("bad batch")))
    pipe = DistributedPipe(model, [2, 3], chunks=2, group=pp_group)
    x, y = batch()
    if rank() == 2:
        expect_error(
            RuntimeError, lambda: pipe.step(x, y, F.mse_loss), "rank 1 (job rank 3) failed"
        )
    elif rank() == 3:
        expect_error(KeyError, lambda: pipe.step(x, y, F.mse_loss), "bad batch")
    else:
        pipe.step(x, y, F.mse_loss)
    pipe.close()


@scenario
def a_weight_the_callers_graph_reaches_too_is_accumulated_once() -> None:
    # The input is an embedding computed by the caller, tied to stage 0's first weight:
    # the stage accumulated its part, then the caller's graph the rest, and the hook fired
    # twice, first with a partial gradient.
    def model_and_embedding() -> tuple[nn.Sequential, nn.Embedding]:
        torch.manual_seed(0)
        embedding = nn.Embedding(WIDTH, WIDTH).double()
        model = blocks(4)
        model[0][0].weight = embedding.weight
        return model, embedding

    ids = torch.randint(WIDTH, (10,), generator=torch.Generator().manual_seed(2))
    _, y = batch()
    plain, plain_embedding = model_and_embedding()
    F.mse_loss(plain(plain_embedding(ids)), y).backward()
    for schedule in ("gpipe", "1f1b", "zb-h1"):
        model, embedding = model_and_embedding()
        fired: list[Tensor] = []
        embedding.weight.register_post_accumulate_grad_hook(
            lambda p, fired=fired: fired.append(cast(Tensor, p.grad).clone())
        )
        pipe = DistributedPipe(model, [2, 2], chunks=2)
        signalled: list[int] = []
        pipe.register_partition_backward_hook(signalled.append)
        pipe.step(embedding(ids) if rank() == 0 else None, y, F.mse_loss, schedule=schedule)
        if rank() == 0:
            assert len(fired) == 1, schedule
            torch.testing.assert_close(fired[0], plain_embedding.weight.grad)
        assert signalled == [rank()], schedule
        pipe.close()


class FailsOnceReplicasLaunched(torch.autograd.Function):
    """Raises in its backward once the store says the stage after it, in both pipelines,
    has launched its all-reduces; passes the gradient otherwise."""

    armed = False

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        if not FailsOnceReplicasLaunched.armed:
            return grad
        FailsOnceReplicasLaunched.armed = False
        store = dist.distributed_c10d._get_default_store()
        store.wait(["launched-0", "launched-1"], timedelta(seconds=60))
        raise SimulatedCrashError("stage 0's last backward fails, alike in both pipelines")


class FailsArmed(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return cast(Tensor, FailsOnceReplicasLaunched.apply(x))


@scenario
def a_step_failing_after_a_stage_launched_its_all_reduces_is_refused_by_every_process() -> None:
    # world 4: pipelines {0, 1} and {2, 3}, replicas {0, 2} and {1, 3}. Stage 1 launched
    # its all-reduces, then stage 0 failed: the next step was refused by stage 1's
    # processes alone, and stage 0's waited in the pipeline's agreement for them.
    pp_group, _ = dist.new_subgroups_by_enumeration([[0, 1], [2, 3]])
    dp_group, _ = dist.new_subgroups_by_enumeration([[0, 2], [1, 3]])
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), FailsArmed(), nn.Tanh(), nn.Linear(WIDTH, 1))
    pipe = DistributedPipe(model.double(), [2, 2], group=pp_group, chunks=1)
    dp = DataParallel(pipe, process_group=dp_group)
    store = dist.distributed_c10d._get_default_store()
    # Called after DataParallel's own hook, which launches the stage's all-reduces.
    pipe.register_partition_backward_hook(lambda j: store.set(f"launched-{rank() // 2}", "1"))
    x, y = batch(rows=8)
    xs, ys = x[4 * (rank() // 2) :][:4], y[4 * (rank() // 2) :][:4, :1]
    FailsOnceReplicasLaunched.armed = rank() in (0, 2)
    expect_error(Exception, lambda: dp.step(xs, ys, F.mse_loss))
    refused = "DataParallel: an earlier step raised" if rank() in (1, 3) else "refused"
    expect_error(Exception, lambda: dp.step(xs, ys, F.mse_loss), refused)
    pipe.close()


class Twice(nn.Module):
    """Returns its input's image twice: one tensor, two outputs."""

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        h = 2 * x
        return h, h


class WritesFirst(nn.Module):
    """Writes into the first of its pair, as it declares: the plain model's second sees it."""

    inplace = True

    def forward(self, pair: tuple[Tensor, Tensor]) -> Tensor:
        a, b = pair
        a.mul_(3)
        return a + b


class WritesFirstUndeclared(WritesFirst):
    inplace = False


class WithMask(nn.Module):
    """Its input, and a mask of it twice: one tensor needing no gradient, two outputs."""

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        mask = (x > 0).double()
        return x, mask, mask


class WritesMask(nn.Module):
    def forward(self, three: tuple[Tensor, Tensor, Tensor]) -> Tensor:
        x, mask, same = three
        mask.add_(1)
        return x * same


class MaskOnce(nn.Module):
    """Its input, and its mask twice on the first call; then the input and the mask once."""

    calls = 0

    def forward(self, x: Tensor) -> tuple[Tensor, ...]:
        MaskOnce.calls += 1
        mask = (x > 0).double()
        return (x, mask, mask) if MaskOnce.calls == 1 else (x, mask)


class ReadsMask(nn.Module):
    def forward(self, values: tuple[Tensor, ...]) -> Tensor:
        return values[0] * values[1]


class Averages(nn.Module):
    """A moving average of its input in a buffer, written in place in every forward."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("ema", torch.zeros(WIDTH, dtype=torch.double))

    def forward(self, x: Tensor) -> Tensor:
        self.ema.mul_(0.9).add_(0.1 * x.detach().mean(0))
        return x + self.ema


@scenario
def a_buffer_written_in_a_forward_by_stages_of_two_processes_is_refused() -> None:
    # Each process updated a copy of its own: losses 63.10 against 62.07, silently.
    shared = Averages()
    layers = nn.Sequential(shared, *blocks(2 * world() - 2), shared)
    pipe = DistributedPipe(layers, [2] * world(), chunks=2, checkpoint="never")
    x, y = batch()
    expected = "wrote into its buffer '0.ema'" if rank() == 0 else "rank 0 failed"
    expect_error(RuntimeError, lambda: pipe.step(x, y, F.mse_loss), expected)
    assert all(p.grad is None for p in pipe.parameters())
    pipe.close()


@scenario
def tensors_sharing_memory_into_a_stage_writing_its_input_are_refused() -> None:
    # The next process received each apart, and its first layer wrote into a copy of one.
    # The pair ends the last process but one's stage; the writer starts the last one's.
    layers = nn.Sequential(*blocks(2 * world() - 3), Twice(), WritesFirst(), block().double())
    pipe = DistributedPipe(layers, [2] * world(), chunks=2)
    x, y = batch()
    expected = "starts with a layer that writes into its input" if rank() == world() - 2 else ""
    expect_error(RuntimeError, lambda: pipe.step(x, y, F.mse_loss), expected)
    assert all(p.grad is None for p in pipe.parameters())
    pipe.close()


@scenario
def tensors_sharing_memory_written_by_a_stage_in_another_process_are_refused() -> None:
    # Received apart, the write showed in one of them, where the plain model's shows in
    # both: evaluate's outputs and step's gradients were off, silently.
    def evaluated(pipe: DistributedPipe, x: Tensor, y: Tensor) -> object:
        return pipe.evaluate(x)

    def stepped(pipe: DistributedPipe, x: Tensor, y: Tensor) -> object:
        return pipe.step(x, y, F.mse_loss)

    for pair, run in [(Twice(), evaluated), (WithMask(), stepped)]:
        writer = WritesFirstUndeclared() if isinstance(pair, Twice) else WritesMask()
        layers = nn.Sequential(*blocks(2 * world() - 3), pair, writer, block().double())
        pipe = DistributedPipe(layers, [2] * world(), chunks=2)
        x, y = batch()
        expected = "wrote in place into its input's leaves" if rank() == world() - 1 else ""
        expect_error(RuntimeError, partial(run, pipe, x, y), expected)
        assert all(p.grad is None for p in pipe.parameters())
        pipe.close()


@scenario
def a_write_into_a_skip_sharing_memory_with_the_main_path_is_refused_by_every_process() -> None:
    # A skip stashed as what its stage returns travels apart from the main path: a write
    # into either showed in one, where the plain model's shows in both (gradients 2.0 off
    # with the main path written, 434 with the pop written), silently.
    x, y = batch()
    last = rank() == world() - 1
    for writes, balance in [("main", [2, 4]), ("main", [3, 3]), ("pop", [2, 4])]:
        pipe = DistributedPipe(shared_skip_model(writes, WIDTH), balance, chunks=2)
        expected = "wrote in place into" if last else f"rank {world() - 1} failed"
        expect_error(RuntimeError, partial(pipe.step, x, y, F.mse_loss), expected)
        assert all(p.grad is None for p in pipe.parameters()), "a refused step wrote .grad"
        pipe.close()
    # Not written, such a skip passes.
    model = shared_skip_model("none", WIDTH)
    plain = copy.deepcopy(model)
    F.mse_loss(plain(x), y).backward()
    pipe = DistributedPipe(model, [2, 4], chunks=2)
    pipe.step(x, y, F.mse_loss)
    reference = dict(plain.named_parameters())
    for name, param in pipe.named_parameters():
        torch.testing.assert_close(param.grad, reference[name].grad, msg=name)
    assert last == any(p.grad is not None for p in pipe.parameters())
    pipe.close()


@scenario
def an_output_with_fewer_leaves_than_an_earlier_sharing_one_crosses() -> None:
    # The groups of leaves sharing memory seen in the first step were sent again with
    # the next step's output of two leaves: its receiver refused the message as malformed.
    MaskOnce.calls = 0
    layers = nn.Sequential(*blocks(2 * world() - 3), MaskOnce(), ReadsMask(), block().double())
    pipe = DistributedPipe(copy.deepcopy(layers), [2] * world(), chunks=1)
    x, y = batch()
    for _ in range(2):
        pipe.step(x, y, F.mse_loss)
    MaskOnce.calls = 0
    for _ in range(2):
        F.mse_loss(layers(x), y).backward()
    assert_grads_equal(pipe, layers, "an output of fewer leaves after one sharing memory")
    pipe.close()


@scenario
def a_predecessors_checkpoint_loads_into_each_processs_stages() -> None:
    # Each process holds its own stages only: the others' were taken for missing layers.
    plain = blocks(2 * world(), seed=9)
    saved = {
        f"partitions.{index // 2}.{key}": value
        for key, value in plain.state_dict().items()
        for index in [int(key.split(".")[0])]
    }
    pipe = DistributedPipe(blocks(2 * world(), seed=10), [2] * world(), chunks=2)
    assert pipe.partition_names == [[str(2 * j), str(2 * j + 1)] for j in range(world())]
    pipe.load_state_dict(from_partitioned_state_dict(saved, pipe))
    reference = dict(plain.named_parameters())
    for name, param in pipe.named_parameters():
        torch.testing.assert_close(param, reference[name], msg=name)
    pipe.close()


@scenario
def pipelines_of_several_sizes_in_one_job_each_equal_the_plain_model() -> None:
    # world 3: rank 0 alone, ranks 1 and 2 together; the rows that tell the job's pipelines
    # apart had one length per pipeline size, and gloo aborted rank 0.
    pipelines = [[0], [1, 2]]
    group, _ = dist.new_subgroups_by_enumeration(pipelines)
    stages = dist.get_world_size(group)
    pipe = DistributedPipe(blocks(2, seed=5), [2 // stages] * stages, group=group, chunks=2)
    plain = blocks(2, seed=5)
    x, y = batch()
    loss = pipe.step(x, y, F.mse_loss)
    expected = F.mse_loss(plain(x), y)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach())
    assert_grads_equal(pipe, plain, f"a pipeline of {stages}")
    pipe.close()


class Payload:
    """Unpickled, it would make a directory: the proof that a peer's bytes ran code."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return os.mkdir, (str(self.path),)


@scenario
def a_crafted_message_runs_no_code_and_fails_closed_naming_its_sender() -> None:
    marker = Path(sys.argv[1]).with_name("payload-ran")
    # Rank 1's close waits this long at most for its stop, which rank 0 no longer takes.
    pipe = DistributedPipe(blocks(2 * world()), [2] * world(), timeout=2)
    if rank() == 1:  # a peer sends a pickle where a description belongs, as an attacker would
        description = pickle.dumps(Payload(marker))
        envelope = bytearray(1024)  # kind 0 (data), the description's length, no tensor
        envelope[: 24 + len(description)] = (
            struct.pack("<qqq", 0, len(description), 0) + description
        )
        transport = pipe._transport
        wire = transport._wire(transport.me, 0)
        wire.send(
            [torch.frombuffer(envelope, dtype=torch.uint8)], transport._wire_rank[0], 0
        ).wait()
    x, y = batch()
    if rank() == 0:
        verdict = peers_verdict(pipe)
        assert not marker.exists(), "the peer's bytes ran code"
        for fragment in ("rank 1 sent a malformed message", "unknown tag", "stopped listening"):
            assert fragment in verdict, f"{fragment!r} missing from: {verdict}"
        expect_error(PeerError, lambda: pipe.step(x, y, F.mse_loss), verdict)
    else:
        expect_error(
            ValueError, lambda: pipe.step(x, y, F.mse_loss), "rank 0 of the pipeline refused"
        )
    pipe.close()


def peers_verdict(pipe: DistributedPipe) -> str:
    """What this process concluded about its peers, once it has: PeerError's message."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            pipe._transport.check_peers()
        except PeerError as error:
            return str(error)
        time.sleep(0.01)
    raise AssertionError("no verdict on the peers within 60 s")


Pair = namedtuple("Pair", "first second")


class ToPair(nn.Module):
    def forward(self, x: Tensor) -> Pair:
        return Pair(x, x * 2)


class FromPair(nn.Module):
    def forward(self, pair: Pair) -> Tensor:
        return pair.first + pair.second


@scenario
def a_value_that_cannot_cross_is_refused_by_its_sender_naming_it() -> None:
    model = nn.Sequential(block(), ToPair(), FromPair(), block()).double()
    balance = [2, 2] + [1] * (world() - 2)
    model.extend(nn.Identity() for _ in range(world() - 2))
    pipe = DistributedPipe(model, balance, chunks=2)
    x, y = batch()
    if rank() == 0:
        expect_error(
            TypeError,
            lambda: pipe.step(x, y, F.mse_loss),
            "the activation of micro-batch 0 that stage 0 sends to stage 1 (rank 1) holds a "
            "namedtuple __main__.Pair, which cannot be sent to another process",
            "return a plain tuple (or a dict) instead",
        )
    else:
        expect_error(RuntimeError, lambda: pipe.step(x, y, F.mse_loss), "rank 0 failed: TypeError")
    pipe.close()


@scenario
def an_output_that_cannot_cross_fails_evaluate_on_every_process() -> None:
    model = nn.Sequential(*(block() for _ in range(2 * world() - 1)), ToPair()).double()
    pipe = DistributedPipe(model, [2] * world(), chunks=2)
    x, _ = batch()
    if rank() == world() - 1:
        expect_error(
            TypeError, lambda: pipe.evaluate(None), "namedtuple __main__.Pair", "plain tuple"
        )
    else:
        last = f"rank {world() - 1} failed: TypeError"
        expect_error(RuntimeError, lambda: pipe.evaluate(x if rank() == 0 else None), last)
    pipe.close()


def a_loss_refused_by_its_process(output: Tensor, target: Tensor) -> Tensor:
    raise ValueError("this loss refuses to run")


@scenario
def a_failure_on_the_last_process_reaches_every_process() -> None:
    pipe = DistributedPipe(blocks(2 * world()), [2] * world(), chunks=2)
    x, y = batch()
    # evaluate's other processes waited for its loss in a broadcast until the failed
    # process exited; the loss now comes by the step's messages, which its abort ends.
    for run in (pipe.step, pipe.evaluate):
        call = partial(run, x, y, a_loss_refused_by_its_process)
        if rank() == world() - 1:
            expect_error(ValueError, call, "refuses")
        else:  # the processes beyond its neighbour hear of it too
            expect_error(RuntimeError, call, f"rank {world() - 1} failed: ValueError: this loss")
    with torch.no_grad():
        expected = F.mse_loss(blocks(2 * world())(x), y)
    torch.testing.assert_close(pipe.evaluate(x, y, F.mse_loss), expected)
    pipe.close()


class OnItsSecondCall(nn.Module):
    """Passes its input on; in its second call, ``act``s on ``pipe`` first (when set)."""

    def __init__(self) -> None:
        super().__init__()
        self.pipe: DistributedPipe | None = None
        self.calls = 0

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        if self.pipe is not None and self.calls == 2:
            self.act(self.pipe)
        return x

    def act(self, pipe: DistributedPipe) -> None:
        raise NotImplementedError


class EndsOnceTheLastRankFailed(OnItsSecondCall):
    """On the last rank's neighbour, the second forward ends once the last rank's abort came.

    The failed rank waits for every process at the step's end (its agreement)
    before it returns, so its close comes after: the neighbour's send follows
    its abort.
    """

    def act(self, pipe: DistributedPipe) -> None:
        mailboxes = pipe._transport._mailboxes
        with mailboxes._changed:
            aborted = mailboxes._changed.wait_for(lambda: bool(mailboxes._aborted), timeout=60)
        assert aborted, "the last rank's abort did not come within 60 s"


@scenario
def a_failure_reaches_a_process_whose_send_follows_the_failed_peers_abort() -> None:
    # Found by CI: the neighbour's send after the last rank's close named the
    # close, not the failure that ended the step.
    waits = EndsOnceTheLastRankFailed()
    layers = list(blocks(2 * world() - 1))
    layers.insert(2 * (world() - 2), waits)  # the neighbour's first layer
    pipe = DistributedPipe(nn.Sequential(*layers), [2] * world(), chunks=2)
    x, y = batch()
    if rank() == world() - 1:
        expect_error(ValueError, lambda: pipe.step(x, y, a_loss_refused_by_its_process), "refuses")
        pipe.close()
        return
    if rank() == world() - 2:
        waits.pipe = pipe
    last = f"rank {world() - 1} failed: ValueError: this loss refuses to run"
    expect_error(RuntimeError, lambda: pipe.step(x, y, a_loss_refused_by_its_process), last)
    pipe.close()


class ClosesItsPipe(OnItsSecondCall):
    """Closes ``pipe`` (when set) in its second call: a script ending its pipeline mid-step."""

    def act(self, pipe: DistributedPipe) -> None:
        pipe.close()


@scenario
def a_pipe_closed_mid_step_fails_every_process_at_once() -> None:
    # Rank 0's neighbour fails waiting for it; the ranks beyond, no neighbours of
    # rank 0, heard nothing and waited the pipe's whole timeout, blaming the neighbour.
    closes = ClosesItsPipe()
    pipe = DistributedPipe(
        nn.Sequential(closes, *blocks(2 * world() - 1)), [2] * world(), chunks=4, timeout=120
    )
    if rank() == 0:
        closes.pipe = pipe
    x, y = batch()
    start = time.monotonic()
    expect_error(RuntimeError, lambda: pipe.step(x, y, F.mse_loss), "rank")
    assert time.monotonic() - start < 15, "the close took a timeout to reach this process"
    pipe.close()


def tied_model_for(stages: int) -> nn.Sequential:
    torch.manual_seed(11)
    embed = Embed()
    layers = [embed, *(block() for _ in range(2 * stages - 2)), Head(embed.token)]
    return nn.Sequential(*layers).double()


CLASSES = 3


def correct(output: Tensor, target: Tensor) -> Tensor:
    return (output.argmax(1) == target).sum()


LOSSES_OF_EVERY_DTYPE: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "int64 count": correct,
    "int32 count": lambda o, t: correct(o, t).int(),
    "uint8 count": lambda o, t: correct(o, t).to(torch.uint8),
    "bool": lambda o, t: (o.argmax(1) == t).any(),
    "float16": lambda o, t: F.cross_entropy(o.half(), t, reduction="sum"),
    "complex64": lambda o, t: torch.complex(o.sum(), t.sum().float()),
}


@scenario
def evaluate_returns_a_loss_of_any_dtype_as_the_single_process_pipe() -> None:
    """Integer and boolean losses (counts, flags) come back as int64 sums, as from Pipe."""
    torch.manual_seed(0)
    layers = [nn.Linear(WIDTH, WIDTH) for _ in range(2 * world() - 1)]
    model = nn.Sequential(*layers, nn.Linear(WIDTH, CLASSES))
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(10, WIDTH, generator=gen), torch.randint(CLASSES, (10,), generator=gen)
    one = Pipe(copy.deepcopy(model), [2] * world(), devices=["cpu"] * world(), chunks=4)
    pipe = DistributedPipe(copy.deepcopy(model), [2] * world(), chunks=4)
    for name, loss_fn in LOSSES_OF_EVERY_DTYPE.items():
        expected = one.evaluate(x, y, loss_fn, loss_reduction="sum")
        got = pipe.evaluate(x, y, loss_fn, loss_reduction="sum")
        assert got.dtype == expected.dtype, (name, got.dtype, expected.dtype)
        assert torch.equal(got, expected), (name, got, expected)
    one.close()
    pipe.close()


@scenario
def forwards_out_of_order_raise_program_error_on_every_process_saying_why() -> None:
    """Refused where the BatchNorm's stage runs, heard by the others: one ProgramError kind."""
    torch.manual_seed(2)
    layers = [nn.Linear(WIDTH, WIDTH) for _ in range(2 * world() - 1)]
    pipe = DistributedPipe(nn.Sequential(nn.BatchNorm1d(WIDTH), *layers), [2] * world(), chunks=3)
    reversed_on_0 = "0F1 0F0 0F2 0B0 0B1 0B2"
    programs = [reversed_on_0] + [f"{s}F0 {s}F1 {s}F2 {s}B0 {s}B1 {s}B2" for s in range(1, world())]
    x, y = torch.randn(9, WIDTH), torch.randn(9, WIDTH)
    why = "stage 0 runs the forward of micro-batch 1 before"
    who = [] if rank() == 0 else ["rank 0 of the pipeline refused this step's programs"]
    step = lambda: pipe.step(x, y, F.mse_loss, schedule=Programs(programs))  # noqa: E731
    expect_error(ProgramError, step, why, *who)
    assert all(p.grad is None for p in pipe.parameters()), "a refused step computed"
    pipe.close()


if __name__ == "__main__":
    main()
