"""Outputs that mix the rows of the batch: computed per micro-batch, and the way out.

A pipe runs each micro-batch on its own, so CLIP's similarity of every image
against every text covers one micro-batch's rows (docs/split.md, "Outputs
that mix the rows of the batch"). Computed after the pipe on the embeddings,
which are row by row, the similarities, the contrastive loss and every
gradient are the plain model's.
"""

from __future__ import annotations

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


def test_similarities_computed_after_the_pipe_are_the_models() -> None:
    model = clip()
    plain = twin(model)
    ids, pixels = batch()
    seq = pipeline.split(model, (ids[:2], pixels[:2]))
    pipe = pipeline.Pipe(seq, [2, 2, 1, 1], chunks=CHUNKS)
    out = pipe((ids, pixels))
    # What the documentation warns of: each micro-batch's images against its own texts.
    assert out.logits_per_image.shape == (ROWS, ROWS // CHUNKS)
    logits = model.logit_scale.exp() * out.image_embeds @ out.text_embeds.T
    loss = contrastive(logits)
    loss.backward()
    expected = plain(ids, pixels, return_loss=True)
    expected.loss.backward()
    torch.testing.assert_close(logits, expected.logits_per_image)
    torch.testing.assert_close(loss, expected.loss)
    assert_same(gradients(model), gradients(plain))
