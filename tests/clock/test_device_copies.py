"""Copy/Wait between devices and streams."""

from __future__ import annotations

import copy

import torch
from torch import nn

from pipeline import Pipe
from pipeline.clock.copy import Copy, Wait
from pipeline.runtime.stream import new_stream
from tests.conftest import cuda_only
from tests.helpers import assert_close_dicts, grads, mlp


def test_copy_and_wait_pass_values_and_gradients_on_cpu() -> None:
    stream = new_stream(torch.device("cpu"))
    x = torch.randn(3, requires_grad=True)
    y, tag = Copy.apply(stream, stream, x, "tag")
    z, tag2 = Wait.apply(stream, stream, y, tag)
    assert tag == tag2 == "tag"
    (z * 2).sum().backward()
    torch.testing.assert_close(x.grad, torch.full((3,), 2.0))


@cuda_only
def test_cuda_transparency_across_devices() -> None:
    count = torch.cuda.device_count()
    devices = [f"cuda:{j % count}" for j in range(3)]
    model = mlp(dtype=torch.float32)
    x = torch.randn(12, 8)
    model(x).sum().backward()
    expected = {k: v.cuda() for k, v in grads(model).items()}
    for checkpoint in ("always", "except_last", "never"):
        pipe = Pipe(
            copy.deepcopy(model), [2, 2, 2], devices=devices, chunks=4, checkpoint=checkpoint
        )  # type: ignore[arg-type]
        pipe.zero_grad()
        out = pipe(x.cuda())
        assert out.device == torch.device(devices[-1])  # type: ignore[union-attr]
        out.sum().backward()  # type: ignore[union-attr]
        assert_close_dicts({k: v.cuda() for k, v in grads(pipe).items()}, expected)


@cuda_only
def test_cpu_and_cuda_partitions_mix() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    x = torch.randn(8, 4)
    model(x).sum().backward()
    expected = grads(model)
    pipe = Pipe(copy.deepcopy(model), [1, 2], devices=["cpu", "cuda:0"], chunks=4)
    pipe.zero_grad()
    pipe(x).sum().backward()  # type: ignore[union-attr]
    assert_close_dicts({k: v.cpu() for k, v in grads(pipe).items()}, expected)


@cuda_only
def test_autocast_cuda_reaches_workers() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    pipe = Pipe(model, [1, 1], devices=["cuda:0", "cuda:0"], chunks=2, checkpoint="always")
    with torch.autocast("cuda", dtype=torch.float16):
        out = pipe(torch.randn(4, 4, device="cuda"))
    assert out.dtype == torch.float16  # type: ignore[union-attr]
    out.float().sum().backward()  # type: ignore[union-attr]
