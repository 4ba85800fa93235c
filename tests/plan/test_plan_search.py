"""The search chooses the fastest configuration that fits; refusals name what was wrong."""

from __future__ import annotations

import copy
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import pipeline
from pipeline.plan import Candidate, PlanError
from pipeline.plan.held import PeakForms
from pipeline.plan.memory import layer_parameters, stage_memory
from pipeline.plan.profile import LayerTimes, Saved, saved_storages
from pipeline.plan.result import Plan, choose
from pipeline.plan.search import candidates
from pipeline.step.schedules import resolve_schedule
from pipeline.step.simulate import validate
from tests.plan.plan_models import ROWS, batch, gelu_mlp, one_thread

pytestmark = pytest.mark.usefixtures(one_thread.__name__)

CPU = torch.device("cpu")


def searched(
    devices: list[torch.device],
    limit: int,
    schedules: tuple[str, ...] = ("gpipe", "1f1b", "zb-h1"),
    optimizer_bytes: int = 8,
    depth: int = 6,
    rows: int = ROWS,
    chunks: tuple[int, ...] = (1, 2, 4, 8),
    modes: tuple[str, ...] = ("never", "except_last", "always"),
) -> tuple[nn.Sequential, list[Candidate]]:
    """Every candidate for the MLP of ``depth`` layers, with measured memory and made-up times.

    Each layer's forward takes 1 s, its backward 2 s (input and weight
    gradients 1 s each), the loss nothing: the search is then deterministic.
    """
    model = gelu_mlp(depth)
    x, y = batch(rows)
    layers = len(model)
    times = LayerTimes((1.0,) * layers + (0.0,), (2.0,) * layers + (0.0,), (1.0,) * layers + (0.0,))
    saved: dict[int, Saved] = {}

    def profiled(rows: int) -> tuple[Saved, LayerTimes]:
        if rows not in saved:
            saved[rows] = saved_storages(model, x[:rows], y[:rows], F.mse_loss, CPU)
        return saved[rows], times

    found = candidates(
        layers, devices, rows, limit, chunks, schedules, modes, profiled,
        layer_parameters(model, optimizer_bytes), overhead=0.0,
    )  # fmt: skip
    return model, found


def test_a_tight_limit_picks_a_configuration_that_fits_a_loose_one_a_faster_one() -> None:
    model, found = searched([CPU, CPU], limit=2**40)
    loose = choose(model, found, 2**40)
    needs = loose.predicted_memory["cpu"]
    model, found = searched([CPU, CPU], limit=needs - 1)
    tight = choose(model, found, needs - 1)
    assert max(tight.predicted_memory.values()) <= needs - 1
    assert tight.predicted_seconds > loose.predicted_seconds
    lost = [why for c, why in tight.runner_ups if c.describe() == loose.chosen.describe()]
    assert lost in ([], ["over the limit on cpu by 1 B"])
    assert not [c for c in found if c.fits and c.seconds < tight.predicted_seconds]


def test_the_balance_moves_layers_off_a_stage_that_holds_more_micro_batches() -> None:
    # 1F1B's first stage of four holds four micro-batches, the last one, and the
    # stages between hold mail both ways: cut for compute alone ([2, 2, 2, 2]) the
    # stage needing the most overflows, so it gets fewer layers and the last one more.
    devices = [torch.device(f"cuda:{k}") for k in range(4)]
    options = {"schedules": ("1f1b",), "optimizer_bytes": 0, "depth": 8, "rows": 256}
    _, found = searched(devices, limit=2**40, **options)  # type: ignore[arg-type]
    # Each configuration also has the cut whose fullest stage holds least: slower.
    even = min((c for c in found if (c.chunks, c.checkpoint) == (8, "never")), key=seconds)
    assert even.balance == (2, 2, 2, 2)
    limit = max(stage.total for stage in even.memory) - 1
    _, found = searched(devices, limit=limit, **options)  # type: ignore[arg-type]
    config = [c for c in found if (c.chunks, c.checkpoint) == (8, "never")]
    assert [c.fits for c in config if c.balance == (2, 2, 2, 2)] == [False]
    fitting = min((c for c in config if c.fits), key=seconds)
    worst = [stage.total for stage in even.memory].index(limit + 1)
    assert worst < 3 and fitting.balance[worst] == 1 and fitting.balance[-1] > 2
    assert all(stage.total <= limit for stage in fitting.memory)


def seconds(candidate: Candidate) -> float:
    return candidate.seconds


def test_when_nothing_fits_the_error_names_the_device_and_the_overflow() -> None:
    model, found = searched([CPU, CPU], limit=1000)
    cheapest = min(max(c.device_bytes.values()) for c in found)
    over = cheapest - 1000
    with pytest.raises(PlanError, match=rf"device cpu needs .*, over by .* \({over} bytes\)"):
        choose(model, found, 1000)


def test_stages_sharing_a_device_share_its_limit_unevenly_where_that_fits() -> None:
    # 1F1B's first stage holds more micro-batches than its last: the least total
    # on the device is a lopsided cut, which an even share of the limit per stage
    # never tried, so a limit that it fitted raised PlanError.
    model = gelu_mlp()
    x, y = batch()
    saved = saved_storages(model, x[: ROWS // 2], y[: ROWS // 2], F.mse_loss, CPU)
    programs = resolve_schedule("1f1b").programs(2, 2)
    order = validate(programs, 2, 2).one_thread_order
    parameters = layer_parameters(model, 8)
    layers = len(model)
    least = min(
        stage_memory(PeakForms(order, 0, set()), saved, parameters, 0, k).total
        + stage_memory(PeakForms(order, 1, set()), saved, parameters, k, layers).total
        for k in range(1, layers)
    )
    model, found = searched([CPU, CPU], least, ("1f1b",), chunks=(2,), modes=("never",))
    chosen = choose(model, found, least).chosen
    assert chosen.fits and max(chosen.device_bytes.values()) <= least


def test_cpu_and_cpu0_are_one_memory_under_one_limit() -> None:
    # Keyed by the device's name, "cpu:0" and "cpu" each got the whole limit: a plan said
    # 47 KiB and 50 KiB within 49.5 KiB, where the CPU held their 96 KiB.
    _, found = searched([torch.device("cpu:0"), CPU], limit=2**40, chunks=(2,))
    _, alike = searched([CPU, CPU], limit=2**40, chunks=(2,))
    assert all(c.device_bytes.keys() == {"cpu"} for c in found)
    assert [c.device_bytes for c in found] == [c.device_bytes for c in alike]


def test_the_table_shows_the_choice_and_why_each_runner_up_lost() -> None:
    model, found = searched([CPU, CPU], limit=2**40)
    plan = choose(model, found, 2**40)
    lines = str(plan).splitlines()
    assert lines[0] == (
        "Plan (memory limit 1024.0 GiB per device, CPU contention x1.00, 0 us per action)"
    )
    assert lines[2].startswith("chosen") and lines[2].endswith("fastest that fits")
    assert len(lines) == 3 + len(plan.runner_ups)
    assert all(re.search(r"slower by \d+\.\d%$", line) for line in lines[3:])


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        ({"memory_limit": 0}, ValueError, "memory_limit must be positive"),
        ({"memory_limit": -5}, ValueError, "memory_limit must be positive"),
        ({"memory_limit": True}, TypeError, "memory_limit must be a whole number"),
        ({"chunks": [3, 4]}, ValueError, r"chunks \[3\] do not divide batch_size=32"),
        ({"batch_size": 16}, ValueError, "batch_size=16 but the sample input has 32 rows"),
        ({"schedules": ["pipedream"]}, ValueError, "schedules must be a non-empty list"),
        ({"checkpoints": []}, ValueError, "checkpoints must be a non-empty list"),
        ({"devices": ["cpu"] * 7}, ValueError, "7 devices but the model has 6 layers"),
        ({"devices": "cpu"}, TypeError, "devices must be a non-empty list"),
        ({"optimizer_bytes_per_param": -1}, ValueError, "optimizer_bytes_per_param must be"),
        # Measures no machine has gave figures of none: -1000 ms, nan ms.
        ({"action_overhead": -1.0}, ValueError, "action_overhead must be None"),
        ({"action_overhead": float("nan")}, ValueError, "action_overhead must be None"),
        ({"contention": 0.0}, ValueError, "contention must be None"),
        ({"contention": float("nan")}, ValueError, "contention must be None"),
        ({"repeats": 0}, ValueError, "repeats must be positive"),
        # Planned, and printed, for a device the machine lacks; refused by plan.pipe() only.
        ({"devices": ["cpu", "meta"]}, ValueError, "include the meta device"),
        ({"devices": ["cpu", f"cuda:{torch.cuda.device_count()}"]}, ValueError, "not available"),
    ],
)
def test_bad_arguments_are_refused_before_any_work(
    change: dict[str, object], error: type[Exception], message: str
) -> None:
    x, y = batch()
    arguments: dict[str, object] = {"devices": ["cpu", "cpu"], "batch_size": 32,
                                    "memory_limit": 2**30}  # fmt: skip
    arguments.update(change)
    with pytest.raises(error, match=message):
        pipeline.plan(gelu_mlp(), x, y, F.mse_loss, **arguments)  # type: ignore[arg-type]


def test_a_target_of_other_rows_than_the_sample_is_refused_before_any_work() -> None:
    # It was profiled (the loss broadcast one row, or failed inside mse_loss), and the plan's
    # pipe refused it at its first step.
    x, y = batch()
    for target in (y[:1], y[:8]):
        with pytest.raises(ValueError, match=f"the target has {len(target)} rows"):
            pipeline.plan(gelu_mlp(), x, target, F.mse_loss, devices=["cpu", "cpu"],
                          batch_size=len(x), memory_limit=2**30)  # fmt: skip


class _TwoOut(nn.Linear):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        return super().forward(x), torch.tanh(x)


class _Join(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a * b


def test_a_positional_sequential_is_built_as_it_was_planned() -> None:
    # Profiled spreading each tuple into the next layer's arguments, it was built with the
    # default call style, which hands the tuple whole: the first step failed in a layer.
    torch.manual_seed(0)
    model = pipeline.PositionalSequential(_TwoOut(16, 16), _Join(), nn.Linear(16, 16)).double()
    plain = copy.deepcopy(model)
    x, y = batch()
    plan = pipeline.plan(model, x, y, F.mse_loss, devices=["cpu", "cpu"], batch_size=len(x),
                         memory_limit=2**30, chunks=[2], repeats=1)  # fmt: skip
    pipe = plan.pipe()
    assert pipe.call_style == "positional"
    pipe.step(x, y, F.mse_loss, schedule=plan.schedule)
    F.mse_loss(plain(x), y).backward()
    for planned, expected in zip(pipe.parameters(), plain.parameters(), strict=True):
        assert planned.grad is not None and expected.grad is not None
        torch.testing.assert_close(planned.grad, expected.grad, rtol=0, atol=1e-12)


def test_a_model_that_is_not_sequential_is_refused() -> None:
    x, y = batch()
    with pytest.raises(TypeError, match=r"pipeline.split\(model"):
        pipeline.plan(nn.Linear(16, 16), x, y, F.mse_loss, devices=["cpu"], batch_size=32,  # type: ignore[arg-type]
                      memory_limit=2**30)  # fmt: skip


def test_the_planned_pipe_trains_to_the_plain_models_gradients() -> None:
    x, y = batch()
    model = gelu_mlp()
    plain = copy.deepcopy(model)
    F.mse_loss(plain(x), y).backward()
    plan = pipeline.plan(model, x, y, F.mse_loss, devices=["cpu", "cpu"], batch_size=len(x),
                         memory_limit=2**30, chunks=[4], repeats=1)  # fmt: skip
    pipe = plan.pipe()
    assert (pipe.balance, pipe.chunks, pipe.checkpoint) == (plan.balance, 4, plan.checkpoint)
    pipe.step(x, y, F.mse_loss, schedule=plan.schedule)
    for planned, expected in zip(pipe.parameters(), plain.parameters(), strict=True):
        assert planned.grad is not None and expected.grad is not None
        torch.testing.assert_close(planned.grad, expected.grad, rtol=0, atol=1e-12)


def test_check_refuses_a_pipe_of_another_configuration() -> None:
    model, found = searched([CPU, CPU], limit=2**40)
    plan: Plan = choose(model, found, 2**40)
    other = pipeline.Pipe(copy.deepcopy(model), plan.balance, devices=["cpu", "cpu"],
                          chunks=plan.chunks * 2, checkpoint=plan.checkpoint)  # type: ignore[arg-type]  # fmt: skip
    with pytest.raises(ValueError, match="has run no step yet"):
        plan.check(other)
    x, y = batch()
    other.step(x, y, F.mse_loss, schedule=plan.schedule)
    with pytest.raises(ValueError, match=rf"chunks {plan.chunks * 2} \(planned {plan.chunks}\)"):
        plan.check(other)


def test_balance_can_be_imported_before_pipeline() -> None:
    # balance imports pipeline, whose __init__ imports the planner, which uses balance.
    code = "import balance, pipeline; print(pipeline.plan.__name__)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "plan"


class Shifted(nn.Module):
    """A first layer that takes a keyword argument, split like the input."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16).double()

    def forward(self, x: torch.Tensor, *, shift: torch.Tensor) -> torch.Tensor:
        return self.linear(x + shift)


def test_the_first_layers_keyword_arguments_are_profiled_and_stepped() -> None:
    x, y = batch()
    shift = torch.randn_like(x)
    model = nn.Sequential(Shifted(), *gelu_mlp(depth=3))
    plain = copy.deepcopy(model)
    F.mse_loss(plain[1:](plain[0](x, shift=shift)), y).backward()
    plan = pipeline.plan(model, x, y, F.mse_loss, kwargs={"shift": shift}, devices=["cpu", "cpu"],
                         batch_size=len(x), memory_limit=2**30, chunks=[2], repeats=1)  # fmt: skip
    pipe = plan.pipe()
    pipe.step(x, y, F.mse_loss, kwargs={"shift": shift}, schedule=plan.schedule,
              measure_memory=True)  # fmt: skip
    check = plan.check(pipe)
    assert check.measured_activations == check.predicted_activations
    for planned, expected in zip(pipe.parameters(), plain.parameters(), strict=True):
        assert planned.grad is not None and expected.grad is not None
        torch.testing.assert_close(planned.grad, expected.grad, rtol=0, atol=1e-12)


def test_planning_leaves_the_model_and_the_random_generator_as_they_were() -> None:
    x, y = batch()
    model = gelu_mlp()
    before = copy.deepcopy(model.state_dict())
    torch.manual_seed(3)
    pipeline.plan(model, x, y, F.mse_loss, devices=["cpu", "cpu"], batch_size=len(x),
                  memory_limit=2**30, chunks=[2], repeats=1)  # fmt: skip
    drawn = torch.rand(3)
    torch.manual_seed(3)
    assert torch.equal(drawn, torch.rand(3))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
