"""examples/hf_llama.py: a transformers Llama split on meta, under torchrun, as the plain model."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]

pytest.importorskip("transformers")


def test_hf_llama_example_trains_across_processes_like_the_plain_model(port: int) -> None:
    command = [
        sys.executable, "-m", "torch.distributed.run",
        "--nproc_per_node=2", f"--master_port={port}",
        str(REPO_ROOT / "examples" / "hf_llama.py"),
        "--steps", "3", "--log-every", "3", "--layers", "2", "--width", "16",
        "--batch", "4", "--chunks", "2", "--context", "16",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "split on meta into 4 pieces" in done.stdout
    assert "2 processes, balance [2, 2]" in done.stdout
    assert "step    3/3  loss" in done.stdout and "plain model" in done.stdout
    assert "largest relative difference between the losses" in done.stdout
    assert "loss fell from" in done.stdout
