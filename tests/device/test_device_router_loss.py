"""Mixtral's router loss on every layout: the plain model's loss and gradients under GPipe.

On a GPU, each partition's stream sums its routers' tokens and reads its
micro-batch's mask from a copy queued on it; the step waits for those
streams once, before the first gradient (``pipeline/runtime/router_loss.py``).
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn

import pipeline
from pipeline import Pipe
from tests.device.compare import FLOAT64
from tests.device.layouts import Layout
from tests.split.split_models import gradients, mixtral, tokens

pytest.importorskip("transformers")


def count(labels: torch.Tensor) -> torch.Tensor:
    return (labels[..., 1:] != -100).sum()


@functools.cache
def split_mixtral() -> tuple[nn.Module, nn.Module]:
    """Mixtral asking for its router loss, and its split (on the CPU), made once."""
    torch.manual_seed(0)
    model = mixtral()
    model.config.output_router_logits = True
    model.router_aux_loss_coef = 0.5
    ids, mask, _ = tokens(2, 6, padded=2)
    example = {"attention_mask": mask, "labels": ids, "num_items_in_batch": count(ids)}
    return model, pipeline.split(model, (ids,), example)


def test_a_gpipe_step_recomputing_gives_the_plain_models_loss_and_gradients(
    layout: Layout,
) -> None:
    checkpoint = "always"  # the recomputation hooks the routers again (the CPU tests: every mode)
    model, seq = split_mixtral()
    plain, seq = copy.deepcopy(model).to(layout.first), copy.deepcopy(seq)
    devices = layout.devices(4)
    balance = [1, 1, 1, 1] if len(devices) == 4 else [4]
    pipe = Pipe(
        seq, balance, devices=devices, chunks=4, threads=layout.threads, checkpoint=checkpoint
    )  # type: ignore[arg-type]
    ids, mask, _ = tokens(8, 6, padded=2)
    labels = ids.clone()
    labels[1, :3] = -100
    ids, mask, labels = (x.to(layout.first) for x in (ids, mask, labels))
    n = count(labels)
    expected = plain(ids, attention_mask=mask, labels=labels, num_items_in_batch=n).loss
    expected.backward()
    loss = pipe.step(
        ids,
        labels,
        lambda out, _: out.loss,
        kwargs={
            "attention_mask": mask,
            "labels": labels,
            "num_items_in_batch": pipeline.NoChunk(n),
        },
        loss_reduction="sum",
        schedule="gpipe",
    )
    FLOAT64.assert_close(loss, expected.detach(), f"{layout.name}: loss")
    found = gradients(pipe)
    for name, grad in gradients(plain).items():
        FLOAT64.assert_close(found[name], grad, f"{layout.name}, {checkpoint}: {name}")
    pipe.close()
