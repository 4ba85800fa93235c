"""Planning a model whose skip connections cross partitions: each layer profiled alone,
its popped skip served as often as it is timed; the plan's pipe as exact as the plain model."""

from __future__ import annotations

import copy
from collections.abc import Generator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pipeline.skip import pop, skippable, stash
from tests.helpers import grads
from tests.plan.plan_models import WIDTH, batch, one_thread, planned_step

pytestmark = pytest.mark.usefixtures(one_thread.__name__)


@skippable(stash=["skip"])
class Keep(nn.Module):
    def forward(self, x: Tensor) -> Generator[Any, Any, Tensor]:
        yield stash("skip", torch.tanh(x))
        return x


@skippable(pop=["skip"])
class Gate(nn.Module):
    """Multiplies by the popped skip: its backward saves both, so the skip is an activation."""

    def forward(self, x: Tensor) -> Generator[Any, Any, Tensor]:
        skip = yield pop("skip")
        return x * skip


def skip_model(last: str = "linear") -> nn.Sequential:
    """``last``: what Gate follows, a Linear, or a GELU block (which saved its input above
    the stage's topmost weight: zero-bubble's I lets it go, and Gate's, which has none)."""
    torch.manual_seed(0)
    # Keep first and Gate last: every cut in two has the skip cross it (a cut by time
    # beside them, as at first, moved with the machine's load).
    layers: list[nn.Module] = [Keep(), nn.Linear(WIDTH, WIDTH)]
    layers += [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU()) for _ in range(4)]
    layers += [nn.Linear(WIDTH, WIDTH)] if last == "linear" else []
    return nn.Sequential(*layers, Gate()).double()


@pytest.mark.parametrize("mode", ["never", "except_last", "always"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1", "zb-h1-peak"])
def test_a_planned_skip_model_steps_like_the_plain_model_with_the_predicted_activations(
    schedule: str, mode: str
) -> None:
    check_planned(skip_model(), schedule, mode)


@pytest.mark.parametrize("schedule", ["zb-h1", "zb-h1-peak"])
def test_a_last_layer_without_weights_is_not_where_i_keeps_the_graph_from(schedule: str) -> None:
    # Each layer is profiled on copies of its input; the leaves under them were taken
    # for weights, so Gate for the stage's topmost weight, and its stage's peak under
    # zb-h1-peak was predicted with a GELU's saved input more per micro-batch.
    check_planned(skip_model(last="gelu"), schedule, "never")


def check_planned(model: nn.Sequential, schedule: str, mode: str) -> None:
    """The plan's pipe: its measured activations the predicted ones, its gradients the
    plain model's."""
    _, pipe, check = planned_step(copy.deepcopy(model), schedule, mode)
    assert check.measured_activations == check.predicted_activations
    x, y = batch()
    F.mse_loss(model(x), y).backward()
    for name, expected in grads(model).items():
        torch.testing.assert_close(grads(pipe)[name], expected, rtol=0, atol=1e-12)
