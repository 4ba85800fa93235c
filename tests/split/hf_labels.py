"""Labels for transformers' own loss: uneven ``-100``s, the count, the recipe's keywords.

Shared by ``test_hf_loss.py`` and the multi-process scenarios of
``tests/distributed/split_scenarios.py``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

import pipeline
from tests.split.split_models import VOCAB

ROWS, LENGTH, CHUNKS = 6, 8, 3


def batch(seed: int, rows: int = ROWS) -> tuple[Tensor, Tensor, Tensor]:
    """Token ids, a mask, and labels whose rows ignore different numbers of tokens."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (rows, LENGTH), generator=generator)
    labels = ids.clone()
    ignored = torch.randint(0, LENGTH - 1, (rows,), generator=generator)
    for row, length in enumerate(ignored.tolist()):
        labels[row, :length] = -100  # a prompt of its own length per row
    return ids, torch.ones(rows, LENGTH, dtype=torch.long), labels


def count(labels: Tensor) -> Tensor:
    """The tokens GPT-2's causal loss counts: the labels shifted by one, not -100."""
    return (labels[..., 1:] != -100).sum()


def per_micro_batch(labels: Tensor) -> list[int]:
    return [int(count(part)) for part in labels.chunk(CHUNKS)]


def out_loss(output: Any, target: Tensor) -> Tensor:
    """transformers' own loss, as most of its users train."""
    return output.loss


def recipe(mask: Tensor, labels: Tensor, n: Tensor | None = None) -> dict[str, Any]:
    """A step's keywords: the batch's count ``n`` (by default ``count(labels)``), shared."""
    n = count(labels) if n is None else n
    return {"attention_mask": mask, "labels": labels, "num_items_in_batch": pipeline.NoChunk(n)}


def split_counted(model: nn.Module, dtype: torch.dtype = torch.long) -> nn.Sequential:
    """GPT-2 split with num_items_in_batch, a 0-dim tensor of ``dtype``, among its keywords."""
    ids, mask, labels = batch(0)
    example = {"attention_mask": mask, "labels": labels, "num_items_in_batch": count(labels)}
    example["num_items_in_batch"] = example["num_items_in_batch"].to(dtype)
    return pipeline.split(model, (ids,), example)


def plain_loss(plain: nn.Module, ids: Tensor, mask: Tensor, labels: Tensor) -> Tensor:
    """The plain model's own loss over the whole batch, back-propagated."""
    loss = plain(ids, attention_mask=mask, labels=labels).loss
    loss.backward()
    return loss.detach()
