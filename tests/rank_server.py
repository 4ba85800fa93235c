"""A rank server: a process that has imported torch and the library once and forks each rank
process of a test group from there, so that a rank starts in milliseconds instead of paying
torch's import (seconds of CPU) again.

The server (``python -m tests.rank_server SOCKET``) imports ``PRELOAD``, runs no torch
operation (so no thread pool exists to break in a fork), and listens on a Unix socket.
A request names a script (or ``-m MODULE``) with its arguments, the environment and the
working directory, and passes the two file descriptors that become the process's stdout
and stderr. The forked child then runs the script as ``python SCRIPT ARGS...`` would: as
``__main__``, with that environment, and it ends as such a script ends (an uncaught
exception prints its traceback and exits 1; atexit handlers, waits for threads and
finalizers all run). The server reaps it and tells the requester its exit code, as
``subprocess.Popen.returncode`` gives it.

The launcher's side: ``RankServers`` starts one server per rank index, so that ranks of
one group differ in their hash salt (``PYTHONHASHSEED``) as separate processes do;
``ForkedRank`` is the rank, polled, killed and waited for as a ``Popen``.
"""

from __future__ import annotations

import builtins
import contextlib
import importlib
import io
import itertools
import json
import os
import runpy
import select
import signal
import socket
import struct
import subprocess
import sys
import time
import types
from importlib.machinery import SourceFileLoader
from pathlib import Path
from typing import Any, TextIO

# What every scenario script imports, the heaviest first (torch.distributed's checkpoint,
# FSDP and DTensor take seconds); transformers is left to the few scripts that use it.
# Not torch.export, which pipeline.split imports when first called: preloaded, it saved a
# rank half a second, which did not show in the suite's time. (A rank that aborted at exit
# then, "terminate called without an active exception", was torch's gloo at exit, which
# tests/gloo_groups.py now avoids, not the preload.)
PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "torch.distributed.checkpoint.state_dict",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torch.distributed.tensor.parallel",
    "torch.nn.parallel",
    "torch.utils.checkpoint",
    "pipeline",
    "pipeline.distributed",
    "tests.gloo_groups",
    "tests.helpers",
]

_HEADER = struct.Struct("!Q")
_POLL_S = 0.02

Request = dict[str, Any]


# The server's side.


def _receive(conn: socket.socket) -> tuple[Request, list[int]]:
    """One request: its length with the output descriptors, then its JSON."""
    header, fds, _, _ = socket.recv_fds(conn, _HEADER.size, 2)
    (length,) = _HEADER.unpack(header)
    body = b""
    while len(body) < length:
        chunk = conn.recv(length - len(body))
        if not chunk:
            raise ConnectionError("the requester left mid-request")
        body += chunk
    request: Request = json.loads(body)
    return request, fds


def _reap(waiting: dict[int, socket.socket]) -> None:
    """Tell each requester whose rank has ended its exit code."""
    while waiting:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            return
        conn = waiting.pop(pid)
        with contextlib.suppress(OSError):  # else the requester is gone: nobody waits
            conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
        conn.close()


def serve(path: str) -> Request:
    """Preload, listen on ``path`` and fork a rank per request until the launcher exits.

    Returns only in a forked child, which then runs the request's script.
    """
    for name in PRELOAD:
        importlib.import_module(name)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".binding")
    listener.listen(64)
    os.rename(path + ".binding", path)  # the socket appears only once it accepts
    launcher = os.getppid()
    waiting: dict[int, socket.socket] = {}
    while os.getppid() == launcher:
        readable, _, _ = select.select([listener], [], [], _POLL_S)
        if readable:
            conn, _ = listener.accept()
            try:
                request, fds = _receive(conn)
            except (OSError, ValueError):  # a requester that died mid-request: no rank
                conn.close()
                continue
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                listener.close()
                conn.close()
                for other in waiting.values():
                    other.close()
                _become(request, fds)
                return request
            for fd in fds:
                os.close(fd)
            conn.sendall(f"{pid}\n".encode())
            waiting[pid] = conn
        _reap(waiting)
    sys.exit(0)  # the launcher is gone


def _become(request: Request, fds: list[int]) -> None:
    """In the forked child: the process state ``python SCRIPT ARGS...`` would start with."""
    for target, fd in zip((1, 2), fds, strict=True):
        os.dup2(fd, target)
    for fd in set(fds):
        os.close(fd)
    if request["unbuffered"]:  # as ``python -u``: no buffer in either layer
        sys.stdout = _unbuffered(1, sys.stdout)
        sys.stderr = _unbuffered(2, sys.stderr)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    argv = request["argv"]
    if argv[0] == "-m":  # runpy puts the module's path in sys.argv[0]
        sys.argv = ["-m", *argv[2:]]
        sys.path[0] = os.getcwd()
    else:
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(argv[0])


def _unbuffered(fd: int, like: TextIO) -> io.TextIOWrapper:
    raw = io.FileIO(fd, "w", closefd=False)
    return io.TextIOWrapper(raw, encoding=like.encoding, errors=like.errors, write_through=True)


def run(argv: list[str]) -> None:
    """Run ``python *argv`` in this process: ``-m MODULE ...`` or ``SCRIPT ...``."""
    if argv[0] == "-m":
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        run_script(argv[0])


def run_script(script: str) -> None:
    """Run ``script`` as the interpreter runs its main script, in a fresh ``__main__``."""
    main = types.ModuleType("__main__")
    main.__file__ = script
    main.__dict__["__builtins__"] = builtins
    main.__loader__ = SourceFileLoader("__main__", script)
    main.__spec__ = None
    sys.modules["__main__"] = main
    code = compile(Path(script).read_bytes(), script, "exec")
    exec(code, main.__dict__)


# The launcher's side.


class ForkedRank:
    """A rank process a server forked: ``poll``, ``kill``, ``wait`` and ``returncode`` as
    ``subprocess.Popen``'s (a negative code is the signal that ended it)."""

    def __init__(self, conn: socket.socket) -> None:
        self._conn = conn
        self._received = b""
        self.returncode: int | None = None
        line = self._line()
        while line is None:
            select.select([conn], [], [])
            line = self._line()
        self.pid = int(line)

    def _line(self) -> str | None:
        """The next line from the server, or None if none has come in full yet."""
        while b"\n" not in self._received:
            if not select.select([self._conn], [], [], 0)[0]:
                return None
            chunk = self._conn.recv(64)
            if not chunk:
                raise ConnectionError("the rank server died; its log tells why")
            self._received += chunk
        line, self._received = self._received.split(b"\n", 1)
        return line.decode()

    def poll(self) -> int | None:
        """The exit code, or None while the rank runs."""
        if self.returncode is None:
            line = self._line()
            if line is not None:
                self.returncode = int(line)
                self._conn.close()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the rank to end; its exit code. ``subprocess.TimeoutExpired`` if it has
        not ended after ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        code = self.poll()
        while code is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(f"rank {self.pid}", timeout or 0)
            select.select([self._conn], [], [], left)
            code = self.poll()
        return code

    def kill(self) -> None:
        """SIGKILL the rank unless it has ended (only its server reaps it, so until the
        server reports the end, the pid is still this rank's)."""
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)


def request_fork(
    server: Path,
    argv: list[str],
    env: dict[str, str],
    stdout: int,
    stderr: int,
    unbuffered: bool = False,
    cwd: Path | None = None,
) -> ForkedRank:
    """Ask the server listening on ``server`` to fork a process running ``python *argv``
    (``python -u`` if ``unbuffered``) with ``env`` in ``cwd`` (else this directory),
    writing to the descriptors ``stdout`` and ``stderr``."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(str(server))
    where = str(cwd) if cwd is not None else os.getcwd()
    request = {"argv": argv, "env": env, "cwd": where, "unbuffered": unbuffered}
    body = json.dumps(request).encode()
    socket.send_fds(conn, [_HEADER.pack(len(body))], [stdout, stderr])
    conn.sendall(body)
    return ForkedRank(conn)


class RankServers:
    """One rank server per rank index, each started on first use, all in ``directory``."""

    def __init__(self, directory: Path, env: dict[str, str], ready_timeout_s: float = 300):
        self._directory = directory
        self._env = env
        self._ready_timeout_s = ready_timeout_s
        self._servers: dict[int, tuple[subprocess.Popen[bytes], Path, Path]] = {}
        self._runs = itertools.count()

    @property
    def directory(self) -> Path:
        """Where the servers listen: server ``i`` on the socket named ``i``."""
        return self._directory

    def _socket(self, index: int) -> Path:
        # Unix socket paths are short (108 bytes): a short name in a short directory.
        return self._directory / str(index)

    def ensure(self, count: int) -> None:
        """Start servers for rank indices below ``count`` and wait until each accepts."""
        for index in range(count):
            if index not in self._servers:
                log = self._directory / f"server{index}.log"
                with log.open("w") as log_file:
                    server = subprocess.Popen(
                        [sys.executable, "-m", "tests.rank_server", str(self._socket(index))],
                        env=self._env,
                        stdin=subprocess.DEVNULL,
                        stdout=log_file,
                        stderr=log_file,
                    )
                self._servers[index] = (server, self._socket(index), log)
        deadline = time.monotonic() + self._ready_timeout_s
        for index in range(count):
            server, path, log = self._servers[index]
            while not path.exists():
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"rank server {index} did not start:\n{log.read_text()}")
                time.sleep(_POLL_S)

    def fork(
        self,
        index: int,
        argv: list[str],
        env: dict[str, str],
        stdout: TextIO,
        stderr: TextIO,
        cwd: Path | None = None,
    ) -> ForkedRank:
        """Fork a process from server ``index`` that runs ``python *argv`` with ``env`` in
        ``cwd`` (else this directory), writing to ``stdout`` and ``stderr``."""
        self.ensure(index + 1)
        return request_fork(
            self._socket(index), argv, env, stdout.fileno(), stderr.fileno(), cwd=cwd
        )

    def run(
        self, argv: list[str], env: dict[str, str], timeout: float, cwd: Path | None = None
    ) -> subprocess.CompletedProcess[str]:
        """``subprocess.run([sys.executable, *argv], env=env, cwd=cwd, capture_output=True,
        text=True, timeout=timeout)``, the process forked by server 0."""
        out = self._directory / f"run{next(self._runs)}"
        with out.with_suffix(".out").open("w") as stdout, out.with_suffix(".err").open("w") as err:
            forked = self.fork(0, argv, env, stdout, err, cwd)
        try:
            code = forked.wait(timeout)
        except subprocess.TimeoutExpired:
            forked.kill()
            forked.wait()
            raise subprocess.TimeoutExpired([sys.executable, *argv], timeout) from None
        printed = out.with_suffix(".out").read_text()
        complained = out.with_suffix(".err").read_text()
        return subprocess.CompletedProcess([sys.executable, *argv], code, printed, complained)

    def close(self) -> None:
        """End every server (their ranks have ended: every group waits for its ranks)."""
        for server, path, _ in self._servers.values():
            server.kill()
            server.wait()
            path.unlink(missing_ok=True)
        self._servers.clear()


if __name__ == "__main__":
    run(serve(sys.argv[1])["argv"])
