"""Storage materialised from ``meta``: every value written by a reset or init, or refused."""

from __future__ import annotations

import importlib
import math

import pytest
import torch
from torch import nn

meta = importlib.import_module("pipeline.distributed.meta")
CPU = torch.device("cpu")


class DataReset(nn.Linear):
    """The older idiom: a reset writing through ``.data``, which counts no version."""

    def reset_parameters(self) -> None:
        self.weight.data.normal_(0, 0.02)
        self.bias.data.zero_()


class Counter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))
        self.register_buffer("seen", torch.zeros(3, dtype=torch.uint8))

    def reset_parameters(self) -> None:
        self.calls.zero_()
        self.seen.data.zero_()


def on_meta(*layers: type[nn.Module]) -> nn.Sequential:
    with torch.device("meta"):
        return nn.Sequential(*(layer() for layer in layers))


def test_resets_writing_through_data_or_zeros_are_taken() -> None:
    model = meta.materialized(on_meta(lambda: DataReset(4, 4), Counter), CPU)  # type: ignore[arg-type]
    assert model[0].weight.std() > 0 and not model[0].bias.any()
    assert int(model[1].calls) == 0 and not model[1].seen.any()


def test_storage_no_init_wrote_into_is_refused_naming_it() -> None:
    def weights_only(module: nn.Module) -> None:
        for parameter in module.parameters(recurse=False):
            nn.init.ones_(parameter)

    model = on_meta(lambda: nn.Linear(4, 4), lambda: nn.BatchNorm1d(4))  # type: ignore[arg-type]
    with pytest.raises(
        ValueError, match=r"1\.running_mean, 1\.running_var, 1\.num_batches_tracked"
    ):
        meta.materialized(model, CPU, weights_only)


def test_storage_an_init_wrote_into_in_part_holds_nan_in_the_rest() -> None:
    # Not refused (a write was seen), but no old memory is left: NaN shows in the first loss.
    def first_row(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            module.weight.data[0] = 1.0
            module.bias.data.zero_()

    model = meta.materialized(on_meta(lambda: nn.Linear(4, 4)), CPU, first_row)  # type: ignore[arg-type]
    assert torch.equal(model[0].weight[0], torch.ones(4)) and model[0].weight[1:].isnan().all()


class Masked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("causal", torch.ones(3, 3, dtype=torch.bool).tril())

    def reset_parameters(self) -> None:
        pass  # the mask was made in __init__, on meta: it has no values


def test_a_bool_buffer_no_reset_wrote_into_is_refused() -> None:
    with pytest.raises(ValueError, match=r"0\.causal got storage .* no reset_parameters\(\) wr"):
        meta.materialized(on_meta(Masked), CPU)


class Sentinels(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("missing", torch.zeros(2))
        self.register_buffer("mask", torch.zeros(2, dtype=torch.uint8))

    def reset_parameters(self) -> None:
        self.missing.fill_(math.nan)
        self.mask.data.fill_(255)


def test_values_an_init_writes_on_purpose_are_taken_whatever_they_are() -> None:
    model = meta.materialized(on_meta(Sentinels), CPU)
    assert model[0].missing.isnan().all() and (model[0].mask == 255).all()


class SparseScratch(nn.Linear):
    """A reset writing into a sparse tensor of its own (no storage to record) on the way."""

    def reset_parameters(self) -> None:
        if self.weight.is_meta:
            return  # built on meta: its values come when it is materialised
        scratch = torch.zeros(4, 4).to_sparse()
        scratch.mul_(2.0)
        self.weight.copy_(scratch.to_dense() + 1.0)
        self.bias.zero_()


def test_a_reset_writing_into_tensors_without_storage_of_their_own_is_taken() -> None:
    model = meta.materialized(on_meta(lambda: SparseScratch(4, 4)), CPU)  # type: ignore[arg-type]
    assert torch.equal(model[0].weight, torch.ones(4, 4))
