"""examples/train_dp.py runs under torchrun and ends with identical replicas."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_train_dp_example_keeps_replicas_identical(port: int) -> None:
    command = [
        sys.executable, "-m", "torch.distributed.run",
        "--nproc_per_node=2", f"--master_port={port}",
        str(REPO_ROOT / "examples" / "train_dp.py"),
        "--steps", "20", "--batch", "64", "--width", "32",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "step   20  loss" in done.stdout and "samples/s" in done.stdout
    assert "max weight difference between replicas: 0\n" in done.stdout
