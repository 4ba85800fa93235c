"""examples/train_grid.py: a pp=2 x dp=2 grid under torchrun ends with identical replicas."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_train_grid_example_keeps_replicas_and_tied_copies_identical(port: int) -> None:
    command = [
        sys.executable, "-m", "torch.distributed.run",
        "--nproc_per_node=4", f"--master_port={port}",
        str(REPO_ROOT / "examples" / "train_grid.py"),
        "--steps", "12", "--log-every", "6", "--layers", "2", "--width", "32",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 replicas x 2 stages" in done.stdout
    assert "step   12/12  loss" in done.stdout and "tokens/s" in done.stdout
    assert "max weight difference between replicas: 0\n" in done.stdout
    assert "max difference between the tied embedding's copies: 0\n" in done.stdout
    assert "loss fell from" in done.stdout
