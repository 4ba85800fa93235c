"""examples/train_grid.py: a pp=2 x dp=2 grid under torchrun ends with identical replicas."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tests.gloo_groups import Torchrun

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_train_grid_example_keeps_replicas_and_tied_copies_identical(torchrun: Torchrun) -> None:
    done = torchrun(4, EXAMPLES / "train_grid.py", timeout=240)  # as a user runs it: defaults
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 replicas x 2 stages" in done.stdout
    assert "step   60/60  loss" in done.stdout and "tokens/s" in done.stdout
    assert "max weight difference between replicas: 0\n" in done.stdout
    assert "max difference between the tied embedding's copies: 0\n" in done.stdout
    assert "loss fell from" in done.stdout
