"""examples/hf_gpt2.py, run as a user runs it (its defaults): a transformers GPT-2, split, trained
by Pipe.step, equal to the plain model in float64 at every step."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from tests.test_examples import parser_of

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

pytest.importorskip("transformers")


def test_hf_gpt2_with_its_defaults_trains_like_the_plain_model(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.syspath_prepend(str(EXAMPLES))  # as when run: it imports gpt.py beside it
    hf_gpt2 = importlib.import_module("hf_gpt2")
    assert hf_gpt2.main([]) == 0
    printed = capsys.readouterr().out
    assert "split into 4 pieces" in printed and "(balance_by_time)" in printed
    assert "step   20/20  loss" in printed and "plain model" in printed
    assert "largest relative difference between the losses" in printed
    assert "(tolerance 1e-08)" in printed  # float64: a defect crosses it, rounding does not
    assert "loss fell from" in printed


def test_hf_gpt2_gives_every_option_a_help_text(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(EXAMPLES))
    parser = parser_of(importlib.import_module("hf_gpt2").main, monkeypatch)
    assert [action.option_strings for action in parser._actions if not action.help] == []


def test_hf_t5_with_its_defaults_trains_like_the_plain_model(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.syspath_prepend(str(EXAMPLES))
    hf_t5 = importlib.import_module("hf_t5")
    assert hf_t5.main([]) == 0
    printed = capsys.readouterr().out
    assert "2 + 2 blocks" in printed and "split into 6 pieces" in printed
    assert "(balance_by_time)" in printed and "plain model" in printed
    assert "(tolerance 1e-08)" in printed and "loss fell from" in printed


def test_hf_t5_gives_every_option_a_help_text(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(EXAMPLES))
    parser = parser_of(importlib.import_module("hf_t5").main, monkeypatch)
    assert [action.option_strings for action in parser._actions if not action.help] == []
