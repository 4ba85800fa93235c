"""DistributedPipe's arguments as one process checks them, before the processes compare them."""

from __future__ import annotations

import torch
from torch import nn

import pipeline
from pipeline.arguments import PipeArguments
from pipeline.distributed.stage_arguments import _layer_texts, check_alone
from tests.split.split_models import early_late


def test_a_split_model_is_taken_and_its_pieces_are_what_the_processes_compare() -> None:
    seq = pipeline.split(early_late(), (torch.randn(2, 8, dtype=torch.double),))
    checked = check_alone(seq, [2, len(seq) - 2], 1, "except_last", "tuple", False, processes=2)
    assert checked == PipeArguments([2, len(seq) - 2], 1, "except_last", "tuple", False)
    # The layers the pipe splits: the pieces, not the model's 4 children.
    shown = [text for _, text in _layer_texts(seq)]
    assert len(shown) == len(seq) == 6
    assert shown[2].startswith("'2': Piece, parameter blocks.1.norm.weight (8,) torch.float64")
    layers = nn.Sequential(nn.Linear(2, 2), nn.Tanh())
    checked = check_alone(layers, [1, 1], 2, "never", "tuple", False, processes=2)
    assert checked == PipeArguments([1, 1], 2, "never", "tuple", False)
