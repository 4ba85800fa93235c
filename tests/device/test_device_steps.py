"""Pipe.step in every schedule, and evaluate, on every layout: the plain model's results."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pipeline.schedules import Interleaved1F1B
from tests.device.compare import EXACT, FLOAT64, MODES, pipe_on, plain_on
from tests.device.layouts import Layout
from tests.helpers import grads
from tests.step.step_models import WIDTH, layered

FLAT = ("gpipe", "1f1b", "zb-h1")


def batch(layout: Layout, rows: int = 8) -> tuple[Tensor, Tensor]:
    x = torch.randn(rows, WIDTH, dtype=torch.float64, device=layout.first)
    return x, torch.randn(rows, WIDTH, dtype=torch.float64, device=layout.first)


def assert_step_equals_the_plain_model(
    layout: Layout, model: nn.Sequential, balance: list[int], schedule: object, chunks: int
) -> None:
    x, y = batch(layout)
    plain = plain_on(model, layout)
    expected = F.mse_loss(plain(x), y)
    expected.backward()
    for mode in MODES:
        pipe = pipe_on(model, layout, balance, chunks=chunks, checkpoint=mode)
        what = f"{layout.name}, {schedule}, {mode}"
        loss = pipe.step(x, y, F.mse_loss, schedule=schedule)  # type: ignore[arg-type]
        FLOAT64.assert_close(loss, expected.detach(), f"{what}: loss")
        found = grads(pipe)
        assert found.keys() == grads(plain).keys(), what
        for name, grad in grads(plain).items():
            FLOAT64.assert_close(found[name], grad, f"{what}: {name}")


@pytest.mark.parametrize("schedule", FLAT)
def test_flat_schedules_equal_the_plain_model_with_a_skip(layout: Layout, schedule: str) -> None:
    model, balance = layered(4, "first to last")
    assert_step_equals_the_plain_model(layout, model, balance, schedule, chunks=4)


def test_interleaved_equals_the_plain_model_with_a_skip(several: Layout) -> None:
    model, balance = layered(4, "two namespaces")
    assert_step_equals_the_plain_model(several, model, balance, Interleaved1F1B(virtual=2), 4)


@pytest.mark.parametrize("schedule", FLAT)
def test_checkpoint_modes_of_a_step_agree_bit_for_bit_with_dropout(
    layout: Layout, schedule: str
) -> None:
    layers, balance = layered(3, "adjacent")
    model = nn.Sequential(*(nn.Sequential(layer, nn.Dropout(0.3)) for layer in layers))
    x, y = batch(layout)
    results = {}
    for mode in MODES:
        pipe = pipe_on(model, layout, balance, chunks=4, checkpoint=mode)
        torch.manual_seed(7)
        results[mode] = pipe.step(x, y, F.mse_loss, schedule=schedule), grads(pipe)
    loss, expected = results["never"]
    for mode in ("always", "except_last"):
        what = f"{layout.name}, {schedule}, {mode}"
        EXACT.assert_close(results[mode][0], loss, f"{what}: loss")
        for name, grad in expected.items():
            EXACT.assert_close(results[mode][1][name], grad, f"{what}: {name}")


def test_evaluate_equals_the_plain_model_in_eval(layout: Layout) -> None:
    torch.manual_seed(3)
    skipping, balance = layered(3, "first to last")
    model = nn.Sequential(
        nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.BatchNorm1d(WIDTH), nn.Dropout(0.5)),
        *skipping,
    ).double()
    balance[0] += 1
    model(torch.randn(16, WIDTH, dtype=torch.float64))  # running statistics of their own
    plain = plain_on(model, layout).eval()
    pipe = pipe_on(model, layout, balance, chunks=3)
    x, y = batch(layout, rows=7)
    with torch.no_grad():
        output = plain(x)
    loss, outputs = pipe.evaluate(x, y, F.mse_loss, return_outputs=True)
    FLOAT64.assert_close(outputs, output, f"{layout.name}: outputs")
    FLOAT64.assert_close(loss, F.mse_loss(output, y), f"{layout.name}: loss")
    assert pipe.training and not outputs.requires_grad
