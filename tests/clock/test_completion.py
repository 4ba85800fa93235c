"""Partition backward hooks fire once per backward, when gradients are final."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import Tensor, nn

from pipeline import Pipe
from tests.helpers import mlp


@pytest.mark.parametrize("threads", ["partition", "device"])
@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
@pytest.mark.parametrize("input_requires_grad", [True, False])
def test_hook_fires_once_per_partition_with_final_gradients(
    checkpoint: str, input_requires_grad: bool, threads: str
) -> None:
    model = mlp()
    x = torch.randn(12, 8, dtype=torch.float64)
    reference = copy.deepcopy(model)
    reference(x).sum().backward()
    expected = [p.grad.clone() for p in reference.parameters()]  # type: ignore[union-attr]

    pipe = Pipe(
        model,
        [2, 2, 2],
        devices=["cpu"] * 3,
        chunks=4,
        checkpoint=checkpoint,  # type: ignore[arg-type]
        threads=threads,  # type: ignore[arg-type]
    )
    final: dict[int, bool] = {}

    def hook(j: int) -> None:
        got = [p.grad for p in pipe.partitions[j].parameters()]
        offset = sum(len(list(pipe.partitions[k].parameters())) for k in range(j))
        want = expected[offset : offset + len(got)]
        pairs = zip(got, want, strict=True)
        final[j] = all(g is not None and torch.allclose(g, w) for g, w in pairs)

    handle = pipe.register_partition_backward_hook(hook)
    out = pipe(x.requires_grad_(input_requires_grad))
    assert isinstance(out, Tensor)
    out.sum().backward()
    signalled = {0, 1, 2} if input_requires_grad else {1, 2}
    assert final == dict.fromkeys(signalled, True)

    handle.remove()
    final.clear()
    pipe(x).sum().backward()  # type: ignore[union-attr]
    assert final == {}


def test_no_hooks_add_no_autograd_nodes() -> None:
    pipe = Pipe(
        nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)),
        [1, 1],
        devices=["cpu"] * 2,
        checkpoint="never",
    )
    out = pipe(torch.randn(2, 2))
    names = []
    stack = [out.grad_fn]  # type: ignore[union-attr]
    while stack:
        node = stack.pop()
        if node is not None:
            names.append(type(node).__name__)
            stack.extend(n for n, _ in node.next_functions)
    assert not any("Arrival" in name for name in names)


@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_a_second_backward_through_one_graph_signals_again(checkpoint: str) -> None:
    # retain_graph=True: each backward makes every partition's gradients final once more.
    pipe = Pipe(mlp(), [3, 3], devices=["cpu"] * 2, chunks=3, checkpoint=checkpoint)  # type: ignore[arg-type]
    signals: list[int] = []
    pipe.register_partition_backward_hook(signals.append)
    out = pipe(torch.randn(6, 8, dtype=torch.float64))
    assert isinstance(out, Tensor)
    out.sum().backward(retain_graph=True)
    out.sum().backward()
    assert signals == [1, 1]  # partition 0 signals only for an input that requires grad


class Masked(nn.Module):
    """Takes and returns ``(mask, h)``: a float mask needing no gradient comes first."""

    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(4, 4)

    def forward(self, pair: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        mask, h = pair
        return mask, torch.tanh(self.l(h)) * mask


def test_a_float_mask_before_the_activation_still_signals_every_partition() -> None:
    # The arrival was put on the first floating tensor, the mask, which gets no gradient:
    # no partition was ever signalled, and DataParallel lost its overlap.
    model = nn.Sequential(Masked(), Masked(), Masked()).double()
    pipe = Pipe(model, [1, 1, 1], devices=["cpu"] * 3, chunks=3)
    signalled: list[int] = []
    pipe.register_partition_backward_hook(signalled.append)
    mask = (torch.rand(6, 4, generator=torch.Generator().manual_seed(0)) > 0.5).double()
    _, out = pipe((mask, torch.randn(6, 4, dtype=torch.float64)))
    out.sum().backward()
    assert sorted(signalled) == [1, 2]  # partition 0's input needs no gradient
