"""Planning a model whose skip connections cross partitions: each layer profiled alone,
its popped skip served as often as it is timed; the plan's pipe as exact as the plain model."""

from __future__ import annotations

import copy
from collections.abc import Generator
from itertools import accumulate, combinations, pairwise
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pipeline.plan import Candidate, PlanError
from pipeline.plan.memory import layer_parameters
from pipeline.plan.profile import LayerTimes, saved_storages
from pipeline.plan.result import choose
from pipeline.plan.search import _Figures, candidates, memory_of
from pipeline.skip import pop, skippable, stash
from pipeline.step.schedules import resolve_schedule
from pipeline.step.simulate import validate
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


class Weights(nn.Module):
    """Many parameter bytes, next to no work: the memory a cut must spread."""

    def __init__(self, count: int) -> None:
        super().__init__()
        self.weights = nn.Parameter(torch.randn(count, dtype=torch.double))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.weights[0]


@skippable(stash=["wide"])
class KeepWide(nn.Module):
    def forward(self, x: Tensor) -> Generator[Any, Any, Tensor]:
        yield stash("wide", torch.tanh(x).repeat(1, 32))
        return x


@skippable(pop=["wide"])
class AddWide(nn.Module):
    def forward(self, x: Tensor) -> Generator[Any, Any, Tensor]:
        wide = yield pop("wide")
        return x + wide[:, :WIDTH]


@pytest.mark.parametrize(
    ("devices", "schedule"),
    [(["cuda:0", "cuda:1", "cuda:2", "cuda:3"], "zb-h1"), (["cpu"] * 3, "1f1b")],
)
def test_the_search_judges_each_cut_with_its_skips_own_stages(
    devices: list[str], schedule: str
) -> None:
    # A skip spanning two cuts or more is held from its stashing stage's forward: judged
    # as if from the neighbour, cuts were ruled out that fit (PlanError where one did, a
    # slower cut chosen where a faster one fit), and PlanError named 15 KiB over where the
    # least was 1 B.
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU()) for _ in range(5)]
    model = nn.Sequential(blocks[0], KeepWide(), Weights(500), *blocks[1:], AddWide()).double()
    x, y = batch(16)
    layers, stages = len(model), len(devices)
    saved = saved_storages(model, x[:4], y[:4], F.mse_loss, torch.device("cpu"))
    parameters = layer_parameters(model, 16)
    programs = resolve_schedule(schedule).programs(4, stages)
    places = tuple(memory_of(torch.device(d)) for d in devices)
    figures = _Figures(
        validate(programs, 4, stages).one_thread_order, set(), saved, parameters, places, None
    )
    times = LayerTimes((1.0,) * layers + (0.0,), (2.0,) * layers + (0.0,), (1.0,) * layers + (0.0,))

    def peak(spans: list[tuple[int, int]]) -> int:
        loads: dict[str, int] = {}
        for place, stage in zip(places, figures.cut(spans), strict=True):
            loads[place] = loads.get(place, 0) + stage.total
        return max(loads.values())

    cuts = [
        list(pairwise((0, *stops, layers))) for stops in combinations(range(1, layers), stages - 1)
    ]
    least = min(map(peak, cuts))

    def found(limit: int) -> list[Candidate]:
        return candidates(
            layers, [torch.device(d) for d in devices], 16, limit, (4,), (schedule,), ("never",),
            lambda rows: (saved, times), parameters, overhead=0.0,
        )  # fmt: skip

    for limit in sorted({peak(spans) for spans in cuts}):  # each fits a cut: a plan
        chosen = choose(model, found(limit), limit).chosen
        assert max(chosen.device_bytes.values()) <= limit
        assert chosen.memory == figures.cut(list(pairwise([0, *accumulate(chosen.balance)])))
    with pytest.raises(PlanError, match=r"over by 1 B"):
        choose(model, found(least - 1), least - 1)
