"""examples/gpt_module.py: the GPT of gpt.py as an ordinary module, equal to it, split like it."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch

import pipeline
from pipeline import Pipe

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_gpt_module_is_the_sequential_gpt_and_splits_into_its_layers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.syspath_prepend(str(EXAMPLES))  # as when run: it imports gpt.py beside it
    gpt, gpt_module = importlib.import_module("gpt"), importlib.import_module("gpt_module")
    args = gpt.parse_args(["--layers", "2", "--width", "16", "--heads", "2", "--context", "8"])
    torch.manual_seed(0)
    sequential = gpt.build_model(11, args).double()
    torch.manual_seed(0)
    model = gpt_module.build_gpt(11, args).double()
    tokens, targets = torch.randint(0, 11, (2, 3, 8))
    sequential.eval()
    model.eval()  # dropout off: the two draw their masks differently
    torch.testing.assert_close(model(tokens), sequential(tokens), rtol=0, atol=0)

    seq = pipeline.split(model, (tokens,))
    assert len(seq) == len(sequential) and list(seq.state_dict()) == list(model.state_dict())
    pipe = Pipe(seq, [2, 2], devices=["cpu"] * 2, chunks=3)
    loss = pipe.step(tokens, targets, gpt.language_model_loss)
    expected = gpt.language_model_loss(sequential(tokens), targets)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach())
    for (name, mine), theirs in zip(model.named_parameters(), sequential.parameters(), strict=True):
        assert mine.grad is not None and theirs.grad is not None, name
        torch.testing.assert_close(mine.grad, theirs.grad, msg=name)
    pipe.close()
