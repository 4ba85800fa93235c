"""Pipe.step: every schedule gives the plain model's loss and gradients, in every combination."""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pipeline import DeferredBatchNorm, NoChunk, Pipe
from pipeline.schedules import GPipe, Interleaved1F1B, OneFOneB, Programs, ZeroBubbleH1
from pipeline.skip import Namespace
from pipeline.step.simulate import ProgramError
from tests.helpers import Pop, Stash

WIDTH = 4
MODES = ("always", "except_last", "never")
SCHEDULES: dict[str, Callable[[], Any]] = {
    "gpipe": GPipe,
    "1f1b": OneFOneB,
    "interleaved": lambda: Interleaved1F1B(virtual=2),
    "zb-h1": ZeroBubbleH1,
}


def block() -> nn.Module:
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh())


def layered(n: int, layout: str) -> tuple[nn.Sequential, list[int]]:
    """n partitions of 2 layers each, with the skips of ``layout`` placed in them."""
    layers = [block() for _ in range(2 * n)]
    pairs: list[tuple[int, int]] = {
        "none": [],
        "within a partition": [(0, 1)],
        "adjacent": [(1, 2)] if n > 1 else [(0, 1)],
        "first to last": [(0, 2 * n - 1)],
        "two namespaces": [(0, 2 * n - 1), (1, 2 * n - 2)] if n > 1 else [(0, 1)],
    }[layout]
    for stash_at, pop_at in pairs:
        ns = Namespace()
        layers[stash_at] = nn.Sequential(Stash(WIDTH).isolate(ns), layers[stash_at])
        layers[pop_at] = nn.Sequential(layers[pop_at], Pop(WIDTH).isolate(ns))
    return nn.Sequential(*layers).double(), [2] * n


LAYOUTS = ["none", "within a partition", "adjacent", "first to last", "two namespaces"]


def chunk_counts(n: int) -> list[int]:
    return sorted({1, max(n - 1, 1), n, 2 * n + 1})


def grads(module: nn.Module) -> list[Tensor | None]:
    return [None if p.grad is None else p.grad.clone() for p in module.parameters()]


def assert_same(actual: list[Tensor | None], expected: list[Tensor | None], what: str) -> None:
    assert len(actual) == len(expected)
    for k, (a, e) in enumerate(zip(actual, expected, strict=True)):
        assert (a is None) == (e is None), f"{what}: parameter {k} gradient presence"
        if a is not None and e is not None:
            torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-12, msg=f"{what}: parameter {k}")


@pytest.mark.parametrize("checkpoint", MODES)
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_every_layout_partition_count_and_chunk_count_equals_plain_and_pipe_call(
    schedule: str, checkpoint: str
) -> None:
    rows = 7  # never divisible by the chunk counts above 1
    for n in (1, 2, 3, 4):
        if schedule == "interleaved" and n % 2:
            continue
        for layout in LAYOUTS:
            torch.manual_seed(n)
            model, balance = layered(n, layout)
            x = torch.randn(rows, WIDTH, dtype=torch.double, requires_grad=True)
            y = torch.randn(rows, WIDTH, dtype=torch.double)
            plain = copy.deepcopy(model)
            plain_loss = F.mse_loss(plain(x), y)
            plain_loss.backward()
            plain_grads, plain_x_grad = grads(plain), x.grad.clone()  # type: ignore[union-attr]
            for chunks in chunk_counts(n):
                if schedule == "interleaved" and min(chunks, rows) % (n // 2):
                    continue
                what = f"{schedule}, {checkpoint}, n={n}, {layout}, chunks={chunks}"
                for via_step in (True, False):
                    pipe = Pipe(
                        copy.deepcopy(model),
                        balance,
                        devices=["cpu"] * n,
                        chunks=chunks,
                        checkpoint=checkpoint,  # type: ignore[arg-type]
                    )
                    x.grad = None
                    if via_step:
                        loss = pipe.step(x, y, F.mse_loss, schedule=SCHEDULES[schedule]())
                    else:
                        loss = F.mse_loss(pipe(x), y)
                        loss.backward()
                    torch.testing.assert_close(loss.detach(), plain_loss.detach(), msg=what)
                    assert_same(grads(pipe), plain_grads, what)
                    torch.testing.assert_close(x.grad, plain_x_grad, msg=what)
                    pipe.close()


def dropout_model() -> nn.Sequential:
    torch.manual_seed(3)
    layers: list[nn.Module] = []
    for _ in range(4):
        layers += [nn.Linear(8, 8), nn.Dropout(0.3), nn.Tanh()]
    return nn.Sequential(*layers).double()


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_dropout_draws_the_masks_of_the_pipe_call_in_every_mode(schedule: str) -> None:
    x, y = torch.randn(8, 8, dtype=torch.double), torch.randn(8, 8, dtype=torch.double)
    reference = Pipe(
        dropout_model(), [3, 3, 3, 3], devices=["cpu"] * 4, chunks=4, checkpoint="never"
    )
    torch.manual_seed(11)
    expected_loss = F.mse_loss(reference(x), y)
    expected_loss.backward()
    for checkpoint in MODES:
        pipe = Pipe(
            dropout_model(), [3, 3, 3, 3], devices=["cpu"] * 4, chunks=4, checkpoint=checkpoint
        )  # type: ignore[arg-type]
        torch.manual_seed(11)
        loss = pipe.step(x, y, F.mse_loss, schedule=SCHEDULES[schedule]())
        torch.testing.assert_close(loss, expected_loss.detach())
        assert_same(grads(pipe), grads(reference), f"{schedule}, {checkpoint}")


def batchnorm_model(deferred: bool) -> tuple[nn.Sequential, nn.Sequential]:
    torch.manual_seed(4)
    model = nn.Sequential(
        nn.Linear(6, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh()
    ).double()
    return model, copy.deepcopy(model)


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("checkpoint", MODES)
def test_batch_norm_statistics_equal_the_plain_model(schedule: str, checkpoint: str) -> None:
    x, y = torch.randn(12, 6, dtype=torch.double), torch.randn(12, 6, dtype=torch.double)
    for deferred in (False, True):
        model, plain = batchnorm_model(deferred)
        pipe = Pipe(
            model,
            [2, 1, 1, 1],
            devices=["cpu"] * 4,
            chunks=4,
            checkpoint=checkpoint,  # type: ignore[arg-type]
            deferred_batch_norm=deferred,
        )
        for _ in range(2):
            pipe.step(x, y, F.mse_loss, schedule=SCHEDULES[schedule]())
            if deferred:  # statistics of the whole batch, once per step
                F.mse_loss(plain(x), y).backward()
            else:  # one momentum step per micro-batch, as in the Pipe's forward
                for xs, ys in zip(x.chunk(4), y.chunk(4), strict=True):
                    (F.mse_loss(plain(xs), ys) / 4).backward()
        what = f"{schedule}, {checkpoint}, deferred={deferred}"
        assert isinstance(pipe[1], DeferredBatchNorm) == deferred
        torch.testing.assert_close(pipe[1].running_mean, plain[1].running_mean, msg=what)
        torch.testing.assert_close(pipe[1].running_var, plain[1].running_var, msg=what)
        assert int(pipe[1].num_batches_tracked) == int(plain[1].num_batches_tracked), what
        if not deferred:
            assert_same(grads(pipe), grads(plain), what)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_autocast_reaches_forward_and_recompute_like_the_pipe_call(schedule: str) -> None:
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8), nn.GELU())
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    reference = Pipe(copy.deepcopy(model), [2, 2], devices=["cpu"] * 2, chunks=4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = reference(x)
        assert out.dtype == torch.bfloat16  # type: ignore[union-attr]
        expected = F.mse_loss(out.float(), y)  # type: ignore[union-attr]
    expected.backward()
    pipe = Pipe(copy.deepcopy(model), [2, 2], devices=["cpu"] * 2, chunks=4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = pipe.step(x, y, lambda o, t: F.mse_loss(o.float(), t), schedule=schedule)
    torch.testing.assert_close(loss, expected.detach())
    assert_same(grads(pipe), grads(reference), schedule)


class Masked(nn.Module):
    """Takes (x, mask, scale, tag) and passes it on; the mask is whole, unsplit."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(
        self, value: tuple[Tensor, Tensor, float, str]
    ) -> tuple[Tensor, Tensor, float, str]:
        x, mask, scale, tag = value
        assert tag == "tag" and mask.shape == (WIDTH,)
        return torch.tanh(self.linear(x)) * mask * scale, mask, scale, tag


class First(nn.Module):
    def forward(self, value: tuple[Tensor, Tensor, float, str]) -> Tensor:
        return value[0]


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_tuple_inputs_with_no_chunk_and_non_tensors(schedule: str) -> None:
    torch.manual_seed(6)
    model = nn.Sequential(Masked(), Masked(), Masked(), First()).double()
    plain = copy.deepcopy(model)
    mask = torch.rand(WIDTH, dtype=torch.double)
    x, y = torch.randn(6, WIDTH, dtype=torch.double), torch.randn(6, WIDTH, dtype=torch.double)
    F.mse_loss(plain((x, mask, 0.5, "tag")), y).backward()
    pipe = Pipe(model, [1, 1, 1, 1], devices=["cpu"] * 4, chunks=2)
    pipe.step((x, NoChunk(mask), 0.5, "tag"), y, F.mse_loss, schedule=SCHEDULES[schedule]())
    assert_same(grads(pipe), grads(plain), schedule)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_loss_reduction_with_an_uneven_last_micro_batch(reduction: str) -> None:
    torch.manual_seed(7)
    model = nn.Sequential(block(), block(), nn.Linear(WIDTH, 3)).double()
    plain = copy.deepcopy(model)
    x, y = torch.randn(10, WIDTH, dtype=torch.double), torch.randint(0, 3, (10,))
    expected = F.cross_entropy(plain(x), y, reduction=reduction)
    expected.backward()
    pipe = Pipe(model, [1, 1, 1], devices=["cpu"] * 3, chunks=4)  # 3, 3, 3, 1 rows

    def loss_fn(output: Tensor, target: Tensor) -> Tensor:
        return F.cross_entropy(output, target, reduction=reduction)

    loss = pipe.step(x, y, loss_fn, loss_reduction=reduction)  # type: ignore[arg-type]
    torch.testing.assert_close(loss, expected.detach())
    assert_same(grads(pipe), grads(plain), reduction)


def test_gradients_accumulate_like_backward_and_outputs_come_back_on_request() -> None:
    torch.manual_seed(8)
    model = nn.Sequential(block(), block()).double()
    plain = copy.deepcopy(model)
    x, y = torch.randn(6, WIDTH, dtype=torch.double), torch.randn(6, WIDTH, dtype=torch.double)
    for _ in range(2):
        F.mse_loss(plain(x), y).backward()
    pipe = Pipe(model, [1, 1], devices=["cpu"] * 2, chunks=3)
    pipe.step(x, y, F.mse_loss)
    loss, output = pipe.step(x, y, F.mse_loss, return_outputs=True)  # type: ignore[misc]
    assert_same(grads(pipe), grads(plain), "two steps accumulate")
    torch.testing.assert_close(output, plain(x).detach())
    assert not output.requires_grad and loss.shape == ()


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_peak_micro_batches_held_equal_the_simulation(schedule: str) -> None:
    pipe = Pipe(layered(4, "none")[0], [2] * 4, devices=["cpu"] * 4, chunks=8, checkpoint="never")
    x, y = torch.randn(16, WIDTH, dtype=torch.double), torch.randn(16, WIDTH, dtype=torch.double)
    pipe.step(x, y, F.mse_loss, schedule=SCHEDULES[schedule]())
    report = pipe.last_step
    assert report is not None
    assert report.peak_in_flight == report.simulation.peak_in_flight
    expected = {
        "gpipe": [8, 8, 8, 8],
        "1f1b": [4, 3, 2, 1],
        "interleaved": [4, 3, 2, 1],
        "zb-h1": [5, 4, 3, 1],
    }[schedule]
    assert report.peak_in_flight == expected


def test_programs_of_ones_own_run_and_bad_ones_are_refused_before_any_work() -> None:
    calls: list[int] = []

    class Count(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            calls.append(1)
            return x * 2

    model = nn.Sequential(nn.Linear(2, 2), Count())
    pipe = Pipe(model, [1, 1], devices=["cpu"] * 2, chunks=2, checkpoint="never")
    x, y = torch.randn(4, 2), torch.randn(4, 2)
    pipe.step(x, y, F.mse_loss, schedule=Programs(["0F0 0F1 0B0 0B1", "1F0 1B0 1F1 1B1"]))
    assert len(calls) == 2
    bad = {
        "deadlock": (["0F0 0B0 0F1 0B1", "1F1 1B1 1F0 1B0"], "deadlock"),
        "missing backward": (["0F0 0F1 0B0", "1F0 1B0 1F1 1B1"], "stage 0, micro-batch 1: 1 x F"),
        "backward first": (["0B0 0F0 0F1 0B1", "1F0 1B0 1F1 1B1"], "runs 0B0 before 0F0"),
        "stage on two workers": (["0F0 0F1 0B0 1B1", "1F0 1B0 1F1 0B1"], "workers 0 and 1"),
        "unknown stage": (["0F0 0F1 0B0 0B1", "1F0 1B0 1F1 1B1 2F0"], "there are 2 stages"),
    }
    for name, (programs, message) in bad.items():
        calls.clear()
        with pytest.raises(ProgramError, match=message):
            pipe.step(x, y, F.mse_loss, schedule=Programs(programs))
        assert calls == [], name
    with pytest.raises(ValueError, match="is not an action"):
        Programs(["0X0"])


class FailAt(nn.Module):
    """Raises in the forward of micro-batch ``microbatch`` or in its backward."""

    def __init__(self, where: str, microbatch: int) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.where = where
        self.microbatch = microbatch
        self.calls = 0
        self.armed = True

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        failing = self.armed and self.calls == self.microbatch + 1
        if failing and self.where == "forward":
            raise KeyError("failed in forward")
        out = torch.tanh(self.linear(x))
        if failing and self.where == "backward":
            out.register_hook(_raise)
        return out


def _raise(grad: Tensor) -> Tensor:
    raise KeyError("failed in backward")


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("where", ["forward", "backward"])
@pytest.mark.parametrize("stage", [0, 1, 3])
def test_a_failing_action_reaches_the_caller_and_the_next_step_is_right(
    schedule: str, where: str, stage: int
) -> None:
    torch.manual_seed(9)
    layers: list[nn.Module] = [block() for _ in range(4)]
    failing = FailAt(where, microbatch=1)
    layers[stage] = nn.Sequential(layers[stage], failing)
    model = nn.Sequential(*layers).double()
    plain = copy.deepcopy(model)
    pipe = Pipe(model, [1, 1, 1, 1], devices=["cpu"] * 4, chunks=4, checkpoint="never")
    x, y = torch.randn(8, WIDTH, dtype=torch.double), torch.randn(8, WIDTH, dtype=torch.double)
    start = time.perf_counter()
    with pytest.raises(KeyError, match=f"failed in {where}") as info:
        pipe.step(x, y, F.mse_loss, schedule=SCHEDULES[schedule]())
    assert time.perf_counter() - start < 20
    assert any("of the schedule" in note for note in getattr(info.value, "__notes__", []))
    del info
    failing.armed = False
    pipe.zero_grad()
    pipe.step(x, y, F.mse_loss, schedule=SCHEDULES[schedule]())
    F.mse_loss(plain(x), y).backward()
    assert_same(grads(pipe), grads(plain), f"the step after a failure, {schedule}")


def test_step_is_refused_where_it_cannot_be_right() -> None:
    pipe = Pipe(nn.Sequential(block(), block()).double(), [1, 1], devices=["cpu"] * 2, chunks=2)
    x, y = torch.randn(4, WIDTH, dtype=torch.double), torch.randn(4, WIDTH, dtype=torch.double)
    with torch.no_grad(), pytest.raises(RuntimeError, match="grad mode is off"):
        pipe.step(x, y, F.mse_loss)
    with pytest.raises(ValueError, match="target splits into micro-batches of"):
        pipe.step(x, y[:3], F.mse_loss)
    with pytest.raises(ValueError, match="loss_reduction must be 'mean' or 'sum'"):
        pipe.step(x, y, F.mse_loss, loss_reduction="max")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="loss_fn must be callable"):
        pipe.step(x, y, "mse")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="schedule must be one of"):
        pipe.step(x, y, F.mse_loss, schedule="fast")
    with pytest.raises(TypeError, match="it must return a scalar tensor"):
        pipe.step(x, y, lambda o, t: (o - t).square())
    interleaved = Interleaved1F1B(virtual=2)
    four = Pipe(layered(4, "none")[0], [2] * 4, devices=["cpu"] * 4, chunks=3)
    with pytest.raises(ValueError, match=r"micro-batches \(3\) to be a multiple of .* \(2\)"):
        four.step(x[:3], y[:3], F.mse_loss, schedule=interleaved)
    with pytest.raises(ValueError, match="runs 4 stages per worker, but the Pipe has 2 partitions"):
        pipe.step(x, y, F.mse_loss, schedule=Interleaved1F1B(virtual=4))
    inside: list[str] = []

    def step_in_backward(grad: Tensor) -> None:
        try:
            pipe.step(x, y, F.mse_loss)
        except RuntimeError as error:
            inside.append(str(error))  # not the error: its frames would keep the Pipe alive

    z = torch.ones(1, requires_grad=True)
    z.register_hook(step_in_backward)
    (z * 2).sum().backward()
    assert inside and "inside a backward pass" in inside[0]


def test_two_threads_stepping_one_pipe_run_one_after_the_other() -> None:
    torch.manual_seed(10)
    model = nn.Sequential(block(), block()).double()
    plain = copy.deepcopy(model)
    pipe = Pipe(model, [1, 1], devices=["cpu"] * 2, chunks=2)
    x, y = torch.randn(4, WIDTH, dtype=torch.double), torch.randn(4, WIDTH, dtype=torch.double)
    threads = [
        threading.Thread(target=lambda: [pipe.step(x, y, F.mse_loss) for _ in range(5)])
        for _ in range(2)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not any(t.is_alive() for t in threads)
    for _ in range(10):
        F.mse_loss(plain(x), y).backward()
    assert_same(grads(pipe), grads(plain), "10 steps from two threads")


def test_partition_backward_hooks_fire_once_per_partition_after_its_last_backward() -> None:
    for schedule in SCHEDULES:
        pipe = Pipe(layered(4, "none")[0], [2] * 4, devices=["cpu"] * 4, chunks=4)
        seen: list[int] = []
        pipe.register_partition_backward_hook(seen.append)
        x, y = torch.randn(8, WIDTH, dtype=torch.double), torch.randn(8, WIDTH, dtype=torch.double)
        pipe.step(x, y, F.mse_loss, schedule=SCHEDULES[schedule]())
        assert sorted(seen) == [0, 1, 2, 3], schedule


@pytest.mark.parametrize(
    ("schedule", "backward_kinds", "recomputing_partitions"),
    [
        # except_last spares a forward directly followed by its own backward:
        # GPipe's last micro-batch, and everything on 1F1B's last partition.
        ("gpipe", {"backward"}, 3),
        ("1f1b", {"backward"}, 2),
        ("zb-h1", {"input_grad", "weight_grad"}, 2),
    ],
)
def test_the_trace_shows_every_action_once_with_its_kind(
    schedule: str, backward_kinds: set[str], recomputing_partitions: int
) -> None:
    import pipeline

    n, m = 3, 4
    pipe = Pipe(
        layered(n, "none")[0],
        [2] * n,
        devices=["cpu", "cpu:0", "cpu"],  # differently named: the hand-overs are copies
        chunks=m,
        checkpoint="except_last",
    )
    x, y = torch.randn(8, WIDTH, dtype=torch.double), torch.randn(8, WIDTH, dtype=torch.double)
    with pipeline.trace() as t:
        pipe.step(x, y, F.mse_loss, schedule=schedule)
    tasks: dict[str, list[tuple[int, int]]] = {}
    for event in t.events:
        tasks.setdefault(event.kind, []).append((event.microbatch, event.partition))
    every = sorted((i, j) for i in range(m) for j in range(n))
    assert sorted(tasks["forward"]) == every
    for kind in backward_kinds:
        assert sorted(tasks[kind]) == every, kind
    recomputed = sorted((i, j) for i in range(m - 1) for j in range(recomputing_partitions))
    assert sorted(tasks["recompute"]) == recomputed
    assert "copy" in tasks
    summary = t.summary()
    assert pipe.last_step is not None
    assert summary.schedule_bound == pipe.last_step.simulation.mean_idle_fraction
    assert "the schedule's simulated idle fraction" in str(summary)
    letters = {"backward": "B", "input_grad": "I", "weight_grad": "W"}
    rendered = t.render(width=200).lower()
    assert all(letters[kind].lower() in rendered for kind in backward_kinds)
