"""What a pipe holding some pieces of a split model keeps: the model's names of what they use."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from split_models import Block
from torch import Tensor, nn

import pipeline
from pipeline.runtime.layers import Part, register_names


class RootDropout(nn.Module):
    """The model's own forward reads its mode (a functional dropout between its children)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 8)
        self.blocks = nn.ModuleList(Block(8) for _ in range(3))
        self.head = nn.Linear(8, 2)

    def forward(self, x: Tensor) -> Tensor:
        h = F.dropout(self.embed(x), 0.5, self.training)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def held(seq: nn.Sequential, layers: list[str]) -> nn.Module:
    owner = nn.Module()
    register_names(owner, seq, layers)
    return owner


def test_the_names_of_what_the_held_pieces_use_in_the_models_order() -> None:
    model = RootDropout()
    seq = pipeline.split(model, (torch.randn(4, 8),))
    first, last = held(seq, ["0", "1"]), held(seq, ["2", "3", "4"])
    assert list(first.state_dict()) == [*model.state_dict()][:6]
    assert list(last.state_dict()) == [*model.state_dict()][6:]
    # Held whole where every tensor is used; a Part of a module used in part.
    assert first.embed is model.embed and first.get_submodule("blocks.0") is model.blocks[0]
    assert isinstance(first.blocks, Part) and list(first.blocks._modules) == ["0"]
    assert isinstance(last.blocks, Part) and list(last.blocks._modules) == ["1", "2"]


def test_the_modes_the_held_pieces_read_follow_the_pipe() -> None:
    model = RootDropout()
    seq = pipeline.split(model, (torch.randn(4, 8),))
    first = held(seq, ["0"])
    # Piece 0 runs the model's dropout, whose mode is the model's: its children's.
    assert {id(m) for m in seq[0].modes_read()} >= {id(model.embed), id(model.head)}
    assert isinstance(first.head, Part) and not list(first.head.parameters())
    x = torch.randn(5, 8)
    first.eval()
    assert not any(m.training for m in model.children())
    torch.testing.assert_close(seq[0](x)[0], model.embed(x))
    first.train()
    assert all(m.training for m in model.children())
    assert not torch.equal(seq[0](x)[0], model.embed(x))
