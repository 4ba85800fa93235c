"""Errors DataParallel and its helpers raise before any communication (single process)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipeline import DataParallel
from pipeline.data_parallel.replicas import first_difference, signature
from pipeline.distributed import read_torchrun_env

TORCHRUN_ENV = {
    "RANK": "1",
    "WORLD_SIZE": "2",
    "LOCAL_RANK": "1",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29500",
}

OPTIONS = {
    "bucket_cap_mb": 25,
    "first_bucket_mb": 1,
    "broadcast_buffers": True,
    "find_unused_parameters": False,
    "gradient_as_bucket_view": False,
}
OTHER_OPTIONS = {
    "bucket_cap_mb": 10,
    "first_bucket_mb": 0.5,
    "broadcast_buffers": False,
    "find_unused_parameters": True,
    "gradient_as_bucket_view": True,
}


def test_uninitialised_process_group_is_a_clear_error() -> None:
    with pytest.raises(RuntimeError, match="init_process_group"):
        DataParallel(nn.Linear(2, 2))


@pytest.mark.parametrize("option", ["bucket_cap_mb", "first_bucket_mb"])
@pytest.mark.parametrize("value", [0, -1.5])
def test_non_positive_bucket_size_is_rejected(option: str, value: float) -> None:
    with pytest.raises(ValueError, match=option):
        DataParallel(nn.Linear(2, 2), **{option: value})


def test_module_without_trainable_parameters_is_rejected() -> None:
    frozen = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="no parameters that require grad"):
        DataParallel(frozen)


def test_sparse_gradients_are_rejected() -> None:
    model = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 1))
    with pytest.raises(ValueError, match=r"'0' \(Embedding\) produces sparse"):
        DataParallel(model)


def test_non_module_is_rejected() -> None:
    with pytest.raises(TypeError, match=r"nn\.Module"):
        DataParallel(lambda x: x)  # type: ignore[arg-type]


def test_torchrun_env_is_read() -> None:
    env = read_torchrun_env(TORCHRUN_ENV)
    assert (env.rank, env.world_size, env.local_rank, env.master_port) == (1, 2, 1, 29500)


def test_missing_torchrun_variables_are_named() -> None:
    partial_env = {k: v for k, v in TORCHRUN_ENV.items() if k not in ("RANK", "MASTER_PORT")}
    with pytest.raises(RuntimeError, match=r"RANK, MASTER_PORT .*torchrun"):
        read_torchrun_env(partial_env)


def test_malformed_torchrun_variable_is_an_error() -> None:
    with pytest.raises(RuntimeError, match="malformed"):
        read_torchrun_env({**TORCHRUN_ENV, "WORLD_SIZE": "two"})


@pytest.mark.parametrize(
    ("other", "fragment"),
    [
        (
            nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 1)),
            "'0.weight' has shape (4, 2) on rank 0 but (4, 3) on rank 3",
        ),
        (
            nn.Sequential(nn.Linear(2, 4), nn.Linear(4, 1)).double(),
            "'0.weight' has dtype torch.float32 on rank 0 but torch.float64 on rank 3",
        ),
        (
            nn.Sequential(nn.Linear(2, 4), nn.Linear(4, 1, bias=False)),
            "rank 0 has 4 parameters and buffers but rank 3 has 3; "
            "the first extra one is parameter '1.bias' on rank 0",
        ),
        (
            nn.Sequential(nn.Linear(2, 4), nn.Sequential(nn.Linear(4, 1))),
            "parameter '1.weight' on rank 0 stands where rank 3 has parameter '1.0.weight'",
        ),
        (
            nn.Sequential(nn.Linear(2, 4).requires_grad_(False), nn.Linear(4, 1)),
            "'0.weight' has requires_grad True on rank 0 but False on rank 3",
        ),
    ],
)
def test_first_difference_names_the_tensor_and_ranks(other: nn.Module, fragment: str) -> None:
    reference = nn.Sequential(nn.Linear(2, 4), nn.Linear(4, 1))
    message = first_difference(signature(reference, OPTIONS), signature(other, OPTIONS), rank=3)
    assert message is not None and fragment in message
    assert "every rank must build the same model" in message


def test_identical_models_have_no_difference() -> None:
    torch.manual_seed(0)
    one, other = signature(nn.Linear(2, 2), OPTIONS), signature(nn.Linear(2, 2), OPTIONS)
    assert first_difference(one, other, rank=1) is None


@pytest.mark.parametrize("option", list(OPTIONS))
def test_first_difference_names_a_differing_option(option: str) -> None:
    model = nn.Linear(2, 2)
    other = signature(model, {**OPTIONS, option: OTHER_OPTIONS[option]})
    message = first_difference(signature(model, OPTIONS), other, rank=1)
    assert message == (
        f"{option} is {OPTIONS[option]!r} on rank 0 but {OTHER_OPTIONS[option]!r} on rank 1: "
        "pass the same options to DataParallel on every rank"
    )


def test_first_difference_names_a_different_device_pattern() -> None:
    # Rank 0 keeps both layers on one device, rank 1 puts the second on
    # another: same model, but buckets (one per device) would differ.
    reference = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    other = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2).to("meta"))
    message = first_difference(signature(reference, OPTIONS), signature(other, OPTIONS), rank=1)
    assert message is not None
    assert "parameter '1.weight' is on device #0 (cpu) of rank 0 but on device #1 (meta)" in message
    assert "same pattern" in message
