"""Layers that update state in every training forward, beyond BatchNorm: spectral norm.

Spectral norm advances its power-iteration vectors on each forward, so in a
pipe, as BatchNorm's statistics, once per micro-batch: the plain model run
micro-batch by micro-batch. Run by two partitions, the updates would come in
the threads' order; a layer gaining such a buffer after the pipe's first
checkpointed forward has it learned anew.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils import parametrizations

from pipeline import Pipe

CHUNKS = 3


def new_style(layer: nn.Linear) -> nn.Module:
    return parametrizations.spectral_norm(layer)


def old_style(layer: nn.Linear) -> nn.Module:
    return nn.utils.spectral_norm(layer)


def model(norm: Callable[[nn.Linear], nn.Module] | None = None) -> nn.Sequential:
    torch.manual_seed(0)
    first = nn.Linear(6, 6)
    layers = [norm(first) if norm else first, nn.Tanh(), nn.Linear(6, 6), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(6, 2)).double()


def batch() -> tuple[Tensor, Tensor]:
    torch.manual_seed(1)
    return torch.randn(9, 6, dtype=torch.float64), torch.randn(9, 2, dtype=torch.float64)


def per_micro_batch(plain: nn.Module, x: Tensor, y: Tensor) -> None:
    """The plain model's step, micro-batch by micro-batch (each loss weighed by its rows)."""
    for xs, ys in zip(x.chunk(CHUNKS), y.chunk(CHUNKS), strict=True):
        (F.mse_loss(plain(xs), ys) * len(xs) / len(x)).backward()


@pytest.mark.parametrize("norm", [new_style, old_style])
@pytest.mark.parametrize("checkpoint", ["never", "always"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_spectral_norm_advances_once_per_micro_batch_as_the_plain_model_run_by_micro_batch(
    norm: Callable[[nn.Linear], nn.Module], checkpoint: str, schedule: str
) -> None:
    plain = model(norm)
    pipe = Pipe(copy.deepcopy(plain), [2, 3], devices=["cpu"] * 2, chunks=CHUNKS,
                checkpoint=checkpoint)  # type: ignore[arg-type]  # fmt: skip
    x, y = batch()
    for _ in range(2):
        per_micro_batch(plain, x, y)
        pipe.step(x, y, F.mse_loss, schedule=schedule)
    for name, p in plain.named_parameters():
        torch.testing.assert_close(pipe.get_parameter(name).grad, p.grad, msg=name)
    for name, b in plain.named_buffers():
        torch.testing.assert_close(pipe.get_buffer(name), b, msg=name)


@pytest.mark.parametrize("norm", [new_style, old_style])
def test_a_spectral_norm_run_by_two_partitions_is_refused(
    norm: Callable[[nn.Linear], nn.Module],
) -> None:
    # Its vectors advanced in the threads' order: gradients changed from run to run
    # (-0.541, -0.514, -0.515, -0.533 for one seed).
    shared = norm(nn.Linear(6, 6))
    layers = nn.Sequential(shared, nn.Tanh(), nn.Linear(6, 6), shared).double()
    with pytest.raises(ValueError, match="power-iteration vectors would be updated in the order"):
        Pipe(layers, [2, 2], devices=["cpu"] * 2)
    Pipe(layers, [4], devices=["cpu"])  # one partition: its uses in the plain model's order


def test_an_instance_norm_tracking_its_statistics_run_by_two_partitions_is_refused() -> None:
    shared = nn.InstanceNorm1d(4, track_running_stats=True)
    layers = nn.Sequential(shared, nn.Linear(5, 5), shared)
    with pytest.raises(ValueError, match="running statistics would be updated in the order"):
        Pipe(layers, [2, 1], devices=["cpu"] * 2)
    Pipe(nn.Sequential(nn.InstanceNorm1d(4), nn.Linear(5, 5), nn.InstanceNorm1d(4)), [2, 1],
         devices=["cpu"] * 2)  # fmt: skip


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_spectral_norm_added_after_the_first_checkpointed_forward_is_learned(
    schedule: str,
) -> None:
    # Its new buffers were taken for ones the first forward had left alone: every later
    # checkpointed step was refused, saying so.
    plain = model()
    pipe = Pipe(copy.deepcopy(plain), [2, 3], devices=["cpu"] * 2, chunks=CHUNKS,
                checkpoint="always")  # fmt: skip
    x, y = batch()
    pipe.step(x, y, F.mse_loss, schedule=schedule)
    pipe.zero_grad()
    old_style(pipe[0])
    old_style(plain[0])
    with torch.no_grad():  # the same vectors to start from
        for name in ("weight_u", "weight_v"):
            getattr(pipe[0], name).copy_(getattr(plain[0], name))
    pipe.step(x, y, F.mse_loss, schedule=schedule)
    per_micro_batch(plain, x, y)
    for name, p in plain.named_parameters():
        torch.testing.assert_close(pipe.get_parameter(name).grad, p.grad, msg=name)
    torch.testing.assert_close(pipe[0].weight_u, plain[0].weight_u)


class Rebinds(nn.Module):
    """Keeps a moving average of its input in a buffer it rebinds (no in-place write)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("ema", torch.zeros(6, dtype=torch.float64))

    def forward(self, x: Tensor) -> Tensor:
        self.ema = 0.9 * self.ema + 0.1 * x.detach().mean(0)
        return x * self.ema


class SavesItsBuffer(nn.Module):
    """Updates its buffer in place, then multiplies by it: autograd saves the buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("ema", torch.ones(6, dtype=torch.float64))

    def forward(self, x: Tensor) -> Tensor:
        self.ema.mul_(0.9).add_(0.1 * x.detach().mean(0))
        return x * self.ema


class Sizes(nn.Module):
    """Sizes its buffer at its first forward, as an observer sizes its statistics."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.empty(0, dtype=torch.float64))

    def forward(self, x: Tensor) -> Tensor:
        if self.scale.numel() == 0:
            self.scale.resize_(x.shape[1]).fill_(1.0)
        self.scale.mul_(1.01)
        return x * self.scale


def trained_twice(
    stateful: type[nn.Module], balance: list[int], call: str
) -> tuple[nn.Module, Pipe]:
    """The plain model (micro-batch by micro-batch) and a checkpointing pipe of a model around
    ``stateful``, after two steps of ``call``; their gradients checked equal."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(6, 6), stateful(), nn.Tanh(), nn.Linear(6, 2)).double()
    pipe = Pipe(copy.deepcopy(plain), balance, devices=["cpu"] * 2, chunks=CHUNKS,
                checkpoint="always")  # fmt: skip
    x, y = batch()
    for _ in range(2):
        per_micro_batch(plain, x, y)
        if call == "pipe(x)":
            F.mse_loss(pipe(x), y).backward()
        else:
            pipe.step(x, y, F.mse_loss, schedule=call)
    for name, p in plain.named_parameters():
        torch.testing.assert_close(pipe.get_parameter(name).grad, p.grad, msg=name)
    return plain, pipe


@pytest.mark.parametrize("stateful", [Rebinds, SavesItsBuffer, Sizes])
@pytest.mark.parametrize("call", ["pipe(x)", "gpipe", "1f1b"])
def test_buffers_rebound_saved_or_sized_in_a_forward_are_replayed_from_a_copy(
    stateful: type[nn.Module], call: str
) -> None:
    # Recomputation copied the kept values into the buffers of now and back: a rebound
    # buffer kept the recomputation's stale value (gradients 0.22 off), a saved one was
    # overwritten under its backward (0.12 off), a sized one failed to copy back.
    plain, pipe = trained_twice(stateful, [2, 2], call)
    for name, b in plain.named_buffers():
        torch.testing.assert_close(pipe.get_buffer(name), b, msg=name)


class Averages(nn.Module):
    """A moving average of its input in a buffer, written in place in every forward."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("ema", torch.zeros(6, dtype=torch.float64))

    def forward(self, x: Tensor) -> Tensor:
        self.ema.mul_(0.9).add_(0.1 * x.detach().mean(0))
        return x + self.ema


@pytest.mark.parametrize("call", ["pipe(x)", "1f1b", "evaluate"])
def test_a_buffer_written_in_a_forward_and_held_by_two_partitions_is_refused(call: str) -> None:
    # Updated in the threads' order: gradients 0.58 or 0.42 off from run to run.
    shared = Averages()
    layers = nn.Sequential(shared, nn.Linear(6, 6), shared, nn.Linear(6, 2)).double()
    pipe = Pipe(layers, [2, 2], devices=["cpu"] * 2, chunks=CHUNKS, checkpoint="never")
    x, y = batch()
    runs = {
        "pipe(x)": lambda: pipe(x),
        "1f1b": lambda: pipe.step(x, y, F.mse_loss),
        "evaluate": lambda: pipe.evaluate(x),
    }
    with pytest.raises(RuntimeError, match=r"wrote into its buffer '0\.ema' in its forward"):
        runs[call]()
    assert all(p.grad is None for p in layers.parameters())
    Pipe(layers, [4], devices=["cpu"])(x)  # one partition: its uses in the plain model's order


class Aliased(nn.Module):
    """Holds its buffer under a plain attribute too, through which it writes and reads."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("ema", torch.ones(6, dtype=torch.float64))
        self.alias = self.ema

    def forward(self, x: Tensor) -> Tensor:
        self.alias.mul_(0.9).add_(0.1 * x.detach().mean(0))
        return x + self.alias


class Viewed(nn.Module):
    """Two buffers, one a view of the other, written through the view."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("state", torch.ones(6, dtype=torch.float64))
        self.register_buffer("head", self.state[:3])

    def forward(self, x: Tensor) -> Tensor:
        self.head.mul_(1.1)
        return x + self.state


@pytest.mark.parametrize("stateful", [Aliased, Viewed])
@pytest.mark.parametrize("call", ["pipe(x)", "1f1b"])
def test_a_buffer_read_through_an_alias_or_a_view_is_replayed(
    stateful: type[nn.Module], call: str
) -> None:
    # A copy swapped in for the module's buffer alone left the alias, or the view's
    # base, with the values of now: gradients 0.2 (0.002 for a view) off.
    # The Tanh recomputed in the same partition: its gradient reads what the alias gave.
    trained_twice(stateful, [3, 1], call)


class RebindsLater(Rebinds):
    """Rebinds its buffer from its second forward on."""

    calls = 0

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        return super().forward(x) if self.calls > 1 else x * self.ema


def test_a_buffer_rebound_only_after_the_first_checkpointed_forward_is_refused() -> None:
    # Its rebinding moved no version counter of the tensor kept: it was not seen, and the
    # recomputation rebound it again (gradients 47 off).
    layers = nn.Sequential(nn.Linear(6, 6), RebindsLater(), nn.Linear(6, 2)).double()
    pipe = Pipe(layers, [2, 1], devices=["cpu"] * 2, chunks=1, checkpoint="always")
    x, y = batch()
    F.mse_loss(pipe(x), y).backward()
    with pytest.raises(RuntimeError, match=r"changed buffers \['1\.ema'\]"):
        pipe(x)
