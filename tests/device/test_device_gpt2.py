"""GPT-2 from transformers, split by pipeline.split, on every layout: the plain model's results.

The head is tied to the token embedding in every layout: where the first
and last partitions are on different devices, the tied weight stays on the
first one's and the head piece reads a differentiable copy of it. One split
serves every layout: splitting takes seconds.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn

import pipeline
from pipeline import Pipe
from tests.device.compare import EXACT, FLOAT64
from tests.device.layouts import Layout
from tests.split.split_models import gpt2, gradients, lm_loss, tokens

pytest.importorskip("transformers")

BALANCE = [2, 2, 1]  # the five pieces: embedding, three blocks, the head


@functools.cache
def split_gpt2() -> tuple[nn.Module, nn.Module]:
    """GPT-2 with dropout and its tied head, and its split (on the CPU), made once."""
    model = gpt2(embd_pdrop=0.3, resid_pdrop=0.3, attn_pdrop=0.3)
    ids, mask, _ = tokens(4, 8, padded=3)
    return model, pipeline.split(model, (ids, None, mask))


def models(layout: Layout) -> tuple[nn.Module, nn.Module]:
    """Copies of the plain model, on the layout's first device, and of its split."""
    model, seq = split_gpt2()
    return copy.deepcopy(model).to(layout.first), copy.deepcopy(seq)


def pipe_of(seq: nn.Module, layout: Layout, **options: str) -> Pipe:
    devices = layout.devices(len(BALANCE))
    balance = BALANCE if len(devices) == len(BALANCE) else [sum(BALANCE)]
    return Pipe(seq, balance, devices=devices, chunks=3, threads=layout.threads, **options)  # type: ignore[arg-type]


def on(layout: Layout, *values: torch.Tensor) -> list[torch.Tensor]:
    return [v.to(layout.first) for v in values]


def assert_gradients_equal(pipe: Pipe, plain: nn.Module, what: str) -> None:
    found = gradients(pipe)
    for name, grad in gradients(plain).items():
        FLOAT64.assert_close(found[name], grad, f"{what}: {name}")


def test_pipe_and_step_equal_the_plain_model(layout: Layout) -> None:
    # In eval mode: dropout off, so the pipe's results are the plain model's.
    plain, seq = models(layout)
    plain.eval()
    pipe = pipe_of(seq, layout)
    pipe.eval()
    ids, mask, target = on(layout, *tokens(5, 9, padded=4))
    expected = plain(ids, None, mask)
    expected_loss = lm_loss(expected, target)
    expected_loss.backward()
    out = pipe((ids, None, mask))
    FLOAT64.assert_close(out.logits, expected.logits, f"{layout.name}: logits")
    lm_loss(out, target.to(out.logits.device)).backward()
    assert_gradients_equal(pipe, plain, f"{layout.name}, pipe(x)")
    pipe.zero_grad()
    loss = pipe.step((ids, None, mask), target, lm_loss, schedule="1f1b")
    FLOAT64.assert_close(loss, expected_loss.detach(), f"{layout.name}: loss")
    assert_gradients_equal(pipe, plain, f"{layout.name}, 1f1b")


def test_dropout_is_replayed_exactly_in_every_schedule(layout: Layout) -> None:
    _, seq = models(layout)
    ids, mask, target = on(layout, *tokens(6, 7, padded=2))
    for schedule in ("pipe(x)", "zb-h1"):
        results = []
        for checkpoint in ("always", "never"):
            pipe = pipe_of(copy.deepcopy(seq).train(), layout, checkpoint=checkpoint)
            torch.manual_seed(1)
            if schedule == "pipe(x)":
                out = pipe((ids, None, mask))
                lm_loss(out, target.to(out.logits.device)).backward()
            else:
                pipe.step((ids, None, mask), target, lm_loss, schedule=schedule)
            results.append(gradients(pipe))
        for name, grad in results[1].items():
            EXACT.assert_close(results[0][name], grad, f"{layout.name}, {schedule}: {name}")
