"""examples/train_dp.py runs under torchrun and ends with identical replicas."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tests.gloo_groups import Torchrun

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_train_dp_example_keeps_replicas_identical(torchrun: Torchrun) -> None:
    done = torchrun(2, EXAMPLES / "train_dp.py", timeout=240)  # as a user runs it: defaults
    assert done.returncode == 0, done.stdout + done.stderr
    assert "step  300  loss" in done.stdout and "samples/s" in done.stdout
    assert "max weight difference between replicas: 0\n" in done.stdout
