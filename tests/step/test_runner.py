"""The runner: failures reach the caller and leave the next step right, refusals, threads,
hooks, the trace of a step."""

from __future__ import annotations

import copy
import threading
import time

import pytest
import torch
import torch.nn.functional as F
from step_models import SCHEDULES, WIDTH, assert_same, block, grads, layered
from torch import Tensor, nn

from pipeline import Pipe
from pipeline.schedules import Interleaved1F1B


class FailAt(nn.Module):
    """Raises in the forward of micro-batch ``microbatch`` or in its backward."""

    def __init__(self, where: str, microbatch: int) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.where = where
        self.microbatch = microbatch
        self.calls = 0
        self.armed = True

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        failing = self.armed and self.calls == self.microbatch + 1
        if failing and self.where == "forward":
            raise KeyError("failed in forward")
        out = torch.tanh(self.linear(x))
        if failing and self.where == "backward":
            out.register_hook(_raise)
        return out


def _raise(grad: Tensor) -> Tensor:
    raise KeyError("failed in backward")


@pytest.mark.parametrize("threads", ["partition", "device"])
@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("where", ["forward", "backward"])
@pytest.mark.parametrize("stage", [0, 1, 3])
def test_a_failing_action_reaches_the_caller_and_the_next_step_is_right(
    schedule: str, where: str, stage: int, threads: str
) -> None:
    torch.manual_seed(9)
    layers: list[nn.Module] = [block() for _ in range(4)]
    failing = FailAt(where, microbatch=1)
    layers[stage] = nn.Sequential(layers[stage], failing)
    model = nn.Sequential(*layers).double()
    plain = copy.deepcopy(model)
    pipe = Pipe(
        model,
        [1, 1, 1, 1],
        devices=["cpu"] * 4,
        chunks=4,
        checkpoint="never",
        threads=threads,  # type: ignore[arg-type]
    )
    x, y = torch.randn(8, WIDTH, dtype=torch.double), torch.randn(8, WIDTH, dtype=torch.double)
    start = time.perf_counter()
    with pytest.raises(KeyError, match=f"failed in {where}") as info:
        pipe.step(x, y, F.mse_loss, schedule=SCHEDULES[schedule]())
    assert time.perf_counter() - start < 20
    assert any("of the schedule" in note for note in getattr(info.value, "__notes__", []))
    del info
    failing.armed = False
    pipe.zero_grad()
    pipe.step(x, y, F.mse_loss, schedule=SCHEDULES[schedule]())
    F.mse_loss(plain(x), y).backward()
    assert_same(grads(pipe), grads(plain), f"the step after a failure, {schedule}")


def test_step_is_refused_where_it_cannot_be_right() -> None:
    pipe = Pipe(nn.Sequential(block(), block()).double(), [1, 1], devices=["cpu"] * 2, chunks=2)
    x, y = torch.randn(4, WIDTH, dtype=torch.double), torch.randn(4, WIDTH, dtype=torch.double)
    with torch.no_grad(), pytest.raises(RuntimeError, match="grad mode is off"):
        pipe.step(x, y, F.mse_loss)
    with pytest.raises(ValueError, match="target splits into micro-batches of"):
        pipe.step(x, y[:3], F.mse_loss)
    with pytest.raises(ValueError, match="loss_reduction must be 'mean' or 'sum'"):
        pipe.step(x, y, F.mse_loss, loss_reduction="max")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="loss_fn must be callable"):
        pipe.step(x, y, "mse")  # type: ignore[arg-type]
    # A flag given as text read as True: "no" returned the outputs, measured memory.
    with pytest.raises(TypeError, match="return_outputs must be True or False, got 'no'"):
        pipe.step(x, y, F.mse_loss, return_outputs="no")  # type: ignore[call-overload]
    with pytest.raises(TypeError, match="measure_memory must be True or False, got 1"):
        pipe.step(x, y, F.mse_loss, measure_memory=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="return_outputs must be True or False, got 'no'"):
        pipe.evaluate(x, y, F.mse_loss, return_outputs="no")  # type: ignore[call-overload]
    assert all(p.grad is None for p in pipe.parameters()) and pipe.last_step is None
    with pytest.raises(ValueError, match="schedule must be one of"):
        pipe.step(x, y, F.mse_loss, schedule="fast")
    with pytest.raises(TypeError, match="it must return a scalar tensor"):
        pipe.step(x, y, lambda o, t: (o - t).square())
    # torch's "cannot get the gradient edge" in the last stage's first backward, before.
    for schedule in ("gpipe", "zb-h1"):
        with pytest.raises(RuntimeError, match=r"loss_fn returned a loss that needs no grad"):
            pipe.step(x, y, lambda o, t: F.mse_loss(o, t).detach(), schedule=schedule)
    assert all(p.grad is None for p in pipe.parameters())
    interleaved = Interleaved1F1B(virtual=2)
    four = Pipe(layered(4, "none")[0], [2] * 4, devices=["cpu"] * 4, chunks=3)
    with pytest.raises(ValueError, match=r"micro-batches \(3\) to be a multiple of .* \(2\)"):
        four.step(x[:3], y[:3], F.mse_loss, schedule=interleaved)
    with pytest.raises(ValueError, match="runs 4 stages per worker, but the Pipe has 2 partitions"):
        pipe.step(x, y, F.mse_loss, schedule=Interleaved1F1B(virtual=4))
    inside: list[str] = []

    def step_in_backward(grad: Tensor) -> None:
        try:
            pipe.step(x, y, F.mse_loss)
        except RuntimeError as error:
            inside.append(str(error))  # not the error: its frames would keep the Pipe alive

    z = torch.ones(1, requires_grad=True)
    z.register_hook(step_in_backward)
    (z * 2).sum().backward()
    assert inside and "inside a backward pass" in inside[0]


def test_two_threads_stepping_one_pipe_run_one_after_the_other() -> None:
    torch.manual_seed(10)
    model = nn.Sequential(block(), block()).double()
    plain = copy.deepcopy(model)
    pipe = Pipe(model, [1, 1], devices=["cpu"] * 2, chunks=2)
    x, y = torch.randn(4, WIDTH, dtype=torch.double), torch.randn(4, WIDTH, dtype=torch.double)
    threads = [
        threading.Thread(target=lambda: [pipe.step(x, y, F.mse_loss) for _ in range(5)])
        for _ in range(2)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not any(t.is_alive() for t in threads)
    for _ in range(10):
        F.mse_loss(plain(x), y).backward()
    assert_same(grads(pipe), grads(plain), "10 steps from two threads")


def test_partition_backward_hooks_fire_once_per_partition_after_its_last_backward() -> None:
    # As docs/guide.md states: every partition, partition 0 too although the
    # input does not require grad, on a worker, with its gradients final.
    model = layered(4, "none")[0]
    x, y = torch.randn(8, WIDTH, dtype=torch.double), torch.randn(8, WIDTH, dtype=torch.double)
    plain = copy.deepcopy(model)
    F.mse_loss(plain(x), y).backward()
    for schedule in SCHEDULES:
        pipe = Pipe(copy.deepcopy(model), [2] * 4, devices=["cpu"] * 4, chunks=4)
        seen: list[int] = []

        def hook(j: int, pipe: Pipe = pipe, seen: list[int] = seen) -> None:
            assert threading.current_thread() is not threading.main_thread()
            assert_same(grads(pipe.partitions[j]), grads(plain[2 * j : 2 * j + 2]), f"{j}")
            seen.append(j)

        pipe.register_partition_backward_hook(hook)
        pipe.step(x, y, F.mse_loss, schedule=SCHEDULES[schedule]())
        assert sorted(seen) == [0, 1, 2, 3], schedule


@pytest.mark.parametrize(
    ("schedule", "backward_kinds", "recomputing_partitions"),
    [
        # except_last spares a forward directly followed by its own backward:
        # GPipe's last micro-batch, and everything on 1F1B's last partition.
        ("gpipe", {"backward"}, 3),
        ("1f1b", {"backward"}, 2),
        ("zb-h1", {"input_grad", "weight_grad"}, 2),
    ],
)
def test_the_trace_shows_every_action_once_with_its_kind(
    schedule: str, backward_kinds: set[str], recomputing_partitions: int
) -> None:
    import pipeline

    n, m = 3, 4
    pipe = Pipe(
        layered(n, "none")[0],
        [2] * n,
        devices=["cpu", "cpu:0", "cpu"],  # differently named: the hand-overs are copies
        chunks=m,
        checkpoint="except_last",
    )
    x, y = torch.randn(8, WIDTH, dtype=torch.double), torch.randn(8, WIDTH, dtype=torch.double)
    with pipeline.trace() as t:
        pipe.step(x, y, F.mse_loss, schedule=schedule)
    tasks: dict[str, list[tuple[int, int]]] = {}
    for event in t.events:
        tasks.setdefault(event.kind, []).append((event.microbatch, event.partition))
    every = sorted((i, j) for i in range(m) for j in range(n))
    assert sorted(tasks["forward"]) == every
    for kind in backward_kinds:
        assert sorted(tasks[kind]) == every, kind
    recomputed = sorted((i, j) for i in range(m - 1) for j in range(recomputing_partitions))
    assert sorted(tasks["recompute"]) == recomputed
    assert "copy" in tasks
    summary = t.summary()
    assert pipe.last_step is not None
    assert summary.schedule_bound == pipe.last_step.simulated_idle.stages
    assert "the schedule's simulated idle fraction" in str(summary)
    letters = {"backward": "B", "input_grad": "I", "weight_grad": "W"}
    rendered = t.render(width=200).lower()
    assert all(letters[kind].lower() in rendered for kind in backward_kinds)
