"""Calling a split model: the sizes it accepts, clear errors, modes, blocks as themselves."""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn.functional as F
from split_models import Block, assert_same, early_late, gradients, twin
from torch import Tensor, nn

import pipeline


class Fixed(nn.Module):
    """Adds a table of 5 positions: the sequence dimension is fixed by the code."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(4) for _ in range(2))
        self.register_buffer("table", torch.randn(5, 4))

    def forward(self, x: Tensor, scale: float = 1.0) -> Tensor:
        h = x + self.table
        for block in self.blocks:
            h = block(h)
        return h * scale


class OneRowDiffers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(4) for _ in range(2))

    def forward(self, x: Tensor) -> Tensor:
        h = x if x.size(0) > 1 else x * 2
        for block in self.blocks:
            h = block(h)
        return h


class TrainsDifferently(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(4) for _ in range(2))

    def forward(self, x: Tensor) -> Tensor:
        h = x * 2 if self.training else x
        for block in self.blocks:
            h = block(h)
        return h


class OwnDropout(nn.Module):
    """Dropout in the model's own forward: it follows the mode of the model's children."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(4) for _ in range(2))

    def forward(self, x: Tensor) -> Tensor:
        h = F.dropout(x, 0.5, self.training)
        for block in self.blocks:
            h = block(h)
        return h


class SizeFirst(nn.Module):
    """Reads its batch size first and its embedding last: past the first piece, each one
    takes the size (an int) as its first argument and the embedding comes as a skip."""

    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(width, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(3))
        self.head = nn.Linear(2 * width, 3)

    def forward(self, x: Tensor) -> Tensor:
        rows = x.size(0)
        embedded = self.embed(x)
        h = embedded
        for block in self.blocks:
            h = block(h)
        return self.head(torch.cat([h, embedded], dim=-1)).reshape(rows, -1)


class TwoInputs(nn.Module):
    """Takes two positional tensors and a keyword mask."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.blocks = nn.ModuleList(Block(4) for _ in range(2))

    def forward(self, a: Tensor, b: Tensor, mask: Tensor | None = None) -> Tensor:
        h = self.a(a) + self.b(b)
        if mask is not None:
            h = h * mask[:, None]
        for block in self.blocks:
            h = block(h)
        return h


def test_free_sizes_vary_and_fixed_ones_are_checked() -> None:
    model = Fixed()
    seq = pipeline.split(model, (torch.randn(3, 5, 4),), {"scale": 2.0})
    x = torch.randn(7, 5, 4)
    torch.testing.assert_close(seq(x, scale=2.0), model(x, scale=2.0))
    with pytest.raises(ValueError, match=r"x dim 1 is 6, but the model's code fixes it to 5"):
        seq(torch.randn(3, 6, 4), scale=2.0)
    with pytest.raises(ValueError, match=r"scale is 3\.0, but the model was split with 2\.0"):
        seq(x, scale=3.0)
    with pytest.raises(TypeError, match=r"x is torch\.float64, but the model was split on"):
        seq(x.double(), scale=2.0)
    with pytest.raises(
        TypeError, match=r"takes 1 positional argument\(s\) and keyword\(s\) \['scale'\]"
    ):
        seq(x)


class Options(nn.Module):
    """Takes flags in **kwargs, as transformers' models take return_dict."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(4) for _ in range(2))

    def forward(self, x: Tensor, **options: bool) -> Tensor | tuple[Tensor, Tensor]:
        h = x
        for block in self.blocks:
            h = block(h)
        return (h, x) if options.get("both") else h


def test_flags_in_keyword_arguments() -> None:
    model = Options()
    seq = pipeline.split(model, (torch.randn(3, 4),), {"both": True})
    x = torch.randn(5, 4)
    out = seq(x, both=True)
    assert isinstance(out, tuple)
    torch.testing.assert_close(out, model(x, both=True))
    with pytest.raises(ValueError, match=r"both is False, but the model was split with True"):
        seq(x, both=False)


def test_a_size_of_one_that_takes_another_path_is_refused_at_call_time() -> None:
    model = OneRowDiffers()
    seq = pipeline.split(model, (torch.randn(3, 4),))
    x = torch.randn(2, 4)
    torch.testing.assert_close(seq(x), model(x))
    with pytest.raises(ValueError, match=r"x dim 0 is 1; .*another path for a size of 1"):
        seq(torch.randn(1, 4))


def test_code_that_differs_between_modes_keeps_the_captured_mode() -> None:
    model = TrainsDifferently().train()
    seq = pipeline.split(model, (torch.randn(3, 4),))
    x = torch.randn(2, 4)
    torch.testing.assert_close(seq(x), model(x))
    seq.eval()
    with pytest.raises(RuntimeError, match=r"split in training mode.*split the model again"):
        seq(x)


def test_dropout_of_the_model_itself_follows_the_split_models_mode() -> None:
    model = OwnDropout().train()
    seq = pipeline.split(model, (torch.randn(3, 4),))
    x = torch.randn(6, 4)
    seq.eval()
    torch.testing.assert_close(seq(x), model.eval()(x))
    seq.train()
    assert not torch.equal(seq(x), seq(x))


def test_blocks_run_as_themselves() -> None:
    model = early_late()
    block = model.blocks[1]
    calls: list[str] = []
    eager = block._call_impl

    def compiled(*args: object, **kwargs: object) -> object:
        calls.append("compiled")
        return eager(*args, **kwargs)

    block._compiled_call_impl = compiled  # what Module.compile() sets
    seq = pipeline.split(model, (torch.randn(3, 8, dtype=torch.float64),))
    assert calls == [] and block._compiled_call_impl is compiled
    seq(torch.randn(2, 8, dtype=torch.float64))
    assert calls == ["compiled"]
    assert seq[2].blocks == [("blocks.1", block)]
    assert {name for name, _ in seq[2].named_parameters()} == {
        "blocks.1.norm.weight",
        "blocks.1.norm.bias",
        "blocks.1.linear.weight",
        "blocks.1.linear.bias",
    }


def test_a_piece_moves_what_it_uses_and_nothing_else() -> None:
    model = early_late()
    seq = pipeline.split(model, (torch.randn(3, 8, dtype=torch.float64),))
    seq[2].to(torch.float32)
    assert model.blocks[1].linear.weight.dtype == torch.float32
    assert model.blocks[0].linear.weight.dtype == torch.float64
    assert model.head.weight.dtype == torch.float64


def test_the_pieces_are_fixed() -> None:
    seq = pipeline.split(early_late(), (torch.randn(3, 8, dtype=torch.float64),))
    with pytest.raises(TypeError, match="pieces of a split model are fixed"):
        seq.append(nn.Linear(2, 2))
    with pytest.raises(TypeError, match="split model takes the 1 values that piece 1 returns"):
        seq[2](torch.ones(1), torch.ones(1))


def test_a_dtype_changed_after_the_split_is_refused() -> None:
    model = early_late()
    seq = pipeline.split(model, (torch.randn(3, 8, dtype=torch.float64),))
    seq.float()
    with pytest.raises(RuntimeError, match=r"split the model again after changing dtypes"):
        seq(torch.randn(2, 8, dtype=torch.float64))


def test_a_copy_runs_on_its_own_modules() -> None:
    model = early_late()
    seq = pipeline.split(model, (torch.randn(3, 8, dtype=torch.float64),))
    twin = copy.deepcopy(seq)
    with torch.no_grad():
        twin.head.bias.add_(1)
    x = torch.randn(2, 8, dtype=torch.float64)
    torch.testing.assert_close(twin(x), seq(x) + 1)


def test_a_saved_split_model_loads_and_runs_on_its_own_modules() -> None:
    model = early_late()
    seq = pipeline.split(model, (torch.randn(3, 8, dtype=torch.float64),))
    saved = io.BytesIO()
    torch.save(seq, saved)  # its steps keep torch ops by name
    saved.seek(0)
    loaded = torch.load(saved, weights_only=False)
    x = torch.randn(2, 8, dtype=torch.float64)
    torch.testing.assert_close(loaded(x), seq(x))
    with torch.no_grad():
        loaded.head.bias.add_(1)
    torch.testing.assert_close(loaded(x), seq(x) + 1)


def test_a_positional_pipe_carries_a_skip_past_a_size_given_first() -> None:
    # With call_style="positional" a piece takes the previous one's tuple spread into its
    # arguments, the size first: the skip's carrier was looked for in that int alone.
    torch.manual_seed(0)
    model = SizeFirst().double()
    plain = twin(model)
    x = torch.randn(6, 5, 4, dtype=torch.float64)
    seq = pipeline.split(model, (x[:2],))
    pipe = pipeline.Pipe(seq, [2, 1, 2], chunks=2, call_style="positional")
    assert any(route.crosses_partitions for route in pipe.skip_layout.routes())
    out = pipe(x)
    expected = plain(x)
    torch.testing.assert_close(out, expected)
    out.sum().backward()
    expected.sum().backward()
    assert_same(gradients(model), gradients(plain))


def test_one_tuple_of_the_positional_arguments_takes_keywords_too() -> None:
    torch.manual_seed(0)
    model = TwoInputs().double()
    a, b = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 4, dtype=torch.float64)
    mask = torch.rand(8, dtype=torch.float64)
    seq = pipeline.split(model, (a[:2], b[:2]), {"mask": mask[:2]})
    expected = model(a, b, mask=mask)
    pipe = pipeline.Pipe(seq, [2, 1], chunks=4)  # the "tuple" call style
    torch.testing.assert_close(pipe((a, b), mask=mask), expected)
    torch.testing.assert_close(pipe.evaluate((a, b), kwargs={"mask": mask}), expected)
    torch.testing.assert_close(seq((a, b), mask=mask), expected)
    with pytest.raises(TypeError, match=r"a tuple of 3 values, which does not fit"):
        seq((a, b, a), mask=mask)
