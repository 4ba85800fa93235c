"""Models for the split tests: tiny transformers configs, a model with early values used late."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

VOCAB = 50


class Block(nn.Module):
    """A residual MLP block."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.linear = nn.Linear(width, width)

    def forward(self, x: Tensor) -> Tensor:
        return x + torch.tanh(self.linear(self.norm(x)))


class EarlyLate(nn.Module):
    """Values made early and used only at the end: the embedding and the first block's output.

    The head also reads a parameter and a buffer of the model itself.
    """

    def __init__(self, width: int = 8, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(width, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(3 * width, 3)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 3 * width))
        self.register_buffer("shift", torch.linspace(-1.0, 1.0, 3))

    def forward(self, x: Tensor) -> Tensor:
        embedded = self.embed(x)
        h = self.blocks[0](embedded)
        early = h * 2
        for block in self.blocks[1:]:
            h = block(h)
        return self.head(torch.cat([h, early, embedded], dim=-1) * self.scale) + self.shift


def early_late() -> EarlyLate:
    return EarlyLate().double()


def gpt2(**config: Any) -> nn.Module:
    """A tiny GPT-2 (tied head), no dropout unless asked, no cache."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    options = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "use_cache": False}
    settings = transformers.GPT2Config(
        n_layer=3, n_embd=16, n_head=2, vocab_size=VOCAB, n_positions=32, **{**options, **config}
    )
    return transformers.GPT2LMHeadModel(settings).double()


def llama() -> nn.Module:
    """A tiny Llama: rotary tables, grouped-query attention (4 heads, 2 key/value heads)."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    settings = transformers.LlamaConfig(
        num_hidden_layers=3,
        hidden_size=16,
        intermediate_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=32,
        use_cache=False,
    )
    return transformers.LlamaForCausalLM(settings).double()


def tokens(batch: int, length: int, padded: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """Token ids, an attention mask with ``padded`` left-padded positions in row 0, targets."""
    ids = torch.randint(0, VOCAB, (batch, length))
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[0, :padded] = 0
    return ids, mask, torch.randint(0, VOCAB, (batch, length))


def lm_loss(output: Any, target: Tensor) -> Tensor:
    return F.cross_entropy(output.logits.flatten(0, 1), target.flatten())


def twin(model: nn.Module) -> nn.Module:
    """An independent copy to run as the plain model."""
    return copy.deepcopy(model)


def gradients(model: nn.Module) -> dict[str, Tensor]:
    """Every parameter's gradient by name (tied ones once, under their first name)."""
    found = {}
    for name, parameter in model.named_parameters():
        assert parameter.grad is not None, f"{name} got no gradient"
        found[name] = parameter.grad.clone()
    return found


def assert_same(actual: dict[str, Tensor], expected: dict[str, Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(actual[name], value, msg=name)


def backward_of(run: Callable[[], Tensor]) -> Tensor:
    loss = run()
    loss.backward()
    return loss.detach()
