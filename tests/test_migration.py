"""docs/migration.md, sentence by sentence: moving from torchgpipe, fairscale, torch's Pipe."""

from __future__ import annotations

import copy
import enum
import inspect
from collections import OrderedDict

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import balance
from pipeline import (
    BalanceError,
    DeferredBatchNorm,
    NoChunk,
    Pipe,
    PositionalSequential,
    from_partitioned_state_dict,
    is_checkpointing,
    is_recomputing,
)
from pipeline.skip import Namespace, pop, skippable, stash, verify_skippables
from tests.conftest import cuda_only
from tests.helpers import mlp


def test_torchgpipe_constructor_and_helpers_keep_their_names_and_arguments() -> None:
    assert all(callable(f) for f in (is_checkpointing, is_recomputing, verify_skippables))
    assert all(callable(f) for f in (Namespace, pop, skippable, stash, NoChunk))
    gpipe = Pipe
    model = gpipe(
        mlp(),
        balance=[2, 4],
        devices=["cpu", "cpu"],
        chunks=8,
        checkpoint="except_last",
        deferred_batch_norm=True,
    )
    assert model.balance == [2, 4] and model.chunks == 8 and model.checkpoint == "except_last"
    time_args = list(inspect.signature(balance.balance_by_time).parameters)
    size_args = list(inspect.signature(balance.balance_by_size).parameters)
    # torchgpipe's arguments, in its order; then the first layer's keywords, new here.
    assert time_args == ["partitions", "module", "sample", "timeout", "device", "kwargs"]
    size = ["partitions", "module", "sample", "chunks", "param_scale", "device", "kwargs"]
    assert size_args == size


class Two(nn.Module):
    """Takes two positional arguments and returns two values, as torch's Pipe passed them."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        return torch.tanh(self.linear(x)) * mask, mask


class Last(nn.Module):
    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        return x + mask


def test_torch_pipe_positional_call_style_equals_positional_sequential() -> None:
    model = PositionalSequential(Two(), Two(), Last()).double()
    plain = copy.deepcopy(model)
    x, mask = torch.randn(6, 4, dtype=torch.double), torch.rand(6, 4, dtype=torch.double)
    for checkpoint in ("always", "except_last", "never"):
        pipe = Pipe(
            copy.deepcopy(model),
            [1, 2],
            devices=["cpu"] * 2,
            chunks=3,
            checkpoint=checkpoint,  # type: ignore[arg-type]
            call_style="positional",
        )
        out = pipe(x, mask)
        assert isinstance(out, Tensor)  # the output itself, no RRef
        expected = plain(x, mask)
        torch.testing.assert_close(out, expected)
        out.sum().backward()
        plain.zero_grad()
        expected.sum().backward()
        for a, b in zip(pipe.parameters(), plain.parameters(), strict=True):
            torch.testing.assert_close(a.grad, b.grad)


def test_the_default_tuple_call_style_passes_a_tuple_whole_and_takes_one_input() -> None:
    class Pair(nn.Module):
        def forward(self, pair: tuple[Tensor, Tensor]) -> Tensor:
            x, y = pair
            return x * y

    pipe = Pipe(nn.Sequential(nn.Identity(), Pair()), [1, 1], devices=["cpu"] * 2, chunks=2)
    x, y = torch.randn(4, 2), torch.randn(4, 2)
    torch.testing.assert_close(pipe((x, y)), x * y)
    with pytest.raises(TypeError, match="call_style='positional'"):
        pipe(x, y)


class Arguments(nn.Module):
    """Records how many arguments it was called with; returns its first tensor, scaled."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))
        self.calls: list[int] = []

    def forward(self, *args: object) -> Tensor:
        self.calls.append(len(args))
        first = args[0][0] if isinstance(args[0], tuple) else args[0]
        assert isinstance(first, Tensor)
        return first * self.scale


def test_positional_call_style_passes_one_tuple_whole_as_torchs_pipe_did() -> None:
    layer = Arguments()
    pipe = Pipe(nn.Sequential(layer), [1], devices=["cpu"], chunks=1, call_style="positional")
    a, b = torch.randn(2, 3), torch.randn(2, 3)
    pipe(a, b)  # layer(a, b)
    pipe((a, b))  # layer((a, b)), as torch's Pipe and PipeSequential
    PositionalSequential(layer)((a, b))
    PositionalSequential(layer)(a, b)
    # step takes one input: a tuple there holds the arguments, step((a, b)) is pipe(a, b).
    pipe.step((a, b), a, lambda out, _: out.sum(), loss_reduction="sum")
    pipe.step(((a, b),), a, lambda out, _: out.sum(), loss_reduction="sum")
    assert layer.calls == [2, 1, 1, 2, 2, 1]


class Nest(nn.Module):
    def forward(self, x: Tensor) -> tuple[tuple[Tensor, Tensor]]:
        return ((x, x * 2),)  # one argument for the next layer: a pair


class TakesPair(nn.Module):
    def forward(self, pair: tuple[Tensor, Tensor]) -> Tensor:
        return pair[0] + pair[1]


def test_one_tuple_between_partitions_stays_one_argument_as_in_positional_sequential() -> None:
    model = PositionalSequential(Nest(), TakesPair())
    pipe = Pipe(model, [1, 1], devices=["cpu"] * 2, chunks=2, call_style="positional")
    x = torch.randn(4, 3)
    torch.testing.assert_close(pipe(x), model(x))


class Rows(nn.Module):
    """Returns its three inputs, each with its own rows (torch's test_uneven_batch_size)."""

    def forward(self, a: Tensor, b: Tensor, c: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return a * 2, b, c


def test_inputs_of_different_sizes_in_dim_0_are_split_each_on_its_own_as_torchs_pipe_did() -> None:
    model = PositionalSequential(Rows())
    pipe = Pipe(model, [1], devices=["cpu"], chunks=2, call_style="positional")
    a, b, c = torch.rand(3, 1), torch.rand(4, 1), torch.rand(7, 1)
    out = pipe(a, b, c)
    assert isinstance(out, tuple)
    for found, expected in zip(out, model(a, b, c), strict=True):
        torch.testing.assert_close(found, expected)
    with pytest.raises(
        ValueError,
        match=r"numbers of micro-batches with chunks=2 \(input\[0\]: 1 rows in 1, "
        r"input\[1\]: 4 rows in 2, input\[2\]: 7 rows in 2\)",
    ):
        pipe(torch.rand(1, 1), b, c)


class FirstOfTwo(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, value: tuple[Tensor, Tensor]) -> Tensor:
        return self.linear(value[0]) * value[1].mean()


def test_a_step_on_uneven_inputs_weighs_micro_batches_by_the_first_tensors_rows() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(FirstOfTwo(), nn.Tanh(), nn.Linear(4, 4)).double()
    plain = copy.deepcopy(model)
    # x splits into 2, 2, 1 rows; aux into 1, 1, 1, all ones: each micro-batch as the plain model.
    x, aux = torch.randn(5, 4, dtype=torch.double), torch.ones(3, 4, dtype=torch.double)
    y = torch.randn(5, 4, dtype=torch.double)
    expected = F.mse_loss(plain((x, aux)), y)
    expected.backward()
    loss = Pipe(model, [1, 2], devices=["cpu"] * 2, chunks=3).step((x, aux), y, F.mse_loss)
    torch.testing.assert_close(loss, expected.detach())
    for found, wanted in zip(model.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(found.grad, wanted.grad)


def test_chunks_float_with_a_whole_value_is_converted_and_a_fraction_refused() -> None:
    assert Pipe(mlp(), [6], devices=["cpu"], chunks=8.0).chunks == 8  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"chunks must be a positive int .* got 8\.5"):
        Pipe(mlp(), [6], devices=["cpu"], chunks=8.5)  # type: ignore[arg-type]


def test_checkpoint_may_be_an_enum_whose_str_is_a_mode() -> None:
    class Mode(enum.Enum):
        ALWAYS = "always"

        def __str__(self) -> str:
            return self.value

    assert Pipe(mlp(), [6], devices=["cpu"], checkpoint=Mode.ALWAYS).checkpoint == "always"  # type: ignore[arg-type]


def test_balance_and_devices_may_be_any_sequences() -> None:
    # Extra devices are refused (test_pipe.py), where the predecessors ignored them.
    pipe = Pipe(mlp(), (2, 4), devices=("cpu", "cpu"))
    assert pipe.balance == [2, 4]
    assert pipe.devices == [torch.device("cpu")] * 2


def test_empty_sequential_with_empty_balance_is_an_identity() -> None:
    pipe = Pipe(nn.Sequential(), balance=[])
    x = torch.randn(3, 2)
    assert pipe(x) is x
    with pytest.raises(TypeError, match="must be a tensor or hold tensors"):
        pipe("text")
    with pytest.raises(BalanceError, match="balance_by_time"):
        Pipe(nn.Sequential())


def test_a_layer_listed_twice_sums_its_gradients_and_across_devices_is_refused() -> None:
    # torchgpipe, fairscale and torch's Pipe refuse a layer listed twice; this Pipe accepts it.
    embedding = nn.Linear(4, 4, bias=False)
    model = nn.Sequential(embedding, nn.Tanh(), nn.Linear(4, 4), embedding).double()
    plain = copy.deepcopy(model)
    pipe = Pipe(model, [2, 1, 1], devices=["cpu"] * 3, chunks=2)
    x = torch.randn(4, 4, dtype=torch.double)
    pipe(x).sum().backward()  # type: ignore[union-attr]
    plain(x).sum().backward()
    torch.testing.assert_close(embedding.weight.grad, plain[0].weight.grad)
    embedding.weight.grad = None
    pipe.step(x, x, lambda out, _: out.sum(), loss_reduction="sum")
    torch.testing.assert_close(embedding.weight.grad, plain[0].weight.grad)
    with pytest.raises(ValueError, match="same device only"):
        Pipe(nn.Sequential(embedding, embedding), [1, 1], devices=["cpu", "meta"])


def named_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        OrderedDict(fc1=nn.Linear(3, 3), act=nn.ReLU(), fc2=nn.Linear(3, 3), bn=nn.BatchNorm1d(3))
    )


@pytest.mark.parametrize("layer_names", ["kept", "renumbered"])
def test_a_predecessors_checkpoint_loads_after_converting_its_keys(layer_names: str) -> None:
    saved = named_model()
    for p in saved.parameters():
        p.data.normal_()
    names = [["fc1", "act"], ["fc2", "bn"]]
    predecessor = {}
    for key, value in saved.state_dict().items():
        layer, rest = key.split(".", 1)
        j = 0 if layer in names[0] else 1
        child = layer if layer_names == "kept" else str(names[j].index(layer))
        predecessor[f"partitions.{j}.{child}.{rest}"] = value
    pipe = Pipe(named_model(), [2, 2], devices=["cpu"] * 2)
    pipe.load_state_dict(
        from_partitioned_state_dict(predecessor, pipe, layer_names=layer_names)  # type: ignore[arg-type]
    )
    for key, value in saved.state_dict().items():
        assert torch.equal(pipe.state_dict()[key], value)
    with pytest.raises(ValueError, match="layer 'fc9' of partition 1"):
        from_partitioned_state_dict({"partitions.1.fc9.weight": torch.ones(1)}, pipe)
    with pytest.raises(ValueError, match="load a plain model's state_dict"):
        from_partitioned_state_dict({"fc1.weight": torch.ones(1)}, pipe)


def test_state_dict_keys_are_the_plain_models_and_layers_are_direct_children() -> None:
    model = named_model()
    keys = list(model.state_dict())
    pipe = Pipe(model, [2, 2], devices=["cpu"] * 2)
    assert list(pipe.state_dict()) == keys
    assert isinstance(pipe.partitions, list)
    # nn.Sequential's (a subclass whose first layer also takes the pipe's keyword arguments).
    assert all(isinstance(p, nn.Sequential) for p in pipe.partitions)
    assert pipe.fc2 is pipe.partitions[1][0]


@cuda_only
def test_the_input_is_moved_to_the_first_device() -> None:
    pipe = Pipe(nn.Sequential(nn.Linear(2, 2)).cuda(), [1], devices=["cuda:0"])
    assert pipe(torch.randn(3, 2)).device == torch.device("cuda", 0)  # type: ignore[union-attr]


def test_a_non_tensor_output_equal_in_every_micro_batch_is_returned_once() -> None:
    class Tagged(nn.Module):
        def forward(self, x: Tensor) -> tuple[Tensor, str]:
            return x * 2, "tag"

    pipe = Pipe(nn.Sequential(nn.Identity(), Tagged()), [1, 1], devices=["cpu"] * 2, chunks=3)
    out, tag = pipe(torch.ones(6, 1))  # type: ignore[misc]
    assert tag == "tag" and torch.equal(out, torch.full((6, 1), 2.0))


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_an_in_place_first_layer_gets_a_copy_and_right_gradients(checkpoint: str) -> None:
    # The case the predecessors answered with "a leaf Variable that requires
    # grad is being used in an in-place operation".
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(inplace=True)).double()
    plain = copy.deepcopy(model)
    pipe = Pipe(model, [1, 1], devices=["cpu"] * 2, chunks=2, checkpoint=checkpoint)  # type: ignore[arg-type]
    x = torch.randn(4, 2, dtype=torch.double, requires_grad=True)
    before = x.detach().clone()
    pipe(x).sum().backward()  # type: ignore[union-attr]
    assert torch.equal(x.detach(), before)
    plain(x.detach()).sum().backward()
    torch.testing.assert_close(model[0].weight.grad, plain[0].weight.grad)


def test_checkpointing_is_non_reentrant_and_autograd_grad_works() -> None:
    pipe = Pipe(mlp(), [3, 3], devices=["cpu"] * 2, chunks=2, checkpoint="always")
    plain = copy.deepcopy(pipe[0:6])
    x = torch.randn(4, 8, dtype=torch.double)
    out = pipe(x)
    assert isinstance(out, Tensor) and out.grad_fn is not None
    seen, pending = set(), [out.grad_fn]
    while pending:
        node = pending.pop()
        if node is not None and node not in seen:
            seen.add(node)
            pending += [n for n, _ in node.next_functions]
    assert not any(
        "Checkpoint" in type(n).__name__ or "Recompute" in type(n).__name__ for n in seen
    )
    got = torch.autograd.grad(out.sum(), list(pipe.parameters()))
    expected = torch.autograd.grad(plain(x).sum(), list(plain.parameters()))
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b)


def test_moving_a_pipe_or_too_few_devices_is_a_value_error() -> None:
    pipe = Pipe(mlp(), [3, 3], devices=["cpu"] * 2)
    with pytest.raises(ValueError, match="would move partitions off their devices"):
        pipe.to("meta")
    with pytest.raises(ValueError, match="3 partitions but 2 devices"):
        Pipe(mlp(), [2, 2, 2], devices=["cpu"] * 2)


def test_deferred_batch_norm_converts_in_place_and_is_plain_batch_norm_outside() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    reference = copy.deepcopy(model)
    assert DeferredBatchNorm.convert(model) is model and isinstance(model[1], DeferredBatchNorm)
    x = torch.randn(8, 3)
    torch.testing.assert_close(model(x), reference(x))
    torch.testing.assert_close(model[1].running_mean, reference[1].running_mean)


def test_torch_compile_of_a_pipe_runs_it_eagerly() -> None:
    pipe = Pipe(mlp(), [3, 3], devices=["cpu"] * 2, chunks=2)
    x = torch.randn(4, 8, dtype=torch.double)
    torch.testing.assert_close(torch.compile(pipe)(x), pipe(x))
