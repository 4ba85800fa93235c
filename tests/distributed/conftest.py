"""Launching a small gloo process group on 127.0.0.1 to run DataParallel scenarios."""

from __future__ import annotations

import itertools
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
SCENARIOS = Path(__file__).with_name("scenarios.py")

Outcomes = list[dict[str, str]]
GroupRunner = Callable[..., Outcomes]


def free_port() -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def rank_env(
    rank: int, world_size: int, port: int, backend: str = "gloo", numpy: bool = True
) -> dict[str, str]:
    """The environment torchrun would give process `rank`, and how scenarios.py should run."""
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "OMP_NUM_THREADS": "1",
        "SCENARIO_BACKEND": backend,
        "SCENARIO_WITHOUT_NUMPY": "0" if numpy else "1",
    }


def run_group(
    directory: Path,
    scenarios: list[str],
    *,
    script: Path = SCENARIOS,
    world_size: int = 2,
    backend: str = "gloo",
    numpy: bool = True,
    pg_timeout_s: float = 20,
    wall_timeout_s: float = 60,
) -> Outcomes:
    """Run `scenarios` (names in scenarios.py) in one process group; each rank's outcomes.

    Every rank reports {scenario: "ok" or the failure}. All processes are
    killed after `wall_timeout_s`, so a hang fails the test instead of
    blocking the suite.
    """
    port = free_port()
    procs = []
    for rank in range(world_size):
        out, log = directory / f"rank{rank}.json", directory / f"rank{rank}.log"
        cmd = [sys.executable, str(script), str(out), str(pg_timeout_s), *scenarios]
        with log.open("w") as log_file:
            proc = subprocess.Popen(
                cmd,
                env=rank_env(rank, world_size, port, backend, numpy),
                stdout=log_file,
                stderr=log_file,
            )
        procs.append((proc, out, log))
    deadline = time.monotonic() + wall_timeout_s
    for proc, _, _ in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for other, _, _ in procs:
                other.kill()
                other.wait()
            pytest.fail(f"process group did not finish within {wall_timeout_s} s")
    outcomes = []
    for proc, out, log in procs:
        if not out.exists():
            pytest.fail(
                f"a rank wrote no results (exit code {proc.returncode}):\n{log.read_text()}"
            )
        outcomes.append(json.loads(out.read_text()))
    return outcomes


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
        script: Path = SCENARIOS,
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
