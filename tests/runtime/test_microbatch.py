from __future__ import annotations

import collections
from collections.abc import Callable

import pytest
import torch

from pipeline.runtime.microbatch import Batch, NoChunk, check_input, gather, scatter


def test_tensor_splits_like_chunk() -> None:
    x = torch.arange(10).view(10, 1)
    batches = scatter(x, 4)
    assert [b.value.shape[0] for b in batches] == [3, 3, 3, 1]
    assert torch.equal(gather(batches), x)


def test_fewer_micro_batches_when_batch_is_small() -> None:
    assert len(scatter(torch.zeros(3, 2), 8)) == 3


def test_tuple_splits_tensors_and_repeats_the_rest() -> None:
    x, y, mask = torch.randn(6, 2), torch.randn(6), torch.ones(4, 4)
    batches = scatter((x, "tag", y, NoChunk(mask), 7), 3)
    assert len(batches) == 3
    for k, batch in enumerate(batches):
        a, tag, b, m, seven = batch.value
        assert torch.equal(a, x[2 * k : 2 * k + 2]) and torch.equal(b, y[2 * k : 2 * k + 2])
        assert tag == "tag" and seven == 7 and m is mask


def test_gather_tuple_concatenates_tensors_and_keeps_equal_values() -> None:
    batches = [Batch((torch.ones(2), "same")), Batch((torch.zeros(1), "same"))]
    out = gather(batches)
    assert isinstance(out, tuple) and out[1] == "same"
    assert torch.equal(out[0], torch.tensor([1.0, 1.0, 0.0]))


def test_gather_refuses_differing_non_tensors() -> None:
    with pytest.raises(ValueError, match="output leaf 1 is a non-tensor that differs"):
        gather([Batch((torch.ones(1), 1)), Batch((torch.ones(1), 2))])


def test_gather_keeps_a_nan_that_every_micro_batch_returned() -> None:
    out = gather([Batch((torch.ones(1), float("nan"))), Batch((torch.ones(1), float("nan")))])
    assert out[1] != out[1]
    with pytest.raises(ValueError, match="differs between micro-batches"):
        gather([Batch((torch.ones(1), float("nan"))), Batch((torch.ones(1), 0.0))])


@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        ("text", TypeError, r"Pipe input \(str\) holds no tensor"),
        (None, TypeError, r"Pipe input \(NoneType\) holds no tensor"),
        ((1, "a"), TypeError, "holds no tensor to split"),
        ((NoChunk(torch.ones(2)),), TypeError, "holds no tensor to split"),
        (torch.tensor(1.0), ValueError, "input is a 0-dim tensor"),
        ((torch.ones(2), {"k": torch.tensor(1.0)}), ValueError, r"input\[1\]\['k'\] is a 0-dim"),
        (torch.ones(0, 3), ValueError, "batch is empty.*skip empty batches"),
    ],
)
def test_bad_inputs(value: object, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        check_input(value)


def test_no_chunk_wraps_only_tensors() -> None:
    with pytest.raises(TypeError, match="NoChunk wraps a tensor, got int"):
        NoChunk(3)  # type: ignore[arg-type]


def test_tensors_nested_in_containers_are_split_too() -> None:
    x, bias, extra = torch.randn(4, 2), torch.randn(4, 2), torch.randn(4)
    value = (x, (bias,), {"extra": [extra, "tag"], "mask": NoChunk(torch.ones(3))})
    batches = scatter(value, 2)
    assert len(batches) == 2
    for k, batch in enumerate(batches):
        a, (b,), rest = batch.value
        rows = slice(2 * k, 2 * k + 2)
        assert torch.equal(a, x[rows]) and torch.equal(b, bias[rows])
        assert torch.equal(rest["extra"][0], extra[rows]) and rest["extra"][1] == "tag"
        assert torch.equal(rest["mask"], torch.ones(3))
    gathered = gather([Batch(b.value[:3]) for b in batches])
    assert torch.equal(gathered[0], x) and torch.equal(gathered[1][0], bias)
    assert torch.equal(gathered[2]["extra"][0], extra)


def test_namedtuples_and_return_types_keep_their_type() -> None:
    Pair = collections.namedtuple("Pair", "values indices")
    for value in (Pair(torch.randn(4, 2), torch.arange(4)), torch.randn(4, 3).max(dim=1)):
        batches = scatter(value, 2)
        assert all(type(b.value) is type(value) for b in batches)
        gathered = gather(batches)
        assert type(gathered) is type(value)
        assert torch.equal(gathered.values, value.values)
        assert torch.equal(gathered.indices, value.indices)


def test_gather_names_a_scalar_output() -> None:
    with pytest.raises(ValueError, match=r"returned a 0-dim tensor.*concatenated along dim 0"):
        gather([Batch(torch.tensor(1.0)), Batch(torch.tensor(2.0))])


def test_gather_names_the_micro_batches_whose_shapes_differ() -> None:
    with pytest.raises(
        ValueError, match=r"micro-batch 0: \(2, 3\), micro-batch 1: \(1,\).*squeeze"
    ):
        gather([Batch(torch.ones(2, 3)), Batch(torch.ones(1))])


def test_gather_names_structures_that_differ() -> None:
    with pytest.raises(TypeError, match="different structure per micro-batch"):
        gather([Batch((torch.ones(1), torch.ones(1))), Batch((torch.ones(1),))])


def test_gather_returns_once_what_every_micro_batch_returned_as_the_same_memory() -> None:
    shared = torch.arange(4.0)
    out = gather([Batch((torch.ones(2), shared)), Batch((torch.ones(1), shared.detach()))])
    assert out[1] is shared
    assert torch.equal(out[0], torch.ones(3))


def test_gather_concatenates_tensors_without_memory_of_their_own() -> None:
    # Address 0 for each: a tensor-parallel last stage's AsyncCollectiveTensor outputs
    # were taken for one memory, and evaluate returned micro-batch 0's 2 rows of 8.
    column = [Batch(torch.empty(2, 6, device="meta")) for _ in range(4)]
    assert gather(column).shape == (8, 6)


def test_a_torch_size_keeps_its_type_through_batches_and_scatter() -> None:
    # pytree flattens a torch.Size as a tuple, and rebuilt it as one: .numel() was gone.
    x = torch.zeros(4, 2)
    assert type(Batch((x, x.shape)).value[1]) is torch.Size
    assert all(type(b.value[1]) is torch.Size for b in scatter((x, x.shape), 2))
    assert type(gather([Batch((x, x.shape)), Batch((x, x.shape))])[1]) is torch.Size


def test_gather_refuses_a_non_tensor_that_counts_each_micro_batchs_rows() -> None:
    # x.size(0) or x.shape returned: equal in every micro-batch, but the plain
    # model's would count the batch's rows, not one micro-batch's.
    pieces = scatter(torch.zeros(6, 8), 3)
    for counted in (2, torch.Size([2, 8])):
        with pytest.raises(ValueError, match=r"micro-batch's rows \(2\).*the batch's \(6\)"):
            gather([Batch((b.value, counted)) for b in pieces], [2, 2, 2])
    assert gather([Batch((b.value, 5)) for b in pieces], [2, 2, 2])[1] == 5


class SetsAttribute(torch.nn.Module):
    """Returns its input times two, with a Python attribute a later layer reads."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = 2 * x
        h.scale = 5.0  # type: ignore[attr-defined]
        return h


class ReadsAttribute(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * getattr(x, "scale", 1.0)


@pytest.mark.parametrize(
    ("call", "where"),
    [(c, w) for c in ("pipe(x)", "step", "evaluate") for w in ("input", "activation", "target")
     if (c, w) != ("pipe(x)", "target")],  # pipe(x) takes no target
)  # fmt: skip
def test_a_tensor_carrying_python_attributes_is_refused_where_the_pipe_would_drop_them(
    call: str, where: str
) -> None:
    # Micro-batches and a partition's received input are new tensors: the attribute was
    # gone, and the reading layer silently took its default (outputs 5.2 and 3.7 off).
    from pipeline import Pipe

    first = SetsAttribute() if where == "activation" else ReadsAttribute()
    model = torch.nn.Sequential(first, ReadsAttribute(), torch.nn.Linear(4, 2)).double()
    pipe = Pipe(model, [1, 2], devices=["cpu"] * 2, chunks=2)
    x, y = torch.randn(4, 4, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64)
    if where != "activation":
        tagged = x if where == "input" else y
        tagged.scale = 5.0  # type: ignore[attr-defined]
    named = {"input": "input carries", "target": "target carries", "activation": "partition 0's"}
    runs = {
        "pipe(x)": lambda: pipe(x),
        "step": lambda: pipe.step(x, y, torch.nn.functional.mse_loss),
        "evaluate": lambda: pipe.evaluate(x, y, torch.nn.functional.mse_loss),
    }
    with pytest.raises(TypeError, match=rf"{named[where]}.* Python attribute\(s\) scale"):
        runs[call]()
    assert all(p.grad is None for p in pipe.parameters())


def test_a_last_partition_output_carrying_attributes_is_refused_where_concatenated() -> None:
    from pipeline import Pipe

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), SetsAttribute()).double()
    x = torch.randn(4, 4, dtype=torch.float64)
    with pytest.raises(TypeError, match="output leaf 0 carries the Python attribute"):
        Pipe(model, [1, 1], devices=["cpu"] * 2, chunks=2)(x)
    assert Pipe(model, [1, 1], devices=["cpu"] * 2, chunks=1)(x).scale == 5.0  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "make",
    [
        lambda x: x.to_sparse(),
        lambda x: x.to_sparse_csr(),
        lambda x: torch.nested.nested_tensor(list(x.unbind())),
    ],
    ids=["coo", "csr", "strided-nested"],
)
def test_an_input_torch_cannot_split_is_refused_naming_its_layout(
    make: Callable[[torch.Tensor], torch.Tensor],
) -> None:
    with pytest.raises(TypeError, match="which torch cannot split into micro-batches"):
        check_input(make(torch.randn(4, 3)))


class Ragged(torch.nn.Module):
    """Rows cut to their lengths: a nested tensor of the jagged layout."""

    def __init__(self) -> None:
        super().__init__()
        self.l = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = [r[: 1 + k % 3] for k, r in enumerate(self.l(x).unbind())]
        return torch.nested.as_nested_tensor(rows, layout=torch.jagged)


class Sums(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([r.sum(0) for r in self.l(x).unbind()])


@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_a_ragged_activation_in_a_step_is_the_plain_models_or_refused_where_recomputed(
    checkpoint: str,
) -> None:
    # Recomputed, it got a new ragged size: torch's shape mismatch in the backward,
    # after the last stage's .grad was written.
    import copy

    from pipeline import Pipe

    torch.manual_seed(0)
    plain = torch.nn.Sequential(Ragged(), Sums()).double()
    layers = copy.deepcopy(plain)
    pipe = Pipe(layers, [1, 1], devices=["cpu"] * 2, chunks=2, checkpoint=checkpoint)  # type: ignore[arg-type]
    x = torch.randn(6, 4, 4, dtype=torch.float64)
    total = lambda out, target: out.square().sum()  # noqa: E731
    if checkpoint == "always":
        with pytest.raises(ValueError, match=r"stage 1 is given a nested .* checkpointed"):
            pipe.step(x, x, total, loss_reduction="sum")
        assert all(p.grad is None for p in layers.parameters())
        return
    pipe.step(x, x, total, loss_reduction="sum")
    plain(x).square().sum().backward()
    for name, p in plain.named_parameters():
        torch.testing.assert_close(layers.get_parameter(name).grad, p.grad, msg=name)


class RowsWide(torch.nn.Module):
    """Keeps as many columns as its micro-batch has rows: shapes differ beyond dim 0."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, : x.shape[0]]


def test_step_outputs_that_cannot_be_concatenated_are_refused_once_the_last_forward_ran() -> None:
    # The refusal came after every backward; with GPipe's programs it now comes before any.
    from pipeline import Pipe

    layers = torch.nn.Sequential(torch.nn.Linear(4, 4), RowsWide()).double()
    pipe = Pipe(layers, [1, 1], devices=["cpu"] * 2, chunks=3)
    x = torch.randn(7, 4, dtype=torch.float64)
    total = lambda out, target: out.sum()  # noqa: E731
    with pytest.raises(ValueError, match="cannot be concatenated along dim 0"):
        pipe.step(x, x, total, schedule="gpipe", return_outputs=True)
    assert all(p.grad is None for p in layers.parameters())


def test_torchs_own_private_attributes_on_a_tensor_pass() -> None:
    # torch._dynamo.mark_dynamic(x, 0) sets _dynamo_dynamic_indices and others, and a
    # compiled layer marks its outputs alike: refused, they failed a compiled pipe's
    # second batch size.
    from pipeline import Pipe

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)).double()
    x = torch.randn(4, 4, dtype=torch.float64)
    x._dynamo_dynamic_indices = {0}  # type: ignore[attr-defined]
    expected = model(x)
    torch.testing.assert_close(Pipe(model, [1, 1], devices=["cpu"] * 2, chunks=2)(x), expected)
