"""Pipe.step's stages: every schedule gives the plain model's loss and gradients, in every
combination."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from step_models import (
    LAYOUTS,
    MODES,
    SCHEDULES,
    WIDTH,
    assert_same,
    block,
    chunk_counts,
    grads,
    layered,
)
from torch import Tensor, nn

from pipeline import DeferredBatchNorm, NoChunk, Pipe


@pytest.mark.parametrize("checkpoint", MODES)
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_every_layout_partition_count_and_chunk_count_equals_the_plain_model(
    schedule: str, checkpoint: str
) -> None:
    check_every_layout(checkpoint, schedule)


@pytest.mark.parametrize("threads", ["partition", "device"])
@pytest.mark.parametrize("checkpoint", MODES)
def test_every_layout_partition_count_and_chunk_count_of_pipe_call_too(
    checkpoint: str, threads: str
) -> None:
    # "device": one thread runs every partition, the clock cycles' fences
    # (fork/join edges, skip portals) included.
    check_every_layout(checkpoint, schedule=None, threads=threads)


def check_every_layout(checkpoint: str, schedule: str | None, threads: str = "auto") -> None:
    """``pipe.step`` with ``schedule`` (``pipe(x)`` and backward if None) against the plain one."""
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
                what = f"{schedule or 'pipe(x)'}, {checkpoint}, n={n}, {layout}, chunks={chunks}"
                pipe = Pipe(
                    copy.deepcopy(model),
                    balance,
                    devices=["cpu"] * n,
                    chunks=chunks,
                    checkpoint=checkpoint,  # type: ignore[arg-type]
                    threads=threads,  # type: ignore[arg-type]
                )
                x.grad = None
                if schedule is not None:
                    loss = pipe.step(x, y, F.mse_loss, schedule=SCHEDULES[schedule]())
                else:
                    loss = F.mse_loss(pipe(x), y)
                    loss.backward()
                torch.testing.assert_close(loss.detach(), plain_loss.detach(), msg=what)
                assert_same(grads(pipe), plain_grads, what)
                torch.testing.assert_close(x.grad, plain_x_grad, msg=what)
                pipe.close()


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_stages_sharing_one_thread_equal_the_plain_model(schedule: str) -> None:
    # threads="device": the programs of every stage run on one thread, in the
    # order validating them gave (each action after its mail, forwards and
    # backwards grouped). Every skip layout, the checkpoint modes in turn.
    check_stages_sharing_threads(schedule, "device", thread_of=None)


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_two_threads_each_running_two_stages_equal_the_plain_model(schedule: str) -> None:
    # As on two GPUs of two partitions each with threads="device": each
    # thread runs its stages' programs in the order their actions started in
    # the validated play, some of its mail coming from the other thread.
    check_stages_sharing_threads(schedule, "partition", thread_of=[0, 0, 1, 1])


def test_two_threads_each_running_two_stages_run_the_same_order_at_every_step() -> None:
    # The order of a thread's actions is the play's, not the order in which
    # mail happened to arrive: what a thread draws from a generator it owns
    # (a GPU's) is the same at every step under the same seed.
    torch.manual_seed(0)
    model, balance = layered(4, LAYOUTS[0])
    pipe = Pipe(model, balance, devices=["cpu"] * 4, chunks=4, checkpoint="never")
    pipe._thread_of = [0, 0, 1, 1]
    x = torch.randn(8, WIDTH, dtype=torch.double)
    for _ in range(3):
        pipe.step(x, x, F.mse_loss, schedule="1f1b")
        report = pipe.last_step
        assert report is not None
        start = report.simulation.start
        for stages in ({0, 1}, {2, 3}):
            ran = [r.action for r in report.actions if r.action.stage in stages]
            assert ran == sorted(ran, key=start.__getitem__)
    pipe.close()


def check_stages_sharing_threads(schedule: str, threads: str, thread_of: list[int] | None) -> None:
    n = 4
    for k, layout in enumerate(LAYOUTS):
        torch.manual_seed(n + k)
        model, balance = layered(n, layout)
        x = torch.randn(8, WIDTH, dtype=torch.double)
        y = torch.randn(8, WIDTH, dtype=torch.double)
        plain = copy.deepcopy(model)
        F.mse_loss(plain(x), y).backward()
        checkpoint = MODES[k % len(MODES)]
        pipe = Pipe(
            model,
            balance,
            devices=["cpu"] * n,
            chunks=4,
            checkpoint=checkpoint,  # type: ignore[arg-type]
            threads=threads,  # type: ignore[arg-type]
        )
        if thread_of is not None:
            pipe._thread_of = thread_of
        pipe.step(x, y, F.mse_loss, schedule=SCHEDULES[schedule]())
        assert_same(grads(pipe), grads(plain), f"{schedule}, {layout}, {checkpoint}")
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


class WithScalar(nn.Module):
    """Returns its input and a reduced scalar, as a transformers output with its ``loss``."""

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return x, x.square().mean()


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_outputs_that_cannot_be_gathered_are_refused_before_any_gradient(schedule: str) -> None:
    # Found with transformers' own loss: the refusal came at the step's end,
    # every gradient already written.
    model = nn.Sequential(block(), block(), WithScalar()).double()
    pipe = Pipe(model, [1, 2], devices=["cpu"] * 2, chunks=3)
    x = torch.randn(6, WIDTH, dtype=torch.double)

    def loss_fn(output: tuple[Tensor, Tensor], target: Tensor) -> Tensor:
        return output[1] + F.mse_loss(output[0], target)

    with pytest.raises(ValueError, match=r"0-dim tensor \(output leaf 1\).*one value per row"):
        pipe.step(x, x, loss_fn, schedule=schedule, return_outputs=True)
    assert all(p.grad is None for p in model.parameters())
    loss = pipe.step(x, x, loss_fn, schedule=schedule)  # without the outputs, it trains
    assert loss.shape == () and all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_skips_on_one_thread_without_grad_equal_the_plain_model(mode: str) -> None:
    # The fences (skip portals among them) run on the worker in the caller's
    # grad and inference mode.
    context = torch.no_grad if mode == "no_grad" else torch.inference_mode
    for layout in LAYOUTS:
        torch.manual_seed(5)
        model, balance = layered(4, layout)
        x = torch.randn(7, WIDTH, dtype=torch.double)
        with context():
            expected = model(x)
        pipe = Pipe(model, balance, devices=["cpu"] * 4, chunks=3, threads="device")
        with context():
            found = pipe(x)
        assert isinstance(found, Tensor) and not found.requires_grad
        assert found.is_inference() == (mode == "inference_mode")
        torch.testing.assert_close(found, expected, msg=layout)
        pipe.close()


@dataclasses.dataclass
class Extra:
    h: Tensor


class WithExtra(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: Tensor) -> tuple[Tensor, Extra]:
        h = self.linear(x)
        return torch.tanh(h), Extra(h * 3)


class TakesExtra(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, pair: tuple[Tensor, Extra]) -> Tensor:
        return self.linear(pair[0]) + pair[1].h


@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_an_object_hiding_a_tensor_that_requires_grad_between_stages_is_refused(
    checkpoint: str,
) -> None:
    # Passed as it was, its tensor kept the first stage's graph: the second stage's
    # backward walked it, and the step failed midway with torch's error ("backward
    # through the graph a second time") after writing gradients.
    torch.manual_seed(0)
    model = nn.Sequential(WithExtra(), TakesExtra()).double()
    x, y = torch.randn(8, WIDTH, dtype=torch.double), torch.randn(8, WIDTH, dtype=torch.double)
    pipe = Pipe(model, [1, 1], devices=["cpu"] * 2, chunks=2, checkpoint=checkpoint)  # type: ignore[arg-type]
    with pytest.raises(
        TypeError, match=r"Extra object holding a tensor computed with grad \(\.h\).*pytree"
    ):
        pipe.step(x, y, F.mse_loss)
    assert all(p.grad is None for p in model.parameters())
    pipe.close()


class WithCount(nn.Module):
    """Returns its input and a non-tensor: its rows, or a number of its own."""

    def __init__(self, value: str) -> None:
        super().__init__()
        self.value = value
        self.calls = 0

    def forward(self, x: Tensor) -> tuple[Tensor, int]:
        self.calls += 1
        return x, x.size(0) if self.value == "rows" else self.calls


@pytest.mark.parametrize("value", ["rows", "a count of calls"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_non_tensor_outputs_that_cannot_be_gathered_are_refused_before_the_step_ends(
    schedule: str, value: str
) -> None:
    # They were refused by the gather, after every gradient was written and every hook
    # had fired (in a DistributedPipe, on the last process alone).
    model = nn.Sequential(block(), block(), WithCount(value)).double()
    pipe = Pipe(model, [1, 2], devices=["cpu"] * 2, chunks=3)
    x = torch.randn(6, WIDTH, dtype=torch.double)
    signalled: list[int] = []
    pipe.register_partition_backward_hook(signalled.append)

    def loss_fn(output: tuple[Tensor, int], target: Tensor) -> Tensor:
        return F.mse_loss(output[0], target)

    found = "holds its micro-batch's rows" if value == "rows" else "differs between micro-batches"
    with pytest.raises(ValueError, match=found):
        pipe.step(x, x, loss_fn, schedule=schedule, return_outputs=True)
    assert not signalled
    if schedule == "gpipe":  # every forward before any backward
        assert all(p.grad is None for p in model.parameters())
    pipe.close()


class Slotted:
    __slots__ = ("held",)

    def __init__(self, held: Any) -> None:
        self.held = held


class Hides(nn.Module):
    """Returns its input and an object holding a tensor: computed (``how``), or a weight."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.how = how

    def forward(self, x: Tensor) -> tuple[Tensor, Any]:
        h = self.linear(x)
        hidden = {"slots": Slotted(h), "list": Slotted([h]), "weight": Slotted(self.linear.weight)}
        return torch.tanh(h), hidden[self.how]


class Unhides(nn.Module):
    def forward(self, pair: tuple[Tensor, Any]) -> Tensor:
        held = pair[1].held
        return pair[0] + (held[0] if isinstance(held, list) else held).sum()


@pytest.mark.parametrize("how", ["slots", "list", "weight"])
def test_a_tensor_hidden_in_slots_or_a_list_is_refused_and_a_weight_held_passes(how: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(Hides(how), Unhides()).double()
    plain = copy.deepcopy(model)
    x, y = torch.randn(8, WIDTH, dtype=torch.double), torch.randn(8, WIDTH, dtype=torch.double)
    pipe = Pipe(model, [1, 1], devices=["cpu"] * 2, chunks=2)
    if how == "weight":  # a leaf: its gradient accumulates wherever it is reached
        pipe.step(x, y, F.mse_loss)
        for micro_x, micro_y in zip(x.chunk(2), y.chunk(2), strict=True):
            (F.mse_loss(plain(micro_x), micro_y) / 2).backward()
        assert_same(grads(model), grads(plain), how)
    else:
        with pytest.raises(TypeError, match=r"Slotted object holding a tensor computed with grad"):
            pipe.step(x, y, F.mse_loss)
        assert all(p.grad is None for p in model.parameters())
    pipe.close()


class WithConstant(nn.Module):
    def forward(self, x: Tensor) -> tuple[Tensor, int]:
        return x, 4


def test_a_constant_non_tensor_output_passes_with_uneven_micro_batches() -> None:
    # Compared by pairs as the micro-batches came, a 4 beside micro-batches of 4 and 4
    # rows was taken for a count of rows, though the last one held 2.
    pipe = Pipe(nn.Sequential(block(), WithConstant()).double(), [1, 1], chunks=4)
    x = torch.randn(14, WIDTH, dtype=torch.double)
    _, (out, constant) = pipe.step(x, x, lambda o, t: F.mse_loss(o[0], t), return_outputs=True)
    assert constant == 4 and out.shape == x.shape
    pipe.close()
