"""Small float64 models and batches shared by the planner's tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import Tensor, nn

ROWS, WIDTH = 32, 16


def gelu_mlp(depth: int = 6) -> nn.Sequential:
    """Linear + GELU blocks and a last Linear: no layer saves its own output."""
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU()) for _ in range(depth - 1)]
    return nn.Sequential(*blocks, nn.Linear(WIDTH, WIDTH)).double()


def batch(rows: int = ROWS) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(rows, WIDTH, dtype=torch.double, generator=gen)
    return x, torch.randn(rows, WIDTH, dtype=torch.double, generator=gen)


@pytest.fixture
def one_thread() -> Iterator[None]:
    """One intra-op thread while a test profiles: on a shared 2-core machine, two threads
    contending with other jobs make each op wait milliseconds."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
