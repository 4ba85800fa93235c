"""Random layers in partitions that share a device: replayed exactly, reproducible."""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn

from pipeline import Pipe, mark_random
from tests.helpers import grads


def dropout_model() -> nn.Sequential:
    layers: list[nn.Module] = []
    for _ in range(3):
        layers += [nn.Linear(16, 16), nn.Dropout(0.5)]
    return nn.Sequential(*layers)


def step(pipe: Pipe, x: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    pipe.zero_grad()
    out = pipe(x)
    assert isinstance(out, Tensor)
    out.square().sum().backward()
    return out.detach(), grads(pipe)


def make_pipe(model: nn.Sequential, checkpoint: str, chunks: int = 4) -> Pipe:
    return Pipe(
        copy.deepcopy(model), [2, 2, 2], devices=["cpu"] * 3, chunks=chunks, checkpoint=checkpoint
    )  # type: ignore[arg-type]


def assert_modes_agree(always: Pipe, never: Pipe, x: Tensor, seeds: int) -> None:
    """Same seed, same outputs and gradients, with and without recomputation."""
    for seed in range(seeds):
        torch.manual_seed(seed)
        out_a, grads_a = step(always, x)
        torch.manual_seed(seed)
        out_n, grads_n = step(never, x)
        torch.testing.assert_close(out_a, out_n, rtol=0, atol=0)
        for name in grads_n:
            torch.testing.assert_close(grads_a[name], grads_n[name], msg=name)


def test_recompute_replays_dropout_masks_in_every_partition_many_times() -> None:
    model = dropout_model()
    always, never = make_pipe(model, "always"), make_pipe(model, "never")
    assert_modes_agree(always, never, torch.randn(32, 16), seeds=15)


def test_fixed_seed_is_reproducible_despite_thread_interleaving() -> None:
    pipe = make_pipe(dropout_model(), "except_last", chunks=8)
    x = torch.randn(64, 16)
    torch.manual_seed(1234)
    first = step(pipe, x)
    for _ in range(10):
        torch.manual_seed(1234)
        again = step(pipe, x)
        assert torch.equal(again[0], first[0])
        assert all(torch.equal(again[1][k], first[1][k]) for k in first[1])


def test_masks_differ_between_micro_batches_and_between_steps() -> None:
    pipe = Pipe(
        nn.Sequential(nn.Dropout(0.5), nn.Identity()), [1, 1], devices=["cpu"] * 2, chunks=4
    )
    x = torch.ones(8, 64)
    first = pipe(x)
    assert isinstance(first, Tensor)
    masks = first.view(4, 2, 64)
    assert not all(torch.equal(masks[0], masks[k]) for k in range(1, 4))
    second = pipe(x)
    assert isinstance(second, Tensor) and not torch.equal(first, second)


def test_generator_after_a_step_is_deterministic() -> None:
    pipe = make_pipe(dropout_model(), "always")
    x = torch.randn(8, 16)
    draws = []
    for _ in range(3):
        torch.manual_seed(7)
        step(pipe, x)
        draws.append(torch.rand(4))
    assert torch.equal(draws[0], draws[1]) and torch.equal(draws[1], draws[2])


class Noise(nn.Module):
    """Adds uniform noise in training: random, but not a known dropout layer."""

    def forward(self, x: Tensor) -> Tensor:
        return x + torch.rand_like(x) if self.training else x


def test_declared_random_layer_draws_alike_with_and_without_checkpointing() -> None:
    model = nn.Sequential(
        nn.Linear(4, 4), mark_random(Noise()), nn.Linear(4, 4), mark_random(Noise())
    )
    always = Pipe(copy.deepcopy(model), [2, 2], devices=["cpu"] * 2, chunks=4, checkpoint="always")
    never = Pipe(copy.deepcopy(model), [2, 2], devices=["cpu"] * 2, chunks=4, checkpoint="never")
    assert_modes_agree(always, never, torch.randn(8, 4), seeds=5)


def test_undeclared_random_layer_recompute_matches_its_forward() -> None:
    seen: list[Tensor] = []

    class Recorder(Noise):
        def forward(self, x: Tensor) -> Tensor:
            out = super().forward(x)
            seen.append((out - x).detach())
            return out

    pipe = Pipe(
        nn.Sequential(nn.Linear(4, 4), Recorder()),
        [1, 1],
        devices=["cpu"] * 2,
        chunks=1,
        checkpoint="always",
    )
    pipe(torch.randn(2, 4)).sum().backward()  # type: ignore[union-attr]
    assert len(seen) == 2 and torch.equal(seen[0], seen[1])


def test_mark_random_returns_the_module() -> None:
    layer = Noise()
    assert mark_random(layer) is layer


def test_partitions_with_dropout_still_run_concurrently() -> None:
    import threading

    from tests.test_worker import Rendezvous

    # The generator lock is held while a dropout layer runs, not for the
    # whole task: both partitions reach the barrier at once.
    barrier = threading.Barrier(2, timeout=10)
    model = nn.Sequential(
        nn.Dropout(0.5), Rendezvous(barrier, call=2), nn.Dropout(0.5), Rendezvous(barrier, call=1)
    )
    pipe = Pipe(model, [2, 2], devices=["cpu"] * 2, chunks=2, checkpoint="never")
    out = pipe(torch.ones(2, 8))
    assert isinstance(out, Tensor) and not barrier.broken
    assert set(out.unique().tolist()) <= {1.0, 3.0, 7.0}  # (x * 2 or 0) + 1, twice


def test_random_layers_behave_as_usual_outside_a_pipe() -> None:
    dropout = nn.Dropout(0.5)
    Pipe(nn.Sequential(dropout, nn.Identity()), [1, 1], devices=["cpu"] * 2).close()
    torch.manual_seed(3)
    a = dropout(torch.ones(64))
    torch.manual_seed(3)
    b = nn.Dropout(0.5)(torch.ones(64))
    assert torch.equal(a, b)
