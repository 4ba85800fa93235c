from __future__ import annotations

import collections

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
