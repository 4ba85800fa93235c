"""CPU contention, forward and backward apart (a seeded forward holds the GIL, a backward not),
and the pace in the pipe that a Pipe is planned from instead."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch.nn.functional as F

import pipeline
from pipeline.plan.contention import NO_CONTENTION, Contention, cpu_contention
from pipeline.plan.result import _by_chunks
from pipeline.plan.timing import StageCosts, predicted_seconds
from pipeline.step.actions import parse_program
from tests.plan.plan_models import batch, gelu_mlp

# Stage 1's forward of micro-batch 0 runs beside stage 0's of micro-batch 1, stage 0's
# backward of micro-batch 0 beside stage 1's forward and half of its backward of 1.
PROGRAMS = [parse_program("0F0 0F1 0B0 0B1"), parse_program("1F0 1B0 1F1 1B1")]
ONE = StageCosts(forward=1.0, backward=2.0, input_grad=1.0, weight=1.0)


def test_forward_work_is_slowed_by_the_forward_factor_and_backward_work_by_the_backward_one() -> (
    None
):
    def seconds(factor: Contention) -> float:
        return predicted_seconds(PROGRAMS, [ONE, ONE], set(), 0.0, [factor, factor])

    assert seconds(Contention()) == 9.0
    # Forwards twice as long where they overlap: 0F1 and 1F0 end at 3, 1F1 at 7, 0B1 at 11.
    assert seconds(Contention(forward=2.0, backward=1.0)) == 11.0
    # Backwards: 0B0 (all of it beside stage 1) takes 4, 1B1 (half) 3; 0B1 ends at 10.
    assert seconds(Contention(forward=1.0, backward=2.0)) == 10.0


def test_a_recomputation_is_forward_work() -> None:
    # Backwards that cost nothing but their recomputation: only the forward factor slows them.
    forward_only = StageCosts(forward=1.0, backward=0.0, input_grad=0.0, weight=0.0)
    every_task = {(i, j) for i in range(2) for j in range(2)}

    def seconds(factor: Contention) -> float:
        costs = [forward_only, forward_only]
        return predicted_seconds(PROGRAMS, costs, every_task, 0.0, [factor, factor])

    assert seconds(Contention()) == 6.0
    assert seconds(Contention(forward=1.0, backward=2.0)) == 6.0
    assert seconds(Contention(forward=2.0, backward=1.0)) == 8.0


def test_cpu_contention_is_measured_for_forwards_and_backwards_apart() -> None:
    x, y = batch()
    assert cpu_contention(gelu_mlp(), x, y, F.mse_loss, 1, 1) == Contention()
    measured = cpu_contention(gelu_mlp(), x, y, F.mse_loss, 2, 1, seeded=True)
    # How much slower depends on the machine's load: only the bounds are known.
    assert isinstance(measured, Contention)
    assert measured.forward >= 1.0 and measured.backward >= 1.0
    assert str(Contention(2.0, 1.5)) == "x2.00 forward, x1.50 backward"
    assert str(Contention(1.25, 1.25)) == "x1.25"


def test_a_pipe_is_planned_from_its_pace_in_the_pipe_unless_a_contention_is_given() -> None:
    x, y = batch()
    options: dict[str, Any] = {
        "devices": ["cpu"] * 2, "batch_size": len(x), "memory_limit": 2**30, "chunks": [2, 4],
        "checkpoints": ["never"], "repeats": 1,
    }  # fmt: skip
    # The model stepped in a Pipe on the devices, for each count: 1F1B (GPipe's pace too)
    # and ZB-H1; one median of the seconds outside the actions for all; no contention.
    paced = pipeline.plan(gelu_mlp(), x, y, F.mse_loss, schedules=["gpipe", "zb-h1"], **options)
    assert sorted(paced.paces) == [("1f1b", 2), ("1f1b", 4), ("zb-h1", 2), ("zb-h1", 4)]
    assert all(p.factor > 0 and p.outside > 0 for p in paced.paces.values()), paced.paces
    assert len({p.outside for p in paced.paces.values()}) == 1, paced.paces
    assert dict(paced.contention) == {2: NO_CONTENTION, 4: NO_CONTENTION}
    assert "pace in the pipeline 2 chunks x" in str(paced).splitlines()[0]
    # Its check compares the whole step call, as the pace predicts it.
    pipe = paced.pipe()
    pipe.step(x, y, F.mse_loss, schedule=paced.schedule)
    report = pipe.last_step
    assert report is not None and report.call_duration > report.duration > 0
    assert paced.check(pipe).measured_seconds == report.call_duration
    pipe.close()
    given = pipeline.plan(
        gelu_mlp(), x, y, F.mse_loss, contention=1.5, schedules=["1f1b"], **options
    )
    assert dict(given.contention) == {2: Contention(1.5, 1.5), 4: Contention(1.5, 1.5)}
    assert not given.paces
    assert "CPU contention x1.50," in str(given).splitlines()[0]
    shown = _by_chunks({2: Contention(1.5, 1.0), 8: Contention(2.0, 1.25)})
    assert shown == "2 chunks x1.50 forward, x1.00 backward; 8 chunks x2.00 forward, x1.25 backward"


def test_a_worker_failing_while_contention_is_measured_raises_instead_of_hanging() -> None:
    before = threading.active_count()
    failed = threading.Event()

    def fails_once_beside_another_worker(output: Any, target: Any) -> Any:
        # Both workers of the measurement are running: fail in one, the other goes on.
        if threading.active_count() >= before + 2 and not failed.is_set():
            failed.set()
            raise RuntimeError("a worker failed")
        return F.mse_loss(output, target)

    x, y = batch()
    with pytest.raises(RuntimeError, match="a worker failed"):
        cpu_contention(gelu_mlp(), x, y, fails_once_beside_another_worker, 2, 1)
