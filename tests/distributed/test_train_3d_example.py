"""examples/train_3d.py: pp=2 x fsdp=2 x tp=2 under torchrun ends equal to the plain model."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_train_3d_example_equals_the_plain_model(port: int) -> None:
    command = [
        sys.executable, "-m", "torch.distributed.run",
        "--nproc_per_node=8", f"--master_port={port}",
        str(REPO_ROOT / "examples" / "train_3d.py"), "--steps", "2",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "pp=2 x dp=2 x tp=2; 2 AdamW steps" in done.stdout
    assert "156 parameters across 8 processes" in done.stdout
    assert "verdict: pp x fsdp x tp is equal to the plain model" in done.stdout
