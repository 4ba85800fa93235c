"""Planning for processes: the search with a stage per process and messages on a link, and a
plan made in every rank of a gloo group building its DistributedPipe."""

from __future__ import annotations

import itertools
import random
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import pipeline
from pipeline.plan import Candidate, PlanError
from pipeline.plan.contention import NO_CONTENTION, Contention
from pipeline.plan.links import CutSeconds, Link, cut_seconds
from pipeline.plan.memory import layer_parameters
from pipeline.plan.pace import Pace, _factor
from pipeline.plan.profile import LayerTimes, Saved, saved_storages
from pipeline.plan.result import Processes, choose
from pipeline.plan.search import _Figures, candidates
from pipeline.plan.sharding import stage_collectives
from pipeline.plan.timing import StageCosts, predicted_seconds, stage_costs
from pipeline.step.actions import parse_program
from pipeline.step.schedules import OneFOneB, resolve_schedule
from pipeline.step.simulate import validate
from tests.plan.plan_models import batch, gelu_mlp

if TYPE_CHECKING:
    from tests.gloo_groups import GroupRunner

CPU = torch.device("cpu")
SCENARIOS = Path(__file__).with_name("plan_scenarios.py")
LAYERS = 4


def made_up_saved(rows: int, boundary: int = 1000) -> Saved:
    """Four layers each saving ``rows`` x 100 bytes and returning ``boundary`` bytes."""
    return Saved(
        storages=(rows * 100,) * LAYERS + (boundary,) * LAYERS,
        saved_by=tuple(frozenset({k}) for k in range(LAYERS)) + (frozenset(),) * LAYERS,
        outputs=tuple((LAYERS + k,) for k in range(LAYERS)),
        output_grads=(boundary,) * LAYERS,
        recorded=(0,) * LAYERS,
        tops=(0,) * LAYERS,
        anchored=(True,) * LAYERS,
        whole=(False,) * LAYERS,
    )


def made_up(link: Link | None, boundary: int = 1000, limit: int = 2**40) -> list[Candidate]:
    """Every candidate of four layers on two stages, no overhead: a batch of 8 rows takes
    8 s forward and 16 s backward per layer, a micro-batch its share."""

    def profiled(rows: int) -> tuple[Saved, LayerTimes]:
        f, b = (float(rows),) * LAYERS + (0.0,), (2.0 * rows,) * LAYERS + (0.0,)
        return made_up_saved(rows, boundary), LayerTimes(f, b, f)

    return candidates(
        LAYERS, [CPU, CPU], 8, limit, (1, 2, 4), ("gpipe", "1f1b", "interleaved"), ("never",),
        profiled, layer_parameters(gelu_mlp(LAYERS), 0), overhead=0.0, link=link,
    )  # fmt: skip


def test_a_message_waits_for_the_link_and_the_sender_goes_on() -> None:
    # One micro-batch through two stages of 1 s forwards, 2 s backwards: each message takes
    # 0.5 s, the step 6 s of compute and two messages.
    programs = [parse_program("0F0 0B0"), parse_program("1F0 1B0")]
    one = StageCosts(1.0, 2.0, 1.0, 1.0)
    cuts = CutSeconds((0.5,), (0.5,))
    assert predicted_seconds(programs, [one, one], set(), 0.0) == 6.0
    assert predicted_seconds(programs, [one, one], set(), 0.0, cuts=cuts) == 7.0
    # Two micro-batches, GPipe (9 s without links): stage 0's second forward does not wait
    # for the first send (0F1 runs 1..2), 1F0 runs 1.5..2.5, 1F1 2.5..3.5, 1B1 3.5..5.5,
    # 1B0 5.5..7.5; its gradient reaches stage 0 at 8: 0B0 runs 8..10.
    programs = [parse_program("0F0 0F1 0B1 0B0"), parse_program("1F0 1F1 1B1 1B0")]
    assert predicted_seconds(programs, [one, one], set(), 0.0) == 9.0
    assert predicted_seconds(programs, [one, one], set(), 0.0, cuts=cuts) == 10.0
    # Messages of one cut and direction take turns: at 1.5 s each, the second activation
    # leaves at 2.5 when the first has crossed, not at 2 when 0F1 ends (10.5 s if it did).
    slow = CutSeconds((1.5,), (0.0,))
    assert predicted_seconds(programs, [one, one], set(), 0.0, cuts=slow) == 11.0


def test_each_cut_costs_its_latency_and_its_bytes_and_nothing_within_a_process() -> None:
    saved = made_up_saved(rows=2, boundary=1000)
    spans = [(0, 1), (1, 2), (2, 3), (3, 4)]
    cuts = cut_seconds(saved, spans, [0, 1, 1, 0], Link(1e-3, 1e-6))
    assert cuts.forward == pytest.approx((2e-3, 0.0, 2e-3))
    assert cuts.backward == pytest.approx((2e-3, 0.0, 2e-3))


def test_processes_hold_their_own_memory_and_a_slow_link_costs_time() -> None:
    free = made_up(Link(0.0, 0.0))
    # Planned for processes, a stage's memory counts against its process's limit.
    assert {c.places for c in free if c.schedule != "interleaved"} == {("rank 0", "rank 1")}
    assert {c.places for c in free if c.schedule == "interleaved"} == {
        ("rank 0", "rank 1", "rank 0", "rank 1")
    }
    assert all(sorted(c.device_bytes) == ["rank 0", "rank 1"] for c in free)
    # A link that costs nothing predicts what one process with a thread per stage does.
    threads = made_up(None)
    # (Each configuration and balance alike; threads sharing the CPU also try the cut
    # that needs the least memory in all.)
    timed = {c.describe(): c.seconds for c in threads}
    assert all(timed[c.describe()] == c.seconds for c in free)
    assert all(c.places == () and list(c.device_bytes) == ["cpu"] for c in threads)
    # Free messages: the most micro-batches, interleaved, the least bubble. Every message
    # 100 s: each crossing costs more than a micro-batch's bubble saves, so one chunk wins.
    best = min(free, key=lambda c: c.seconds)
    assert (best.chunks, best.schedule) == (4, "interleaved")
    slow = made_up(Link(100.0, 0.0))
    assert min(slow, key=lambda c: c.seconds).chunks == 1


def test_a_tied_weight_is_held_once_by_each_process_holding_it() -> None:
    # docs/distributed_pipe.md: every holder of a tied weight keeps a copy, trained and
    # stepped in its own process. The planner counted it on its first holder only: rank 1
    # held 110 KiB where the plan said 25 KiB.
    model = gelu_mlp(LAYERS)
    model[-1].weight = model[0][0].weight  # the first layer's weight, tied to the last's
    tied = model[0][0].weight.numel() * 8
    parameters = layer_parameters(model, optimizer_bytes_per_param=16)

    def profiled(rows: int) -> tuple[Saved, LayerTimes]:
        f, b = (float(rows),) * LAYERS + (0.0,), (2.0 * rows,) * LAYERS + (0.0,)
        return made_up_saved(rows), LayerTimes(f, b, f)

    def found(link: Link | None, schedule: str) -> dict[tuple[int, ...], Candidate]:
        found = candidates(
            LAYERS, [CPU, CPU], 8, 2**40, (2,), (schedule,), ("never",), profiled, parameters,
            overhead=0.0, link=link,
        )  # fmt: skip
        return {c.balance: c for c in found}

    link = Link(1e-4, 1e-9)
    for balance, planned in found(link, "1f1b").items():
        one = found(None, "1f1b")[balance]  # one process: one tensor, on its first holder
        first, last = planned.memory[0], planned.memory[-1]
        assert first.parameters == one.memory[0].parameters
        assert last.parameters == one.memory[-1].parameters + tied, balance
        assert last.gradients == one.memory[-1].gradients + tied, balance
        assert last.optimizer == one.memory[-1].optimizer + 2 * tied, balance
    # Interleaved, [1, 1, 1, 1]: stages 0 and 2 in rank 0, 1 and 3 (the last, tied) in rank 1.
    stages = found(link, "interleaved")[(1, 1, 1, 1)].memory
    assert stages[3].parameters == parameters.stage(3, 4).nbytes + tied
    # Tied to the third layer instead, both holders in rank 0: one copy there.
    model[-1].weight, model[2][0].weight = (
        nn.Parameter(model[-1].weight.detach().clone()),
        model[0][0].weight,
    )
    parameters = layer_parameters(model, optimizer_bytes_per_param=16)
    stages = found(link, "interleaved")[(1, 1, 1, 1)].memory
    assert stages[2].parameters == parameters.stage(2, 3).nbytes
    assert stages[0].parameters == parameters.stage(0, 1).nbytes


class Weights(nn.Module):
    """Many parameter bytes, next to no work: the memory a cut must spread."""

    def __init__(self, count: int) -> None:
        super().__init__()
        self.weights = nn.Parameter(torch.randn(count, dtype=torch.double))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weights[0]


@pytest.mark.parametrize("schedule", ["interleaved", "1f1b"])
@pytest.mark.parametrize(
    ("sizes", "tied"),
    [((3000, 0, 0, 0, 3000, 0), False), ((0, 3000, 3000, 0, 500, 0), False),
     ((3000, 0, 3000, 0, 0, 0), True)],
)  # fmt: skip
def test_processes_fit_wherever_a_cut_does_and_the_least_overflow_is_named(
    sizes: tuple[int, ...], tied: bool, schedule: str
) -> None:
    # Interleaved over 2 processes: stages 0 and 2 in rank 0, 1 and 3 in rank 1. The search
    # tried an even share of the limit per stage, the compute cut and the least memory summed
    # over all stages: "no configuration fits" for limits that a cut fitted. Where nothing
    # fitted, with a stage per process too, the error named a cut 1.5 MB over where the
    # least was 1 KB over.
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(16, 16), nn.GELU()) for _ in sizes]
    model = nn.Sequential(*(Weights(n) if n else b for n, b in zip(sizes, blocks, strict=True)))
    model = model.double()
    if tied:  # the first layer's weights, tied to the third's: once in a process holding both
        model[2].weights = model[0].weights
    x, y = batch(16)
    layers = len(model)
    saved = saved_storages(model, x[:8], y[:8], F.mse_loss, CPU)
    parameters = layer_parameters(model, 16)
    stages = 4 if schedule == "interleaved" else 2
    programs = resolve_schedule(schedule).programs(2, stages)
    order = validate(programs, 2, stages).one_thread_order
    places = tuple(f"rank {j % 2}" for j in range(stages))
    figures = _Figures(order, set(), saved, parameters, places, Link(1e-4, 1e-9))
    loads = []
    for stops in itertools.combinations(range(1, layers), stages - 1):
        spans = list(itertools.pairwise((0, *stops, layers)))
        totals = [stage.total for stage in figures.cut(spans)]
        loads.append(max(sum(totals[0::2]), sum(totals[1::2])))
    least = min(loads)
    times = LayerTimes((1.0,) * layers + (0.0,), (2.0,) * layers + (0.0,), (1.0,) * layers + (0.0,))

    def found(limit: int) -> list[Candidate]:
        return candidates(
            layers, [CPU, CPU], 16, limit, (2,), (schedule,), ("never",),
            lambda rows: (saved, times), parameters, overhead=0.0, link=Link(1e-4, 1e-9),
        )  # fmt: skip

    processes = Processes(2, None, CPU, Link(1e-4, 1e-9))
    chosen = choose(model, found(least), least, 1.0, 0.0, processes).chosen
    assert max(chosen.device_bytes.values()) <= least
    with pytest.raises(PlanError, match=r"rank \d needs .*, over by 1 B"):
        choose(model, found(least - 1), least - 1, 1.0, 0.0, processes)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_choice_is_the_fastest_predicted_cut_that_fits(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Fitting cuts were ranked by their slowest stage and one kept, where a process runs
    # two interleaved stages: the plan was up to 19.5% slower, by its own prediction, than
    # a cut that fitted.
    rnd = random.Random(seed)
    torch.manual_seed(seed)
    layers = 8
    model = nn.Sequential(*[Weights(rnd.choice([1, 1, 500, 2000, 4000])) for _ in range(layers)])
    model = model.double()
    x, y = batch(16)
    saved = saved_storages(model, x[:8], y[:8], F.mse_loss, CPU)
    forward = tuple(rnd.uniform(0.5, 3.0) for _ in range(layers)) + (0.0,)
    times = LayerTimes(forward, tuple(2 * t for t in forward), forward)
    link = Link(1e-4, 1e-9)

    def found(limit: int) -> list[Candidate]:
        return candidates(
            layers, [CPU, CPU], 16, limit, (2,), ("interleaved",), ("never",),
            lambda rows: (saved, times), layer_parameters(model, 16), overhead=0.0, link=link,
        )  # fmt: skip

    stops = itertools.combinations(range(1, layers), 3)
    every = [[b - a for a, b in itertools.pairwise((0, *cut, layers))] for cut in stops]

    def brute_force() -> list[Candidate]:  # every cut a candidate
        with monkeypatch.context() as patched:
            search = sys.modules[candidates.__module__]  # pipeline.plan is also a function
            patched.setattr(search, "shared_balances", lambda *_: (every, every[0]))
            return found(2**40)

    peaks = sorted({max(c.device_bytes.values()) for c in brute_force()})
    for limit in peaks[:: len(peaks) // 5]:
        plan = choose(model, found(limit), limit, 1.0, 0.0, None).chosen
        fastest = min(c.seconds for c in brute_force() if max(c.device_bytes.values()) <= limit)
        assert plan.seconds == pytest.approx(fastest), limit


def test_the_bytes_on_the_link_move_the_choice() -> None:
    # The same link, messages of 1 kB or of 100 GB: the large ones make one chunk win.
    link = Link(0.0, 1e-9)
    small = min(made_up(link, boundary=1000), key=lambda c: c.seconds)
    large = min(made_up(link, boundary=10**11), key=lambda c: c.seconds)
    assert small.chunks == 4 and large.chunks == 1


def test_the_table_and_the_overflow_name_processes() -> None:
    found = made_up(Link(1e-4, 1e-9))
    processes = Processes(2, None, CPU, Link(1e-4, 1e-9))
    plan = choose(gelu_mlp(LAYERS), found, 2**40, {2: NO_CONTENTION}, 0.0, processes)
    lines = str(plan).splitlines()
    assert lines[0] == (
        "Plan (memory limit 1024.0 GiB per process, CPU contention x1.00, 0 us per action, "
        "2 processes, link 100 us + 1.000 ns/B per message)"
    )
    assert "peak per process" in lines[1]
    least = min(max(c.device_bytes.values()) for c in found)
    tight = made_up(Link(1e-4, 1e-9), limit=least - 1)
    with pytest.raises(PlanError, match=r"per process\. .*: rank \d needs .*, over by 1 B"):
        choose(gelu_mlp(LAYERS), tight, least - 1, 1.0, 0.0, processes)
    with pytest.raises(ValueError, match=r"made outside a process group: call pipeline.plan"):
        plan.distributed()


def test_outside_a_group_a_plan_for_processes_needs_the_link_and_the_action_cost() -> None:
    x, y = batch(8)
    model = gelu_mlp(LAYERS)
    with pytest.raises(ValueError, match=r"torch.distributed is not initialised here: call"):
        pipeline.plan(model, x, y, F.mse_loss, processes=2, batch_size=8, memory_limit=2**30)
    plan = pipeline.plan(
        model, x, y, F.mse_loss, processes=2, batch_size=8, memory_limit=2**30, chunks=[2],
        schedules=("1f1b",), checkpoints=("never",), repeats=1, contention=1.0,
        action_overhead=1e-4, link_latency=2e-4, link_seconds_per_byte=1e-9,
    )  # fmt: skip
    assert plan.processes == Processes(2, None, CPU, Link(2e-4, 1e-9))
    assert sorted(plan.predicted_memory) == ["rank 0", "rank 1"]
    with pytest.raises(ValueError, match=r"this plan is for 2 processes: build this process"):
        plan.pipe()


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        ({"devices": None}, TypeError, "exactly one of them; got devices=None, processes=None"),
        ({"processes": 2}, TypeError, r"exactly one of them; got devices=\['cpu'"),
        ({"link_latency": 1e-4}, ValueError, "plan with processes=N to use them"),
        ({"devices": None, "processes": 0}, ValueError, "processes must be positive"),
        (
            {"devices": None, "processes": 9, "link_latency": 0, "link_seconds_per_byte": 0},
            ValueError,
            "9 processes but the model has 4 layers; every stage needs a layer at least: pass "
            "fewer processes",
        ),
        (
            {"devices": None, "processes": 2, "link_latency": 1e-4},
            ValueError,
            "only link_latency was given",
        ),
        (
            {"devices": None, "processes": 2, "link_latency": -1.0, "link_seconds_per_byte": 0},
            ValueError,
            "link_latency must be a number of seconds, 0 or more, got -1.0",
        ),
    ],
)
def test_bad_placements_are_refused_before_any_work(
    change: dict[str, object], error: type[Exception], message: str
) -> None:
    x, y = batch(8)
    options: dict[str, object] = {
        "devices": ["cpu", "cpu"], "batch_size": 8, "memory_limit": 2**30,
        "action_overhead": 1e-4, "contention": 1.0, **change,
    }  # fmt: skip
    with pytest.raises(error, match=message):
        pipeline.plan(gelu_mlp(LAYERS), x, y, F.mse_loss, **options)  # type: ignore[arg-type]


NAMES = [
    "every_process_plans_the_same_pipe_and_its_step_equals_the_plain_model",
    "an_interleaved_plan_runs_two_stages_per_process_and_equals_the_plain_model",
    "plans_made_with_different_arguments_are_refused_by_every_process",
    "different_plans_build_no_pipe_every_process_refuses",
    "a_plan_for_processes_builds_no_pipe_and_takes_no_planned_option_again",
]


def test_two_processes_plan_alike_and_their_pipe_equals_the_plain_model(
    group_runner: GroupRunner,
) -> None:
    outcomes = group_runner(NAMES, script=SCENARIOS, world_size=2, wall_timeout_s=120)
    failures = [
        f"rank {r}, {name}:\n{outcome.get(name)}"
        for name in NAMES
        for r, outcome in enumerate(outcomes)
        if outcome.get(name) != "ok"
    ]
    assert not failures, "\n".join(failures)


def test_the_pace_fitted_to_a_step_plays_that_step_and_scales_every_candidate() -> None:
    # A step measured at 1.5 times the profile's compute, plus 2 s outside the actions: the
    # factor found plays the profile's 1F1B step in exactly the measured time, and a
    # candidate planned with that pace is predicted at that time too.
    saved = made_up_saved(2)
    times = LayerTimes((2.0,) * LAYERS + (0.0,), (4.0,) * LAYERS + (0.0,), (2.0,) * LAYERS + (0.0,))
    link = Link(0.25, 0.0)
    programs = OneFOneB().programs(4, 2)
    cuts = cut_seconds(saved, [(0, 2), (2, 4)], [0, 1], link)

    # Sharded stages' collectives, per layer: played beside the actions, not scaled.
    sharded = ((0.3,) * LAYERS, (0.7,) * LAYERS)

    def played(factor: float, collectives: Any = None) -> float:
        costs = [stage_costs(times, a, b, Contention(factor, factor)) for a, b in [(0, 2), (2, 4)]]
        fixed = stage_collectives(collectives, [(0, 2), (2, 4)])
        return predicted_seconds(programs, costs, set(), 0.5, None, cuts, fixed)

    measured = 2.0 + played(1.5)
    factor = _factor("1f1b", 4, (saved, times), [2, 2], 2, measured, 2.0, link, 0.5, None)
    assert factor == pytest.approx(1.5, rel=1e-6)
    with_collectives = 2.0 + played(1.5, sharded)
    assert with_collectives > measured
    fitted = _factor("1f1b", 4, (saved, times), [2, 2], 2, with_collectives, 2.0, link, 0.5,
                     sharded)  # fmt: skip
    assert fitted == pytest.approx(1.5, rel=1e-6)
    pace = Pace(factor, 2.0)
    found = candidates(
        LAYERS, [CPU, CPU], 8, 2**40, (4,), ("1f1b",), ("never",), lambda rows: (saved, times),
        layer_parameters(gelu_mlp(LAYERS), 0), overhead=0.5, link=link, paces={("1f1b", 4): pace},
    )  # fmt: skip
    # The cut the pace was measured on (others fit too: the search predicts them all).
    even = next(c for c in found if c.balance == (2, 2))
    assert even.seconds == pytest.approx(measured, rel=1e-6)
    sharded_found = candidates(
        LAYERS, [CPU, CPU], 8, 2**40, (4,), ("1f1b",), ("never",), lambda rows: (saved, times),
        layer_parameters(gelu_mlp(LAYERS), 0), overhead=0.5, link=link, paces={("1f1b", 4): pace},
        collectives=sharded,
    )  # fmt: skip
    even = next(c for c in sharded_found if c.balance == (2, 2))
    assert even.seconds == pytest.approx(with_collectives, rel=1e-6)
    # Without it, the same candidate is the profile's time: less by the pace's share.
    plain = candidates(
        LAYERS, [CPU, CPU], 8, 2**40, (4,), ("1f1b",), ("never",), lambda rows: (saved, times),
        layer_parameters(gelu_mlp(LAYERS), 0), overhead=0.5, link=link,
    )  # fmt: skip
    even = next(c for c in plain if c.balance == (2, 2))
    assert even.seconds == pytest.approx(played(1.0), rel=1e-6)
    # A step the link and the actions' own cost already exceed: the smallest factor.
    assert _factor("1f1b", 4, (saved, times), [2, 2], 2, 1.0, 2.0, link, 0.5) == 0.01
    assert str(pace) == "x1.50 + 2000.0 ms"
