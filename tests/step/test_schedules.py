"""Schedules and the simulator: the programs each schedule makes, refusals before any work,
what a step holds."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
import torch.nn.functional as F
from step_models import SCHEDULES, WIDTH, layered
from torch import Tensor, nn

from pipeline import Pipe
from pipeline.schedules import (
    Action,
    GPipe,
    OneFOneB,
    ProgramError,
    Programs,
    Schedule,
    ZeroBubbleH1,
    resolve_schedule,
    validate,
)
from pipeline.step.actions import parse_program


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_peak_micro_batches_held_equal_the_simulation(schedule: str) -> None:
    pipe = Pipe(layered(4, "none")[0], [2] * 4, devices=["cpu"] * 4, chunks=8, checkpoint="never")
    x, y = torch.randn(16, WIDTH, dtype=torch.double), torch.randn(16, WIDTH, dtype=torch.double)
    pipe.step(x, y, F.mse_loss, schedule=SCHEDULES[schedule]())
    report = pipe.last_step
    assert report is not None
    assert report.peak_in_flight == report.simulation.peak_in_flight
    expected = {
        "gpipe": [8, 8, 8, 8],
        "1f1b": [4, 3, 2, 1],
        "interleaved": [4, 3, 2, 1],
        "zb-h1": [4, 3, 2, 1],
        "zb-h1 peak": [4, 4, 4, 4],
    }[schedule]
    assert report.peak_in_flight == expected


def test_zero_bubble_memory_other_than_stage_or_peak_is_refused() -> None:
    with pytest.raises(ValueError, match=r"memory must be 'stage'.*or 'peak'.*got 'pipeline'"):
        ZeroBubbleH1(memory="pipeline")  # type: ignore[arg-type]
    assert repr(ZeroBubbleH1(memory="peak")) == "ZeroBubbleH1(memory='peak')"
    assert repr(ZeroBubbleH1()) == "ZeroBubbleH1()"
    # By name too; the name tells the two apart (a plan's check compares names).
    assert repr(resolve_schedule("zb-h1-peak")) == "ZeroBubbleH1(memory='peak')"
    assert (resolve_schedule("zb-h1-peak").name, resolve_schedule("zb-h1").name) == (
        "zb-h1-peak",
        "zb-h1",
    )


def test_programs_of_ones_own_run_and_bad_ones_are_refused_before_any_work() -> None:
    calls: list[int] = []

    class Count(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            calls.append(1)
            return x * 2

    model = nn.Sequential(nn.Linear(2, 2), Count())
    pipe = Pipe(model, [1, 1], devices=["cpu"] * 2, chunks=2, checkpoint="never")
    x, y = torch.randn(4, 2), torch.randn(4, 2)
    pipe.step(x, y, F.mse_loss, schedule=Programs(["0F0 0F1 0B0 0B1", "1F0 1B0 1F1 1B1"]))
    assert len(calls) == 2
    bad = {
        "deadlock": (["0F0 0B0 0F1 0B1", "1F1 1B1 1F0 1B0"], "deadlock"),
        "missing backward": (["0F0 0F1 0B0", "1F0 1B0 1F1 1B1"], "stage 0, micro-batch 1: 1 x F"),
        "backward first": (["0B0 0F0 0F1 0B1", "1F0 1B0 1F1 1B1"], "runs 0B0 before 0F0"),
        "stage on two workers": (["0F0 0F1 0B0 1B1", "1F0 1B0 1F1 0B1"], "workers 0 and 1"),
        "unknown stage": (["0F0 0F1 0B0 0B1", "1F0 1B0 1F1 1B1 2F0"], "there are 2 stages"),
    }
    for name, (programs, message) in bad.items():
        calls.clear()
        with pytest.raises(ProgramError, match=message):
            pipe.step(x, y, F.mse_loss, schedule=Programs(programs))
        assert calls == [], name
    with pytest.raises(ValueError, match="is not an action"):
        Programs(["0X0"])
    # Actions built by hand that parse_program would not make: refused before any work
    # (a float micro-batch passed, then failed after .grad was written).
    model.zero_grad(set_to_none=True)
    for odd in (Action(0, "X", 0), Action(0, "F", 1.0)):  # type: ignore[arg-type]
        programs = [[Action(0, "F", 0), odd, Action(0, "B", 0)], parse_program("1F0 1B0")]
        with pytest.raises(ProgramError, match="which is not an action"):
            pipe.step(x, y, F.mse_loss, schedule=Given(programs))
        assert calls == [] and all(p.grad is None for p in model.parameters()), odd
    # Equal, as dataclasses, to the actions of programs validated at an earlier step: the
    # validation kept for those was taken for theirs, and a float failed mid-step.
    valid = [parse_program("0F0 0F1 0B0 0B1"), parse_program("1F0 1B0 1F1 1B1")]
    pipe.step(x, y, F.mse_loss, schedule=Given(valid))
    for odd in (Action(0, "F", 1.0), Action(0, "F", True)):  # type: ignore[arg-type]
        twin = [[valid[0][0], odd, *valid[0][2:]], valid[1]]
        assert twin == valid
        model.zero_grad(set_to_none=True)
        calls.clear()
        with pytest.raises(ProgramError, match="which is not an action"):
            pipe.step(x, y, F.mse_loss, schedule=Given(twin))
        assert calls == [] and all(p.grad is None for p in model.parameters()), odd
    # Valid for 2 micro-batches, validated at a step of 2: a step of 1 micro-batch (one row)
    # ran them unvalidated (IndexError after .grad was written); a program for 1 at a step of
    # 2 too (KeyError).
    two = Programs(["0F0 0F1 0B0 0B1", "1F0 1B0 1F1 1B1"])
    one = Programs(["0F0 0B0", "1F0 1B0"])
    x1, y1 = torch.randn(1, 2), torch.randn(1, 2)
    for (valid_x, valid_y, ran), (other_x, other_y), message in [
        ((x, y, two), (x1, y1), "names stage 0 or micro-batch 1, but there are 2 stages and 1"),
        ((x1, y1, one), (x, y), "found stage 0, micro-batch 1: none"),
    ]:
        pipe.step(valid_x, valid_y, F.mse_loss, schedule=ran)
        model.zero_grad(set_to_none=True)
        calls.clear()
        with pytest.raises(ProgramError, match=message):
            pipe.step(other_x, other_y, F.mse_loss, schedule=ran)
        assert calls == [] and all(p.grad is None for p in model.parameters()), message


@pytest.mark.parametrize("variant", ["batch_norm", "spectral_norm", "deferred", "eval", "none"])
def test_forwards_out_of_micro_batch_order_are_refused_where_a_layer_updates_state(
    variant: str,
) -> None:
    # BatchNorm's running statistics take each forward's momentum update in turn, which do
    # not commute: a program running micro-batch 2's forward first gave other statistics
    # than the plain model's (1.4e-2 off), silently. Refused before any work where a layer
    # updates state in its forward; run, and exact, where none does.
    torch.manual_seed(0)
    middle: nn.Module = nn.BatchNorm1d(8) if variant != "none" else nn.Tanh()
    first: nn.Module = nn.Linear(8, 8)
    if variant == "spectral_norm":
        first, middle = nn.utils.parametrizations.spectral_norm(first), nn.Tanh()
    model = nn.Sequential(first, middle, nn.Tanh(), nn.Linear(8, 8)).double()
    if variant == "eval":
        middle.eval()
    plain = copy.deepcopy(model)
    x, y = torch.randn(12, 8, dtype=torch.double), torch.randn(12, 8, dtype=torch.double)
    pipe = Pipe(model, [2, 2], devices=["cpu"] * 2, chunks=3,
                deferred_batch_norm=variant == "deferred")  # fmt: skip
    state = copy.deepcopy(pipe.state_dict())
    reordered = Programs(["0F2 0F1 0F0 0B0 0B1 0B2", "1F2 1F1 1F0 1B0 1B1 1B2"])
    if variant in ("batch_norm", "spectral_norm"):
        with pytest.raises(ProgramError, match="stage 0 runs the forward of micro-batch 2 before"):
            pipe.step(x, y, F.mse_loss, schedule=reordered)
        assert all(p.grad is None for p in pipe.parameters())
        for name, value in pipe.state_dict().items():
            torch.testing.assert_close(value, state[name], rtol=0, atol=0, msg=name)
        return
    pipe.step(x, y, F.mse_loss, schedule=reordered)
    for xb, yb in zip(x.chunk(3), y.chunk(3), strict=True):
        (F.mse_loss(plain(xb), yb) / 3).backward()
    for (name, p), q in zip(pipe.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-12, msg=name)
    if variant != "deferred":  # deferred: the whole batch's statistics, as one pass's
        for (name, b), c in zip(pipe.named_buffers(), plain.buffers(), strict=True):
            torch.testing.assert_close(b, c, rtol=0, atol=1e-12, msg=name)


class Given(Schedule):
    """A schedule of one's own that gives its programs as they are."""

    def __init__(self, programs: list[list[Action]]) -> None:
        self.given = programs

    def programs(self, m: int, stages: int) -> list[list[Action]]:
        return self.given


def test_a_schedule_giving_no_programs_is_refused_naming_it() -> None:
    pipe = Pipe(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), [1, 1], devices=["cpu"] * 2)
    x = torch.randn(4, 2)
    for given in (None, "0F0 0B0"):
        with pytest.raises(ProgramError, match=f"returned {given!r}: return one program per"):
            pipe.step(x, x, F.mse_loss, schedule=Given(given))  # type: ignore[arg-type]


def test_programs_given_as_iterators_or_texts_run_as_lists_do() -> None:
    # Iterators were read once, by the first check: the next saw no action at all.
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    pipe = Pipe(model, [1, 1], devices=["cpu"] * 2, chunks=2, checkpoint="never")
    x, y = torch.randn(4, 2), torch.randn(4, 2)
    texts = ["0F0 0F1 0B0 0B1", "1F0 1B0 1F1 1B1"]
    for programs in ([iter(parse_program(t)) for t in texts], texts):
        model.zero_grad(set_to_none=True)
        pipe.step(x, y, F.mse_loss, schedule=Given(programs))  # type: ignore[arg-type]
        assert all(p.grad is not None for p in model.parameters())


class Wrapped(Schedule):
    """A schedule of one's own, parametrised, without a __repr__: every instance prints alike."""

    def __init__(self, inner: Schedule) -> None:
        self.inner = inner
        self.asked = 0

    def programs(self, m: int, stages: int) -> list[list[Action]]:
        self.asked += 1
        return self.inner.programs(m, stages)


def test_schedules_that_print_alike_run_their_own_programs() -> None:
    layers = nn.Sequential(*[nn.Linear(8, 8) for _ in range(3)])
    pipe = Pipe(layers, [1, 1, 1], devices=["cpu"] * 3, chunks=4)
    x = torch.randn(8, 8)
    first, second = Wrapped(GPipe()), Wrapped(OneFOneB())
    assert repr(first) == repr(second)
    pipe.step(x, x, F.mse_loss, schedule=first)
    assert pipe.last_step is not None and pipe.last_step.peak_in_flight == [4, 4, 4]
    for _ in range(2):
        pipe.step(x, x, F.mse_loss, schedule=second)
        assert pipe.last_step.peak_in_flight == [3, 2, 1]
        assert pipe.last_step.simulation.peak_in_flight == [3, 2, 1]
    assert (first.asked, second.asked) == (1, 2)  # asked at every step: it may change


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize(("m", "n"), [(4, 2), (8, 4)])
def test_built_in_programs_are_valid_and_hold_what_their_schedule_promises(
    schedule: str, m: int, n: int
) -> None:
    simulation = validate(SCHEDULES[schedule]().programs(m, n), m, n)
    one_f_one_b = [min(m, n - s) for s in range(n)]
    gpipe_idle = (n - 1) / (m + n - 1)
    if schedule == "gpipe":
        assert simulation.peak_in_flight == [m] * n
        assert simulation.mean_idle_fraction == pytest.approx(gpipe_idle)
    elif schedule == "1f1b":
        assert simulation.peak_in_flight == one_f_one_b
        assert simulation.mean_idle_fraction == pytest.approx(gpipe_idle)
    elif schedule == "zb-h1 peak":  # 1F1B's peak on every stage, less idle than zb-h1's
        assert simulation.peak_in_flight == [min(m, n)] * n
        per_stage = validate(ZeroBubbleH1().programs(m, n), m, n)
        assert simulation.makespan < per_stage.makespan
    else:  # interleaved, and zb-h1 at 1F1B's memory (a graph waiting for W counts)
        assert simulation.peak_in_flight == one_f_one_b
        assert simulation.mean_idle_fraction < gpipe_idle


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize(("m", "n"), [(1, 1), (4, 2), (8, 4), (5, 3)])
def test_the_one_thread_order_keeps_each_program_and_puts_each_action_after_its_mail(
    schedule: str, m: int, n: int
) -> None:
    if schedule == "interleaved" and n % 2:
        return  # two stages per worker: an even count
    programs = SCHEDULES[schedule]().programs(m, n)
    order = validate(programs, m, n).one_thread_order
    assert sorted(map(str, order)) == sorted(str(a) for p in programs for a in p)
    at = {action: k for k, action in enumerate(order)}
    for program in programs:
        assert [at[a] for a in program] == sorted(at[a] for a in program)
    for action, k in at.items():
        s, i = action.stage, action.microbatch
        if action.kind == "F" and s > 0:
            assert at[Action(s - 1, "F", i)] < k  # its activation
        if action.kind in ("B", "I"):
            after = [Action(s, "F", i)] if s == n - 1 else []
            after += [a for a in (Action(s + 1, "B", i), Action(s + 1, "I", i)) if a in at]
            assert after and all(at[a] < k for a in after)  # its loss, or its gradient
        if action.kind == "W":
            assert at[Action(s, "I", i)] < k


def test_the_one_thread_order_runs_forwards_together_and_backwards_together() -> None:
    # 1F1B over 4 stages on one thread: after the warm-up, each round runs the
    # four stages' forwards, then their backwards (a forward and a backward in
    # turn cost the thread cache misses); the play's order switches far more.
    programs = OneFOneB().programs(8, 4)
    simulation = validate(programs, 8, 4)
    kinds = "".join(a.kind for a in simulation.one_thread_order)
    rounds = "F" * 10 + "BBBBFFFF" * 4 + "BBBBFFF" + "BBBBFF" + "BBBBF" + "BBBB"
    assert kinds == rounds
    played = sorted((a for p in programs for a in p), key=simulation.start.__getitem__)
    played_kinds = "".join(a.kind for a in played)

    def switches(text: str) -> int:
        return sum(a != b for a, b in itertools.pairwise(text))

    assert switches(kinds) < switches(played_kinds)
