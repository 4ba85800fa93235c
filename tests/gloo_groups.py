"""Running named scenarios in every rank of a small gloo process group on 127.0.0.1: the
launcher (pytest's side) and the runner (each rank's side).

A scenario script registers its scenarios with ``@scenario`` and ends with
``main()``; ``run_group`` starts it as ``python SCRIPT OUT.json PG_TIMEOUT_S
NAME...`` in every rank, with torchrun's environment variables, and reads
back each rank's {name: "ok" or the traceback}. Given rank servers
(tests/rank_server.py), a gloo group's ranks are forked from them, torch
already imported, instead of started afresh.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import gc
import json
import os
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from pipeline.distributed import init_process_group_from_env
from tests.rank_server import ForkedRank, RankServers

REPO_ROOT = Path(__file__).resolve().parents[1]

Outcomes = list[dict[str, str]]
GroupRunner = Callable[..., Outcomes]
# conftest.py's fixtures that run a process as subprocess.run(..., capture_output=True, text=True)
ForkedPython = Callable[..., "subprocess.CompletedProcess[str]"]
Torchrun = Callable[..., "subprocess.CompletedProcess[str]"]


def free_port() -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def process_env() -> dict[str, str]:
    """This environment, with the repository importable and one OpenMP thread."""
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
    }


def rank_env(
    rank: int, world_size: int, port: int, backend: str = "gloo", numpy: bool = True
) -> dict[str, str]:
    """The environment torchrun would give process `rank`, and how its scenarios should run."""
    return {
        **process_env(),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "SCENARIO_BACKEND": backend,
        "SCENARIO_WITHOUT_NUMPY": "0" if numpy else "1",
    }


def run_group(
    directory: Path,
    scenarios: list[str],
    *,
    script: Path,
    world_size: int = 2,
    backend: str = "gloo",
    numpy: bool = True,
    pg_timeout_s: float = 20,
    wall_timeout_s: float = 60,
    servers: RankServers | None = None,
    fresh: bool = False,
) -> Outcomes:
    """Run `scenarios` (names in `script`) in one process group; each rank's outcomes.

    Every rank reports {scenario: "ok" or the failure}. All processes are
    killed after `wall_timeout_s`, so a hang fails the test instead of
    blocking the suite. With `servers`, a gloo group with NumPy forks its
    ranks from them; NCCL, a group without NumPy (which torch's import must
    not find) and one asked to be `fresh` (CUDA: a tier's GPU groups) start
    fresh interpreters.
    """
    if backend != "gloo" or not numpy or fresh:
        servers = None
    for _ in range(3):
        procs = _start(
            directory, scenarios, script, world_size, backend, numpy, pg_timeout_s, servers
        )
        if _wait(procs, wall_timeout_s):
            break
    else:
        pytest.fail("rank 0 found its free port taken three times in a row (EADDRINUSE)")
    outcomes = []
    for proc, out, log in procs:
        code = proc.wait()  # at once: every rank has ended
        if not out.exists():
            pytest.fail(f"a rank wrote no results (exit code {code}):\n{log.read_text()}")
        if code < 0:
            pytest.fail(f"a rank died of signal {-code} after its scenarios:\n{log.read_text()}")
        outcomes.append(json.loads(out.read_text()))
    return outcomes


Launched = list[tuple[subprocess.Popen[bytes] | ForkedRank, Path, Path]]


def _start(
    directory: Path,
    scenarios: list[str],
    script: Path,
    world_size: int,
    backend: str,
    numpy: bool,
    pg_timeout_s: float,
    servers: RankServers | None,
) -> Launched:
    """Start every rank of a group on a free port; (process, outcomes file, log) per rank."""
    if servers is not None:
        servers.ensure(world_size)  # before the port is chosen: starting them takes seconds
    port = free_port()
    procs: Launched = []
    for rank in range(world_size):
        out, log = directory / f"rank{rank}.json", directory / f"rank{rank}.log"
        out.unlink(missing_ok=True)
        argv = [str(script), str(out), str(pg_timeout_s), *scenarios]
        env = rank_env(rank, world_size, port, backend, numpy)
        with log.open("w") as log_file:
            if servers is not None:
                proc: subprocess.Popen[bytes] | ForkedRank = servers.fork(
                    rank, argv, env, log_file, log_file
                )
            else:
                proc = subprocess.Popen(
                    [sys.executable, *argv], env=env, stdout=log_file, stderr=log_file
                )
        procs.append((proc, out, log))
    return procs


def _wait(procs: Launched, wall_timeout_s: float) -> bool:
    """Wait for every rank; False if rank 0 could not listen on the port (another test took
    it between ``free_port`` and the bind: the caller starts again on another port)."""
    deadline = time.monotonic() + wall_timeout_s
    while any(proc.poll() is None for proc, _, _ in procs):
        first, _, log = procs[0]
        if first.poll() is not None and "EADDRINUSE" in log.read_text(errors="replace"):
            _kill(procs)
            return False
        if time.monotonic() > deadline:
            _kill(procs)
            pytest.fail(f"process group did not finish within {wall_timeout_s} s")
        time.sleep(0.1)
    return True


def _kill(procs: Launched) -> None:
    for proc, _, _ in procs:
        proc.kill()
        proc.wait()


# The runner: what each rank runs.

SCENARIOS: dict[str, Callable[[], None]] = {}
BREAKS_GROUP: set[str] = set()
PG_TIMEOUT_S = 20.0  # set from the command line by main()


def scenario(fn: Callable[[], None]) -> Callable[[], None]:
    """Register a scenario under its function name."""
    SCENARIOS[fn.__name__] = fn
    return fn


def breaks_group(fn: Callable[[], None]) -> Callable[[], None]:
    """Mark a scenario after which the process group can no longer be used."""
    BREAKS_GROUP.add(fn.__name__)
    return fn


class SimulatedCrashError(Exception):
    """Raised by a scenario on the rank that should die abruptly at that point."""


class SimulatedScriptError(BaseException):
    """Raised by a scenario on the rank whose script should fail there, as a bug would.

    Its outcomes are written, then it leaves the runner uncaught: the
    interpreter exits as it does for a script that raised, finalizers and all.
    """


def rank() -> int:
    return dist.get_rank()


def world() -> int:
    return dist.get_world_size()


@contextlib.contextmanager
def calls_counted(names: Sequence[str]) -> Iterator[dict[str, int]]:
    """How often the block calls each of torch.distributed's functions ``names``."""
    counts = dict.fromkeys(names, 0)
    originals = {name: getattr(dist, name) for name in names}

    def counting(name: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            counts[name] += 1
            return originals[name](*args, **kwargs)

        return call

    for name in names:
        setattr(dist, name, counting(name))
    try:
        yield counts
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


def expect_error(kind: type[Exception], run: Callable[[], Any], *fragments: str) -> str:
    try:
        run()
    except kind as error:
        message = str(error)
        for fragment in fragments:
            assert fragment in message, f"{fragment!r} missing from: {message}"
        return message
    raise AssertionError(f"expected {kind.__name__} mentioning {fragments}")


def assert_same_buffers(actual: torch.nn.Module, expected: torch.nn.Module, what: str) -> None:
    """Every buffer of ``actual`` equal, bit for bit, to ``expected``'s of its name."""
    reference = dict(expected.named_buffers())
    for name, buffer in actual.named_buffers():
        torch.testing.assert_close(buffer, reference[name], rtol=0, atol=0, msg=f"{what}: {name}")


def _destroy_at_exit() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def main() -> None:
    """Run the scenarios named on the command line in this rank; write their outcomes."""
    global PG_TIMEOUT_S
    # A rank that aborts (SIGABRT: "terminate called ...", now and then at exit) prints
    # every thread's Python stack into its log, which the runner shows.
    faulthandler.enable(all_threads=True)
    out, PG_TIMEOUT_S, names = Path(sys.argv[1]), float(sys.argv[2]), sys.argv[3:]
    backend = os.environ.get("SCENARIO_BACKEND", "gloo")
    init_process_group_from_env(backend=backend, timeout=timedelta(seconds=PG_TIMEOUT_S))
    # As a script's `finally: destroy_process_group()` would, also for the scenarios that
    # end the group and the rank whose script raises: a group left to the interpreter's
    # exit can abort the process (SIGABRT, "terminate called without an active
    # exception"; torch's issue #190489), when a gloo worker thread lets go of a
    # collective's tensors, which needs the GIL, while the interpreter finalizes. Run
    # after the library's own exit handler (atexit runs the last registered first).
    atexit.register(_destroy_at_exit)
    torch.set_num_threads(1)
    outcomes: dict[str, str] = {}
    for name in names:
        try:
            SCENARIOS[name]()
            outcomes[name] = "ok"
        except SimulatedScriptError:
            outcomes[name] = "ok"
            out.write_text(json.dumps(outcomes))
            raise
        except SimulatedCrashError:
            outcomes[name] = "ok"
            out.write_text(json.dumps(outcomes))
            os._exit(0)  # die without a goodbye, as a crashed rank would
        except Exception:
            outcomes[name] = traceback.format_exc()
    out.write_text(json.dumps(outcomes))
    # What the scenarios made and left in reference cycles (torch's DDP and its reducer
    # among them) is freed now, with the group and the interpreter whole, not while the
    # interpreter finalizes, where a C++ thread let go of then aborts the process.
    gc.collect()
    if not BREAKS_GROUP.intersection(names):
        dist.barrier()
        dist.destroy_process_group()
