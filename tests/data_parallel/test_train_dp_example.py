"""examples/train_dp.py runs under torchrun and ends with identical replicas."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tests.gloo_groups import Torchrun

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_train_dp_example_keeps_replicas_identical(torchrun: Torchrun) -> None:
    args = ["--steps", "20", "--batch", "64", "--width", "32"]
    done = torchrun(2, EXAMPLES / "train_dp.py", *args, timeout=90)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "step   20  loss" in done.stdout and "samples/s" in done.stdout
    assert "max weight difference between replicas: 0\n" in done.stdout
