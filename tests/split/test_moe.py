"""Mixture-of-Experts models: routing that depends on tensor values inside a block.

A block whose fake run cannot follow its code (which experts run depends on
the router's values) is run once for real on stand-in values to learn what
it returns (``pipeline/split/standin.py``). Mixtral, Qwen2-MoE and a
DeepSeek-V3-shaped model with transformers' eager experts then split equal
to the plain model; where the stand-in run fails too, or the output's shape
follows values, the refusal is loud. Split on ``meta`` (stand-ins on the CPU)
and DistributedPipe: tests/distributed/split_scenarios.py.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from split_models import (
    assert_same,
    backward_of,
    deepseek_v3,
    gradients,
    lm_loss,
    mixtral,
    qwen2_moe,
    tokens,
    twin,
)
from torch import Tensor, nn

import pipeline
from pipeline import Pipe
from pipeline.split import SplitError

transformers = pytest.importorskip("transformers")

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")


@pytest.mark.parametrize(
    "make", [mixtral, qwen2_moe, deepseek_v3], ids=["mixtral", "qwen2_moe", "deepseek_v3"]
)
def test_eager_routed_experts_split_equal_to_plain_in_pipe_call_and_every_schedule(
    make: Callable[[], nn.Module],
) -> None:
    torch.manual_seed(0)
    model = make()
    plain = twin(model)
    ids, _, target = tokens(8, 6)
    seq = pipeline.split(model, (ids[:2],))
    assert len(seq) == 4  # before the layers, two layers, after
    expected_loss = backward_of(lambda: lm_loss(plain(ids), target))
    expected = gradients(plain)
    pipe = Pipe(seq, [1, 1, 1, 1], devices=["cpu"] * 4, chunks=4)
    loss = backward_of(lambda: lm_loss(pipe(ids), target))
    torch.testing.assert_close(loss, expected_loss)
    assert_same(gradients(model), expected)
    for schedule in SCHEDULES:
        model.zero_grad()
        loss = pipe.step(ids, target, lm_loss, schedule=schedule)
        torch.testing.assert_close(loss, expected_loss, msg=schedule)
        assert_same(gradients(model), expected)
    pipe.close()


# transformers' default ('grouped_mm') takes float32 and bfloat16 only.
@pytest.mark.parametrize(
    ("experts", "dtype"), [("batched_mm", torch.float64), (None, torch.float32)]
)
def test_the_other_experts_implementations_split_equal_to_plain(
    experts: str | None, dtype: torch.dtype
) -> None:
    model = mixtral(experts, dtype)
    plain = twin(model)
    ids, _, target = tokens(4, 6)
    seq = pipeline.split(model, (ids,))
    out, expected = seq(ids), plain(ids)
    torch.testing.assert_close(out.logits, expected.logits)
    lm_loss(out, target).backward()
    lm_loss(expected, target).backward()
    assert_same(gradients(model), gradients(plain))


class Routed(nn.Module):
    """Runs the rows whose gate is positive through a layer: a choice made on values.

    Counts its calls in a buffer and draws noise, to show that the stand-in run
    leaves the module and the random streams as they were.
    """

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(4, 1)
        self.layer = nn.Linear(4, 4)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        chosen = (self.gate(x) > 0).squeeze(-1).nonzero().squeeze(-1)
        out = x + 0.0 * torch.randn_like(x)
        if len(chosen):  # a branch on the values
            out = out.index_add(0, chosen, self.layer(x[chosen]))
        return out


class Stack(nn.Module):
    def __init__(self, block: Callable[[], nn.Module]) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 4)
        self.blocks = nn.ModuleList(block() for _ in range(2))

    def forward(self, x: Tensor) -> Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return h


def test_the_stand_in_run_leaves_the_model_and_the_random_streams_as_they_were() -> None:
    torch.manual_seed(0)
    model = Stack(Routed).double()
    plain = twin(model)
    before = {name: t.clone() for name, t in model.state_dict().items()}
    example = torch.randn(3, 4, dtype=torch.float64)
    generator = torch.get_rng_state()
    seq = pipeline.split(model, (example,))
    assert torch.equal(torch.get_rng_state(), generator)
    assert_same(model.state_dict(), before)
    x = torch.randn(5, 4, dtype=torch.float64)
    torch.testing.assert_close(seq(x), plain(x))
    assert [int(block.calls) for block in model.blocks] == [1, 1]


class NeedsACount(nn.Module):
    """Reads a count from an integer input: zero (what a stand-in holds) cannot be shaped."""

    def forward(self, x: Tensor, count: Tensor) -> Tensor:
        n = int(count.item())
        return x + torch.ones(n).reshape(-1, n).sum()


class Counted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(NeedsACount() for _ in range(2))

    def forward(self, x: Tensor, count: Tensor) -> Tensor:
        for block in self.blocks:
            x = block(x, count)
        return x


def test_a_block_that_fails_on_stand_in_values_too_is_refused_saying_both() -> None:
    with pytest.raises(SplitError) as error:
        pipeline.split(Counted(), (torch.randn(2, 3), torch.tensor(3)))
    message = str(error.value)
    assert message.startswith("cannot capture block blocks.0 (NeedsACount)")
    assert "depends on the values of tensors" in message
    assert "a run on stand-in values" in message and "failed with RuntimeError" in message
    assert "experts_implementation='batched_mm'" in message


class Scaled(nn.Module):
    """Scales by its count of positive inputs: shaped like its input, by values' code."""

    def forward(self, x: Tensor) -> Tensor:
        return x * int((x > 0).sum())


@pytest.mark.parametrize("embed", ["identity", "linear"])
def test_a_stand_in_run_tells_apart_sizes_equal_in_the_example(embed: str) -> None:
    # A batch of 4 rows of 4 (the rows' width a size of the capture, or fixed by a
    # Linear): the run on stand-ins could not tell which size its output followed. It
    # refused the first example; the second fixed its output's width to the batch's
    # symbol, and every other batch size was refused at the call, saying the model's code
    # fixed it (a Mixtral whose batch equals its hidden size). A second run on moved
    # sizes tells them apart.
    model = Stack(Scaled)
    if embed == "identity":
        model.embed = nn.Identity()
    seq = pipeline.split(model, (torch.randn(4, 4),))
    for rows in (2, 4, 7):
        x = torch.randn(rows, 4)
        torch.testing.assert_close(seq(x), model(x))
    if embed == "identity":
        x = torch.randn(3, 6)
        torch.testing.assert_close(seq(x), model(x))


class Positioned(nn.Module):
    """Adds positions, which the code needs as long as the rows: apart, the run fails."""

    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        return x * int((x > 0).sum()) + positions


class PositionedStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Positioned() for _ in range(2))

    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        for block in self.blocks:
            x = block(x, positions)
        return x


def test_sizes_a_stand_in_run_needs_equal_are_moved_together() -> None:
    # Rows of 6 and 6 positions, two sizes of the capture (a Mixtral given cache_position):
    # refused at the split, whatever the example, since moved apart the block fails.
    model = PositionedStack()
    seq = pipeline.split(model, (torch.randn(4, 6), torch.arange(6.0)))
    x, positions = torch.randn(3, 5), torch.arange(5.0)
    torch.testing.assert_close(seq(x, positions), model(x, positions))


class ScaledLinear(nn.Module):
    """A Linear scaled by a count of its inputs: fails on stand-ins of another width."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        count = int((x > 0).sum())  # the capture's fake run stops here, before the Linear
        return self.linear(x) * (count % 3 + 1)


def test_a_second_run_failing_in_a_submodule_leaves_the_capture_as_it_was() -> None:
    # Fed the model's input, whose width is a size of the capture: moved, the block's
    # Linear failed, inside torch.export's tracking of module calls, and the capture
    # failed after ("Unexpected key ...linear@2") where one run had split it.
    torch.manual_seed(0)
    model = Stack(ScaledLinear)
    model.embed = nn.Identity()
    seq = pipeline.split(model, (torch.randn(3, 5, 4),))
    x = torch.randn(2, 7, 4)
    torch.testing.assert_close(seq(x), model(x))


class OfTheExample(nn.Module):
    """Runs only on the example's sizes: no second run can tell its sizes apart."""

    def forward(self, x: Tensor) -> Tensor:
        count = int((x > 0).sum())  # the capture's fake run stops here
        if x.shape != (4, 4):
            raise ValueError("only 4 x 4")
        return x * count


def test_sizes_no_second_run_can_tell_apart_are_refused_with_the_examples_figures() -> None:
    model = Stack(OfTheExample)
    model.embed = nn.Identity()
    with pytest.raises(SplitError) as error:
        pipeline.split(model, (torch.randn(4, 4),))
    message = str(error.value)
    assert "its output has a size of 4, which several of its inputs' sizes had" in message
    assert "failed on stand-ins of other sizes (only 4 x 4)" in message
    assert "(none of them 4)" in message


class Counts(nn.Module):
    """Returns as many ones as it has positive inputs, after a branch on that count: an
    output whose shape follows the values."""

    def forward(self, x: Tensor) -> Tensor:
        count = int((x > 0).sum())
        return x.new_ones(count) if count else x.new_zeros(1)


def test_an_output_shaped_by_values_is_refused_at_the_call_that_differs() -> None:
    torch.manual_seed(0)
    model = Stack(Counts)
    model.embed = nn.Identity()
    model.blocks = nn.ModuleList([Counts()])
    seq = pipeline.split(model, (torch.randn(4, 5),))
    ones = torch.ones(4, 5)  # 20 positive entries, as no stand-in of normal values has
    with pytest.raises(RuntimeError, match=r"returned a torch\.float32 tensor of shape") as error:
        seq(ones)
    assert "split learned its output from a run on stand-in values" in str(error.value)
    assert "give it outputs shaped like its inputs" in str(error.value)
