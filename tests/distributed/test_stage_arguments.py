"""DistributedPipe's arguments as one process checks them, before the processes compare them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import pipeline
from pipeline.arguments import PipeArguments
from pipeline.distributed.stage_arguments import check_alone
from tests.split.split_models import early_late


def test_a_split_model_is_refused_and_a_sequential_of_layers_is_not() -> None:
    seq = pipeline.split(early_late(), (torch.randn(2, 8, dtype=torch.double),))
    with pytest.raises(TypeError, match="DistributedPipe does not take a split model"):
        check_alone(seq, [len(seq)], 1, "except_last", "tuple", False, processes=1)
    layers = nn.Sequential(nn.Linear(2, 2), nn.Tanh())
    checked = check_alone(layers, [1, 1], 2, "never", "tuple", False, processes=2)
    assert checked == PipeArguments([1, 1], 2, "never", "tuple", False)
