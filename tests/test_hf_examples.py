"""examples/hf_gpt2.py: a transformers GPT-2, split, trained by Pipe.step as the plain model."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

pytest.importorskip("transformers")


def test_hf_gpt2_trains_like_the_plain_model(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.syspath_prepend(str(EXAMPLES))  # as when run: it imports gpt.py beside it
    hf_gpt2 = importlib.import_module("hf_gpt2")
    argv = ["--steps", "4", "--batch", "6", "--chunks", "3", "--layers", "2", "--width", "16"]
    argv += ["--heads", "2", "--context", "16", "--schedule", "zb-h1", "--log-every", "2"]
    assert hf_gpt2.main(argv) == 0
    printed = capsys.readouterr().out
    assert "split into 4 pieces" in printed and "(balance_by_time)" in printed
    assert "step    4/4  loss" in printed and "plain model" in printed
    assert "largest relative difference between the losses" in printed
    assert "loss fell from" in printed
