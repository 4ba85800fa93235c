"""DeferredBatchNorm tracks running statistics over the whole mini-batch."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pipeline import DeferredBatchNorm, Pipe


def bn_model(momentum: float | None = 0.1) -> nn.Sequential:
    # The BatchNorm's input is the same with or without micro-batches, so its
    # statistics can be compared with the plain model's.
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.BatchNorm1d(6, momentum=momentum))


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
@pytest.mark.parametrize("chunks", [1, 3, 4])
@pytest.mark.parametrize("momentum", [0.1, None])
def test_running_statistics_equal_batch_norm_on_the_full_batch(
    checkpoint: str, chunks: int, momentum: float | None
) -> None:
    model = bn_model(momentum)
    pipe = Pipe(
        copy.deepcopy(model),
        [2, 1],
        devices=["cpu"] * 2,
        chunks=chunks,
        checkpoint=checkpoint,
        deferred_batch_norm=True,
    )  # type: ignore[arg-type]
    for _ in range(3):
        x = torch.randn(12, 4)
        model(x).sum().backward()
        pipe(x).sum().backward()  # type: ignore[union-attr]
    for name, value in model.state_dict().items():
        torch.testing.assert_close(pipe.state_dict()[name], value, msg=name)


@pytest.mark.parametrize("mean", [1000.0, 3000.0])
def test_statistics_of_inputs_far_from_zero_keep_their_precision(mean: float) -> None:
    # float32 inputs of spread 0.1 around a large mean: the sum of squares less
    # the squared mean cancelled to a negative variance at 3000.
    model = nn.Sequential(nn.Identity(), nn.BatchNorm1d(4))
    pipe = Pipe(
        copy.deepcopy(model), [1, 1], devices=["cpu"] * 2, chunks=4, deferred_batch_norm=True
    )
    torch.manual_seed(0)
    for _ in range(30):
        x = mean + 0.1 * torch.randn(32, 4)
        model(x), pipe(x)
    for name in ("running_mean", "running_var"):
        torch.testing.assert_close(
            pipe.state_dict()[f"1.{name}"], model.state_dict()[f"1.{name}"], rtol=1e-4, atol=0
        )
    assert "1.sum" not in dict(pipe.named_buffers())  # the pass's moments are no buffers


def test_eval_uses_the_running_statistics() -> None:
    model = bn_model()
    pipe = Pipe(
        copy.deepcopy(model), [2, 1], devices=["cpu"] * 2, chunks=4, deferred_batch_norm=True
    )
    x = torch.randn(8, 4)
    model(x), pipe(x)
    model.eval(), pipe.eval()
    torch.testing.assert_close(pipe(x), model(x))


def test_without_deferral_statistics_are_per_micro_batch() -> None:
    model = bn_model()
    pipe = Pipe(copy.deepcopy(model), [2, 1], devices=["cpu"] * 2, chunks=4)
    x = torch.randn(8, 4)
    model(x), pipe(x)
    assert pipe.state_dict()["2.num_batches_tracked"] == 4
    assert not torch.allclose(pipe.state_dict()["2.running_var"], model[2].running_var)


def test_convert_changes_the_class_of_the_layer_itself_keeping_its_hooks() -> None:
    # The object stays: its hooks, a reference kept to it, and its own mode.
    bn = nn.BatchNorm2d(3)
    model = nn.Sequential(nn.Conv2d(3, 3, 1), bn)
    calls: list[str] = []
    bn.register_forward_pre_hook(lambda *_: calls.append("pre"))
    bn.register_forward_hook(lambda *_: calls.append("forward"))
    assert DeferredBatchNorm.convert(model) is model
    assert model[1] is bn and isinstance(bn, DeferredBatchNorm) and isinstance(bn, nn.BatchNorm2d)
    pipe = Pipe(model, [1, 1], devices=["cpu"] * 2, chunks=2, deferred_batch_norm=True)
    pipe(torch.randn(4, 3, 2, 2))
    assert calls == ["pre", "forward"] * 2 and int(bn.num_batches_tracked) == 1
    bn.eval()  # frozen through the reference kept from before the pipe
    pipe(torch.randn(4, 3, 2, 2))
    assert int(bn.num_batches_tracked) == 1
    assert isinstance(DeferredBatchNorm.convert(nn.BatchNorm1d(2)), DeferredBatchNorm)
    with pytest.raises(ValueError, match="expected at least 2D input"):
        DeferredBatchNorm(2)(torch.zeros(2))


class OwnBatchNorm(nn.BatchNorm1d):
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return 2 * super().forward(input)


@pytest.mark.parametrize(
    ("layers", "message"),
    [
        ([nn.Linear(4, 4), OwnBatchNorm(4)], "of another class"),
        ([nn.Linear(4, 4), nn.SyncBatchNorm(4)], "of another class"),
        ([nn.Linear(4, 4), nn.LazyBatchNorm1d()], "not materialised"),
        ("shared", r"one layer at \['1', '2'\]"),
        ("nested", "is a Pipe of its own"),
    ],
)
def test_a_batch_norm_that_cannot_defer_is_refused_before_any_is_converted(
    layers: list[nn.Module] | str, message: str
) -> None:
    first = nn.BatchNorm1d(4)
    if layers == "shared":
        shared = nn.BatchNorm1d(4)
        layers = [first, shared, shared]
    elif layers == "nested":
        inner = Pipe(nn.Sequential(nn.BatchNorm1d(4), nn.Tanh()), [1, 1], devices=["cpu"] * 2)
        layers = [first, inner]
    model = nn.Sequential(first, *layers) if layers[0] is not first else nn.Sequential(*layers)
    with pytest.raises(ValueError, match=message):
        Pipe(model, [1, len(model) - 1], devices=["cpu"] * 2, deferred_batch_norm=True)
    assert type(first) is nn.BatchNorm1d  # nothing converted


def test_a_layer_training_in_a_pipe_in_eval_mode_commits_its_statistics() -> None:
    model = bn_model()
    plain = copy.deepcopy(model)
    pipe = Pipe(model, [2, 1], devices=["cpu"] * 2, chunks=3, deferred_batch_norm=True)
    pipe.eval(), plain.eval()
    model[2].train(), plain[2].train()
    x = torch.randn(12, 4)
    pipe(x), plain(x)  # outputs normalised per micro-batch; the statistics the plain model's
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(pipe.state_dict()[name], value, msg=name)


def test_a_batch_norm_after_another_sees_inputs_normalised_per_micro_batch() -> None:
    # The first BatchNorm's input is the plain model's, so its statistics are
    # too. The second one's input comes from the first's output, normalised
    # per micro-batch in the pipe and over the whole batch in the plain model:
    # its statistics are those of the inputs it got, not the plain model's.
    torch.manual_seed(12)
    model = nn.Sequential(
        nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 6), nn.BatchNorm1d(6)
    ).double()
    plain, untouched = copy.deepcopy(model), copy.deepcopy(model)
    pipe = Pipe(model, [2, 3], devices=["cpu"] * 2, chunks=3, deferred_batch_norm=True)
    x = torch.randn(12, 4, dtype=torch.double)
    pipe(x)
    plain(x)
    state, expected = pipe.state_dict(), plain.state_dict()
    for name in ("running_mean", "running_var"):
        torch.testing.assert_close(state[f"1.{name}"], expected[f"1.{name}"], msg=name)
        assert not torch.allclose(state[f"4.{name}"], expected[f"4.{name}"]), name
    first = untouched[1]
    normalised = [
        F.batch_norm(h, None, None, first.weight, first.bias, training=True, eps=first.eps)
        for h in untouched[0](x).chunk(3)
    ]
    with torch.no_grad():  # one BatchNorm step over the whole batch of what it got
        untouched[4](untouched[3](torch.tanh(torch.cat(normalised))))
    for name in ("4.running_mean", "4.running_var"):
        torch.testing.assert_close(state[name], untouched.state_dict()[name], msg=name)


def test_a_batch_norm_run_by_two_partitions_is_refused() -> None:
    # Its running statistics were updated in the order of the partitions' threads.
    shared = nn.BatchNorm1d(4)
    model = nn.Sequential(shared, nn.Linear(4, 4), shared)
    with pytest.raises(ValueError, match="is also '2' of partition 1: its running statistics"):
        Pipe(model, [2, 1], devices=["cpu"] * 2)
    Pipe(model, [3], devices=["cpu"])  # one partition: its uses in the plain model's order


def _stepped_alike(pipe: Pipe, model: nn.Sequential, engine: str) -> None:
    x, y = torch.randn(12, 4, dtype=torch.float64), torch.randn(12, 6, dtype=torch.float64)
    F.mse_loss(model(x), y).backward()
    if engine == "step":
        pipe.step(x, y, F.mse_loss)
    else:
        F.mse_loss(pipe(x), y).backward()  # type: ignore[arg-type]


def _assert_statistics_equal(pipe: Pipe, model: nn.Sequential) -> None:
    for name, value in model.state_dict().items():
        torch.testing.assert_close(pipe.state_dict()[name], value, msg=name, rtol=0, atol=1e-12)


@pytest.mark.parametrize("engine", ["pipe(x)", "step"])
def test_a_batch_norm_converted_after_the_pipe_was_built_is_deferred(engine: str) -> None:
    model = bn_model().double()
    plain = copy.deepcopy(model)
    pipe = Pipe(model, [2, 1], devices=["cpu"] * 2, chunks=4)
    DeferredBatchNorm.convert(model)  # the layer the pipe holds changes class
    for _ in range(2):
        _stepped_alike(pipe, plain, engine)
    assert int(model[2].num_batches_tracked) == 2  # once per mini-batch, not per micro-batch
    _assert_statistics_equal(pipe, plain)


@pytest.mark.parametrize("engine", ["pipe(x)", "step"])
def test_a_deferred_batch_norm_put_in_after_the_pipe_was_built_is_committed(engine: str) -> None:
    model = nn.Sequential(nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6)), nn.Tanh()).double()
    pipe = Pipe(model, [1, 1], devices=["cpu"] * 2, chunks=4, deferred_batch_norm=True)
    model[0][1] = DeferredBatchNorm.convert(nn.Sequential(nn.BatchNorm1d(6).double()))[0]
    plain = copy.deepcopy(model)
    plain[0][1].__class__ = nn.BatchNorm1d  # the plain model's layer, updated on whole batches
    _stepped_alike(pipe, plain, engine)
    assert int(model[0][1].num_batches_tracked) == 1
    _assert_statistics_equal(pipe, plain)


@pytest.mark.parametrize("engine", ["pipe(x)", "step"])
def test_a_batch_norm_put_in_after_the_pipe_converted_its_own_is_refused(engine: str) -> None:
    model = nn.Sequential(nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6)), nn.Tanh()).double()
    pipe = Pipe(model, [1, 1], devices=["cpu"] * 2, chunks=4, deferred_batch_norm=True)
    model[0][1] = nn.BatchNorm1d(6).double()
    with pytest.raises(ValueError, match=r"'0.1' is a BatchNorm1d put in after the pipe conv"):
        _stepped_alike(pipe, copy.deepcopy(model), engine)
    assert int(model[0][1].num_batches_tracked) == 0  # refused before any forward
    assert model[0][0].weight.grad is None
    model[0][1].eval()  # a layer that updates nothing is no concern
    _stepped_alike(pipe, copy.deepcopy(model), engine)


class NormTwice(nn.Module):
    """One BatchNorm called twice per forward: the plain model updates its statistics twice."""

    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(torch.tanh(self.bn(x)))


@pytest.mark.parametrize("engine", ["pipe(x)", "step"])
@pytest.mark.parametrize("chunks", [1, 4])
def test_a_deferred_batch_norm_called_twice_in_one_forward_is_refused(
    engine: str, chunks: int
) -> None:
    model = nn.Sequential(nn.Linear(4, 6), NormTwice()).double()
    pipe = Pipe(model, [1, 1], devices=["cpu"] * 2, chunks=chunks, deferred_batch_norm=True)
    with pytest.raises(RuntimeError, match="DeferredBatchNorm1d ran twice in one micro-batch"):
        _stepped_alike(pipe, copy.deepcopy(model), engine)
    assert int(model[1].bn.num_batches_tracked) == 0 and model[0].weight.grad is None


def test_a_deferred_batch_norm_of_ones_own_in_two_places_of_a_partition_is_refused() -> None:
    norm = DeferredBatchNorm.convert(nn.Sequential(nn.BatchNorm1d(6)))[0]
    model = nn.Sequential(nn.Linear(4, 6), norm, nn.Tanh(), norm).double()
    with pytest.raises(ValueError, match="'1' of partition 0 is also '3' of partition 1"):
        Pipe(model, [3, 1], devices=["cpu"] * 2, chunks=2)
    pipe = Pipe(model, [4], devices=["cpu"], chunks=2)  # twice in one partition
    with pytest.raises(RuntimeError, match="ran twice in one micro-batch's forward"):
        _stepped_alike(pipe, copy.deepcopy(model), "step")
    assert int(norm.num_batches_tracked) == 0


@pytest.mark.parametrize("engine", ["pipe(x)", "step"])
def test_a_lazy_batch_norm_in_a_recomputing_pipe_is_refused_before_any_partition_runs(
    engine: str,
) -> None:
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.LazyBatchNorm1d()).double()
    pipe = Pipe(model, [2, 1], devices=["cpu"] * 2, chunks=2, checkpoint="always")
    plain = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.BatchNorm1d(6)).double()
    with pytest.raises(RuntimeError, match=r"buffer '2.running_mean' of partition 1 is not mat"):
        _stepped_alike(pipe, plain, engine)
    assert int(model[1].num_batches_tracked) == 0  # partition 0 ran nothing either
    model(torch.randn(4, 4, dtype=torch.float64))  # the dry run torch asks of lazy modules
    _stepped_alike(pipe, copy.deepcopy(model), engine)


def test_a_lazy_batch_norm_in_a_pipe_evaluated_or_not_recomputing_runs() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.LazyBatchNorm1d()).double()
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6)).double()
    pipe = Pipe(model, [1, 1], devices=["cpu"] * 2, chunks=2, checkpoint="always").eval()
    plain.eval()
    _stepped_alike(pipe, plain, "step")  # in eval mode nothing recomputes
    torch.testing.assert_close(model[0].weight.grad, plain[0].weight.grad)


class NormInItsOwnCheckpoint(nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.bn, self.reentrant = nn.BatchNorm1d(6), reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self.bn, x, use_reentrant=self.reentrant)  # type: ignore[no-any-return]


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_deferred_batch_norm_in_a_layers_own_checkpoint_is_refused(reentrant: bool) -> None:
    # torch recomputes it in the backward, outside the deferral: one update per micro-batch
    # more than the plain model's two (its forward's and its recomputation's).
    model = nn.Sequential(nn.Linear(4, 6), NormInItsOwnCheckpoint(reentrant)).double()
    pipe = Pipe(model, [1, 1], devices=["cpu"] * 2, chunks=2, deferred_batch_norm=True)
    with pytest.raises(RuntimeError, match=r"runs inside a torch\.utils\.checkpoint of a layer's"):
        _stepped_alike(pipe, copy.deepcopy(model), "step")
    assert int(model[1].bn.num_batches_tracked) == 0
