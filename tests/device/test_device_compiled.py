"""Compiled layers inside partitions on every layout: compiled, and the plain model's gradients.

Each layer of the pipe is compiled in place for its partition's device: with
inductor on a GPU, the backend users run there; with ``aot_eager`` on the
CPU (dynamo and AOTAutograd without code generation: inductor's C++ build
takes tens of seconds on a loaded CPU, and tests/runtime/test_compile.py
runs it there once).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pipeline import Pipe
from tests.device.compare import EXACT, FLOAT64, forward_backward, pipe_on, plain_on
from tests.device.layouts import Layout
from tests.device.models import residuals
from tests.helpers import grads

dynamo = pytest.importorskip("torch._dynamo")


def compiled(pipe: Pipe) -> Pipe:
    """``pipe`` with each layer compiled in place for its partition's device."""
    owners = [j for j, size in enumerate(pipe.balance) for _ in range(size)]
    for k, j in enumerate(owners):
        pipe[k].compile(backend="inductor" if pipe.devices[j].type == "cuda" else "aot_eager")
    return pipe


def frames() -> int:
    return int(dynamo.utils.counters["frames"]["ok"])


def test_compiled_layers_give_the_plain_models_gradients(layout: Layout) -> None:
    dynamo.reset()
    model = residuals()
    x = torch.randn(8, 8, dtype=torch.float64, device=layout.first)
    y = torch.randn(8, 8, dtype=torch.float64, device=layout.first)
    expected = forward_backward(plain_on(model, layout), x)
    plain = plain_on(model, layout)
    F.mse_loss(plain(x), y).backward()
    pipe = compiled(pipe_on(model, layout, [2, 2, 2], chunks=2))
    found = forward_backward(pipe, x)
    assert frames() > 0
    for name, grad in expected[1].items():
        FLOAT64.assert_close(found[1][name], grad, f"{layout.name}, pipe(x): {name}")
    pipe.zero_grad()
    pipe.step(x, y, F.mse_loss, schedule="zb-h1")
    for name, grad in grads(plain).items():
        FLOAT64.assert_close(grads(pipe)[name], grad, f"{layout.name}, zb-h1: {name}")


def test_compiled_dropout_is_replayed_exactly(layout: Layout) -> None:
    dynamo.reset()
    model = residuals(dropout=0.3)
    x = torch.randn(8, 8, dtype=torch.float64, device=layout.first)
    runs = {}
    for mode in ("always", "never"):  # except_last checkpoints a subset of always's tasks
        pipe = compiled(pipe_on(model, layout, [2, 2, 2], chunks=2, checkpoint=mode))
        torch.manual_seed(5)
        runs[mode] = forward_backward(pipe, x)
    assert frames() > 0
    dropless = plain_on(model, layout).eval()(x)
    assert not torch.equal(runs["never"][0], dropless), "dropout dropped nothing: no draw compared"
    for name, grad in runs["never"][1].items():
        EXACT.assert_close(runs["always"][1][name], grad, f"{layout.name}: {name}")
