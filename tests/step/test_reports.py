"""pipe.last_step: every action as it ran, waits apart from compute, peaks, a readable report;
and pipeline.trace() showing the same waits as waits."""

from __future__ import annotations

import threading
import time
from collections.abc import Hashable

import pytest
import torch
import torch.nn.functional as F
from step_models import SCHEDULES, WIDTH, block
from torch import Tensor, nn

import pipeline
from pipeline import Pipe
from pipeline.step.mail import Mailboxes, Message


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_last_step_records_every_action_once(schedule: str) -> None:
    pipe = Pipe(nn.Sequential(*(block() for _ in range(4))), [1] * 4, devices=["cpu"] * 4, chunks=4)
    x = torch.randn(8, WIDTH)
    pipe.step(x, x, F.mse_loss, schedule=SCHEDULES[schedule]())
    report = pipe.last_step
    assert report is not None
    programs = report.schedule.programs(4, 4)
    assert sorted(r.action for r in report.actions) == sorted(a for p in programs for a in p)
    worker_of = {a.stage: w for w, p in enumerate(programs) for a in p}
    for r in report.actions:
        assert r.worker == worker_of[r.action.stage]
        assert 0 <= r.start <= r.end <= report.duration + 1e-9
        assert 0 <= r.waited <= r.end - r.start
    assert report.actions[0].start == 0.0
    assert [r.start for r in report.actions] == sorted(r.start for r in report.actions)
    for part in report.partitions:
        mine = [r for r in report.actions if r.action.stage == part.partition]
        assert part.busy == pytest.approx(sum(r.compute for r in mine))
        assert part.waiting == pytest.approx(sum(r.waited for r in mine))
        in_actions = sum(r.end - r.start for r in report.actions if r.worker == part.worker)
        assert part.idle == pytest.approx(max(report.duration - in_actions, 0.0))
        assert sum(v for k, v in part.time_by_kind.items() if k != "R") == pytest.approx(part.busy)
    assert report.peak_in_flight == report.simulation.peak_in_flight


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_partitions_sharing_a_thread_are_one_worker_in_the_report_and_its_simulation(
    schedule: str,
) -> None:
    # Seen on a GPU (4 partitions on cuda:0, one thread): "busy 25%, idle
    # 75% (simulated idle 27%)" for a thread that was never idle, against a
    # simulation that gave each partition a device of its own.
    n = 4
    pipe = Pipe(
        nn.Sequential(*(block() for _ in range(n))),
        [1] * n,
        devices=["cpu"] * n,
        chunks=4,
        threads="device",
    )
    x = torch.randn(8, WIDTH)
    with pipeline.trace() as t:
        pipe.step(x, x, F.mse_loss, schedule=SCHEDULES[schedule]())
    report = pipe.last_step
    assert report is not None
    assert {r.worker for r in report.actions} == {0}
    in_actions = sum(r.end - r.start for r in report.actions)
    for part in report.partitions:
        assert part.worker == 0
        assert part.idle == pytest.approx(max(report.duration - in_actions, 0.0))
    # One thread running every program always has an action it can run; each
    # stage computes a quarter of the step (unit costs: the same work each).
    assert report.simulated_idle.workers == 0.0
    assert report.simulated_idle.stages == pytest.approx(1 - 1 / n)
    assert "(simulated idle 0%)" in repr(report)
    assert t.summary().schedule_bound == pytest.approx(1 - 1 / n)


class Sleep(nn.Module):
    """Takes a known time: sleeps in forward (backward takes next to none)."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: Tensor) -> Tensor:
        time.sleep(self.seconds)
        return self.linear(x)


class HoldFirst(nn.Module):
    """On its first call, waits until ``event`` is set, then sleeps ``seconds``."""

    def __init__(self, event: threading.Event, seconds: float) -> None:
        super().__init__()
        self.event = event
        self.seconds = seconds
        self.calls = 0

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        if self.calls == 1:
            assert self.event.wait(timeout=30), "partition 1 never waited for its input"
            time.sleep(self.seconds)
        return x


HELD = 0.05  # partition 1 waits at least this long for micro-batch 0
COMPUTE = 0.01  # each forward of partition 1


def test_waits_are_reported_as_waiting_not_busy(monkeypatch: pytest.MonkeyPatch) -> None:
    # Partition 0 holds micro-batch 0 back until partition 1 waits for it:
    # partition 1 then waits at least HELD, however the threads are scheduled.
    waiting = threading.Event()
    take = Mailboxes.take

    def noting_take(self: Mailboxes, step: int, key: Hashable, waiting_for: str) -> Message:
        if key == ("act", 1, 0):
            waiting.set()
        return take(self, step, key, waiting_for)

    monkeypatch.setattr(Mailboxes, "take", noting_take)
    model = nn.Sequential(HoldFirst(waiting, HELD), Sleep(COMPUTE), Sleep(COMPUTE))
    pipe = Pipe(model, [2, 1], devices=["cpu"] * 2, chunks=4, checkpoint="never")
    x = torch.randn(8, WIDTH)
    with pipeline.trace() as t:
        pipe.step(x, x, F.mse_loss, schedule="gpipe")
    report = pipe.last_step
    assert report is not None

    first = next(r for r in report.actions if str(r.action) == "1F0")
    assert first.waited >= HELD
    assert first.compute == pytest.approx(first.end - first.start - first.waited)
    assert first.compute >= COMPUTE
    part = report.partitions[1]
    assert part.waiting >= HELD
    # Busy is the sleeps (4 forwards), give or take generous overhead, not the wait.
    assert 4 * COMPUTE <= part.time_by_kind["F"] <= 4 * COMPUTE + 1.0

    # The trace shows the same wait inside the forward span, and does not count it.
    waits = [e for e in t.events if e.kind == "wait" and (e.partition, e.microbatch) == (1, 0)]
    assert len(waits) == 1 and waits[0].duration >= HELD
    summary = t.summary().partitions[1]
    spans = sum(e.duration for e in t.events if e.partition == 1 and e.kind != "wait")
    assert summary.busy <= spans - HELD + 1e-6
    assert summary.time_by_kind["wait"] >= HELD
    # A wait of HELD fills a column whole while the step lasts under 1000 * HELD / 2.
    chart = t.render(width=1000).splitlines()[2]
    assert chart.startswith("partition 1") and "~" in chart
    assert any(e["cat"] == "wait" for e in t.chrome_trace()["traceEvents"] if e["ph"] == "X")


class Tanh(nn.Module):
    """A partition saving exactly its output (tanh saves its result) besides its input."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH).double()

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(self.linear(x))


@pytest.mark.parametrize(("schedule", "held"), [("gpipe", 4), ("1f1b", 2)])
def test_activation_peak_follows_the_micro_batches_held(schedule: str, held: int) -> None:
    model = nn.Sequential(Tanh(), Tanh())
    pipe = Pipe(model, [1, 1], devices=["cpu"] * 2, chunks=4, checkpoint="never")
    x = torch.randn(8, WIDTH, dtype=torch.double)
    pipe.step(x, x, F.mse_loss, schedule=schedule, measure_memory=True)
    report = pipe.last_step
    assert report is not None and report.peak_in_flight[0] == held
    # Partition 0 saves its input (views of the caller's x: not the step's,
    # not counted) and, per micro-batch of 2 rows, its tanh output.
    row = WIDTH * 8
    assert report.partitions[0].peak_activation_bytes == held * 2 * row
    pipe.step(x, x, F.mse_loss, schedule=schedule)
    assert pipe.last_step is not None
    assert all(p.peak_activation_bytes is None for p in pipe.last_step.partitions)


def test_repr_is_one_line_and_the_table_has_a_row_per_partition() -> None:
    pipe = Pipe(nn.Sequential(block(), block(), block()), [1, 1, 1], devices=["cpu"] * 3, chunks=3)
    x = torch.randn(6, WIDTH)
    pipe.step(x, x, F.mse_loss, schedule="zb-h1", measure_memory=True)
    report = pipe.last_step
    text = repr(report)
    assert "\n" not in text and len(text) < 200
    assert text.startswith("StepReport(ZeroBubbleH1(), 3 micro-batches x 3 partitions, ")
    assert "busy" in text and "waiting" in text and "simulated idle" in text
    assert "(partitions' peaks summed)" in text
    lines = report.table().splitlines()  # type: ignore[union-attr]
    assert lines[0] == text
    assert lines[1].split() == [
        "part", "worker", "F", "ms", "I", "ms", "W", "ms", "R", "ms", "busy", "waiting",
        "idle", "peak", "mb", "activations",
    ]  # fmt: skip
    assert [line.split()[0] for line in lines[2:]] == ["0", "1", "2"]


class FailsWhenArmed(nn.Module):
    armed = False

    def forward(self, x: Tensor) -> Tensor:
        if self.armed:
            raise ValueError("armed")
        return x


def test_a_step_that_fails_midway_leaves_no_report_and_a_refused_one_the_last() -> None:
    # A failed step left the last step's report in place, read as its own.
    failing = FailsWhenArmed()
    pipe = Pipe(nn.Sequential(block(), failing, block()), [2, 1], devices=["cpu"] * 2, chunks=2)
    x = torch.randn(4, WIDTH)
    pipe.step(x, x, F.mse_loss)
    report = pipe.last_step
    assert report is not None
    with pytest.raises(TypeError, match="loss_fn must be callable"):
        pipe.step(x, x, "mse")  # type: ignore[arg-type]
    assert pipe.last_step is report
    failing.armed = True
    with pytest.raises(ValueError, match="armed"):
        pipe.step(x, x, F.mse_loss)
    assert pipe.last_step is None


@pytest.mark.parametrize("threads", ["partition", "device"])
def test_a_traces_bound_counts_each_evaluations_forwards_and_names_none_for_mixed_steps(
    threads: str,
) -> None:
    # The bound was the training steps' mean, beside an idle share over every step,
    # evaluations included; and a trace of pipe(x) and step calls compared the lot
    # with the step's schedule.
    n, m = 3, 4
    pipe = Pipe(
        nn.Sequential(*(block() for _ in range(n))),
        [1] * n,
        devices=["cpu"] * n,
        chunks=m,
        threads=threads,  # type: ignore[arg-type]
    )
    x = torch.randn(8, WIDTH)
    with pipeline.trace() as t:
        pipe.evaluate(x)
    # A thread each: GPipe's forward bound; one thread: each stage a third of the work.
    alone = (n - 1) / (m + n - 1) if threads == "partition" else 1 - 1 / n
    assert t.summary().schedule_bound == pytest.approx(alone)
    with pipeline.trace() as t:
        pipe.step(x, x, F.mse_loss, schedule="1f1b")
        pipe.evaluate(x)
    assert pipe.last_step is not None
    # Each step weighs as its window does in the idle share beside it.
    spans = [
        max(e.end for e in t.events if e.step == k) - min(e.start for e in t.events if e.step == k)
        for k in (0, 1)
    ]
    mean = (pipe.last_step.simulated_idle.stages * spans[0] + alone * spans[1]) / sum(spans)
    assert t.summary().schedule_bound == pytest.approx(mean)
    with pipeline.trace() as t:
        pipe.step(x, x, F.mse_loss, schedule="1f1b")
        pipe(x).sum().backward()  # type: ignore[union-attr]
    summary = t.summary()
    assert summary.mixed and summary.schedule_bound is None
    assert "no one bound to compare" in str(summary)
