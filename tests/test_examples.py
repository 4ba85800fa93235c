"""The main job runs end to end (an ordinary module split and balanced) and its pipe matches
the plain model."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def test_train_matches_the_plain_model(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # the main job runs without it
    train = load("train")
    argv = [
        "--steps",
        "6",
        "--batch-size",
        "64",
        "--width",
        "32",
        "--depth",
        "2",
        "--chunks",
        "4",
        "--partitions",
        "3",
        "--log-every",
        "3",
        "--balance-timeout",
        "0.05",
    ]
    assert train.main(argv) == 0
    printed = capsys.readouterr().out
    # An ordinary module: split into embed, 2 blocks, head, and balanced by time.
    assert "model: Classifier split into 4 pieces" in printed
    assert "balance_by_time [" in printed
    assert "[pipe] step    6/6" in printed and "final losses agree" in printed
    assert "samples/s" in printed


def test_train_writes_a_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    train = load("train")
    path = tmp_path / "out.json"
    argv = [
        "--steps",
        "2",
        "--batch-size",
        "32",
        "--width",
        "16",
        "--depth",
        "1",
        "--chunks",
        "4",
        "--partitions",
        "2",
        "--trace",
        str(path),
        "--no-compare",
        "--balance-timeout",
        "0.05",
    ]
    assert train.main(argv) == 0
    events = json.loads(path.read_text())
    assert events  # Chrome trace JSON with the pipe's tasks
    assert f"written to {path}" in capsys.readouterr().out


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_gpt_trains_through_step_with_a_tied_head(
    schedule: str, capsys: pytest.CaptureFixture[str]
) -> None:
    gpt = load("gpt")
    argv = ["--steps", "8", "--batch", "8", "--layers", "2", "--width", "32", "--context", "32"]
    assert gpt.main([*argv, "--schedule", schedule, "--log-every", "4"]) == 0
    printed = capsys.readouterr().out
    assert "balance_by_time" in printed and "step    8/8" in printed
    assert "gradients differ from the plain model's by" in printed and "loss fell" in printed


def test_train_runs_the_pipe_call_too(capsys: pytest.CaptureFixture[str]) -> None:
    train = load("train")
    argv = ["--steps", "4", "--batch-size", "32", "--width", "16", "--depth", "1"]
    argv += ["--balance-timeout", "0.05", "--schedule", "call", "--log-every", "2"]
    assert train.main(argv) == 0
    assert "final losses agree" in capsys.readouterr().out
