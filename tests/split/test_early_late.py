"""A model of our own whose early values are used at the end: skips straight to the last piece."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from split_models import EarlyLate, assert_same, early_late, gradients, twin

import pipeline
from balance import balance_by_params, balance_by_time
from pipeline import Pipe
from pipeline.skip import Route


@pytest.fixture(scope="module")
def split_model() -> tuple[EarlyLate, pipeline.split.SplitModel]:  # type: ignore[name-defined]
    model = early_late()
    return model, pipeline.split(model, (torch.randn(4, 8, dtype=torch.float64),))


def test_pieces_before_each_block_and_after(split_model) -> None:
    _, seq = split_model
    starts = [piece.start for piece in seq]
    assert starts == [
        "the start",
        "blocks.0",
        "blocks.1",
        "blocks.2",
        "blocks.3",
        "after the last block",
    ]
    assert [[name for name, _ in piece.blocks] for piece in seq][1:5] == [
        ["blocks.0"],
        ["blocks.1"],
        ["blocks.2"],
        ["blocks.3"],
    ]


def test_early_values_skip_the_pieces_between(split_model) -> None:
    _, seq = split_model
    # The embedding reaches block 0 on the main path; block 0's piece, its user, relays it
    # with its own output as skips to the head, past blocks 1 to 3, which get h alone.
    assert [piece.receives for piece in seq] == [1, 1, 1, 1, 1, 1]
    assert len(seq[1].stashes) == 2
    assert sorted(seq[5].poppable_names) == sorted(seq[1].stashable_names)
    assert all(not piece.stashes and not piece.pops for piece in list(seq)[2:5])


@pytest.mark.parametrize("rows", [4, 7, 1])
def test_outputs_and_gradients_equal_the_model(split_model, rows: int) -> None:
    model, seq = split_model
    plain = twin(model)
    x = torch.randn(rows, 8, dtype=torch.float64)
    model.zero_grad()
    out = seq(x)
    expected = plain(x)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    out.square().sum().backward()
    expected.square().sum().backward()
    assert_same(gradients(model), gradients(plain))


def test_names_are_the_models(split_model) -> None:
    model, seq = split_model
    assert list(seq.state_dict()) == list(model.state_dict())
    assert [n for n, _ in seq.named_parameters()] == [n for n, _ in model.named_parameters()]
    assert seq.blocks[2] is model.blocks[2]
    assert seq.scale is model.scale


def test_state_dict_round_trips_both_ways() -> None:
    model = early_late()
    seq = pipeline.split(model, (torch.randn(3, 8, dtype=torch.float64),))
    other = early_late()
    seq.load_state_dict(other.state_dict())
    x = torch.randn(5, 8, dtype=torch.float64)
    torch.testing.assert_close(seq(x), other(x), rtol=0, atol=0)
    third = early_late()
    third.load_state_dict(seq.state_dict())
    torch.testing.assert_close(third(x), other(x), rtol=0, atol=0)


@pytest.mark.parametrize(("balance", "chunks"), [([3, 3], 2), ([2, 2, 2], 3), ([1, 2, 2, 1], 4)])
def test_pipe_forward_and_backward(split_model, balance: list[int], chunks: int) -> None:
    model, seq = split_model
    plain = twin(model)
    pipe = Pipe(seq, balance, devices=["cpu"] * len(balance), chunks=chunks)
    x = torch.randn(7, 8, dtype=torch.float64)
    model.zero_grad()
    out = pipe(x)
    expected = plain(x)
    torch.testing.assert_close(out, expected)
    out.square().sum().backward()
    expected.square().sum().backward()
    assert_same(gradients(model), gradients(plain))
    assert list(pipe.state_dict()) == list(model.state_dict())
    assert [n for n, _ in pipe.named_parameters()] == [n for n, _ in model.named_parameters()]
    pipe.close()


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved", "zb-h1"])
def test_pipe_step(split_model, schedule: str) -> None:
    model, seq = split_model
    plain = twin(model)
    balance = [2, 1, 1, 2] if schedule == "interleaved" else [2, 2, 2]
    pipe = Pipe(seq, balance, devices=["cpu"] * len(balance), chunks=4)
    x, y = torch.randn(8, 8, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)
    model.zero_grad()
    loss = pipe.step(x, y, F.mse_loss, schedule=schedule)
    expected = F.mse_loss(plain(x), y)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach())
    assert_same(gradients(model), gradients(plain))
    pipe.close()


def test_a_trace_records_every_partitions_tasks(split_model) -> None:
    _, seq = split_model
    pipe = Pipe(seq, [2, 2, 2], devices=["cpu"] * 3, chunks=2, checkpoint="except_last")
    x, y = torch.randn(4, 8, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    with pipeline.trace() as timeline:
        pipe.step(x, y, F.mse_loss, schedule="1f1b")
    done = {(e.kind, e.microbatch, e.partition) for e in timeline.events}
    every = {(i, j) for i in range(2) for j in range(3)}
    for kind in ("forward", "backward"):
        assert {(i, j) for k, i, j in done if k == kind} == every, kind
    # except_last: micro-batch 0 recomputed where its backward waits (not on the last partition).
    assert {(i, j) for k, i, j in done if k == "recompute"} == {(0, 0), (0, 1)}
    assert len(timeline.summary().partitions) == 3
    pipe.close()


def test_skip_layout_goes_straight(split_model) -> None:
    _, seq = split_model
    pipe = Pipe(seq, [2, 2, 2], devices=["cpu"] * 3)
    routes = pipe.skip_layout.routes()
    assert [(route.source, route.target) for route in routes] == [(0, 2), (0, 2)]
    assert all(isinstance(route, Route) for route in routes)
    pipe.close()


def test_balance_groups_pieces(split_model) -> None:
    _, seq = split_model
    assert sum(balance_by_params(3, seq)) == len(seq)
    sample = torch.randn(4, 8, dtype=torch.float64)
    assert sum(balance_by_time(2, seq, sample, timeout=0.01, device="cpu")) == len(seq)


def test_distributed_checkpoint_state_dict_of_a_pipe(split_model) -> None:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    model, seq = split_model
    pipe = Pipe(seq, [3, 3], devices=["cpu"] * 2)
    state = get_model_state_dict(pipe)
    assert list(state) == list(model.state_dict())
    other = early_late()
    set_model_state_dict(pipe, other.state_dict())
    x = torch.randn(2, 8, dtype=torch.float64)
    torch.testing.assert_close(pipe(x), other(x))
    pipe.close()
