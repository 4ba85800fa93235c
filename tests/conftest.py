"""Shared fixtures: every test must leave no pipeline worker thread behind."""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator

import pytest
import torch


def pipe_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("pipe-partition-")]


@pytest.fixture(autouse=True)
def _no_leaked_workers() -> Iterator[None]:
    yield
    if pipe_threads():
        gc.collect()
    for thread in pipe_threads():
        thread.join(timeout=5)
    assert pipe_threads() == [], "a test left pipeline worker threads running"


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
