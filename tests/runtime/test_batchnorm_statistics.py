"""Running statistics and other forward-updated buffers in a Pipe equal the plain model's.

Without deferral, a normalisation layer in a Pipe sees one micro-batch at a
time, so its reference is the plain model run on the same micro-batches one
after another: one momentum step per micro-batch, never a second one from
recomputation. With ``deferred_batch_norm=True`` the reference is the plain
model run on the whole batch.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import NamedTuple

import pytest
import torch
from torch import Tensor, nn
from torch.nn.utils.parametrizations import spectral_norm

from pipeline import DeferredBatchNorm
from tests.helpers import cpu_pipe

MODES = ["always", "except_last", "never"]
ROWS = 11  # 4+4+3 rows in 3 chunks, 3+3+3+2 in 4: no micro-batch of a single row
STEPS = 3
SPLITS = [
    pytest.param([3, 3], 1, id="2-partitions-1-chunk"),
    pytest.param([3, 3], 3, id="2-partitions-3-chunks"),
    pytest.param([2, 2, 2], 4, id="3-partitions-4-chunks"),
]

Results = dict[str, Tensor]
Record = dict[str, Results]  # "output", "grads" and "buffers" after one step
Batches = list[tuple[Tensor, Tensor]]  # per step, an input and the weights of its loss


class Norm(NamedTuple):
    """A layer with buffers that its training forward changes, and what feeds it."""

    layer: Callable[[], nn.Module]  # keeps the shape of its input
    norm: Callable[[], nn.Module]
    shape: tuple[int, ...]  # of one input row


NORMS = {
    "BatchNorm1d": Norm(lambda: nn.Linear(6, 6), lambda: nn.BatchNorm1d(6), (6,)),
    "BatchNorm1d-cumulative": Norm(
        lambda: nn.Linear(6, 6), lambda: nn.BatchNorm1d(6, momentum=None), (6,)
    ),
    "BatchNorm2d": Norm(
        lambda: nn.Conv2d(3, 3, 3, padding=1), lambda: nn.BatchNorm2d(3), (3, 4, 4)
    ),
    "InstanceNorm1d": Norm(
        lambda: nn.Conv1d(3, 3, 1),
        lambda: nn.InstanceNorm1d(3, affine=True, track_running_stats=True),
        (3, 5),
    ),
    "spectral_norm": Norm(lambda: nn.Linear(6, 6), lambda: spectral_norm(nn.Linear(6, 6)), (6,)),
}
BATCH_NORMS = ["BatchNorm1d", "BatchNorm1d-cumulative", "BatchNorm2d"]


def in_every_partition(n: Norm) -> nn.Sequential:
    """Six layers, a norm in every partition of [3, 3] and of [2, 2, 2]."""
    return nn.Sequential(n.layer(), n.norm(), nn.Tanh(), n.layer(), n.norm(), nn.Tanh()).double()


def once(n: Norm, last: nn.Module | None = None) -> nn.Sequential:
    """Six layers, one norm: in partition 0 of [3, 3], 1 of [2, 2, 2].

    With deferral, a second norm's input would depend on how the first one
    normalised (per micro-batch), so only a single norm compares with the
    plain model run on the whole batch.
    """
    last = n.layer() if last is None else last
    return nn.Sequential(n.layer(), nn.Tanh(), n.norm(), n.layer(), nn.Tanh(), last).double()


def batches(n: Norm, steps: int = STEPS) -> Batches:
    return [
        (torch.randn(ROWS, *n.shape, dtype=torch.float64) * 3 + 1,
         torch.randn(ROWS, *n.shape, dtype=torch.float64))
        for _ in range(steps)
    ]  # fmt: skip


def forward_loss(model: nn.Module, x: Tensor, w: Tensor, pieces: int) -> tuple[Tensor, Tensor]:
    """Run ``model`` on ``x`` in ``pieces`` consecutive calls; the output and the summed loss."""
    outs = [model(xp) for xp in x.chunk(pieces)]
    loss = sum((wp * out).square().sum() for wp, out in zip(w.chunk(pieces), outs, strict=True))
    assert isinstance(loss, Tensor)
    return torch.cat(outs).detach(), loss


def record(model: nn.Module, output: Tensor) -> Record:
    params = {name for name, _ in model.named_parameters()}
    return {
        "output": {"output": output},
        "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
        "buffers": {n: b.clone() for n, b in model.state_dict().items() if n not in params},
    }


def train(model: nn.Module, data: Batches, *, pieces: int = 1, lr: float = 0.1) -> list[Record]:
    """SGD steps, each on one batch run in ``pieces`` calls; a record per step."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    records = []
    for x, w in data:
        optimizer.zero_grad()
        output, loss = forward_loss(model, x, w, pieces)
        loss.backward()
        records.append(record(model, output))
        optimizer.step()
    return records


def assert_records_equal(
    actual: list[Record], expected: list[Record], sections: tuple[str, ...]
) -> None:
    assert len(actual) == len(expected)
    for step, (got, want) in enumerate(zip(actual, expected, strict=True)):
        for section in sections:
            assert got[section].keys() == want[section].keys(), f"step {step} {section}"
            for name, value in want[section].items():
                torch.testing.assert_close(got[section][name], value, msg=f"step {step} {name}")


@pytest.mark.parametrize("norm", list(NORMS))
@pytest.mark.parametrize(("balance", "chunks"), SPLITS)
@pytest.mark.parametrize("checkpoint", MODES)
def test_statistics_and_gradients_equal_the_plain_model_run_per_micro_batch(
    norm: str, balance: list[int], chunks: int, checkpoint: str
) -> None:
    model, data = in_every_partition(NORMS[norm]), batches(NORMS[norm])
    expected = train(copy.deepcopy(model), data, pieces=chunks)
    actual = train(cpu_pipe(model, balance, chunks, checkpoint), data)
    assert_records_equal(actual, expected, ("output", "grads", "buffers"))
    if norm.startswith("BatchNorm"):
        tracked = actual[-1]["buffers"]["1.num_batches_tracked"]
        assert int(tracked) == STEPS * chunks


@pytest.mark.parametrize("norm", list(NORMS))
@pytest.mark.parametrize("checkpoint", MODES)
def test_statistics_and_gradients_on_one_thread_for_every_partition_equal_the_plain_model(
    norm: str, checkpoint: str
) -> None:
    balance, chunks = [2, 2, 2], 4
    model, data = in_every_partition(NORMS[norm]), batches(NORMS[norm])
    expected = train(copy.deepcopy(model), data, pieces=chunks)
    actual = train(cpu_pipe(model, balance, chunks, checkpoint, threads="device"), data)
    assert_records_equal(actual, expected, ("output", "grads", "buffers"))


@pytest.mark.parametrize(("balance", "chunks"), SPLITS[1:])
@pytest.mark.parametrize("checkpoint", ["always", "except_last"])
def test_spectral_norm_in_a_checkpointed_partition_equals_the_pipe_without_checkpointing(
    balance: list[int], chunks: int, checkpoint: str
) -> None:
    # Recomputation must start from the power-iteration vectors the forward
    # saw, not from those later micro-batches left behind.
    n = NORMS["spectral_norm"]
    model, data = in_every_partition(n), batches(n)
    expected = train(cpu_pipe(copy.deepcopy(model), balance, chunks, "never"), data)
    actual = train(cpu_pipe(model, balance, chunks, checkpoint), data)
    assert_records_equal(actual, expected, ("output", "grads", "buffers"))
    assert "1.parametrizations.weight.0._u" in actual[-1]["buffers"]


@pytest.mark.parametrize("norm", BATCH_NORMS)
@pytest.mark.parametrize(("balance", "chunks"), SPLITS)
@pytest.mark.parametrize("checkpoint", MODES)
def test_deferred_statistics_equal_the_plain_model_on_whole_batches(
    norm: str, balance: list[int], chunks: int, checkpoint: str
) -> None:
    # Gradients differ (each micro-batch is normalised on its own), so the
    # parameters are left alone (lr=0) and only the statistics compared.
    model, data = once(NORMS[norm]), batches(NORMS[norm])
    expected = train(copy.deepcopy(model), data, lr=0.0)
    pipe = cpu_pipe(model, balance, chunks, checkpoint, deferred_batch_norm=True)
    actual = train(pipe, data, lr=0.0)
    assert_records_equal(actual, expected, ("buffers",))
    assert int(actual[-1]["buffers"]["2.num_batches_tracked"]) == STEPS


class FailsWhenArmed(nn.Module):
    """The identity; while armed, its second call raises (the step's second micro-batch)."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = False
        self.calls = 0

    def forward(self, x: Tensor) -> Tensor:
        if self.armed:
            self.calls += 1
            if self.calls == 2:
                raise RuntimeError("bad batch")
        return x


@pytest.mark.parametrize(
    "balance",
    [pytest.param([3, 3], id="failure-in-a-later-partition"),
     pytest.param([2, 4], id="failure-in-the-same-partition")],
)  # fmt: skip
@pytest.mark.parametrize("checkpoint", MODES)
def test_failed_step_leaves_deferred_statistics_as_if_the_batch_was_skipped(
    balance: list[int], checkpoint: str
) -> None:
    n = NORMS["BatchNorm1d"]
    model, data = once(n, last=FailsWhenArmed()), batches(n)
    skipped = copy.deepcopy(model)
    pipe = cpu_pipe(model, balance, 4, checkpoint, deferred_batch_norm=True)
    failing = pipe[5]
    assert isinstance(failing, FailsWhenArmed)
    failing.armed = True
    with pytest.raises(RuntimeError, match="bad batch"):
        forward_loss(pipe, *data[0], pieces=1)
    failing.armed = False
    expected = train(skipped, data[1:], lr=0.0)
    actual = train(pipe, data[1:], lr=0.0)
    assert_records_equal(actual, expected, ("buffers",))


@pytest.mark.parametrize("checkpoint", MODES)
def test_users_module_outside_the_pipe_updates_statistics_like_batch_norm(
    checkpoint: str,
) -> None:
    n = NORMS["BatchNorm1d"]
    model, data = once(n), batches(n, steps=4)
    reference = copy.deepcopy(model)
    pipe = cpu_pipe(model, [3, 3], 3, checkpoint, deferred_batch_norm=True)
    assert isinstance(model[2], DeferredBatchNorm) and model[2] is pipe[2]
    # The user's module called directly, a Pipe step, the module again, a Pipe step.
    for (x, w), (runner, pieces) in zip(
        data, [(model, 1), (pipe, 1), (model, 3), (pipe, 1)], strict=True
    ):
        got = train(runner, [(x, w)], pieces=pieces, lr=0.0)
        want = train(reference, [(x, w)], pieces=pieces, lr=0.0)
        assert_records_equal(got, want, ("buffers",))


def two_forwards_then_one_backward(model: nn.Module, pieces: int, data: Batches) -> list[Record]:
    runs = [forward_loss(model, x, w, pieces) for x, w in data]
    sum(loss for _, loss in runs).backward()  # type: ignore[union-attr]
    return [record(model, output) for output, _ in runs]


def one_forward_then_two_backwards(model: nn.Module, pieces: int, data: Batches) -> list[Record]:
    output, loss = forward_loss(model, *data[0], pieces)
    loss.backward(retain_graph=True)
    loss.backward()
    return [record(model, output)]


@pytest.mark.parametrize(
    "pattern",
    [two_forwards_then_one_backward, one_forward_then_two_backwards],
    ids=lambda f: f.__name__,
)
@pytest.mark.parametrize("norm", list(NORMS))
@pytest.mark.parametrize("checkpoint", ["always", "except_last"])
def test_recomputation_after_the_buffers_moved_on_equals_the_plain_model(
    pattern: Callable[[nn.Module, int, Batches], list[Record]], norm: str, checkpoint: str
) -> None:
    # A second forward (or the first backward's recomputation) moves the
    # buffers on before a recomputation, which must see the forward's values,
    # leave the current ones, and not disturb the non-checkpointed micro-batch.
    chunks = 3
    model, data = in_every_partition(NORMS[norm]), batches(NORMS[norm], steps=2)
    expected = pattern(copy.deepcopy(model), chunks, data)
    actual = pattern(cpu_pipe(model, [3, 3], chunks, checkpoint), 1, data)
    assert_records_equal(actual, expected, ("output", "grads", "buffers"))
