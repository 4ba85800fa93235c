"""pipeline.profile(): every task of a Pipe, on its worker thread, read from the profiler's events.

The plain torch.profiler.profile() records the caller's thread only (and
autograd's): a Pipe run under it warns once, naming pipeline.profile.
DistributedPipe.step under the plain profiler: stage_scenarios.py.
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import record_function

import pipeline
from pipeline.step.actions import Program
from pipeline.step.runner import forward_programs
from pipeline.step.schedules import Interleaved1F1B, resolve_schedule
from pipeline.trace import profiling
from pipeline.trace.event import task_name
from tests.helpers import task_names

M = 4
# Neighbouring partitions on differently named CPU devices, so that pipe(x) copies.
DEVICES = ["cpu", "cpu:0", "cpu", "cpu:0"]


def small_pipe(partitions: int) -> pipeline.Pipe:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(partitions)))
    return pipeline.Pipe(model, [1] * partitions, devices=DEVICES[:partitions], chunks=M)


class Threads:
    """The threads each named range of a profile ran on, and the caller's thread."""

    def __init__(self, prof: torch.profiler.profile) -> None:
        self.of: dict[str, set[int]] = defaultdict(set)
        for event in prof.events():
            self.of[event.name].add(event.thread)
        (self.caller,) = self.of["caller"]

    def one_thread(self, names: set[str]) -> int:
        """The one thread all of ``names`` ran on (each is there)."""
        assert names <= self.of.keys(), sorted(names - self.of.keys())
        threads = set().union(*(self.of[name] for name in names))
        assert len(threads) == 1, (sorted(names), threads)
        return threads.pop()


@pytest.fixture
def unwarned(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The process as if no Pipe had warned of a profiler yet (the warning comes once)."""
    monkeypatch.setattr(profiling, "_warned", False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an unexpected warning fails the test
        yield


def test_every_task_of_pipe_x_is_on_its_partitions_worker(unwarned: None) -> None:
    pipe = small_pipe(partitions=3)
    x = torch.randn(2 * M, 8, requires_grad=True)
    with pipeline.profile() as prof, record_function("caller"):
        pipe(x).sum().backward()
    threads = Threads(prof)
    workers = [threads.one_thread({task_name("forward", i, j) for i in range(M)}) for j in range(3)]
    assert len(set(workers)) == 3 and threads.caller not in workers
    # The fence copies on the caller's thread; autograd recomputes (except_last).
    copies = {task_name("copy", i, j) for i in range(M) for j in (1, 2)}
    recomputes = {task_name("recompute", i, j) for i in range(M - 1) for j in range(3)}
    assert copies | recomputes <= threads.of.keys()
    assert threads.one_thread(copies) == threads.caller
    pipe.close()


@pytest.mark.parametrize(
    "schedule", ["gpipe", "1f1b", "zb-h1", Interleaved1F1B(virtual=2)], ids=str
)
def test_every_action_of_step_is_on_its_programs_worker(schedule: object, unwarned: None) -> None:
    pipe = small_pipe(partitions=4)
    chosen = resolve_schedule(schedule)  # type: ignore[arg-type]
    programs: list[Program] = chosen.programs(M, 4)
    x, y = torch.randn(2 * M, 8), torch.randn(2 * M, 8)
    with pipeline.profile() as prof, record_function("caller"):
        pipe.step(x, y, F.mse_loss, schedule=chosen)
    threads = Threads(prof)
    workers = [threads.one_thread(task_names(program)) for program in programs]
    assert len(set(workers)) == len(programs) and threads.caller not in workers
    pipe.close()


def test_every_forward_of_evaluate_is_on_its_partitions_worker(unwarned: None) -> None:
    pipe = small_pipe(partitions=3)
    x, y = torch.randn(2 * M, 8), torch.randn(2 * M, 8)
    with pipeline.profile() as prof, record_function("caller"):
        pipe.evaluate(x, y, F.mse_loss)
    threads = Threads(prof)
    workers = [threads.one_thread(task_names(p)) for p in forward_programs(M, 3, 3)]
    assert len(set(workers)) == 3 and threads.caller not in workers
    with torch.profiler.profile(), pytest.warns(UserWarning, match="pipeline.profile") as caught:
        pipe.evaluate(x)
    assert caught[0].filename == __file__
    pipe.close()


def test_the_plain_profiler_makes_a_pipe_warn_once_naming_pipeline_profile(
    unwarned: None,
) -> None:
    pipe = small_pipe(partitions=2)
    x, y = torch.randn(2 * M, 8), torch.randn(2 * M, 8)
    pipe(x)
    with pipeline.profile():
        pipe(x)
        pipe.step(x, y, F.mse_loss)
    with torch.profiler.profile() as prof:
        with pytest.warns(UserWarning, match=r"worker threads.*pipeline\.profile\(\)") as caught:
            pipe.step(x, y, F.mse_loss)
        pipe(x)  # once per process: no second warning
        pipe.step(x, y, F.mse_loss)
    assert caught[0].filename == __file__  # the line that called the Pipe
    # What the plain profiler shows: the caller's thread, none of the workers' tasks.
    assert not [e.name for e in prof.events() if e.name.startswith("pipe.forward")]
    pipe.close()


def test_pipe_x_warns_at_the_callers_line(unwarned: None) -> None:
    pipe = small_pipe(partitions=2)
    with torch.profiler.profile(), pytest.warns(UserWarning, match="pipeline.profile") as caught:
        pipe(torch.randn(2 * M, 8))
    assert caught[0].filename == __file__
    pipe.close()


def test_an_experimental_config_of_ones_own_is_refused() -> None:
    config = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    with pytest.raises(TypeError, match="sets experimental_config itself"):
        pipeline.profile(experimental_config=config)
