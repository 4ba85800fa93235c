"""Mixture-of-Experts models: routing that depends on tensor values inside a block.

Refused with a message that says why and what works; what it advises is
tested to split equal to the plain model.
"""

from __future__ import annotations

import pytest
import torch
from split_models import VOCAB, assert_same, gradients, lm_loss, tokens, twin
from torch import nn

import pipeline

transformers = pytest.importorskip("transformers")


def mixtral(experts: str | None, dtype: torch.dtype = torch.float64) -> nn.Module:
    transformers.logging.set_verbosity_error()
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


@pytest.mark.parametrize("points", [None, ["model.layers.0.mlp.experts"]])
def test_routing_on_tensor_values_is_refused_with_what_works(points: list[str] | None) -> None:
    ids, _, _ = tokens(2, 6)
    with pytest.raises(ValueError) as error:
        pipeline.split(mixtral("eager"), (ids,), points=points)
    message = str(error.value)
    assert "cannot capture block model.layers.0" in message
    assert "module 'model.layers.0.mlp.experts' (MixtralExperts)" in message
    assert "depends on the values of tensors" in message
    assert "naming a module inside it in points does not help" in message
    assert "experts_implementation='batched_mm'" in message and "'grouped_mm'" in message


# transformers' default ('grouped_mm') takes float32 and bfloat16 only.
@pytest.mark.parametrize(
    ("experts", "dtype"), [("batched_mm", torch.float64), (None, torch.float32)]
)
def test_the_advised_experts_implementations_split_equal_to_plain(
    experts: str | None, dtype: torch.dtype
) -> None:
    model = mixtral(experts, dtype)
    plain = twin(model)
    ids, _, target = tokens(4, 6)
    seq = pipeline.split(model, (ids,))
    assert len(seq) == 4  # before the layers, two layers, after
    out, expected = seq(ids), plain(ids)
    torch.testing.assert_close(out.logits, expected.logits)
    lm_loss(out, target).backward()
    lm_loss(expected, target).backward()
    assert_same(gradients(model), gradients(plain))


def test_the_router_logits_recorded_by_hooks_are_refused() -> None:
    model = mixtral("batched_mm")
    model.config.output_router_logits = True
    ids, _, _ = tokens(2, 6)
    with pytest.raises(ValueError, match="the model's config sets output_router_logits, but"):
        pipeline.split(model, (ids,))
