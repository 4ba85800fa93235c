"""Fork/join phony edges put GPipe's backward order into the autograd graph."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from pipeline import Pipe
from pipeline.clock.dependency import depend, fork, join


def graph_nodes(tensor: Tensor) -> list[Any]:
    seen, stack, nodes = set(), [tensor.grad_fn], []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        nodes.append(node)
        stack.extend(n for n, _ in node.next_functions)
    return nodes


def test_depend_draws_a_phony_edge_from_join_to_fork() -> None:
    before = torch.ones(2, requires_grad=True) * 2
    after = torch.ones(2, requires_grad=True) * 3
    before2, after2 = depend(before, after)
    join_node = after2.grad_fn
    assert join_node is not None and join_node.name().endswith("JoinBackward")
    targets = [n for n, _ in join_node.next_functions if n is not None]
    assert before2.grad_fn in targets  # Join's backward feeds Fork's phony input
    torch.testing.assert_close(before2, before)
    torch.testing.assert_close(after2, after)


def test_fork_join_pass_gradients_unchanged() -> None:
    x = torch.randn(3, requires_grad=True)
    y, phony = fork(x)
    z = join(y * 2, phony)
    z.sum().backward()
    torch.testing.assert_close(x.grad, torch.full((3,), 2.0))


def test_no_edges_without_grad() -> None:
    x = torch.randn(3)
    y, phony = fork(x)
    assert y is x and phony.numel() == 0
    assert join(x, phony) is x


class Record(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, log: list[tuple[int, int]], key: tuple[int, int]) -> Tensor:
        ctx.log, ctx.key = log, key
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        ctx.log.append(ctx.key)
        return grad, None, None


class Tag(nn.Module):
    """Logs (partition, micro-batch) when the backward passes through it."""

    def __init__(self, partition: int, log: list[tuple[int, int]]) -> None:
        super().__init__()
        self.partition, self.log, self.calls = partition, log, 0

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        return Record.apply(x, self.log, (self.partition, self.calls - 1))


def test_pipeline_backward_runs_micro_batches_in_reverse_on_each_partition() -> None:
    log: list[tuple[int, int]] = []
    model = nn.Sequential(
        nn.Linear(2, 2), Tag(0, log), nn.Linear(2, 2), Tag(1, log), nn.Linear(2, 2), Tag(2, log)
    )
    pipe = Pipe(model, [2, 2, 2], devices=["cpu"] * 3, chunks=4, checkpoint="never")
    out = pipe(torch.randn(8, 2))
    assert isinstance(out, Tensor)
    names = {n.name() for n in graph_nodes(out)}
    assert any(n.endswith("ForkBackward") for n in names)
    assert any(n.endswith("JoinBackward") for n in names)
    out.sum().backward()
    for j in range(3):
        assert [mb for p, mb in log if p == j] == [3, 2, 1, 0]


def gpipe_backward_wave(m: int, n: int) -> list[tuple[int, int]]:
    """(partition, micro-batch) as GPipe's backward reaches them: wave by wave, the later
    partition first within a wave."""
    tasks = [(j, i) for i in range(m) for j in range(n)]
    return sorted(tasks, key=lambda task: ((m - 1 - task[1]) + (n - 1 - task[0]), -task[0]))


def test_one_thread_for_every_partition_runs_the_backward_as_gpipes_wave() -> None:
    # threads="device" on one device: the fences and the tasks make their
    # nodes on the worker, so autograd (the most recent ready node first)
    # reaches micro-batch i - 1 on partition j + 1 before micro-batch i on
    # partition j. Depth-first (micro-batch by micro-batch) held more memory.
    log: list[tuple[int, int]] = []
    model = nn.Sequential(
        nn.Linear(2, 2), Tag(0, log), nn.Linear(2, 2), Tag(1, log), nn.Linear(2, 2), Tag(2, log)
    )
    pipe = Pipe(
        model, [2, 2, 2], devices=["cpu"] * 3, chunks=4, checkpoint="never", threads="device"
    )
    for _ in range(2):  # the worker's own node numbers grow from one call to the next
        log.clear()
        for tag in (model[1], model[3], model[5]):
            tag.calls = 0
        pipe(torch.randn(8, 2)).sum().backward()
        assert log == gpipe_backward_wave(4, 3)
    pipe.close()
