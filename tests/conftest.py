"""Shared fixtures: every test must leave no pipeline worker thread behind; gloo groups,
torchrun and python scripts, their processes forked by rank servers (tests/rank_server.py)."""

from __future__ import annotations

import faulthandler
import gc
import itertools
import os
import subprocess
import threading
import weakref
from collections.abc import Generator, Iterator
from pathlib import Path

import pytest
import torch

from pipeline import Pipe
from tests.gloo_groups import (
    REPO_ROOT,
    ForkedPython,
    GroupRunner,
    Outcomes,
    Torchrun,
    free_port,
    process_env,
    run_group,
)
from tests.rank_server import RankServers


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

# A test that runs longer than this, its setup and teardown included, is
# hung: no test needs a tenth of it on a loaded machine.
HUNG_AFTER_S = 1200
_real_stderr = pytest.StashKey[int]()


def pytest_configure(config: pytest.Config) -> None:
    # Capture is suspended while pytest configures: fd 2 is the terminal's or CI's log.
    config.stash[_real_stderr] = os.dup(2)


def collect_and_freeze() -> None:
    """Collect the garbage, then keep what is left out of later collections' walks.

    What is alive here mostly lives to the end: modules, and torch's caches, which keep
    every export's shape environment (each pipeline.split's) for good. Walked by every
    full collection, the leak check's below among them, these made each take 0.2 to
    0.5 s. Frozen objects are still freed when their last reference goes.
    """
    gc.collect()
    gc.freeze()


def pytest_collection_finish(session: pytest.Session) -> None:
    collect_and_freeze()  # what collection imported: torch, transformers, the test modules


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Generator[None, object, object]:
    """A hung test ends the run with every thread's stack on stderr, instead of
    holding it until CI's own timeout kills it with none."""
    with os.fdopen(os.dup(item.config.stash[_real_stderr]), "w") as stderr:
        faulthandler.dump_traceback_later(HUNG_AFTER_S, exit=True, file=stderr)
        try:
            return (yield)
        finally:
            faulthandler.cancel_dump_traceback_later()


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
        collect_and_freeze()
    for thread in pipe_threads():
        thread.join(timeout=30)  # at once where they end; generous on a loaded machine
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
def rank_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RankServers]:
    """Rank servers for the session's gloo groups, started as groups first need them."""
    servers = RankServers(tmp_path_factory.mktemp("servers"), process_env())
    yield servers
    servers.close()


@pytest.fixture(scope="session")
def group_runner(
    tmp_path_factory: pytest.TempPathFactory, rank_servers: RankServers
) -> GroupRunner:
    """run_group, each call in a fresh temporary directory, its ranks forked by rank servers."""
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
        fresh: bool = False,
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
            servers=rank_servers,
            fresh=fresh,
        )

    return launch


# Servers for torchrun's workers: local rank r is forked by server r % 4. A server costs
# as much as the one worker it would serve, and only the 8-process example has more
# workers, whose ranks r and r + 4 then share a hash salt (the others still differ).
SERVED_LOCAL_RANKS = 4


@pytest.fixture
def forked_python(rank_servers: RankServers) -> ForkedPython:
    """``run(argv, env, timeout, cwd=None)``: ``python *argv`` as ``subprocess.run(...,
    capture_output=True, text=True)`` runs it, but forked by a rank server, torch imported
    already: for scripts whose run, not whose import, a test checks."""
    return rank_servers.run


@pytest.fixture
def torchrun(rank_servers: RankServers, port: int) -> Torchrun:
    """``python -m torch.distributed.run --nproc_per_node=N --master_port=PORT SCRIPT ARGS``
    with the repository importable and one OpenMP thread, output captured as text. The
    launcher and each worker's SCRIPT (through tests/rank_client.py) are forked by rank
    servers."""

    def run(
        nproc: int, script: Path, *args: str, timeout: float
    ) -> subprocess.CompletedProcess[str]:
        servers = min(nproc, SERVED_LOCAL_RANKS)
        rank_servers.ensure(servers)
        argv = [
            "-m", "torch.distributed.run",
            f"--nproc_per_node={nproc}", f"--master_port={port}",
            str(REPO_ROOT / "tests" / "rank_client.py"), str(script), *args,
        ]  # fmt: skip
        env = {
            **process_env(),
            "RANK_SERVER_DIR": str(rank_servers.directory),
            "RANK_SERVERS": str(servers),
        }
        return rank_servers.run(argv, env, timeout)

    return run
