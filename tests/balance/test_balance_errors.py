"""Bad input to balance: the error type, a message naming the value and the fix, and no work."""

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import balance
from balance import (
    BalanceError,
    balance_by_params,
    balance_by_size,
    balance_by_time,
    balance_cost,
)
from balance.blockpartition import solve

CPU = torch.device("cpu")


class Counted(nn.Linear):
    """A Linear(4, 4) that counts its forward calls, to show that no work was done."""

    calls = 0

    def __init__(self) -> None:
        super().__init__(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        Counted.calls += 1
        return super().forward(x)


@pytest.fixture
def model() -> nn.Sequential:
    Counted.calls = 0
    return nn.Sequential(Counted(), Counted(), Counted())


def by_time(partitions: Any, module: Any, sample: Any = None, **options: Any) -> list[int]:
    sample = torch.randn(2, 4) if sample is None else sample
    return balance_by_time(partitions, module, sample, timeout=0.01, **options)


def by_size(partitions: Any, module: Any, sample: Any = None, **options: Any) -> list[int]:
    sample = torch.randn(2, 4) if sample is None else sample
    return balance_by_size(partitions, module, sample, **options)


PROFILERS: list[Callable[..., list[int]]] = [by_time, by_size, balance_by_params]


def test_balance_error_is_a_value_error() -> None:
    assert issubclass(BalanceError, ValueError)
    assert balance.BalanceError is BalanceError


@pytest.mark.parametrize("profiler", PROFILERS)
def test_more_partitions_than_layers(
    profiler: Callable[..., list[int]], model: nn.Sequential
) -> None:
    with pytest.raises(BalanceError, match=r"partitions=4 is more than the 3 layers.*<= 3"):
        profiler(4, model)
    assert Counted.calls == 0


@pytest.mark.parametrize("profiler", PROFILERS)
@pytest.mark.parametrize("partitions", [0, -2])
def test_partitions_below_one(
    profiler: Callable[..., list[int]], model: nn.Sequential, partitions: int
) -> None:
    with pytest.raises(BalanceError, match=rf"partitions={partitions}, but it must be at least 1"):
        profiler(partitions, model)
    assert Counted.calls == 0


@pytest.mark.parametrize("profiler", PROFILERS)
@pytest.mark.parametrize("partitions", [2.0, "2", True, None])
def test_partitions_not_an_int(
    profiler: Callable[..., list[int]], model: nn.Sequential, partitions: object
) -> None:
    with pytest.raises(TypeError, match=r"partitions must be an int, got"):
        profiler(partitions, model)
    assert Counted.calls == 0


@pytest.mark.parametrize("profiler", PROFILERS)
def test_empty_module(profiler: Callable[..., list[int]]) -> None:
    with pytest.raises(BalanceError, match=r"module is an empty nn.Sequential"):
        profiler(1, nn.Sequential())


@pytest.mark.parametrize("profiler", PROFILERS)
@pytest.mark.parametrize("module", [nn.Linear(4, 4), [nn.Linear(4, 4)], nn.ModuleList([nn.ReLU()])])
def test_module_not_a_sequential(profiler: Callable[..., list[int]], module: object) -> None:
    with pytest.raises(TypeError, match=r"module must be an nn.Sequential, got \w+; wrap"):
        profiler(1, module)


@pytest.mark.parametrize("profiler", [by_time, by_size])
def test_sample_the_first_layer_cannot_take(
    profiler: Callable[..., list[int]], model: nn.Sequential
) -> None:
    message = (
        r"layer 0 \(Counted\) failed on input float32\[2, 3\] with RuntimeError: .*; "
        r"pass a sample that this layer accepts"
    )
    with pytest.raises(BalanceError, match=message) as caught:
        profiler(2, model, torch.randn(2, 3), device=CPU)
    assert isinstance(caught.value.__cause__, RuntimeError)


@pytest.mark.parametrize("profiler", [by_time, by_size])
def test_a_later_layer_that_cannot_take_the_output(profiler: Callable[..., list[int]]) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 6), nn.Linear(4, 2))
    message = (
        r"layer 2 \(Linear\) failed on input float32\[2, 6\] with RuntimeError: .*; "
        r"check that it accepts the output of layer 1"
    )
    with pytest.raises(BalanceError, match=message):
        profiler(2, model, device=CPU)


@pytest.mark.parametrize("profiler", [by_time, by_size])
def test_tuple_inputs_are_described(profiler: Callable[..., list[int]]) -> None:
    class Pair(nn.Module):
        def forward(self, values: tuple[Tensor, Tensor, int]) -> Tensor:
            left, right, _ = values
            return left @ right

    sample = (torch.randn(2, 3), torch.ones(2, 3, dtype=torch.int64), 7)
    message = r"layer 0 \(Pair\) failed on input \(float32\[2, 3\], int64\[2, 3\], int\)"
    with pytest.raises(BalanceError, match=message):
        profiler(1, nn.Sequential(Pair()), sample, device=CPU)


@pytest.mark.parametrize("profiler", [by_time, by_size])
def test_a_layer_returning_neither_tensor_nor_tuple(profiler: Callable[..., list[int]]) -> None:
    class AsDict(nn.Module):
        def forward(self, x: Tensor) -> dict[str, Tensor]:
            return {"x": x}

    model = nn.Sequential(nn.Linear(4, 4), AsDict())
    with pytest.raises(BalanceError, match=r"layer 1 \(AsDict\) returned dict; layers must return"):
        profiler(1, model, device=CPU)


def test_a_layer_whose_backward_fails() -> None:
    class NoBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: Tensor) -> Tensor:
            return x.clone()

        @staticmethod
        def backward(ctx: Any, grad: Tensor) -> Tensor:
            raise RuntimeError("no backward here")

    class Broken(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            result: Tensor = NoBackward.apply(x)
            return result

    model = nn.Sequential(nn.Linear(4, 4), Broken())
    with pytest.raises(BalanceError, match=r"backward of layer 1 \(Broken\) failed with Runtime"):
        by_time(1, model, device=CPU)


@pytest.mark.parametrize("profiler", [by_time, by_size])
@pytest.mark.parametrize("sample", [[torch.randn(2, 4)], {"x": torch.randn(2, 4)}, 3.0])
def test_sample_not_a_tensor_or_tuple(
    profiler: Callable[..., list[int]], model: nn.Sequential, sample: object
) -> None:
    with pytest.raises(TypeError, match=r"sample must be a Tensor or a tuple, got \w+"):
        profiler(2, model, sample, device=CPU)
    assert Counted.calls == 0


@pytest.mark.parametrize("timeout", [0, -1.0, float("nan"), float("inf")])
def test_bad_timeout(model: nn.Sequential, timeout: float) -> None:
    with pytest.raises(BalanceError, match=r"timeout=.*must be"):
        balance_by_time(2, model, torch.randn(2, 4), timeout=timeout, device=CPU)
    assert Counted.calls == 0


def test_timeout_not_a_number(model: nn.Sequential) -> None:
    with pytest.raises(TypeError, match=r"timeout must be a number, got str"):
        balance_by_time(2, model, torch.randn(2, 4), timeout="1", device=CPU)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"chunks": 0}, BalanceError, r"chunks=0, but it must be at least 1"),
        ({"chunks": 2.5}, TypeError, r"chunks must be an int, got float"),
        ({"param_scale": -1.0}, BalanceError, r"param_scale=-1.0, but it must be 0 or more"),
        ({"param_scale": float("nan")}, BalanceError, r"param_scale=nan, but it must be a finite"),
    ],
)
def test_bad_size_options(
    model: nn.Sequential, options: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        by_size(2, model, device=CPU, **options)
    assert Counted.calls == 0


@pytest.mark.parametrize("profiler", [by_time, by_size])
@pytest.mark.parametrize(
    ("device", "error", "message"),
    [
        ("nonsense", BalanceError, r"device='nonsense' is not a device .*; pass e.g. 'cpu'"),
        (0.5, TypeError, r"device must be a torch.device or a str, got float"),
    ],
)
def test_bad_device(
    profiler: Callable[..., list[int]],
    model: nn.Sequential,
    device: object,
    error: type[Exception],
    message: str,
) -> None:
    with pytest.raises(error, match=message):
        profiler(2, model, device=device)
    assert Counted.calls == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
@pytest.mark.parametrize("profiler", [by_time, by_size])
def test_a_device_this_machine_lacks(
    profiler: Callable[..., list[int]], model: nn.Sequential
) -> None:
    with pytest.raises(BalanceError, match=r"device='cuda:0', but no cuda device is available"):
        profiler(2, model, device="cuda:0")
    assert Counted.calls == 0


@pytest.mark.parametrize("costs", [[1.0, -0.5, 2.0], [1, float("nan")], [float("inf"), 1.0]])
def test_negative_or_non_finite_costs(costs: list[float]) -> None:
    with pytest.raises(BalanceError, match=r"costs\[\d\] is .*; every cost must be"):
        solve(costs, 1)
    with pytest.raises(BalanceError, match=r"costs\[\d\] is"):
        balance_cost(costs, 1)


def test_the_message_names_the_bad_cost() -> None:
    with pytest.raises(BalanceError, match=r"^costs\[1\] is -0.5; every cost must be 0 or more$"):
        solve([1.0, -0.5], 1)
    with pytest.raises(BalanceError, match=r"^costs\[0\] is inf; every cost must be a finite"):
        solve([float("inf")], 1)


@pytest.mark.parametrize("cost", ["1", None, torch.tensor(1.0), True, 1 + 2j])
def test_costs_that_are_not_real_numbers(cost: object) -> None:
    with pytest.raises(TypeError, match=r"costs\[1\] is \w+ .*; costs must be real numbers"):
        solve([1.0, cost], 1)  # type: ignore[list-item]


def test_solve_partition_errors() -> None:
    with pytest.raises(BalanceError, match=r"partitions=3 is more than the 2 costs"):
        solve([1, 2], 3)
    with pytest.raises(BalanceError, match=r"partitions=1 is more than the 0 costs"):
        solve([], 1)
    with pytest.raises(BalanceError, match=r"partitions=0, but it must be at least 1"):
        solve([1, 2], 0)
    with pytest.raises(TypeError, match=r"partitions must be an int, got float 1.5"):
        solve([1, 2], 1.5)  # type: ignore[arg-type]


def test_numpy_like_numbers_are_accepted() -> None:
    numpy = pytest.importorskip("numpy")
    costs = [numpy.float32(0.5), numpy.int64(2), numpy.float64(1.5)]
    assert balance_cost(costs, 2) == [2, 1]
    assert balance_cost([1, 2, 3], numpy.int64(3)) == [1, 1, 1]
