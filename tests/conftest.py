"""Shared fixtures: every test must leave no pipeline worker thread behind; gloo groups."""

from __future__ import annotations

import gc
import itertools
import threading
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from pipeline import Pipe
from tests.gloo_groups import GroupRunner, Outcomes, free_port, run_group


def pipe_threads() -> list[threading.Thread]:
    names = ("pipe-partition-", "pipe-device-")
    return [t for t in threading.enumerate() if t.name.startswith(names)]


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


@pytest.fixture
def port() -> int:
    """A free TCP port on 127.0.0.1."""
    return free_port()


@pytest.fixture(scope="session")
def group_runner(tmp_path_factory: pytest.TempPathFactory) -> GroupRunner:
    """run_group, each call in a fresh temporary directory."""
    counter = itertools.count()

    def launch(
        scenarios: list[str],
        *,
        script: Path,
        world_size: int = 2,
        backend: str = "gloo",
        numpy: bool = True,
        pg_timeout_s: float = 20,
        wall_timeout_s: float = 60,
    ) -> Outcomes:
        directory = tmp_path_factory.mktemp(f"group{next(counter)}")
        return run_group(
            directory,
            scenarios,
            script=script,
            world_size=world_size,
            backend=backend,
            numpy=numpy,
            pg_timeout_s=pg_timeout_s,
            wall_timeout_s=wall_timeout_s,
        )

    return launch
