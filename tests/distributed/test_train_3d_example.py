"""examples/train_3d.py: pp=2 x fsdp=2 x tp=2 under torchrun ends equal to the plain model."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tests.gloo_groups import Torchrun

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_train_3d_example_equals_the_plain_model(torchrun: Torchrun) -> None:
    done = torchrun(8, EXAMPLES / "train_3d.py", timeout=240)  # as a user runs it: defaults
    assert done.returncode == 0, done.stdout + done.stderr
    assert "pp=2 x dp=2 x tp=2; 3 AdamW steps" in done.stdout
    assert "39 of the plain model's 39 parameters compared across 8 processes" in done.stdout
    assert "verdict: pp x fsdp x tp is equal to the plain model" in done.stdout
