"""The GPT of ``examples/gpt.py`` written as an ordinary module, for ``pipeline.split``.

``gpt.build_model`` writes the model as the ``nn.Sequential`` a ``Pipe``
partitions; ``GPT`` here is the same model as one writes it without a
pipeline: its blocks in an ``nn.ModuleList`` and a ``forward`` that loops
over them. Its layers are built in the same order from the same classes, so
one seed gives both the same weights, and ``pipeline.split(GPT(...), (x,))``
gives the pipeline's ``nn.Sequential`` (the embedding, each block, the head).

    model = GPT(vocab, width=64, heads=4, layers=4, context=64, dropout=0.1)
    seq = pipeline.split(model, (tokens,))
"""

from __future__ import annotations

import argparse

from gpt import Block, Embed, Head
from torch import Tensor, nn


class GPT(nn.Module):
    """Token and position embedding, pre-norm blocks, a head tied to the token embedding."""

    def __init__(
        self, vocab: int, width: int, heads: int, layers: int, context: int, dropout: float
    ) -> None:
        super().__init__()
        self.embed = Embed(vocab, width, context, dropout)
        self.blocks = nn.ModuleList(Block(width, heads, dropout) for _ in range(layers))
        self.head = Head(self.embed.token, width)

    def forward(self, tokens: Tensor) -> Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def build_gpt(vocab: int, args: argparse.Namespace) -> GPT:
    """``GPT`` from the arguments of ``gpt.add_model_arguments`` (``gpt.build_model``'s twin)."""
    return GPT(vocab, args.width, args.heads, args.layers, args.context, args.dropout)
