"""What split refuses, before any piece exists: the message names the module, the line, the fix."""

from __future__ import annotations

import traceback
from dataclasses import dataclass

import pytest
import torch
from split_models import Block
from torch import Tensor, nn
from torch.utils._pytree import register_dataclass

import pipeline
from pipeline.split import SplitError


class Model(nn.Module):
    """Embed, four blocks, head: what each refused variant changes."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 4)
        self.blocks = nn.ModuleList(Block(4) for _ in range(4))
        self.head = nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


class Branches(Model):
    def forward(self, x: Tensor) -> Tensor:
        h = self.embed(x)
        if h.sum() > 0:
            h = -h
        for block in self.blocks:
            h = block(h)
        return self.head(h)


class Counts(Model):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        return super().forward(x)


class ChangesInput(Model):
    def forward(self, x: Tensor) -> Tensor:
        out = super().forward(x)
        x.mul_(2)
        return out


class ChangesEarlierValue(Model):
    def forward(self, x: Tensor) -> Tensor:
        h = self.embed(x)
        first = h * 1
        for block in self.blocks:
            h = block(h)
        first.add_(1)
        return self.head(h + first)


class ChangingBlock(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x.mul_(2)


def refusal(model: nn.Module, points: list[str] | None = None) -> str:
    with pytest.raises(ValueError) as error:
        pipeline.split(model, (torch.randn(3, 4),), points=points)
    return str(error.value)


def test_a_branch_on_a_tensor_value() -> None:
    message = refusal(Branches())
    assert "the model (Branches)" in message
    assert "test_refusals.py" in message and "`if h.sum() > 0:`" in message
    assert "branches on the value of a tensor" in message
    assert "without looking at tensor contents" in message


class NeedsMask(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(4) for _ in range(2))

    def forward(self, x: Tensor, *, mask: Tensor) -> Tensor:
        for block in self.blocks:
            x = block(x) * mask
        return x


def test_example_arguments_the_forward_cannot_take_are_named_before_tracing() -> None:
    message = refusal(NeedsMask())
    assert message.startswith("NeedsMask.forward cannot be called with the example arguments")
    assert "'mask'" in message and "pipeline.split(model, args, kwargs)" in message
    assert "points" not in message


def test_a_model_on_meta_split_on_a_real_example_is_refused() -> None:
    # The captured code made its tensors where the example was: the materialised
    # pipe failed its first step ("Tensor on device meta is not on the expected device").
    with torch.device("meta"):
        model = Model()
    with pytest.raises(SplitError, match="the model is on the meta device but the example"):
        pipeline.split(model, (torch.randn(2, 4),))
    assert len(pipeline.split(model, (torch.randn(2, 4, device="meta"),))) > 1


@dataclass
class Plain:
    logits: Tensor


@dataclass
class Registered:
    logits: Tensor


register_dataclass(Registered)  # what the refusal of Plain advises


class ReturnsPlain(Model):
    def forward(self, x: Tensor) -> Plain:
        return Plain(super().forward(x))


class ReturnsRegistered(Model):
    def forward(self, x: Tensor) -> Registered:
        return Registered(super().forward(x))


def test_an_output_torch_cannot_take_apart_is_named_with_the_fix() -> None:
    # The advice was torch's failure place (`<string>:1`) and to add a point there.
    message = refusal(ReturnsPlain())
    assert message.startswith("cannot capture ReturnsPlain(...): its output holds Plain")
    assert "register_dataclass(Plain)" in message and "ModelOutput" in message
    assert "points" not in message
    model = ReturnsRegistered()
    x = torch.randn(5, 4)
    out = pipeline.split(model, (torch.randn(3, 4),))(x)
    assert type(out) is Registered
    torch.testing.assert_close(out.logits, model(x).logits)


def test_a_refusal_shows_split_s_frames_only() -> None:
    # torch.export's frames and its exception chain (hundreds of lines) are not the user's.
    with pytest.raises(SplitError) as caught:
        pipeline.split(Branches(), (torch.randn(3, 4),))
    frames = traceback.extract_tb(caught.value.__traceback__)
    assert [f.filename for f in frames if "torch" in f.filename.split("/")] == []
    assert caught.value.__cause__ is None and caught.value.__suppress_context__


def test_a_buffer_changed_in_place() -> None:
    message = refusal(Counts())
    assert "changes buffer 'calls' in place" in message
    assert "`self.calls += 1`" in message and "points" in message


def test_an_argument_changed_in_place() -> None:
    message = refusal(ChangesInput())
    assert "changes its argument 'x' in place" in message and "`x.mul_(2)`" in message


def test_a_value_of_an_earlier_piece_changed_in_place() -> None:
    message = refusal(ChangesEarlierValue())
    assert "changes in place a value that an earlier piece made" in message
    assert "`first.add_(1)`" in message


class ReadsAfterChange(Model):
    def forward(self, x: Tensor) -> Tensor:
        h = self.embed(x)
        out = self.blocks[0](h)
        for block in self.blocks[1:]:
            out = block(out)
        return self.head(out + h)


def test_a_block_that_changes_an_input_read_elsewhere() -> None:
    model = ReadsAfterChange()
    model.blocks[0] = ChangingBlock()
    message = refusal(model, points=["blocks.0", "blocks.2"])
    assert "block blocks.0 (ChangingBlock) changes its input tensor 0 in place" in message
    assert "reads that tensor elsewhere" in message


def test_a_block_may_change_an_input_nothing_else_reads() -> None:
    model = Model()
    model.blocks[2] = ChangingBlock()
    seq = pipeline.split(model, (torch.randn(3, 4),), points=["blocks.1", "blocks.2"])
    x = torch.randn(5, 4)
    torch.testing.assert_close(seq(x), model(x))


def test_hooks_on_captured_modules() -> None:
    model = Model()
    model.embed.register_forward_hook(lambda module, args, out: None)
    message = refusal(model)
    assert "module 'embed' (Linear) has forward hooks" in message and "points" in message


def test_hooks_on_blocks_run() -> None:
    model = Model()
    calls: list[int] = []
    model.blocks[1].register_forward_hook(lambda module, args, out: calls.append(1))
    seq = pipeline.split(model, (torch.randn(3, 4),))
    assert calls == []
    seq(torch.randn(2, 4))
    assert calls == [1]


def test_points_that_are_not_modules() -> None:
    with pytest.raises(ValueError, match=r"'blocks\.7'.*not a module.*did you mean"):
        pipeline.split(Model(), (torch.randn(3, 4),), points=["blocks.7"])
    with pytest.raises(ValueError, match=r"'blocks\.1\.linear' inside 'blocks\.1'"):
        pipeline.split(Model(), (torch.randn(3, 4),), points=["blocks.1", "blocks.1.linear"])
    with pytest.raises(TypeError, match="list of module names"):
        pipeline.split(Model(), (torch.randn(3, 4),), points="blocks.1")  # type: ignore[arg-type]


def test_no_repeated_blocks_asks_for_points() -> None:
    with pytest.raises(ValueError, match=r"no nn\.ModuleList or nn\.Sequential.*points=\[\.\.\.\]"):
        pipeline.split(nn.Linear(4, 4), (torch.randn(3, 4),))


def test_a_point_called_twice() -> None:
    class Twice(Model):
        def forward(self, x: Tensor) -> Tensor:
            return self.head(self.blocks[0](self.blocks[0](self.embed(x))))

    message = refusal(Twice(), points=["blocks.0"])
    assert "module 'blocks.0' is called 2 times" in message


def test_a_point_that_does_not_run() -> None:
    class Skips(Model):
        def forward(self, x: Tensor) -> Tensor:
            return self.head(self.blocks[0](self.embed(x)))

    message = refusal(Skips(), points=["blocks.0", "blocks.3"])
    assert "points ['blocks.3'] did not run" in message


class Settings:
    """A config: an object a module holds, whose attributes the model's code reads."""

    def __init__(self, kind: str | None) -> None:
        self.kind = kind


class SetsItsConfig(nn.Module):
    """Sets ``config.kind`` on its first call, as transformers' classifiers set problem_type."""

    def __init__(self, kind: str | None = None) -> None:
        super().__init__()
        self.config = Settings(kind)
        self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.config.kind is None:
            self.config.kind = "doubled"
        for block in self.blocks:
            x = block(x)
        return x * (2 if self.config.kind == "doubled" else 1)


def test_a_config_the_models_code_changes_during_the_capture_is_refused_and_put_back() -> None:
    model = SetsItsConfig()
    message = refusal(model)
    assert "changed config.kind from None to 'doubled'" in message
    assert "Set it before splitting" in message
    assert model.config.kind is None  # the capture left the model as it was
    model.config.kind = "doubled"  # as the first call would
    seq = pipeline.split(model, (torch.randn(3, 4),))
    x = torch.randn(5, 4)
    torch.testing.assert_close(seq(x), model(x))
