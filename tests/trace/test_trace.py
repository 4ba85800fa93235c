"""Tests of pipeline.trace: the recorded tasks and their reports (the profiler: test_profiling)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

import pipeline
from pipeline.arguments import CheckpointMode
from pipeline.clock.cycles import clock_cycles
from pipeline.runtime.microbatch import Value
from pipeline.runtime.partitions import PartitionCall
from pipeline.trace import recording as trace_module
from pipeline.trace.backward import BackwardSpan, run_hooked
from pipeline.trace.event import Event, Kind
from pipeline.trace.gantt import render

M, N = 4, 3
# Neighbouring partitions on differently named CPU devices, so the fence copies.
DEVICES = ["cpu", "cpu:0", "cpu"]


def small_pipe(checkpoint: CheckpointMode = "never") -> pipeline.Pipe:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(8, 8) for _ in range(N)))
    return pipeline.Pipe(model, balance=[1] * N, devices=DEVICES, chunks=M, checkpoint=checkpoint)


def traced_step(pipe: pipeline.Pipe) -> pipeline.Trace:
    with pipeline.trace() as t:
        pipe(torch.randn(2 * M, 8)).sum().backward()
    return t


def tasks(trace: pipeline.Trace, *kinds: Kind) -> list[tuple[int, int]]:
    return [(e.microbatch, e.partition) for e in trace.events if e.kind in kinds]


def test_forward_and_copies_follow_the_clock_cycles() -> None:
    events = [e for e in traced_step(small_pipe()).events if e.kind in ("forward", "copy")]
    expected = [
        [("copy", i, j) for i, j in cycle if j > 0] + [("forward", i, j) for i, j in cycle]
        for cycle in clock_cycles(M, N)
    ]
    seen: list[list[tuple[str, int, int]]] = [[] for _ in expected]
    for e in events:
        seen[e.microbatch + e.partition].append((e.kind, e.microbatch, e.partition))
    # Tasks of one cycle run at once, so only their set is fixed; copies come first.
    assert [sorted(s) for s in seen] == [sorted(c) for c in expected]
    assert all([k for k, *_ in s] == [k for k, *_ in sorted(s)] for s in seen)
    cycles = [e.microbatch + e.partition for e in events]
    assert cycles == sorted(cycles)
    assert {e.thread for e in events if e.kind == "forward"} == {
        f"pipe-partition-{j}" for j in range(N)
    }


def test_backward_runs_micro_batches_in_reverse_on_each_partition() -> None:
    t = traced_step(small_pipe())
    backward = tasks(t, "backward")
    assert sorted(backward) == sorted((i, j) for i in range(M) for j in range(N))
    for j in range(N):
        assert [i for i, p in backward if p == j] == list(reversed(range(M)))
    forward_end = max(e.end for e in t.events if e.kind == "forward")
    assert all(e.start >= forward_end for e in t.events if e.kind == "backward")


def test_recompute_runs_inside_the_backward_of_its_task() -> None:
    t = traced_step(small_pipe("except_last"))
    recomputed = tasks(t, "recompute")
    assert sorted(recomputed) == sorted((i, j) for i in range(M - 1) for j in range(N))
    events = {(e.kind, e.microbatch, e.partition): e for e in t.events}
    for i, j in recomputed:
        backward, recompute = events["backward", i, j], events["recompute", i, j]
        assert backward.start <= recompute.start and recompute.end <= backward.end


def test_chrome_trace_has_one_row_per_partition(tmp_path: Path) -> None:
    t = traced_step(small_pipe("except_last"))
    path = tmp_path / "trace.json"
    t.save_chrome_trace(path)
    loaded = json.loads(path.read_text())
    complete = [e for e in loaded["traceEvents"] if e["ph"] == "X"]
    assert len(complete) == len(t.events)
    assert {e["tid"] for e in complete} == set(range(N))
    names = {
        e["tid"]: e["args"]["name"] for e in loaded["traceEvents"] if e["name"] == "thread_name"
    }
    assert names == {j: f"partition {j}" for j in range(N)}
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in complete)
    assert {e["name"] for e in complete} >= {
        "pipe.copy[mb=1,part=0->1]",
        "pipe.backward[mb=3,part=2]",
    }


def test_summary_of_a_real_step_is_a_fraction() -> None:
    report = traced_step(small_pipe()).summary()
    assert len(report.partitions) == N
    assert all(0.0 <= p.idle_fraction <= 1.0 for p in report.partitions)
    assert report.bubble_bound == pytest.approx((N - 1) / (M + N - 1))
    assert "GPipe bound" in str(report)


def synthetic_step(step: int, shift: float) -> list[Event]:
    """GPipe with 2 micro-batches on 2 partitions: unit forwards, backwards of 2."""
    spans: list[tuple[Kind, int, int, float, float]] = [
        ("forward", 0, 0, 0, 1),
        ("forward", 1, 0, 1, 2),
        ("copy", 0, 1, 1, 1.5),
        ("forward", 0, 1, 1.5, 2),
        ("forward", 1, 1, 2, 3),
        ("backward", 1, 1, 3, 5),
        ("backward", 1, 0, 5, 7),
        ("backward", 0, 1, 5, 7),
        ("recompute", 0, 0, 6.5, 7.5),
        ("backward", 0, 0, 7.5, 9),
    ]
    return [Event(k, i, j, step, "t", a + shift, b + shift) for k, i, j, a, b in spans]


def test_summary_matches_a_hand_computed_case() -> None:
    # Two steps 100 s apart: the time between them counts neither as busy nor idle.
    trace = pipeline.Trace(synthetic_step(0, 0.0) + synthetic_step(1, 100.0), origin=0)
    report = trace.summary()
    assert (report.steps, report.microbatches, report.window) == (2, 2, 18.0)
    busy = [p.busy for p in report.partitions]
    # Partition 0: forwards 0-2; backward 5-7, recompute 6.5-7.5 and backward 7.5-9
    # cover 5-9, counted once. Partition 1: forwards 1.5-3 (a copy is not compute),
    # backwards 3-7.
    assert busy == pytest.approx([2 * 6.0, 2 * 5.5])
    assert [p.idle_fraction for p in report.partitions] == pytest.approx([3 / 9, 3.5 / 9])
    assert report.idle_fraction == pytest.approx(3.25 / 9)
    assert report.bubble_bound == pytest.approx(1 / 3)
    assert report.partitions[1].time_by_kind["copy"] == pytest.approx(1.0)
    assert "idle (bubble) fraction over all 2 steps 36.1%" in str(report)
    one = pipeline.Trace(synthetic_step(0, 0.0), origin=0)
    assert "idle (bubble) fraction over the step 36.1%" in str(one.summary())


def test_render_draws_the_last_step_one_line_per_partition() -> None:
    trace = pipeline.Trace(synthetic_step(0, 0.0) + synthetic_step(1, 100.0), origin=0)
    lines = trace.render(width=9).splitlines()
    assert lines[0].startswith("step 1: time 0 .. ")
    assert lines[1] == "partition 0 |Ff...bbRB| idle 33.3% of this step"
    assert lines[2] == "partition 1 |.CfbbBB..| idle 38.9% of this step"
    assert len(lines) == 5  # the time axis, two partitions, the two-line legend


def test_render_draws_a_recomputation_inside_its_backward() -> None:
    # The backward's event covers its recomputation's: the chart drew B over the
    # whole action, and never an R, where the summary counted recompute time.
    events = [
        Event("backward", 0, 0, 0, "t", 0.0, 0.004),
        Event("recompute", 0, 0, 0, "t", 0.0001, 0.002),
    ]
    assert render(events, width=4).splitlines()[1] == "partition 0 |RRBB| idle 0.0% of this step"


def test_tracing_off_records_and_hooks_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    hooked: list[int] = []

    def spy(function: PartitionCall, value: Value, span: BackwardSpan) -> Value:
        hooked.append(span.microbatch)
        return run_hooked(function, value, span)

    monkeypatch.setattr(trace_module, "run_hooked", spy)
    pipe = small_pipe("except_last")
    with pipeline.trace() as t:
        pass
    pipe(torch.randn(2 * M, 8)).sum().backward()
    assert t.events == []
    assert hooked == []
    traced_step(pipe)
    # The last micro-batch's forwards, and the recomputations of the others (whose
    # forwards run without grad).
    assert len(hooked) == M * N


def test_backward_after_the_block_is_still_recorded() -> None:
    pipe = small_pipe()
    with pipeline.trace() as t:
        out = pipe(torch.randn(2 * M, 8))
    assert tasks(t, "backward") == []
    out.sum().backward()
    assert len(tasks(t, "backward")) == M * N


def test_traces_nest_and_the_innermost_records() -> None:
    pipe = small_pipe()
    with pipeline.trace() as outer:
        with pipeline.trace() as inner:
            pipe(torch.randn(2 * M, 8))
        pipe(torch.randn(2 * M, 8))
    assert len(tasks(inner, "forward")) == len(tasks(outer, "forward")) == M * N


def test_a_disabled_trace_records_nothing() -> None:
    pipe = small_pipe()
    with pipeline.trace(enabled=False) as t:
        pipe(torch.randn(2 * M, 8)).sum().backward()
    assert t.events == []


def test_each_call_is_a_step_and_backward_keeps_the_step_of_its_forward() -> None:
    # Two forward passes, then one backward through both (gradient accumulation).
    pipe = small_pipe("except_last")
    with pipeline.trace() as t:
        loss = sum(pipe(torch.randn(2 * M, 8)).sum() for _ in range(2))
        assert isinstance(loss, torch.Tensor)
        loss.backward()
    for step in (0, 1):
        kinds = [e.kind for e in t.events if e.step == step]
        assert kinds.count("forward") == kinds.count("backward") == M * N
        assert kinds.count("recompute") == (M - 1) * N
    assert t.summary().steps == 2


def test_a_second_threads_trace_is_refused_while_one_records() -> None:
    # A trace records every pipe of the process: two threads' traces took each other's
    # records (a 2-partition pipe's trace showed 3 partitions and 43 forwards for 24).
    import threading

    entered, leave = threading.Event(), threading.Event()

    def records() -> None:
        with pipeline.trace():
            entered.set()
            assert leave.wait(60)

    other = threading.Thread(target=records)
    other.start()
    try:
        assert entered.wait(60)
        refused = pytest.raises(RuntimeError, match="recording already, entered by thread")
        with refused, pipeline.trace():
            pass
    finally:
        leave.set()
        other.join(60)
    with pipeline.trace() as t:  # once the other ended, this thread traces
        pass
    assert trace_module._active is None and t.events == []
