"""pipeline.plan(processes=N) in every rank of a gloo group: one plan, its pipe, its check.

Started by tests/gloo_groups.py's run_group with ``script=plan_scenarios.py``.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import pipeline
from pipeline.plan import Plan, PlanError
from pipeline.runtime.agreement import fingerprint, gather_rows
from tests.gloo_groups import expect_error, main, rank, scenario, world
from tests.plan.plan_models import batch, gelu_mlp

ROWS = 8


def planned(model: nn.Sequential, **changes: Any) -> Plan:
    """The plan of ``model`` for this group's processes: small, quick, the same in every rank."""
    x, y = batch(ROWS)
    options: dict[str, Any] = {
        "processes": world(),
        "batch_size": ROWS,
        "memory_limit": 2**30,
        "chunks": [2, 4],
        "schedules": ("gpipe", "1f1b", "zb-h1"),
        "checkpoints": ("never", "always"),
        "repeats": 1,
        **changes,
    }
    return pipeline.plan(model, x, y, F.mse_loss, **options)


@scenario
def every_process_plans_the_same_pipe_and_its_step_equals_the_plain_model() -> None:
    model = gelu_mlp(4)
    plain = copy.deepcopy(model)
    plan = planned(model)
    assert plan.processes is not None and plan.processes.count == world()
    assert sorted(plan.predicted_memory) == [f"rank {r}" for r in range(world())]
    link = plan.processes.link
    assert link.latency > 0 and link.seconds_per_byte >= 0, link
    # Measured: how large depends on the machine's load, so only their signs are known.
    assert plan.action_overhead >= 0
    # The pace in a DistributedPipe of the group for each count: 1F1B's (GPipe's too) and
    # ZB-H1's; one median of the seconds outside the actions for all of them.
    paces = plan.paces
    assert sorted(paces) == [("1f1b", 2), ("1f1b", 4), ("zb-h1", 2), ("zb-h1", 4)], paces
    assert all(p.factor > 0 and p.outside > 0 for p in paces.values()), paces
    assert len({p.outside for p in paces.values()}) == 1, paces
    assert "pace in the pipeline 2 chunks x" in str(plan).splitlines()[0]
    # The same choice, and the same predictions to the last bit, in every process.
    mine = fingerprint(f"{plan.chosen!r}")
    assert len({row[0] for row in gather_rows([mine], plan.processes.group)}) == 1  # type: ignore[arg-type]

    step_equals_the_plain_model(plan, plain)


@scenario
def an_interleaved_plan_runs_two_stages_per_process_and_equals_the_plain_model() -> None:
    model = gelu_mlp(4)
    plain = copy.deepcopy(model)
    plan = planned(model, schedules=("interleaved",), action_overhead=1e-4)
    assert (plan.schedule, plan.balance) == ("interleaved", [1, 1, 1, 1])
    assert plan.processes is not None
    assert sorted(plan.paces) == [("interleaved", 2), ("interleaved", 4)]
    # Too few layers for two stages per process: no pace to measure, and nothing to choose.
    expect_error(
        PlanError,
        lambda: planned(gelu_mlp(2), schedules=("interleaved",), action_overhead=1e-4),
        "no configuration can run: the interleaved schedule needs twice as many layers",
    )
    assert plan.chosen.places == ("rank 0", "rank 1", "rank 0", "rank 1")
    step_equals_the_plain_model(plan, plain)


def step_equals_the_plain_model(plan: Plan, plain: nn.Sequential) -> None:
    """One step of the plan's DistributedPipe: the plain model's loss and gradients, and
    every stage's measured activations the predicted ones."""
    pipe = plan.distributed()
    try:
        x, y = batch(ROWS)
        first, last = rank() == 0, rank() == world() - 1
        loss = pipe.step(
            x if first else None,
            y if last else None,
            F.mse_loss,
            schedule=plan.schedule,
            measure_memory=True,
        )
        expected = F.mse_loss(plain(x), y)
        expected.backward()
        torch.testing.assert_close(loss, expected.detach())
        reference = dict(plain.named_parameters())
        names = [name for name, _ in pipe.named_parameters()]
        assert names, "this process holds no parameter"
        for name, param in pipe.named_parameters():
            assert param.grad is not None, name
            torch.testing.assert_close(param.grad, reference[name].grad, msg=name)

        check = plan.check(pipe)  # every process: a collective
        assert len(check.measured_activations) == len(plan.balance)
        assert check.measured_activations == check.predicted_activations, str(check)
        assert check.measured_seconds > 0 and check.predicted_seconds > 0
        # The longest of the processes' step calls, the one time the pace predicts.
        report = pipe.last_step
        assert report is not None and check.measured_seconds >= report.call_duration - 1e-9
        assert f"step time: predicted {check.predicted_seconds * 1e3:.2f} ms" in str(check)
    finally:
        pipe.close()


@scenario
def plans_made_with_different_arguments_are_refused_by_every_process() -> None:
    limit = 2**30 if rank() == 0 else 2**29
    expect_error(
        ValueError,
        lambda: planned(gelu_mlp(4), memory_limit=limit),
        "pipeline.plan was called differently in the processes of the group: ranks [0] and "
        "ranks [1] differ",
    )
    expect_error(
        ValueError,
        lambda: planned(gelu_mlp(4), processes=world() + 1),
        f"processes={world() + 1} but the process group has {world()} processes",
    )
    # A refusal on one rank: it raises its own error, every other rank one naming it.
    if rank() == 1:
        expect_error(ValueError, lambda: planned(gelu_mlp(4), chunks=[3]), "do not divide")
    else:
        expect_error(
            ValueError,
            lambda: planned(gelu_mlp(4)),
            "rank 1 refused its pipeline.plan arguments (its error says why); no process planned",
        )


@scenario
def different_plans_build_no_pipe_every_process_refuses() -> None:
    # Plans that differ all the same (here made so by hand) reach DistributedPipe's
    # own agreement, which refuses them in every process before building anything.
    model = gelu_mlp(4)
    plan = planned(model, link_latency=1e-4, link_seconds_per_byte=1e-9, action_overhead=1e-4,
                   contention=1.0)  # fmt: skip
    if rank() == 1:
        other = next(c for c in plan.candidates if c.chunks != plan.chunks)
        plan = Plan(model, other, plan.candidates, 1.0, 1e-4, plan.processes)
    expect_error(ValueError, plan.distributed, "differs between the processes of the pipeline")


@scenario
def a_plan_for_processes_builds_no_pipe_and_takes_no_planned_option_again() -> None:
    plan = planned(gelu_mlp(4), link_latency=1e-4, link_seconds_per_byte=1e-9,
                   action_overhead=1e-4, contention=1.0)  # fmt: skip
    expect_error(ValueError, plan.pipe, f"this plan is for {world()} processes")
    expect_error(TypeError, lambda: plan.distributed(chunks=2), "plan.distributed() got chunks")


if __name__ == "__main__":
    main()
