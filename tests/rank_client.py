"""``python tests/rank_client.py SCRIPT ARGS...`` runs ``python SCRIPT ARGS...`` forked by the
rank server of this process's LOCAL_RANK (modulo RANK_SERVERS, how many run), when
RANK_SERVER_DIR names the directory of running rank servers (tests/rank_server.py) and that
one is there; else it becomes a fresh ``python SCRIPT ARGS...`` itself.

torchrun starts it as its workers' script: each worker keeps torchrun's environment and
rendezvous, its stdout and stderr, and torchrun's signals (passed on to the forked process),
and ends with the forked process's exit code; only torch's import is not paid again.
This file imports nothing heavy: it starts in milliseconds.
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import sys
from pathlib import Path
from types import FrameType

from tests.rank_server import request_fork

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def main() -> None:
    """Run the script forked by the rank server, or exec it where there is none."""
    argv = sys.argv[1:]
    unbuffered = isinstance(getattr(sys.stdout, "buffer", None), io.FileIO)  # python -u
    index = int(os.environ["LOCAL_RANK"]) % int(os.environ.get("RANK_SERVERS", "1"))
    server = Path(os.environ.get("RANK_SERVER_DIR", "/nonexistent")) / str(index)
    if not server.exists():
        os.execv(sys.executable, [sys.executable, *(["-u"] if unbuffered else []), *argv])
    forked = request_fork(server, argv, dict(os.environ), 1, 2, unbuffered)

    def forward(signum: int, frame: FrameType | None) -> None:
        with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
            os.kill(forked.pid, signum)

    for signum in FORWARDED:
        signal.signal(signum, forward)
    code = forked.wait()
    if code < 0:  # end as the forked process ended: by its signal
        for signum in FORWARDED:
            signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


if __name__ == "__main__":
    main()
