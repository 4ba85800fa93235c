"""What a stage keeps: its activations within the schedule's bound, its outputs freed once sent."""

from __future__ import annotations

import copy
import gc
import weakref
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pipeline import Pipe
from pipeline.skip import pop, skippable, stash
from tests.step.step_models import MODES, SCHEDULES, assert_same, grads

ROWS, WIDTH, M, STAGES = 4, 16, 8, 4
# One micro-batch's tensors of ROWS x WIDTH saved per stage of ``gelu_stages``: a
# Linear saves its input (on stage 0 a view of the caller's batch, not counted),
# GELU its input, and the last stage's MSE loss its input (the target is the caller's).
SAVED_PER_STAGE = [1, 2, 2, 3]
UNIT = ROWS * WIDTH * 8  # bytes, in float64


def gelu_stages() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU()) for _ in range(STAGES)]
    )


def batch() -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(1)
    return tuple(torch.randn(ROWS * M, WIDTH, dtype=torch.double, generator=gen) for _ in range(2))  # type: ignore[return-value]


class _DoubledInPlace(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x.mul_(2)


class _ShrinksItsWeight(nn.Linear):
    def forward(self, x: Tensor) -> Tensor:
        with torch.no_grad():
            self.weight.mul_(0.9)  # after the last micro-batch's forward saved it
        return super().forward(x)


@pytest.mark.parametrize("checkpoint", ["never", "except_last"])
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_a_write_in_place_into_a_saved_tensor_is_refused_when_measuring_too(
    schedule: str, checkpoint: str
) -> None:
    # Tanh saves its output, which the next layer doubles in place; a layer changes its
    # weight, which an earlier micro-batch saved where its backward comes later: torch's
    # backward refuses, but it does not check tensors saved under hooks, and the meter's are
    # such: measured, the steps ran and gave gradients of the overwritten tensors (1.0 and
    # 0.013 off), silently. Measured or not, a step now refuses alike, or runs alike.
    torch.manual_seed(0)
    doubled = nn.Sequential(
        nn.Linear(WIDTH, WIDTH), nn.Tanh(), _DoubledInPlace(), nn.Linear(WIDTH, WIDTH)
    )
    shrinking = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), _ShrinksItsWeight(WIDTH, WIDTH))
    x, y = batch()
    for model, balance in ((doubled, [3, 1]), (shrinking, [2, 1])):
        outcomes = []
        for measure in (False, True):
            pipe = Pipe(copy.deepcopy(model).double(), balance, devices=["cpu"] * 2, chunks=2,
                        checkpoint=checkpoint)  # type: ignore[arg-type]  # fmt: skip
            try:
                pipe.step(x, y, F.mse_loss, schedule=SCHEDULES[schedule](), measure_memory=measure)
                outcomes.append(grads(pipe))
            except RuntimeError as error:
                assert "modified by an inplace operation" in str(error)
                outcomes.append(None)
        if outcomes[0] is None or outcomes[1] is None:
            assert outcomes == [None, None], "refused measured or unmeasured only"
        else:
            assert_same(outcomes[1], outcomes[0], "measured against unmeasured")
        assert model is shrinking or outcomes == [None, None], "the doubled output is refused"


class _SparseProduct(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(WIDTH, WIDTH, dtype=torch.double))

    def forward(self, x: Tensor) -> Tensor:
        return torch.sparse.mm(torch.relu(x).to_sparse(), self.weight)


def test_a_saved_sparse_tensor_counts_its_indices_and_values() -> None:
    # The meter read the storage of a sparse tensor, which has none, and failed mid-step.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), _SparseProduct(), nn.Tanh()).double()
    plain = copy.deepcopy(model)
    x, y = batch()
    pipe = Pipe(model, [1, 2], devices=["cpu"] * 2, chunks=M, checkpoint="never")
    pipe.step(x, y, F.mse_loss, schedule="gpipe", measure_memory=True)
    F.mse_loss(plain(x), y).backward()
    assert_same(grads(model), grads(plain), "the pipe")
    with torch.no_grad():
        sparse = torch.relu(model[0](x[:ROWS])).to_sparse()
    saved = sparse._indices().nbytes + sparse._values().nbytes  # sparse.mm's saved input
    assert pipe.last_step is not None
    stage = pipe.last_step.partitions[1].peak_activation_bytes
    assert stage is not None and stage >= M * saved


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_each_stage_saves_at_most_its_micro_batches_in_flight_times_one_micro_batch(
    schedule: str,
) -> None:
    pipe = Pipe(gelu_stages().double(), [1] * STAGES, devices=["cpu"] * STAGES, chunks=M,
                checkpoint="never")  # fmt: skip
    x, y = batch()
    pipe.step(x, y, F.mse_loss, schedule=schedule, measure_memory=True)
    report = pipe.last_step
    assert report is not None
    for s, partition in enumerate(report.partitions):
        held = M if schedule == "gpipe" else min(STAGES - s, M)
        bound = SAVED_PER_STAGE[s] * UNIT * held
        measured = partition.peak_activation_bytes
        assert measured is not None
        # The caller's batch is not counted, nor more micro-batches than the bound's.
        assert 0.95 * bound <= measured <= 1.05 * bound, (s, measured, bound)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_the_meter_lets_go_of_outputs_saved_by_their_own_op(schedule: str) -> None:
    # Found by the planner's benchmark: tanh saves its output, whose grad_fn is
    # tanh's node; packed as it was, the meter made a cycle that zb-h1, whose
    # weight passes keep the graph, never broke: every micro-batch stayed.
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(2)])
    pipe = Pipe(model.double(), [1, 1], devices=["cpu"] * 2, chunks=M, checkpoint="never")
    outputs: list[weakref.ref[Tensor]] = []
    for block in model:
        block[1].register_forward_hook(lambda _, __, out: outputs.append(weakref.ref(out)))
    x, y = batch()
    pipe.step(x, y, F.mse_loss, schedule=schedule, measure_memory=True)
    gc.collect()
    assert len(outputs) == 2 * M and all(ref() is None for ref in outputs)
    report = pipe.last_step
    assert report is not None
    # Stage 0 keeps a Linear's input (the caller's, not counted) and tanh's
    # output; stage 1 its Linear's input, tanh's output and the loss's input
    # (tanh's output again: one storage).
    for s, partition in enumerate(report.partitions):
        held = M if schedule == "gpipe" else min(2 - s, M)
        assert partition.peak_activation_bytes == [1, 2][s] * UNIT * held, (s, schedule)


def output_watch(module: nn.Module, freed: list[bool]) -> None:
    """On each forward of ``module`` with grad: once backward reaches its output, note
    whether that output (the tensor) was let go by then."""

    def forward_hook(_: nn.Module, __: Any, output: Tensor) -> None:
        if not output.requires_grad:
            return  # a checkpointed forward: nothing kept
        ref = weakref.ref(output)
        output.register_hook(lambda grad: freed.append(ref() is None))

    module.register_forward_hook(forward_hook)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_outputs_are_let_go_once_sent_and_gradients_equal_the_plain_models(
    schedule: str, mode: str
) -> None:
    model = gelu_stages().double()
    x, y = batch()
    F.mse_loss(model(x), y).backward()
    expected = grads(model)
    model.zero_grad(set_to_none=True)
    freed: list[bool] = []
    for stage in list(model)[:-1]:
        output_watch(stage, freed)
    pipe = Pipe(model, [1] * STAGES, devices=["cpu"] * STAGES, chunks=M, checkpoint=mode)
    pipe.step(x, y, F.mse_loss, schedule=SCHEDULES[schedule]())
    assert_same(grads(model), expected, f"{schedule}, checkpoint={mode}")
    # Every forward with grad of the first stages (checkpointed ones recompute in backward).
    assert len(freed) >= M
    assert all(freed), "a stage kept its output tensor until its backward"


class WithTable(nn.Module):
    """Returns its input and a table computed from a buffer: a float that needs no gradient,
    like the rotary tables a split Llama sends between its pieces."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.linspace(0.5, 1.5, WIDTH, dtype=torch.double))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return torch.tanh(x), self.scale.expand_as(x).contiguous()


class TimesTable(nn.Module):
    """Multiplies by the table: its backward saves ``x`` only if the table needs a gradient."""

    def forward(self, value: tuple[Tensor, Tensor]) -> Tensor:
        x, table = value
        return x * table


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_a_checkpointed_task_mails_an_output_that_needs_no_gradient_as_such(
    schedule: str,
) -> None:
    # A checkpointed forward used to run without grad and mail every float output as
    # needing a gradient: the next stage then saved x for the table's gradient, computed
    # it and mailed it back for nothing (48 KiB a micro-batch more on a split Llama).
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(WIDTH, WIDTH), WithTable(), TimesTable(), nn.Linear(WIDTH, WIDTH)
    )
    model = model.double()
    saved = second_stage_saved_per_mode(model, schedule)
    # One micro-batch, recomputed: the second stage saves what it saves without checkpoints.
    assert saved["always"] == saved["never"]


def second_stage_saved_per_mode(model: nn.Sequential, schedule: str) -> dict[str, int | None]:
    """Partition 1's peak saved bytes in one step of one micro-batch, without and with
    checkpoints, each step's gradients checked against the plain model's."""
    x, y = batch()
    saved = {}
    for checkpoint in ("never", "always"):
        pipe = Pipe(
            copy.deepcopy(model), [2, 2], devices=["cpu"] * 2, chunks=1, checkpoint=checkpoint
        )  # type: ignore[arg-type]
        pipe.step(x, y, F.mse_loss, schedule=schedule, measure_memory=True)
        report = pipe.last_step
        assert report is not None
        saved[checkpoint] = report.partitions[1].peak_activation_bytes
        F.mse_loss(model(x), y).backward()
        assert_same(grads(pipe), grads(model), checkpoint)
        model.zero_grad(set_to_none=True)
    return saved


@skippable(stash=["table"])
class StashTable(WithTable):
    """Stashes the buffer's table, a float that needs no gradient, for a later partition."""

    def forward(self, x: Tensor) -> Any:  # type: ignore[override]
        out, table = super().forward(x)
        yield stash("table", table)
        return out


@skippable(pop=["table"])
class PopTable(nn.Module):
    def forward(self, x: Tensor) -> Any:
        table = yield pop("table")
        return x * table


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_a_checkpointed_task_mails_a_skip_that_needs_no_gradient_as_such(schedule: str) -> None:
    # The skip's mail, as the output's: it used to say that every float needed a gradient.
    torch.manual_seed(0)
    layers = [nn.Linear(WIDTH, WIDTH), StashTable(), nn.Linear(WIDTH, WIDTH), PopTable()]
    model = nn.Sequential(*layers).double()
    saved = second_stage_saved_per_mode(model, schedule)
    assert saved["always"] == saved["never"]
