from __future__ import annotations

import pytest
import torch

from pipeline.microbatch import Batch, NoChunk, check_input, gather, scatter


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
    with pytest.raises(ValueError, match="position 1 is a non-tensor that differs"):
        gather([Batch((torch.ones(1), 1)), Batch((torch.ones(1), 2))])


@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        ([torch.ones(2)], TypeError, "must be a Tensor or a tuple of values, got list"),
        ("text", TypeError, "got str"),
        ((1, "a"), TypeError, "holds no tensor to split"),
        ((NoChunk(torch.ones(2)),), TypeError, "holds no tensor to split"),
        (torch.tensor(1.0), ValueError, "is a scalar"),
        ((torch.ones(3), torch.ones(4)), ValueError, r"disagree on the batch size.*0: 3.*1: 4"),
        (torch.ones(0, 3), ValueError, "batch is empty"),
    ],
)
def test_bad_inputs(value: object, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        check_input(value)


def test_no_chunk_wraps_only_tensors() -> None:
    with pytest.raises(TypeError, match="NoChunk wraps a tensor, got int"):
        NoChunk(3)  # type: ignore[arg-type]
