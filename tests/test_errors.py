"""Errors that name their fix (finding F16) and in-place first layers (finding F17)."""

from __future__ import annotations

import copy
import re
from collections import OrderedDict

import pytest
import torch
from torch import Tensor, nn

from pipeline import Pipe
from pipeline.arguments import CheckpointMode
from tests.helpers import assert_close_dicts, grads, mlp

MODES: list[CheckpointMode] = ["always", "except_last", "never"]


def cpu_pipe(model: nn.Sequential, balance: list[int], **kwargs: object) -> Pipe:
    return Pipe(model, balance, devices=["cpu"] * len(balance), **kwargs)  # type: ignore[arg-type]


class Sum(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x.sum()


class Squeeze(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x.squeeze()


class ToInt(nn.Module):
    def forward(self, x: Tensor) -> int:
        return 3


def test_empty_batch_raises_value_error_saying_skip_empty_batches() -> None:
    pipe = cpu_pipe(mlp(), [3, 3], chunks=2)
    with pytest.raises(ValueError, match=r"input batch is empty.*skip empty batches"):
        pipe(torch.randn(0, 8, dtype=torch.float64))


def test_batch_norm_error_keeps_its_type_and_notes_the_micro_batch_sizes() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)).double()
    pipe = cpu_pipe(model, [1, 1], chunks=8)
    with pytest.raises(ValueError, match="Expected more than 1 value per channel") as info:
        pipe(torch.randn(9, 8, dtype=torch.float64))
    assert type(info.value) is ValueError
    notes = "\n".join(getattr(info.value, "__notes__", []))
    del info  # the traceback's frames would keep the Pipe and its workers alive
    assert "partition 1" in notes and "micro-batch 4 of 5" in notes, notes
    assert "split 9 rows into micro-batches of [2, 2, 2, 2, 1] rows" in notes, notes


def test_scalar_output_raises_value_error_about_0_dim_concatenation() -> None:
    pipe = cpu_pipe(nn.Sequential(nn.Linear(8, 8), Sum()).double(), [1, 1], chunks=2)
    with pytest.raises(ValueError, match=r"0-dim tensor.*concatenated along dim 0"):
        pipe(torch.randn(4, 8, dtype=torch.float64))


def test_output_shapes_differing_per_micro_batch_raise_value_error_naming_them() -> None:
    pipe = cpu_pipe(nn.Sequential(nn.Linear(8, 8), Squeeze()).double(), [1, 1], chunks=4)
    listed = "micro-batch 0: (2, 8), micro-batch 1: (2, 8), micro-batch 2: (8,)"
    with pytest.raises(ValueError, match=re.escape(listed)):
        pipe(torch.randn(5, 8, dtype=torch.float64))  # micro-batches of 2, 2 and 1 rows


def test_slice_gives_sequential_of_named_layers_and_string_index_raises_type_error() -> None:
    model = nn.Sequential(
        OrderedDict(fc1=nn.Linear(8, 8), act=nn.Tanh(), fc2=nn.Linear(8, 8), out=nn.Tanh())
    )
    layers = dict(model.named_children())
    pipe = cpu_pipe(model, [1, 3])
    head = pipe[0:2]
    assert type(head) is nn.Sequential
    assert [(n, m) for n, m in head.named_children()] == [
        ("fc1", layers["fc1"]),
        ("act", layers["act"]),
    ]
    across = pipe[1:]
    assert [n for n, _ in across.named_children()] == ["act", "fc2", "out"]
    assert all(across[k] is layers[n] for k, n in enumerate(["act", "fc2", "out"]))
    with pytest.raises(TypeError, match="Pipe indices must be ints or slices, got str"):
        pipe["a"]  # type: ignore[call-overload]


def test_assigning_an_unknown_checkpoint_mode_raises_and_keeps_the_mode() -> None:
    pipe = cpu_pipe(mlp(), [3, 3], chunks=2, checkpoint="never")
    with pytest.raises(
        ValueError,
        match=r"checkpoint must be one of 'always', 'except_last', 'never', got 'sometimes'",
    ):
        pipe.checkpoint = "sometimes"
    assert pipe.checkpoint == "never"
    x = torch.randn(4, 8, dtype=torch.float64)
    torch.testing.assert_close(pipe(x), pipe[:](x))


def test_to_empty_on_meta_is_refused_like_to_meta() -> None:
    pipe = cpu_pipe(mlp(), [3, 3], chunks=2)
    before = {k: v.clone() for k, v in pipe.state_dict().items()}
    with pytest.raises(ValueError, match=r"Pipe\.to\(meta\) would move partitions off"):
        pipe.to("meta")
    with pytest.raises(
        ValueError, match=r"Pipe\.to_empty\(meta\) would move partitions off.*pass devices="
    ):
        pipe.to_empty(device="meta")
    for key, value in pipe.state_dict().items():
        assert value.device.type == "cpu" and torch.equal(value, before[key]), key


def test_torch_compile_of_a_pipe_gives_the_pipe_output() -> None:
    pipe = cpu_pipe(mlp(), [3, 3], chunks=2)
    x = torch.randn(4, 8, dtype=torch.float64)
    torch.testing.assert_close(torch.compile(pipe)(x), pipe(x))


@pytest.mark.parametrize("balance", [[1, 2], [2, 1]])
@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("checkpoint", MODES)
def test_in_place_first_layer_never_changes_the_callers_input(
    balance: list[int], requires_grad: bool, checkpoint: CheckpointMode
) -> None:
    model = nn.Sequential(nn.ReLU(inplace=True), nn.Linear(8, 8), nn.Tanh()).double()
    reference = copy.deepcopy(model)
    base = torch.randn(8, 8, dtype=torch.float64)
    x_ref = base.clone().requires_grad_(requires_grad)
    expected = reference(x_ref.clone())  # the plain model, run on a copy of the input
    expected.sum().backward()

    pipe = cpu_pipe(model, balance, chunks=4, checkpoint=checkpoint)
    x = base.clone().requires_grad_(requires_grad)
    out = pipe(x)
    assert torch.equal(x.detach(), base), "the Pipe wrote into the caller's input"
    out.sum().backward()

    assert torch.equal(x.detach(), base), "backward wrote into the caller's input"
    torch.testing.assert_close(out, expected)
    assert_close_dicts(grads(pipe), grads(reference))
    if requires_grad:
        torch.testing.assert_close(x.grad, x_ref.grad)


def test_partition_returning_an_int_raises_type_error_naming_the_partition() -> None:
    pipe = cpu_pipe(nn.Sequential(nn.Linear(8, 8), ToInt()).double(), [1, 1], chunks=2)
    with pytest.raises(TypeError, match="partition 1 returned int, which holds no tensor"):
        pipe(torch.randn(4, 8, dtype=torch.float64))
