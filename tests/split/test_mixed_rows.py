"""Outputs that mix the rows of the batch: refused over several micro-batches, and the way out.

A pipe runs each micro-batch on its own, so CLIP's similarity of every image
against every text would cover one micro-batch's rows (docs/split.md,
"Outputs that mix the rows of the batch"): refused before any work. Computed
after the pipe on the embeddings, which are row by row, the similarities, the
contrastive loss and every gradient are the plain model's.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from split_models import assert_same, gradients, quiet_transformers, twin
from torch import Tensor, nn

import pipeline

ROWS, CHUNKS = 8, 4


def clip() -> nn.Module:
    transformers = quiet_transformers()
    torch.manual_seed(0)
    common = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2}
    text = {**common, "vocab_size": 50, "num_attention_heads": 2, "max_position_embeddings": 16}
    vision = {**common, "num_attention_heads": 2, "image_size": 8, "patch_size": 4}
    config = transformers.CLIPConfig(text_config=text, vision_config=vision, projection_dim=8)
    return transformers.CLIPModel(config).double()


def batch() -> tuple[Tensor, Tensor]:
    torch.manual_seed(1)
    return torch.randint(0, 50, (ROWS, 6)), torch.randn(ROWS, 3, 8, 8, dtype=torch.float64)


def contrastive(logits: Tensor) -> Tensor:
    """CLIP's loss: each image against every text of the batch, and the other way."""
    pairs = torch.arange(len(logits))
    return (F.cross_entropy(logits, pairs) + F.cross_entropy(logits.T, pairs)) / 2


class Embeddings(nn.Module):
    """CLIP's embeddings alone: row by row."""

    def __init__(self, clip: nn.Module) -> None:
        super().__init__()
        self.clip = clip

    def forward(self, ids: Tensor, pixels: Tensor) -> tuple[Tensor, Tensor]:
        out = self.clip(ids, pixels)
        return out.image_embeds, out.text_embeds


@pytest.mark.parametrize("call", ["pipe(x)", "evaluate", "step"])
def test_outputs_mixing_rows_are_refused_over_several_micro_batches(call: str) -> None:
    # Gathered along dim 0: logits_per_image of shape (8, 2) where the plain model gives
    # (8, 8), each micro-batch's images against its own texts alone, silently.
    model = clip()
    ids, pixels = batch()
    seq = pipeline.split(model, (ids[:2], pixels[:2]))
    assert seq.rows_across == ("['logits_per_image']", "['logits_per_text']")
    pipe = pipeline.Pipe(seq, [2, 2, 1, 1], chunks=CHUNKS)
    refused = r"outputs at \['logits_per_image'\], \['logits_per_text'\] hold the batch's size"
    with pytest.raises(ValueError, match=refused):
        if call == "pipe(x)":
            pipe((ids, pixels))
        elif call == "evaluate":
            pipe.evaluate((ids, pixels))
        else:
            pipe.step(
                (ids, pixels), ids, lambda out, _: out.logits_per_image.sum(), return_outputs=True
            )
    assert all(p.grad is None for p in model.parameters())
    # One micro-batch: the model's own outputs.
    pipe.chunks = 1
    torch.testing.assert_close(
        pipe((ids, pixels)).logits_per_image, twin(model)(ids, pixels).logits_per_image
    )


def test_similarities_computed_after_the_pipe_are_the_models() -> None:
    model = clip()
    plain = twin(model)
    ids, pixels = batch()
    seq = pipeline.split(Embeddings(model), (ids[:2], pixels[:2]))
    assert seq.rows_across == ()
    pipe = pipeline.Pipe(seq, [2, 2, 1, 1], chunks=CHUNKS)
    image, text = pipe((ids, pixels))
    logits = model.logit_scale.exp() * image @ text.T
    loss = contrastive(logits)
    loss.backward()
    expected = plain(ids, pixels, return_loss=True)
    expected.loss.backward()
    torch.testing.assert_close(logits, expected.logits_per_image)
    torch.testing.assert_close(loss, expected.loss)
    assert_same(gradients(model), gradients(plain))
