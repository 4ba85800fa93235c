"""transformers' own loss (``out.loss`` of GPT-2 given ``labels=``) under micro-batching.

Labels with unevenly ignored tokens (``-100``): with ``num_items_in_batch``
(the recipe of docs/split.md) every schedule and ``evaluate`` give the
plain model's loss and gradients; without it, a row-weighted ``out.loss``
is refused before any work, with the recipe.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from split_models import VOCAB, assert_same, gpt2, gradients, twin
from torch import Tensor, nn

import pipeline
from pipeline import Pipe

transformers = pytest.importorskip("transformers")

ROWS, LENGTH, CHUNKS = 6, 8, 3
BALANCE = [2, 3]  # five pieces: the embeddings, three blocks, the head


def batch(seed: int) -> tuple[Tensor, Tensor, Tensor]:
    """Token ids, a mask, and labels whose rows ignore different numbers of tokens."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (ROWS, LENGTH), generator=generator)
    labels = ids.clone()
    ignored = torch.randint(0, LENGTH - 1, (ROWS,), generator=generator)
    for row, length in enumerate(ignored.tolist()):
        labels[row, :length] = -100  # a prompt of its own length per row
    return ids, torch.ones(ROWS, LENGTH, dtype=torch.long), labels


def count(labels: Tensor) -> Tensor:
    """The tokens GPT-2's causal loss counts: the labels shifted by one, not -100."""
    return (labels[..., 1:] != -100).sum()


def per_micro_batch(labels: Tensor) -> list[int]:
    return [int(count(part)) for part in labels.chunk(CHUNKS)]


def out_loss(output: Any, target: Tensor) -> Tensor:
    return output.loss


def recipe(mask: Tensor, labels: Tensor) -> dict[str, Any]:
    """The step's keywords: the batch's count, shared by every micro-batch."""
    return {
        "attention_mask": mask,
        "labels": labels,
        "num_items_in_batch": pipeline.NoChunk(count(labels)),
    }


@pytest.fixture(scope="module")
def counted() -> tuple[nn.Module, nn.Sequential]:
    """GPT-2 split with num_items_in_batch, a 0-dim tensor, among its keywords."""
    model = gpt2()
    ids, mask, labels = batch(0)
    example = {"attention_mask": mask, "labels": labels, "num_items_in_batch": count(labels)}
    return model, pipeline.split(model, (ids,), example)


@pytest.fixture(scope="module")
def uncounted() -> tuple[nn.Module, nn.Sequential]:
    """GPT-2 split with labels but no num_items_in_batch: out.loss is a mean per call."""
    model = gpt2()
    ids, mask, labels = batch(0)
    return model, pipeline.split(model, (ids,), {"attention_mask": mask, "labels": labels})


@contextmanager
def pipe_of(model: nn.Module, seq: nn.Sequential) -> Iterator[Pipe]:
    model.zero_grad(set_to_none=True)
    pipe = Pipe(seq, BALANCE, chunks=CHUNKS)
    try:
        yield pipe
    finally:
        pipe.close()


def plain_loss(plain: nn.Module, ids: Tensor, mask: Tensor, labels: Tensor) -> Tensor:
    """The plain model's own loss over the whole batch, back-propagated."""
    loss = plain(ids, attention_mask=mask, labels=labels).loss
    loss.backward()
    return loss.detach()


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_the_recipe_gives_the_plain_models_loss_and_gradients(
    counted: tuple[nn.Module, nn.Sequential], schedule: str
) -> None:
    model, seq = counted
    plain = twin(model)
    with pipe_of(model, seq) as pipe:
        # Two batches of different counts: the count is an input of each step.
        for seed in (1, 2):
            ids, mask, labels = batch(seed)
            counts = per_micro_batch(labels)
            assert len(set(counts)) > 1, "the micro-batches must hold different counts"
            model.zero_grad()
            plain.zero_grad()
            loss = pipe.step(
                ids,
                labels,
                out_loss,
                kwargs=recipe(mask, labels),
                schedule=schedule,
                loss_reduction="sum",
            )
            expected = plain_loss(plain, ids, mask, labels)
            torch.testing.assert_close(loss, expected, msg=f"batch {seed}, counts {counts}")
            assert_same(gradients(model), gradients(plain))


def test_the_recipe_evaluates_the_plain_models_loss(
    counted: tuple[nn.Module, nn.Sequential],
) -> None:
    model, seq = counted
    ids, mask, labels = batch(3)
    with pipe_of(model, seq) as pipe:
        loss = pipe.evaluate(
            ids, labels, out_loss, kwargs=recipe(mask, labels), loss_reduction="sum"
        )
    with torch.no_grad():
        expected = model(ids, attention_mask=mask, labels=labels).loss
    torch.testing.assert_close(loss, expected)


def test_the_count_with_a_row_weighing_is_refused(
    counted: tuple[nn.Module, nn.Sequential],
) -> None:
    model, seq = counted
    ids, mask, labels = batch(1)
    with pipe_of(model, seq) as pipe, pytest.raises(ValueError, match="loss_reduction='sum'"):
        pipe.step(ids, labels, out_loss, kwargs=recipe(mask, labels))
    assert all(p.grad is None for p in model.parameters()), "refused before any work"


@pytest.mark.parametrize("options", [{}, {"loss_reduction": "sum"}])
def test_out_loss_without_the_count_is_refused_with_the_recipe(
    uncounted: tuple[nn.Module, nn.Sequential], options: dict[str, Any]
) -> None:
    model, seq = uncounted
    ids, mask, labels = batch(1)
    kwargs = {"attention_mask": mask, "labels": labels}
    with pipe_of(model, seq) as pipe:
        with pytest.raises(ValueError) as refused:
            pipe.step(ids, labels, out_loss, kwargs=kwargs, **options)
        with pytest.raises(ValueError, match="num_items_in_batch"):
            pipe.evaluate(ids, labels, out_loss, kwargs=kwargs, **options)
    message = str(refused.value)
    for part in (
        str(per_micro_batch(labels)),  # what is uneven
        "num_items_in_batch",
        "pipeline.NoChunk(n)",
        "(labels[..., 1:] != -100).sum()",
        "loss_reduction='sum'",
        "do not pass labels",
    ):
        assert part in message, part
    assert all(p.grad is None for p in model.parameters()), "refused before any work"


def test_labels_even_once_shifted_are_weighed_by_rows(
    uncounted: tuple[nn.Module, nn.Sequential],
) -> None:
    # Row 0 ignores its first label, which the causal loss never counts: the
    # micro-batches' counts are in proportion to their rows, and the mean is exact.
    model, seq = uncounted
    plain = twin(model)
    ids, mask, _ = batch(4)
    labels = ids.clone()
    labels[0, 0] = -100
    assert len(set(per_micro_batch(labels))) == 1
    kwargs = {"attention_mask": mask, "labels": labels}
    with pipe_of(model, seq) as pipe:
        loss = pipe.step(ids, labels, out_loss, kwargs=kwargs)
    torch.testing.assert_close(loss, plain_loss(plain, ids, mask, labels))
    assert_same(gradients(model), gradients(plain))
