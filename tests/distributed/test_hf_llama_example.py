"""examples/hf_llama.py: a transformers Llama split on meta, under torchrun, as the plain model."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from tests.gloo_groups import Torchrun

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

pytest.importorskip("transformers")


def test_hf_llama_example_trains_across_processes_like_the_plain_model(torchrun: Torchrun) -> None:
    done = torchrun(2, EXAMPLES / "hf_llama.py", timeout=240)  # as a user runs it: defaults
    assert done.returncode == 0, done.stdout + done.stderr
    assert "split on meta into 6 pieces" in done.stdout
    assert "2 processes, balance [3, 3]" in done.stdout
    assert "step   30/30  loss" in done.stdout and "plain model" in done.stdout
    assert "largest relative difference between the losses" in done.stdout
    assert "loss fell from" in done.stdout
