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


def quiet_transformers() -> Any:
    """transformers, its warnings off (the test is skipped where it is not installed)."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    return transformers


def gpt2(**config: Any) -> nn.Module:
    """A tiny GPT-2 (tied head), no dropout unless asked, no cache."""
    transformers = quiet_transformers()
    options = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "use_cache": False}
    settings = transformers.GPT2Config(
        n_layer=3, n_embd=16, n_head=2, vocab_size=VOCAB, n_positions=32, **{**options, **config}
    )
    return transformers.GPT2LMHeadModel(settings).double()


def llama() -> nn.Module:
    """A tiny Llama: rotary tables, grouped-query attention (4 heads, 2 key/value heads)."""
    transformers = quiet_transformers()
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


def t5() -> nn.Module:
    """A tiny T5: an encoder and a decoder of 2 blocks each, relative position biases, tied head."""
    transformers = quiet_transformers()
    settings = transformers.T5Config(
        d_model=16,
        d_kv=8,
        d_ff=32,
        num_layers=2,
        num_heads=2,
        vocab_size=VOCAB,
        dropout_rate=0.0,
        decoder_start_token_id=0,
        use_cache=False,
    )
    return transformers.T5ForConditionalGeneration(settings).double()


def bart() -> nn.Module:
    """A tiny BART: stacks of 2 encoder and 3 decoder layers, of two classes."""
    transformers = quiet_transformers()
    settings = transformers.BartConfig(
        d_model=16,
        encoder_layers=2,
        decoder_layers=3,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=32,
        decoder_ffn_dim=32,
        vocab_size=VOCAB,
        max_position_embeddings=32,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        use_cache=False,
    )
    return transformers.BartForConditionalGeneration(settings).double()


def mixtral(experts: str | None = "eager", dtype: torch.dtype = torch.float64) -> nn.Module:
    """A tiny Mixtral: 2 layers of 4 experts, 2 per token; ``experts`` its implementation.

    ``"eager"`` routes in Python (which experts run depends on the router's values);
    ``None`` leaves transformers' default.
    """
    transformers = quiet_transformers()
    chosen = {} if experts is None else {"experts_implementation": experts}
    settings = transformers.MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=32,
        use_cache=False,
        **chosen,
    )
    return transformers.MixtralForCausalLM(settings).to(dtype)


def qwen2_moe() -> nn.Module:
    """A tiny Qwen2-MoE, eager routing: 4 experts (2 per token) beside a gated shared expert."""
    transformers = quiet_transformers()
    settings = transformers.Qwen2MoeConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        moe_intermediate_size=8,
        shared_expert_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=32,
        use_cache=False,
        experts_implementation="eager",
    )
    return transformers.Qwen2MoeForCausalLM(settings).double()


def deepseek_v3() -> nn.Module:
    """A tiny DeepSeek-V3 shape, eager routing: a dense layer, then a layer of 4 routed experts
    in 2 groups (1 chosen per token), a shared expert, latent attention."""
    transformers = quiet_transformers()
    settings = transformers.DeepseekV3Config(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        moe_intermediate_size=8,
        num_hidden_layers=2,
        first_k_dense_replace=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        kv_lora_rank=8,
        q_lora_rank=8,
        qk_rope_head_dim=4,
        qk_nope_head_dim=4,
        v_head_dim=4,
        max_position_embeddings=32,
        use_cache=False,
        experts_implementation="eager",
    )
    return transformers.DeepseekV3ForCausalLM(settings).double()


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
