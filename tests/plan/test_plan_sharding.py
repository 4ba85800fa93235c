"""The terms of a stage sharded with FSDP2, as ``plan(mesh=)`` predicts them, in one process.

What a step holds is checked against them in 4 processes
(tests/distributed/sharded_scenarios.py); here, what FSDP2's padding and
refusals make of uneven, scalar and mixed parameters.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipeline.plan.links import Link
from pipeline.plan.sharding import (
    Collectives,
    layer_collectives,
    refuse_unshardable,
    sharded_parameters,
)


def test_parameters_whose_rows_do_not_divide_are_padded_as_fsdp2_pads_them() -> None:
    # A Linear(5, 7) over 2 shards: 7 rows padded to 8, each shard 4 rows; the gathered
    # buffer is the padded whole (it was counted unpadded, 4 to 40% low).
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 1, bias=False))
    terms = sharded_parameters(model, optimizer_bytes_per_param=8, shards=2)
    assert terms.nbytes == ((4 * 5 + 4) * 4, 0, 1 * 7 * 4)
    assert terms.gathered == ((8 * 5 + 8) * 4, 0, 2 * 7 * 4)
    assert terms.trained_bytes == ((7 * 5 + 7) * 4 + (4 * 5 + 4) * 4, 0, 7 * 4 + 7 * 4)
    assert terms.optimizer == ((4 * 5 + 4) * 8, 0, 7 * 8)


def test_one_shard_still_gathers_and_reduces_into_copies() -> None:
    # A mesh of dp=1: plan.distributed() shards every stage all the same.
    model = nn.Sequential(nn.Linear(4, 4))
    terms = sharded_parameters(model, optimizer_bytes_per_param=0, shards=1)
    whole = (16 + 4) * 4
    assert (terms.nbytes, terms.gathered, terms.trained_bytes) == ((whole,), (whole,), (2 * whole,))


def test_each_unit_gathers_and_reduces_once_a_step() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    model[2].weight.requires_grad_(False)
    collectives = Collectives(Link(1.0, 0.5), Link(2.0, 0.25))
    gather, reduce = layer_collectives(model, collectives)
    assert gather == (1.0 + 0.5 * 80, 0.0, 1.0 + 0.5 * 40)
    assert reduce == (2.0 + 0.25 * 80, 0.0, 2.0 + 0.25 * 8)  # the frozen weight: not reduced


class Scale(nn.Module):
    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(shape, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(2))


@pytest.mark.parametrize(
    ("layer", "words"),
    [
        (Scale(()), "0-dimensional parameter"),  # fully_shard refused it in some processes
        (Scale((2,), torch.float64), "2 dtypes"),  # FSDP2 failed at the first step
    ],
)
def test_what_fully_shard_cannot_shard_is_refused_before_any_work(
    layer: nn.Module, words: str
) -> None:
    with pytest.raises(ValueError, match=words):
        refuse_unshardable(nn.Sequential(nn.Linear(2, 2), layer))


def test_a_weight_held_by_two_layers_is_refused() -> None:
    tied = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 3))
    tied[2].weight = tied[0].weight
    with pytest.raises(ValueError, match="layers 0 and 2 hold one parameter"):
        refuse_unshardable(tied)
