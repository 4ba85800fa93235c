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
    masks: list[bool] = []
    for layer in model:
        layer.register_forward_pre_hook(lambda _, args: masks.append(args[0][0].requires_grad))
    _, out = pipe((mask, torch.randn(6, 4, dtype=torch.float64)))
    out.sum().backward()
    assert sorted(signalled) == [1, 2]  # partition 0's input needs no gradient
    # The edges ordering the backwards ride on the activation: the mask needs no grad.
    assert masks and not any(masks)


class Reentrant(nn.Module):
    """A layer under torch's reentrant checkpoint: its weight gets a gradient only from a
    micro-batch whose input requires grad, so it sees what the plain model would."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.inputs_requiring_grad: list[bool] = []

    def forward(self, x: Tensor) -> Tensor:
        self.inputs_requiring_grad.append(x.requires_grad)
        out: Tensor = torch.utils.checkpoint.checkpoint(self.lin, x, use_reentrant=True)
        return out


def behind_a_frozen_layer() -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), Reentrant(), nn.Tanh(), nn.Linear(6, 3))
    model[0].requires_grad_(False)
    return model.double()


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_inputs_behind_frozen_partitions_need_no_grad_as_in_the_plain_model(
    checkpoint: str,
) -> None:
    # The edge ordering micro-batches' backwards made every input after the first
    # require grad: the layer saw True 3 times of 4, and under reentrant checkpointing
    # its weight got the gradients of those 3 micro-batches where the plain model's none.
    x, y = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)
    plain = behind_a_frozen_layer()
    for xi, yi in zip(x.chunk(4), y.chunk(4), strict=True):
        (nn.functional.mse_loss(plain(xi), yi) / 4).backward()
    model = behind_a_frozen_layer()
    pipe = Pipe(model, [2, 3], devices=["cpu"] * 2, chunks=4, checkpoint=checkpoint)  # type: ignore[arg-type]
    nn.functional.mse_loss(pipe(x), y).backward()
    assert plain[2].inputs_requiring_grad == [False] * 4
    # Checkpointed tasks run twice; every run saw what the plain model's did.
    assert set(model[2].inputs_requiring_grad) == {False}
    for (name, p), q in zip(plain.named_parameters(), model.parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-10, atol=1e-12, msg=name)


def test_a_partition_behind_frozen_ones_is_signalled_by_step_not_by_a_backward() -> None:
    # pipe(x): no gradient flows into partition 1's inputs to observe (as for partition 0
    # when the input needs none); step knows when each partition's last backward ran.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3))
    model[0].requires_grad_(False)
    pipe = Pipe(model.double(), [2, 2, 1], devices=["cpu"] * 3, chunks=4, checkpoint="never")
    signalled: list[int] = []
    pipe.register_partition_backward_hook(signalled.append)
    x, y = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)
    nn.functional.mse_loss(pipe(x), y).backward()
    assert signalled == [2]
    signalled.clear()
    pipe.step(x, y, nn.functional.mse_loss)
    assert sorted(signalled) == [0, 1, 2]


@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_a_mask_crossing_a_device_cut_needs_no_grad_as_in_the_plain_model(checkpoint: str) -> None:
    # Copy and Wait, autograd functions over the whole micro-batch, made every floating
    # output need a gradient where one input did: the mask came to require grad.
    model = nn.Sequential(Masked(), Masked()).double()
    masks: list[bool] = []
    model[1].register_forward_pre_hook(lambda _, args: masks.append(args[0][0].requires_grad))
    pipe = Pipe(model, [1, 1], devices=["cpu:0", "cpu:1"], chunks=2, checkpoint=checkpoint)  # type: ignore[arg-type]
    mask = (torch.rand(6, 4, generator=torch.Generator().manual_seed(0)) > 0.5).double()
    _, out = pipe((mask, torch.randn(6, 4, dtype=torch.float64)))
    out.sum().backward()
    assert masks and not any(masks)
