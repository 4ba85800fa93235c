"""Buffers a checkpointed forward changes are put back for recomputation, and only those."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from pipeline import Pipe
from pipeline.runtime.buffers import PartitionBuffers


class Masked(nn.Module):
    """A constant buffer (a mask) and a BatchNorm whose running statistics change."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mask", torch.ones(4))
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x: Tensor) -> Tensor:
        return self.bn(x) * self.mask


def forward_once(buffers: PartitionBuffers, module: nn.Module) -> dict[str, Tensor]:
    snapshot = buffers.before_forward()
    module(torch.randn(8, 4))
    buffers.after_forward(snapshot)
    return snapshot.values


def test_changing_buffers_are_learned_by_value_and_constant_ones_never_copied() -> None:
    module = Masked()
    buffers = PartitionBuffers(module, 0)
    first = forward_once(buffers, module)
    # batch_norm updates running statistics without bumping their versions.
    changing = {"bn.running_mean", "bn.running_var", "bn.num_batches_tracked"}
    assert buffers.changing == changing and first.keys() == changing
    assert forward_once(buffers, module).keys() == changing


def test_recomputation_sees_the_buffers_of_its_forward_and_leaves_the_current_ones() -> None:
    module = Masked()
    buffers = PartitionBuffers(module, 0)
    snapshot = buffers.before_forward()
    before = module.bn.running_mean.clone()
    module(torch.randn(8, 4))
    buffers.after_forward(snapshot)
    module(torch.randn(8, 4))  # a later micro-batch moves the statistics on
    now = module.bn.running_mean.clone()
    with buffers.replayed(snapshot):
        assert torch.equal(module.bn.running_mean, before)
        module(torch.randn(8, 4))
    assert torch.equal(module.bn.running_mean, now)


class CountsFromTheSecondCall(nn.Module):
    """Changes its buffer in some forwards only: recomputation could not replay the first."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("count", torch.zeros(()))
        self.calls = 0

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        if self.calls > 1:
            self.count += 1
        return torch.tanh(x) * (1 + self.count)


def test_a_buffer_that_starts_changing_later_is_refused_not_replayed_wrongly() -> None:
    pipe = Pipe(
        nn.Sequential(nn.Linear(4, 4), CountsFromTheSecondCall()),
        [1, 1],
        devices=["cpu"] * 2,
        chunks=2,
        checkpoint="always",
    )
    with pytest.raises(RuntimeError, match=r"partition 1 changed buffers \['1.count'\]"):
        pipe(torch.randn(4, 4))


def test_a_batch_norm_frozen_for_a_while_then_trained_is_replayed_like_never_checkpointed() -> None:
    # What changes was learned once, in the first checkpointed forward: a
    # BatchNorm in eval mode then changed nothing, and once trained again
    # every checkpointed step was refused, after its statistics had moved.
    def model() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.BatchNorm1d(4)).double()

    x, y = torch.randn(8, 4, dtype=torch.double), torch.randn(8, 4, dtype=torch.double)
    pipes = {
        mode: Pipe(model(), [2, 1], devices=["cpu"] * 2, chunks=2, checkpoint=mode)
        for mode in ("always", "never")
    }
    for step, training in enumerate([False, True, True]):
        states = []
        for pipe in pipes.values():
            pipe.zero_grad()
            pipe[2].train(training)
            pipe.step(x, y, torch.nn.functional.mse_loss)
            grads = {f"{n}.grad": p.grad for n, p in pipe.named_parameters()}
            states.append({**dict(pipe.named_buffers()), **grads})
        for name, value in states[1].items():
            torch.testing.assert_close(states[0][name], value, msg=f"step {step}: {name}")
