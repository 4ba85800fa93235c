"""Shared fixtures: every test must leave no pipeline worker thread behind."""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Iterator

import pytest
import torch

from pipeline import Pipe


def pipe_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("pipe-partition-")]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if report.when == "call":
        item.stash[_FAILED] = report.failed


_FAILED = pytest.StashKey[bool]()


@pytest.fixture(autouse=True)
def _no_leaked_workers(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[None]:
    created: weakref.WeakSet[Pipe] = weakref.WeakSet()
    start = Pipe._start

    def tracked_start(pipe: Pipe) -> None:
        start(pipe)
        created.add(pipe)

    monkeypatch.setattr(Pipe, "_start", tracked_start)
    yield
    if request.node.stash.get(_FAILED, False):
        # A failed test's traceback keeps its Pipes alive; the failure is
        # reported already, so close them instead of reporting a leak too.
        for pipe in list(created):
            pipe.close()
    if pipe_threads():
        gc.collect()
    for thread in pipe_threads():
        thread.join(timeout=5)
    assert pipe_threads() == [], "a test left pipeline worker threads running"


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
