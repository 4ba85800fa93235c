"""Pipe construction: validation, nn.Module semantics, state_dict, device moves."""

from __future__ import annotations

import copy
from collections import OrderedDict

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pipeline import BalanceError, Pipe
from tests.helpers import mlp


def test_attributes_and_sequence_protocol() -> None:
    model = mlp()
    layers = list(model)
    pipe = Pipe(model, [2, 4], devices=["cpu", "cpu"], chunks=3, checkpoint="never")
    assert pipe.balance == [2, 4] and pipe.chunks == 3 and pipe.checkpoint == "never"
    assert pipe.devices == [torch.device("cpu")] * 2
    assert [list(p) for p in pipe.partitions] == [layers[:2], layers[2:]]
    assert len(pipe) == 6 and list(pipe) == layers
    assert pipe[0] is layers[0] and pipe[-1] is layers[-1]
    with pytest.raises(IndexError, match="layer index 6 out of range for a Pipe of 6 layers"):
        pipe[6]


def test_default_devices_without_cuda_are_cpu() -> None:
    if torch.cuda.is_available():
        pytest.skip("the default is CUDA devices here")
    pipe = Pipe(mlp(), [3, 3])
    assert pipe.devices == [torch.device("cpu")] * 2


def test_state_dict_keys_equal_the_sequential_and_round_trip() -> None:
    model = nn.Sequential(OrderedDict(fc=nn.Linear(3, 3), act=nn.ReLU(), bn=nn.BatchNorm1d(3)))
    keys = list(model.state_dict())
    pipe = Pipe(copy.deepcopy(model), [1, 2], devices=["cpu"] * 2)
    assert list(pipe.state_dict()) == keys
    fresh = nn.Sequential(OrderedDict(fc=nn.Linear(3, 3), act=nn.ReLU(), bn=nn.BatchNorm1d(3)))
    fresh.load_state_dict(pipe.state_dict())
    pipe.load_state_dict(model.state_dict())
    for name, value in model.state_dict().items():
        assert torch.equal(pipe.state_dict()[name], value)
        assert torch.equal(fresh.state_dict()[name], pipe.state_dict()[name])
    assert pipe.fc is pipe[0]


def test_deferred_batch_norm_keeps_state_dict_keys() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    keys = list(model.state_dict())
    pipe = Pipe(model, [1, 1], devices=["cpu"] * 2, deferred_batch_norm=True)
    assert list(pipe.state_dict()) == keys


def test_train_and_eval_reach_every_layer() -> None:
    pipe = Pipe(nn.Sequential(nn.Dropout(), nn.Dropout()), [1, 1], devices=["cpu"] * 2)
    pipe.eval()
    assert not any(layer.training for layer in pipe)
    pipe.train()
    assert all(layer.training for layer in pipe)


def test_dtype_moves_are_allowed_and_device_moves_refused() -> None:
    pipe = Pipe(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), [1, 1], devices=["cpu"] * 2)
    assert pipe.to(torch.float64) is pipe and pipe[0].weight.dtype == torch.float64
    assert pipe.double() is pipe
    assert pipe.cpu() is pipe and pipe.to("cpu") is pipe
    with pytest.raises(ValueError, match=r"Pipe.to\(meta\) would move partitions off their"):
        pipe.to("meta")
    with pytest.raises(ValueError, match=r"Pipe.cuda\(cuda:0\) would move partitions"):
        pipe.cuda(0)


@pytest.mark.parametrize(
    ("balance", "message"),
    [
        (None, "Pipe needs balance"),
        ([], "balance is empty"),
        (3, "balance must be a list of ints, got 3"),
        ([3, 0, 3], r"not positive ints \(\[0\]\)"),
        ([3, -1, 4], r"not positive ints \(\[-1\]\)"),
        ([3.0, 3], r"not positive ints \(\[3.0\]\)"),
        ([True, 5], r"not positive ints \(\[True\]\)"),
        ([2, 2], "sums to 4 but the module has 6 layers"),
        ([4, 4], "sums to 8 but the module has 6 layers"),
    ],
)
def test_bad_balance(balance: object, message: str) -> None:
    with pytest.raises(BalanceError, match=message) as info:
        Pipe(mlp(), balance, devices=["cpu"] * 2)  # type: ignore[arg-type]
    assert isinstance(info.value, ValueError)
    assert "balance_by_time" in str(info.value)


def test_not_a_sequential() -> None:
    with pytest.raises(TypeError, match=r"Pipe splits an nn\.Sequential, got Linear"):
        Pipe(nn.Linear(2, 2), [1])  # type: ignore[arg-type]


def test_empty_sequential_needs_an_empty_balance_and_is_the_identity() -> None:
    with pytest.raises(BalanceError, match=r"Pipe needs balance.*balance_by_time"):
        Pipe(nn.Sequential())
    with pytest.raises(BalanceError, match="sums to 1 but the module has 0 layers"):
        Pipe(nn.Sequential(), [1])
    pipe = Pipe(nn.Sequential(), [])
    x = torch.tensor(42)
    assert pipe(x) is x
    pair = (torch.ones(2), "tag")
    assert pipe(pair) is pair
    with pytest.raises(TypeError, match="must be a tensor or hold tensors, got int"):
        pipe(42)


def test_chunks_that_are_whole_floats_are_ints() -> None:
    pipe = Pipe(mlp(), [6], devices=["cpu"], chunks=4.0)  # type: ignore[arg-type]
    assert pipe.chunks == 4 and type(pipe.chunks) is int


def test_checkpoint_is_any_value_whose_str_names_a_mode_and_is_checked_on_assignment() -> None:
    class Mode:
        def __str__(self) -> str:
            return "never"

    pipe = Pipe(mlp(), [6], devices=["cpu"], checkpoint=Mode())  # type: ignore[arg-type]
    assert pipe.checkpoint == "never" and type(pipe.checkpoint) is str
    pipe.checkpoint = "always"
    assert pipe.checkpoint == "always"
    with pytest.raises(ValueError, match=r"checkpoint must be one of .* got 'sometimes'"):
        pipe.checkpoint = "sometimes"  # type: ignore[assignment]
    assert pipe.checkpoint == "always"


@pytest.mark.parametrize("chunks", [0, -2, 1.5, "4", True, None])
def test_bad_chunks(chunks: object) -> None:
    with pytest.raises(ValueError, match="chunks must be a positive int"):
        Pipe(mlp(), [6], devices=["cpu"], chunks=chunks)  # type: ignore[arg-type]
    # Set between calls: torch's "chunk expects 'chunks' to be greater than 0" in the next
    # call, before; 2.0 was refused there where the constructor takes it.
    pipe = Pipe(mlp(), [6], devices=["cpu"], chunks=2)
    with pytest.raises(ValueError, match="chunks must be a positive int"):
        pipe.chunks = chunks  # type: ignore[assignment]
    assert pipe.chunks == 2
    pipe.chunks = 4.0  # type: ignore[assignment]
    assert pipe.chunks == 4 and type(pipe.chunks) is int


def test_bad_checkpoint() -> None:
    with pytest.raises(
        ValueError,
        match="checkpoint must be one of 'always', 'except_last', 'never', got 'sometimes'",
    ):
        Pipe(mlp(), [6], devices=["cpu"], checkpoint="sometimes")  # type: ignore[arg-type]


def test_more_partitions_than_devices() -> None:
    with pytest.raises(ValueError, match=r"3 partitions but 2 devices"):
        Pipe(mlp(), [2, 2, 2], devices=["cpu", "cpu"])
    with pytest.raises(TypeError, match="devices must be a list of devices"):
        Pipe(mlp(), [6], devices="cpu")  # type: ignore[arg-type]


def test_more_devices_than_partitions_are_refused_not_dropped() -> None:
    with pytest.raises(ValueError, match=r"2 partitions but 3 devices .*one device per partition"):
        Pipe(mlp(), [3, 3], devices=["cpu"] * 3)


def test_a_model_that_is_not_a_sequential_is_pointed_to_split() -> None:
    with pytest.raises(TypeError, match=r"got Linear; .*pipeline\.split\(model, example_args\)"):
        Pipe(nn.Linear(2, 2), [1], devices=["cpu"])  # type: ignore[arg-type]


def test_repr_shows_how_the_pipe_runs_above_its_layers() -> None:
    pipe = Pipe(mlp(), [4, 2], devices=["cpu", "cpu"], chunks=3, checkpoint="never")
    lines = repr(pipe).splitlines()
    assert lines[:2] == [
        "Pipe(",
        "  balance=[4, 2], devices=['cpu', 'cpu'], threads='auto', chunks=3, checkpoint='never'",
    ]
    assert lines[2].startswith("  (0): ")


def test_a_missing_target_is_named_as_the_target() -> None:
    pipe = Pipe(mlp(), [3, 3], devices=["cpu", "cpu"], chunks=2)
    with pytest.raises(TypeError, match=r"^Pipe target \(NoneType\) holds no tensor"):
        pipe.step(torch.randn(4, 4), None, torch.nn.functional.mse_loss)


def test_unavailable_cuda_device() -> None:
    with pytest.raises(ValueError, match=r"device cuda:\d+ is not available"):
        Pipe(mlp(), [3, 3], devices=["cpu", f"cuda:{torch.cuda.device_count()}"])
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"device cuda is not available"):
            Pipe(mlp(), [3, 3], devices=["cpu", "cuda"])
        pipe = Pipe(mlp(), [6], devices=["cpu"])
        with pytest.raises(ValueError, match=r"Pipe.cuda\(cuda\) would move partitions"):
            pipe.cuda()


def test_layer_shared_between_partitions_on_one_device_trains_like_the_plain_model() -> None:
    torch.manual_seed(0)
    shared = nn.Linear(4, 4)
    model = nn.Sequential(shared, nn.Tanh(), nn.Linear(4, 4), shared, nn.Tanh()).double()
    plain = copy.deepcopy(model)
    x = torch.randn(6, 4, dtype=torch.double)
    plain(x).square().sum().backward()
    for checkpoint in ("always", "except_last", "never"):
        pipe = Pipe(
            copy.deepcopy(model), [2, 2, 1], devices=["cpu"] * 3, chunks=3, checkpoint=checkpoint
        )  # type: ignore[arg-type]
        pipe(x).square().sum().backward()  # type: ignore[union-attr]
        assert pipe[0] is pipe[3]
        torch.testing.assert_close(pipe[0].weight.grad, plain[0].weight.grad)
        torch.testing.assert_close(pipe[2].weight.grad, plain[2].weight.grad)


def test_parameter_shared_between_partitions_on_one_device_is_fine() -> None:
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    b.weight = a.weight
    plain = copy.deepcopy(nn.Sequential(a, b))
    pipe = Pipe(nn.Sequential(a, b), [1, 1], devices=["cpu"] * 2, chunks=2)
    x = torch.randn(4, 2)
    pipe(x).sum().backward()  # type: ignore[union-attr]
    plain(x).sum().backward()
    torch.testing.assert_close(a.weight.grad, plain[0].weight.grad)


def test_sharing_across_devices_is_refused() -> None:
    shared = nn.Linear(2, 2)
    with pytest.raises(
        ValueError,
        match=r"Linear '0' of partition 0 \(on cpu\) is also '1' of partition 1 \(on meta\).*"
        "same device only",
    ):
        Pipe(nn.Sequential(shared, shared), [1, 1], devices=["cpu", "meta"])


def test_sharing_within_one_partition_is_fine() -> None:
    shared = nn.Linear(2, 2)
    pipe = Pipe(nn.Sequential(shared, shared, nn.ReLU()), [2, 1], devices=["cpu"] * 2, chunks=2)
    pipe(torch.randn(4, 2)).sum().backward()  # type: ignore[union-attr]
    assert shared.weight.grad is not None


def test_layer_name_clashing_with_pipe_attribute() -> None:
    with pytest.raises(ValueError, match="layer name 'chunks' clashes with a Pipe attribute"):
        Pipe(nn.Sequential(OrderedDict(chunks=nn.ReLU())), [1], devices=["cpu"])


def test_bad_input_is_refused_before_any_work() -> None:
    calls = []

    class Count(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            calls.append(1)
            return x

    pipe = Pipe(nn.Sequential(Count()), [1], devices=["cpu"], chunks=2)
    with pytest.raises(TypeError, match="holds no tensor"):
        pipe(None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="different numbers of micro-batches"):
        pipe((torch.zeros(2), torch.zeros(1)))
    assert calls == []


class Masked(nn.Module):
    """Scales its rows by a mask that has no batch dimension, and passes the mask on."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 6)

    def forward(self, value: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"h": torch.tanh(self.linear(value["h"])) * value["mask"], "mask": value["mask"]}


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_a_no_chunk_value_returned_comes_back_once_as_from_the_plain_model(
    checkpoint: str,
) -> None:
    # Every micro-batch returns the same memory: gathered, it is the plain model's one value,
    # not one copy per micro-batch.
    from pipeline import NoChunk

    model = nn.Sequential(Masked(), Masked(), Masked()).double()
    plain = copy.deepcopy(model)
    h = torch.randn(9, 6, dtype=torch.float64)
    mask = torch.rand(6, dtype=torch.float64, requires_grad=True)
    pipe = Pipe(model, [1, 2], devices=["cpu"] * 2, chunks=3, checkpoint=checkpoint)  # type: ignore[arg-type]
    out = pipe({"h": h, "mask": NoChunk(mask)})
    expected_mask = mask.detach().clone().requires_grad_()
    expected = plain({"h": h, "mask": expected_mask})
    assert out["mask"].shape == expected["mask"].shape == (6,)
    (out["h"].sum() + out["mask"].pow(2).sum()).backward()
    (expected["h"].sum() + expected["mask"].pow(2).sum()).backward()
    torch.testing.assert_close(mask.grad, expected_mask.grad)
    for ours, theirs in zip(model.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(ours.grad, theirs.grad)


class Expanding(nn.Module):
    """Returns its rows and a learned state expanded to them (stride 0 in dim 0)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 6)
        self.state = nn.Parameter(torch.randn(1, 6))

    def forward(self, value: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        h, positions = value
        return self.linear(h), self.state.expand(h.size(0), 6), positions


@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_a_tensor_expanded_to_each_micro_batchs_rows_is_concatenated_like_any_rows(
    checkpoint: str,
) -> None:
    # The micro-batches' pieces share one memory, as a NoChunk value's do; but
    # each has its micro-batch's rows, and the plain model returns the batch's.
    model = nn.Sequential(nn.Identity(), Expanding()).double()
    plain = copy.deepcopy(model)
    h = torch.randn(6, 6, dtype=torch.float64)
    positions = torch.arange(4).expand(6, 4)  # as transformers builds position ids
    pipe = Pipe(model, [1, 1], devices=["cpu"] * 2, chunks=3, checkpoint=checkpoint)  # type: ignore[arg-type]
    out, expected = pipe((h, positions)), plain((h, positions))
    assert [tuple(t.shape) for t in out] == [tuple(t.shape) for t in expected]
    sum(t.sum() for t in out[:2]).backward()
    sum(t.sum() for t in expected[:2]).backward()
    for ours, theirs in zip(model.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(ours.grad, theirs.grad)
    assert pipe.evaluate((h, positions))[2].shape == (6, 4)
    _, stepped = pipe.step((h, positions), h, lambda o, t: F.mse_loss(o[0], t), return_outputs=True)
    assert [tuple(t.shape) for t in stepped] == [tuple(t.shape) for t in expected]


def test_a_no_chunk_tensor_before_the_split_ones_does_not_count_as_the_rows() -> None:
    from pipeline import NoChunk

    model = nn.Sequential(Masked(), Masked()).double()
    plain = copy.deepcopy(model)
    h, y = torch.randn(7, 6, dtype=torch.float64), torch.randn(7, 6, dtype=torch.float64)
    mask = torch.rand(6, dtype=torch.float64)
    pipe = Pipe(model, [1, 1], devices=["cpu"] * 2, chunks=3)
    loss = pipe.step({"mask": NoChunk(mask), "h": h}, y, lambda o, t: F.mse_loss(o["h"], t))
    expected = F.mse_loss(plain({"mask": mask, "h": h})["h"], y)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach())
    for ours, theirs in zip(model.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(ours.grad, theirs.grad)


@pytest.mark.parametrize("kind", ["forward", "state_dict"])
def test_hooks_on_the_sequential_itself_are_refused_as_they_would_never_run(kind: str) -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    if kind == "forward":
        model.register_forward_hook(lambda *_: None)
    else:
        model.register_state_dict_post_hook(lambda *_: None)
    with pytest.raises(ValueError, match=f"has {kind} hooks .*would never run"):
        Pipe(model, [1, 1], devices=["cpu"] * 2)


class Doubling(nn.Module):
    """Doubles, in place, the mask it is given (a NoChunk input) and scales its rows by it."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 6)

    def forward(self, value: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        h, mask = value
        return self.linear(h) * mask.mul_(2)


@pytest.mark.parametrize("call", ["pipe(x)", "evaluate", "step"])
def test_a_write_into_a_tensor_every_micro_batch_is_given_is_refused(call: str) -> None:
    # Once per micro-batch where the plain model writes once: 8 times the mask, not 2.
    from pipeline import NoChunk

    model = nn.Sequential(Doubling(), nn.Linear(6, 6))
    pipe = Pipe(model, [1, 1], devices=["cpu"] * 2, chunks=3)
    h, mask = torch.randn(6, 6), torch.ones(6)
    run = {
        "pipe(x)": lambda: pipe((h, NoChunk(mask))),
        "evaluate": lambda: pipe.evaluate((h, NoChunk(mask))),
        "step": lambda: pipe.step((h, NoChunk(mask)), h, F.mse_loss),
    }[call]
    with pytest.raises(RuntimeError, match="partition 0 wrote in place into a tensor that every"):
        run()
    assert all(p.grad is None for p in model.parameters())
