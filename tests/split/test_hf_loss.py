"""transformers' own loss (``out.loss`` of GPT-2 given ``labels=``) under micro-batching.

Labels with unevenly ignored tokens (``-100``): with ``num_items_in_batch``
(the recipe of docs/split.md) every schedule and ``evaluate`` give the
plain model's loss and gradients; without it, a row-weighted ``out.loss``
is refused before any work, with the recipe.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch
from hf_labels import (
    CHUNKS,
    batch,
    count,
    out_loss,
    per_micro_batch,
    plain_loss,
    recipe,
    split_counted,
)
from split_models import VOCAB, assert_same, gpt2, gradients, t5, twin
from torch import nn

import pipeline
from pipeline import Pipe

if TYPE_CHECKING:
    from tests.gloo_groups import GroupRunner, Outcomes

transformers = pytest.importorskip("transformers")

BALANCE = [2, 3]  # five pieces: the embeddings, three blocks, the head
SCENARIOS = Path(__file__).parents[1] / "distributed" / "split_scenarios.py"
ACROSS_PROCESSES = [
    "split_gpt2_own_loss_with_the_count_across_processes",
    "split_gpt2_own_loss_in_data_parallel_is_the_mean_over_every_token",
]


@pytest.fixture(scope="module")
def counted() -> tuple[nn.Module, nn.Sequential]:
    """GPT-2 split with num_items_in_batch, a 0-dim tensor, among its keywords."""
    model = gpt2()
    return model, split_counted(model)


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


def test_labels_reach_a_stage_whose_gradients_are_held(
    counted: tuple[nn.Module, nn.Sequential],
) -> None:
    # The labels, an integer skip into the last stage, need no gradient: a
    # backward that computes its targets' gradients (a hook held back) skips them.
    model, seq = counted
    plain = twin(model)
    ids, mask, labels = batch(5)
    calls = []
    handle = model.transformer.ln_f.weight.register_hook(lambda grad: calls.append(grad))
    try:
        with pipe_of(model, seq) as pipe:
            loss = pipe.step(
                ids, labels, out_loss, kwargs=recipe(mask, labels), loss_reduction="sum"
            )
    finally:
        handle.remove()
    torch.testing.assert_close(loss, plain_loss(plain, ids, mask, labels))
    assert_same(gradients(model), gradients(plain))
    assert len(calls) == 1, "the hook sees the step's whole gradient once"


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


def test_a_count_given_as_a_number_is_refused() -> None:
    # A number is a constant of the captured code: right for one batch only.
    model = gpt2()
    ids, _, labels = batch(0)
    seq = pipeline.split(
        model, (ids,), {"labels": labels, "num_items_in_batch": int(count(labels))}
    )
    ids, _, labels = batch(1)  # the next batch, with another count
    kwargs = {"labels": labels, "num_items_in_batch": int(count(labels))}
    with pipe_of(model, seq) as pipe, pytest.raises(TypeError) as refused:
        pipe.step(ids, labels, out_loss, kwargs=kwargs, loss_reduction="sum")
    assert "0-dim tensor" in str(refused.value)
    assert "pipeline.NoChunk(n)" in str(refused.value)
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


@pytest.fixture(scope="module")
def two_processes(group_runner: GroupRunner) -> Outcomes:
    # Each process splits GPT-2 before its first collective: a generous timeout.
    return group_runner(
        ACROSS_PROCESSES, script=SCENARIOS, world_size=2, pg_timeout_s=120, wall_timeout_s=300
    )


@pytest.mark.parametrize("name", ACROSS_PROCESSES)
def test_the_recipe_across_processes(two_processes: Outcomes, name: str) -> None:
    """A DistributedPipe of two processes, and DataParallel of two replicas' Pipes."""
    for rank, outcomes in enumerate(two_processes):
        assert outcomes.get(name) == "ok", f"rank {rank}:\n{outcomes.get(name)}"


def test_a_count_that_a_model_computing_its_own_loss_ignores_is_refused() -> None:
    # T5's forward computes its own mean CrossEntropyLoss (its loss_function goes unused):
    # the recipe's sum of out.loss would be chunks times its loss, silently.
    model = t5()
    torch.manual_seed(0)
    ids, labels = torch.randint(1, VOCAB, (6, 8)), torch.randint(1, VOCAB, (6, 8))
    n = (labels != -100).sum()
    seq = pipeline.split(model, (ids,), {"labels": labels, "num_items_in_batch": n})
    assert seq.loss_name is None
    pipe = Pipe(seq, [3, 3], chunks=3)
    kwargs = {"labels": labels, "num_items_in_batch": pipeline.NoChunk(n)}
    with pytest.raises(ValueError, match="this model ignores it"):
        pipe.step(ids, labels, out_loss, kwargs=kwargs, loss_reduction="sum")
    assert all(p.grad is None for p in model.parameters())
    pipe.close()


def llama_heads(kind: str) -> nn.Module:
    """A tiny Llama for token or sequence classification: 3 labels, padding token 0."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=16, intermediate_size=32, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=32, use_cache=False,
        num_labels=3, pad_token_id=0,
    )  # fmt: skip
    head = {"token": transformers.LlamaForTokenClassification}
    head["sequence"] = transformers.LlamaForSequenceClassification
    return head[kind](config).double()


@pytest.mark.parametrize("kind", ["token", "sequence"])
def test_a_loss_of_labels_not_ignored_that_takes_no_count_is_checked_and_its_count_refused(
    kind: str,
) -> None:
    # Llama's classification heads call their loss_function without the keyword
    # arguments: a count never reaches it (the recipe gave twice the loss), and the
    # mean is over each micro-batch's labels not ignored (-100), weighed wrongly by rows.
    model = llama_heads(kind)
    model.config.problem_type = "single_label_classification"  # as its first call sets it
    torch.manual_seed(0)
    ids = torch.randint(1, VOCAB, (8, 6))
    labels = torch.randint(0, 3, (8, 6) if kind == "token" else (8,))
    labels[:3] = -100  # the first micro-batch's labels mostly ignored
    if kind == "token":  # the sequence's loss_function is called alike (a split less)
        n = (labels != -100).sum()
        seq = pipeline.split(model, (ids,), {"labels": labels, "num_items_in_batch": n})
        assert not seq.loss_takes_count
        pipe = Pipe(seq, [2, 2], chunks=2)
        counted = {"labels": labels, "num_items_in_batch": pipeline.NoChunk(n)}
        with pytest.raises(ValueError, match="this model ignores it"):
            pipe.step(ids, labels, out_loss, kwargs=counted, loss_reduction="sum")
        pipe.close()
    pipe = Pipe(pipeline.split(model, (ids,), {"labels": labels}), [2, 2], chunks=2)
    held = r"hold \[(6, 24|1, 4)\] of them.*from the output's logits"
    with pytest.raises(ValueError, match=held):
        pipe.step(ids, labels, out_loss, kwargs={"labels": labels})
    assert all(p.grad is None for p in model.parameters())
    pipe.close()


def _masked_loss_models() -> dict[str, Any]:
    common = {"vocab_size": VOCAB, "hidden_size": 16, "intermediate_size": 32,
              "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 32,
              "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}  # fmt: skip
    return {
        # A BCE over the tokens the attention mask keeps.
        "electra pretraining": lambda: transformers.ElectraForPreTraining(
            transformers.ElectraConfig(embedding_size=8, **common)
        ),
        # torch.where(attention_mask, labels, -100), then a cross-entropy.
        "biogpt token classification": lambda: transformers.BioGptForTokenClassification(
            transformers.BioGptConfig(num_labels=3, use_cache=False, **common)
        ),
    }


@pytest.mark.parametrize(
    ("name", "dtype"),
    [
        ("electra pretraining", torch.long),
        ("electra pretraining", torch.double),  # it takes its 0/1 labels as floats too
        ("biogpt token classification", torch.long),
    ],
)
def test_a_loss_over_the_tokens_the_attention_mask_keeps_is_checked_by_that_count(
    name: str, dtype: torch.dtype
) -> None:
    # Their forwards compute out.loss over the tokens the attention mask keeps; labels with no
    # -100 looked in proportion to the rows, and uneven padding gave another loss and
    # gradients than the plain model's (a gradient 73% off), silently.
    torch.manual_seed(0)
    model = _masked_loss_models()[name]().double()
    model.config._attn_implementation = "eager"
    plain = twin(model)
    ids, labels = torch.randint(3, VOCAB, (8, 6)), torch.randint(0, 2, (8, 6)).to(dtype)
    mask = torch.ones(8, 6, dtype=torch.long)
    seq = pipeline.split(model, (ids,), {"attention_mask": mask, "labels": labels})
    uneven = mask.clone()
    uneven[:4, 2:] = 0  # the first micro-batch mostly padding, the second none
    with contextlib.closing(Pipe(seq, [2, len(seq) - 2], chunks=2)) as pipe:
        with pytest.raises(ValueError, match="only those its attention mask keeps"):
            pipe.step(ids, labels, out_loss, kwargs={"attention_mask": uneven, "labels": labels})
        assert all(p.grad is None for p in model.parameters()), "refused before any work"
        even = mask.clone()
        even[::2, 4:] = 0  # two pads in every other row: each micro-batch keeps as many
        loss = pipe.step(ids, labels, out_loss, kwargs={"attention_mask": even, "labels": labels})
    expected = plain(ids, attention_mask=even, labels=labels).loss
    expected.backward()
    torch.testing.assert_close(loss, expected)
    assert_same(gradients(model), gradients(plain))


def test_an_encoder_decoders_attention_mask_is_not_taken_for_its_losss() -> None:
    # T5's attention_mask is its encoder's: its loss counts the decoder's labels alone.
    # Shaped like the labels and padded unevenly, it was taken for the loss's and the
    # step refused, where it gives the plain model's loss and gradients.
    model = t5()
    plain = twin(model)
    torch.manual_seed(0)
    ids, labels = torch.randint(3, VOCAB, (8, 6)), torch.randint(3, VOCAB, (8, 6))
    labels[::2, 5:] = -100  # one ignored label in every other row: even across micro-batches
    mask = torch.ones(8, 6, dtype=torch.long)
    seq = pipeline.split(model, (ids,), {"attention_mask": mask, "labels": labels})
    mask[:4, 3:] = 0  # the first micro-batch's sources short
    kwargs = {"attention_mask": mask, "labels": labels}
    with contextlib.closing(Pipe(seq, [3, len(seq) - 3], chunks=2)) as pipe:
        loss = pipe.step(ids, labels, out_loss, kwargs=kwargs)
    expected = plain(ids, **kwargs).loss
    expected.backward()
    torch.testing.assert_close(loss, expected)
    assert_same(gradients(model), gradients(plain))


def _bert_heads() -> dict[str, Any]:
    config = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    return {
        "question answering": lambda: transformers.BertForQuestionAnswering(config),
        "pretraining": lambda: transformers.BertForPreTraining(config),
    }


@pytest.mark.parametrize("name", ["question answering", "pretraining"])
def test_targets_besides_labels_that_a_heads_loss_leaves_out_are_checked(name: str) -> None:
    # Only labels were counted: an answer beyond the sequence (its loss's ignored index)
    # or a next-sentence label of -100 in one micro-batch weighed the micro-batches' means
    # by rows, and the loss and gradients went another way (0.085 off), silently.
    torch.manual_seed(0)
    model = _bert_heads()[name]().double()
    plain = twin(model)
    ids = torch.randint(1, VOCAB, (8, 6))
    if name == "question answering":
        start, end = torch.randint(0, 6, (8,)), torch.randint(0, 6, (8,))
        uneven = {"start_positions": start.clone(), "end_positions": end.clone()}
        uneven["start_positions"][0] = 6  # past the sequence: left out
        even = {"start_positions": start, "end_positions": end.clone()}
        even["end_positions"][[0, 4]] = -1  # clamped to 0: counted
    else:
        labels = torch.randint(1, VOCAB, (8, 6))
        uneven = {"labels": labels, "next_sentence_label": torch.tensor([-100] + [1, 0] * 3 + [1])}
        even = {"labels": labels, "next_sentence_label": torch.tensor([0, 1] * 4)}
    seq = pipeline.split(model, (ids,), even)
    with contextlib.closing(Pipe(seq, [2, len(seq) - 2], chunks=2)) as pipe:
        with pytest.raises(ValueError, match=r"other targets.*hold \[3, 4\] of them"):
            pipe.step(ids, ids, out_loss, kwargs=uneven)
        assert all(p.grad is None for p in model.parameters()), "refused before any work"
        loss = pipe.step(ids, ids, out_loss, kwargs=even)
    expected = plain(ids, **even).loss
    expected.backward()
    torch.testing.assert_close(loss, expected)
    assert_same(gradients(model), gradients(plain))
