"""Worker threads: concurrency, exceptions, teardown."""

from __future__ import annotations

import copy
import gc
import threading
import traceback

import pytest
import torch
from torch import Tensor, nn

from pipeline import Pipe
from tests.conftest import pipe_threads
from tests.helpers import Rendezvous


def test_two_cpu_partitions_run_concurrently() -> None:
    # In cycle 1, partition 0 runs micro-batch 1 while partition 1 runs
    # micro-batch 0. Serialized, one side would wait alone and time out.
    barrier = threading.Barrier(2, timeout=10)
    model = nn.Sequential(Rendezvous(barrier, call=2), Rendezvous(barrier, call=1))
    pipe = Pipe(model, [1, 1], devices=["cpu", "cpu"], chunks=2)
    with torch.no_grad():
        out = pipe(torch.zeros(2, 1))
    assert torch.equal(out, torch.full((2, 1), 2.0))  # type: ignore[arg-type]
    assert not barrier.broken


def test_each_partition_has_its_own_named_thread() -> None:
    seen: dict[int, str] = {}

    class Where(nn.Module):
        def __init__(self, j: int) -> None:
            super().__init__()
            self.j = j

        def forward(self, x: Tensor) -> Tensor:
            seen[self.j] = threading.current_thread().name
            return x

    pipe = Pipe(nn.Sequential(Where(0), Where(1), Where(2)), [1, 1, 1], devices=["cpu"] * 3)
    pipe(torch.zeros(1, 1))
    assert seen == {j: f"pipe-partition-{j}" for j in range(3)}
    assert len(pipe_threads()) == 3


class Where(nn.Module):
    """Records the name of the thread each call runs on."""

    def __init__(self, seen: list[str]) -> None:
        super().__init__()
        self.seen = seen

    def forward(self, x: Tensor) -> Tensor:
        self.seen.append(threading.current_thread().name)
        return x * 2


def test_partitions_of_one_device_share_its_thread_with_threads_device() -> None:
    seen: list[str] = []
    pipe = Pipe(
        nn.Sequential(Where(seen), Where(seen), Where(seen)),
        [1, 1, 1],
        devices=["cpu"] * 3,
        chunks=2,
        checkpoint="never",
        threads="device",
    )
    x = torch.ones(4, 1, requires_grad=True)
    pipe(x).sum().backward()  # type: ignore[union-attr]
    pipe.step(x, torch.zeros(4, 1), torch.nn.functional.mse_loss)
    assert len(seen) == 12 and set(seen) == {"pipe-device-cpu"}
    assert [t.name for t in pipe_threads()] == ["pipe-device-cpu"]
    copied = copy.deepcopy(pipe)
    assert copied.threads == "device" and len(pipe_threads()) == 2
    pipe.close()
    copied.close()


def test_threads_must_name_a_layout() -> None:
    with pytest.raises(ValueError, match="threads must be 'auto'"):
        Pipe(nn.Sequential(nn.Identity()), [1], threads="gpu")  # type: ignore[arg-type]


class Boom(nn.Module):
    """Raises a new ``kind`` exception on its ``when``-th call."""

    def __init__(self, kind: type[Exception], when: int) -> None:
        super().__init__()
        self.kind = kind
        self.when = when
        self.calls = 0

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        if self.calls == self.when:
            raise self.kind("boom")
        return x


@pytest.mark.parametrize("kind", [ValueError, KeyError, ZeroDivisionError])
def test_exception_keeps_its_type_and_traceback_and_next_call_works(kind: type[Exception]) -> None:
    pipe = Pipe(
        nn.Sequential(nn.Linear(2, 2), Boom(kind, when=2), nn.Linear(2, 2)),
        [1, 1, 1],
        devices=["cpu"] * 3,
        chunks=4,
    )
    with pytest.raises(kind) as info:
        pipe(torch.randn(8, 2))
    frames = traceback.extract_tb(info.value.__traceback__)
    assert any(frame.name == "forward" and "test_worker" in frame.filename for frame in frames)
    out = pipe(torch.randn(8, 2))  # the workers survived
    assert isinstance(out, Tensor) and out.shape == (8, 2)
    assert len(pipe_threads()) == 3


def test_exception_in_backward_recompute_reaches_the_caller() -> None:
    class FailOnRecompute(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            from pipeline import is_recomputing

            if is_recomputing():
                raise RuntimeError("recompute failed")
            return x.tanh()  # saves its output, so backward recomputes it

    pipe = Pipe(
        nn.Sequential(nn.Linear(2, 2), FailOnRecompute()),
        [1, 1],
        devices=["cpu"] * 2,
        chunks=2,
        checkpoint="always",
    )
    out = pipe(torch.randn(4, 2))
    with pytest.raises(RuntimeError, match="recompute failed"):
        out.sum().backward()  # type: ignore[union-attr]


def test_partition_returning_no_tensor_is_a_type_error() -> None:
    class ReturnsCount(nn.Module):
        def forward(self, x: Tensor) -> int:
            return x.numel()

    pipe = Pipe(nn.Sequential(nn.Identity(), ReturnsCount()), [1, 1], devices=["cpu"] * 2)
    with pytest.raises(TypeError, match="partition 1 returned int, which holds no tensor"):
        pipe(torch.zeros(2, 2))


def test_partition_returning_a_list_passes_it_on() -> None:
    class ReturnsList(nn.Module):
        def forward(self, x: Tensor) -> list[Tensor]:
            return [x, x * 2]

    class Add(nn.Module):
        def forward(self, pair: list[Tensor]) -> Tensor:
            assert isinstance(pair, list)
            return pair[0] + pair[1]

    pipe = Pipe(nn.Sequential(ReturnsList(), Add()), [1, 1], devices=["cpu"] * 2, chunks=2)
    x = torch.randn(4, 2)
    assert torch.equal(pipe(x), x * 3)  # type: ignore[arg-type]


def test_close_stops_threads_and_refuses_more_work() -> None:
    pipe = Pipe(nn.Sequential(nn.Identity(), nn.Identity()), [1, 1], devices=["cpu"] * 2)
    assert len(pipe_threads()) == 2
    pipe.close()
    assert pipe_threads() == []
    with pytest.raises(RuntimeError, match="Pipe is closed"):
        pipe(torch.zeros(1, 1))
    pipe.close()  # idempotent


def test_garbage_collection_stops_threads_of_many_pipes() -> None:
    pipes = [
        Pipe(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), [1, 1], devices=["cpu"] * 2, chunks=2)
        for _ in range(5)
    ]
    for pipe in pipes:
        pipe(torch.randn(4, 2)).sum().backward()  # type: ignore[union-attr]
    assert len(pipe_threads()) == 10
    del pipe, pipes
    gc.collect()
    assert pipe_threads() == []


def test_pipe_is_freed_while_its_output_graph_is_alive() -> None:
    import weakref

    pipe = Pipe(
        nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)),
        [1, 1],
        devices=["cpu"] * 2,
        chunks=2,
        checkpoint="always",
    )
    out = pipe(torch.randn(4, 2))
    ref = weakref.ref(pipe)
    del pipe
    gc.collect()
    assert ref() is None and pipe_threads() == []
    out.sum().backward()  # type: ignore[union-attr]  # the graph does not need the Pipe
