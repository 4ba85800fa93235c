"""Encoder-decoder models (T5, BART) cut at the blocks of both stacks, equal to the plain model.

The default points take every stack of blocks, the decoder's too (before,
the largest stack alone: T5's whole decoder and head landed in one piece).
The encoder's output reaches each decoder piece as a value it uses, never
through a piece that does not.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn

import pipeline
from pipeline import Pipe
from pipeline.split.points import default_blocks
from tests.split.split_models import (
    VOCAB,
    assert_same,
    backward_of,
    bart,
    gradients,
    lm_loss,
    t5,
    twin,
)

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")


def batch(rows: int) -> tuple[Tensor, dict[str, Tensor], Tensor]:
    """Encoder ids, the decoder's inputs and the attention mask as keywords, targets."""
    torch.manual_seed(1)
    ids = torch.randint(1, VOCAB, (rows, 10))
    decoder = torch.randint(1, VOCAB, (rows, 7))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    return (
        ids,
        {"decoder_input_ids": decoder, "attention_mask": mask},
        torch.randint(1, VOCAB, (rows, 7)),
    )


def block_of(name: str) -> str:
    """``encoder.block.1`` for ``encoder.block.1.layer.0.SelfAttention.q.weight``."""
    parts = name.split(".")
    for k, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: k + 1])
    return ""


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (t5, ["encoder.block.0", "encoder.block.1", "decoder.block.0", "decoder.block.1"]),
        (
            bart,
            [f"model.encoder.layers.{k}" for k in range(2)]
            + [f"model.decoder.layers.{k}" for k in range(3)],
        ),
    ],
    ids=["T5", "BART"],
)
def test_the_default_points_are_the_blocks_of_both_stacks(
    make: Callable[[], nn.Module], expected: list[str]
) -> None:
    assert default_blocks(make()) == expected


def test_a_stack_inside_a_block_or_much_smaller_is_not_a_stack() -> None:
    class Expert(nn.Linear):
        pass

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.experts = nn.ModuleList(Expert(4, 4) for _ in range(8))

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(Layer() for _ in range(2))
            self.heads = nn.ModuleList(nn.Linear(4, 1) for _ in range(3))  # 15 against 320

    assert default_blocks(Model()) == ["layers.0", "layers.1"]
    # A container of one child hides nothing; a list of one block is the stack
    # when there is no other (examples/train.py with --depth 1).
    assert default_blocks(nn.Sequential(Model())) == ["0.layers.0", "0.layers.1"]
    single = nn.Module()
    single.blocks = nn.ModuleList([nn.Linear(4, 4)])
    assert default_blocks(single) == ["blocks.0"]


@pytest.fixture(scope="module")
def split_t5() -> tuple[nn.Module, nn.Module, nn.Sequential]:
    model = t5()
    plain = twin(model)
    ids, kwargs, _ = batch(2)
    return model, plain, pipeline.split(model, (ids,), kwargs)


def test_t5_pieces_hold_one_block_each_and_the_encoder_output_skips_no_piece(
    split_t5: tuple[nn.Module, nn.Module, nn.Sequential],
) -> None:
    _, _, seq = split_t5
    blocks = [sorted({block_of(n) for n, _ in piece.named_parameters()} - {""}) for piece in seq]
    assert blocks[1:5] == [
        ["encoder.block.0"],
        ["encoder.block.1"],
        ["decoder.block.0"],
        ["decoder.block.1"],
    ]
    # Each decoder block reads the encoder's output: it arrives with the main path
    # from the encoder's last piece, which no piece in between carries for others.
    assert [piece.receives for piece in seq][3:5] == [4, 6]


def test_t5_equals_the_plain_model_in_pipe_call_and_every_schedule(
    split_t5: tuple[nn.Module, nn.Module, nn.Sequential],
) -> None:
    model, plain, seq = split_t5
    ids, kwargs, target = batch(8)
    expected_loss = backward_of(lambda: lm_loss(plain(ids, **kwargs), target))
    expected = gradients(plain)
    pipe = Pipe(seq, [1, 2, 2, 1], devices=["cpu"] * 4, chunks=4)
    model.zero_grad()
    torch.testing.assert_close(
        backward_of(lambda: lm_loss(pipe(ids, **kwargs), target)), expected_loss
    )
    assert_same(gradients(model), expected)
    for schedule in SCHEDULES:
        model.zero_grad()
        loss = pipe.step(ids, target, lm_loss, kwargs=kwargs, schedule=schedule)
        torch.testing.assert_close(loss, expected_loss, msg=schedule)
        assert_same(gradients(model), expected)
    pipe.close()


def test_bart_equals_the_plain_model_with_its_decoder_cut_too() -> None:
    model = bart()
    plain = twin(model)
    ids, kwargs, target = batch(8)
    expected_loss = backward_of(lambda: lm_loss(plain(ids, **kwargs), target))
    seq = pipeline.split(model, (ids[:2],), {k: v[:2] for k, v in kwargs.items()})
    assert len(seq) == 7  # before, 5 blocks, after
    pipe = Pipe(seq, [3, 2, 2], devices=["cpu"] * 3, chunks=4)
    loss = pipe.step(ids, target, lm_loss, kwargs=kwargs, schedule="1f1b")
    pipe.close()
    torch.testing.assert_close(loss, expected_loss)
    assert_same(gradients(model), gradients(plain))
