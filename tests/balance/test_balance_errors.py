"""Bad input to balance: the error type, a message naming the value and the fix, and no work."""

import copy
import threading
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
from pipeline import NoChunk

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


UNSET: Any = object()


def by_time(partitions: Any, module: Any, sample: Any = UNSET, **options: Any) -> list[int]:
    sample = torch.randn(2, 4) if sample is UNSET else sample
    return balance_by_time(partitions, module, sample, timeout=0.01, **options)


def by_size(partitions: Any, module: Any, sample: Any = UNSET, **options: Any) -> list[int]:
    sample = torch.randn(2, 4) if sample is UNSET else sample
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
def test_nested_inputs_are_described(profiler: Callable[..., list[int]]) -> None:
    class Fails(nn.Module):
        def forward(self, value: Any) -> Tensor:
            raise RuntimeError("no")

    sample = {"x": [torch.randn(2, 3), NoChunk(torch.ones(3))], "n": 2}
    message = (
        r"layer 0 \(Fails\) failed on input "
        r"\{'x': \[float32\[2, 3\], float32\[3\]\], 'n': int\}"
    )
    with pytest.raises(BalanceError, match=message):
        profiler(1, nn.Sequential(Fails()), sample, device=CPU)


@pytest.mark.parametrize("profiler", [by_time, by_size])
@pytest.mark.parametrize("sample", [3.0, None, "text", nn.Linear(4, 4)])
def test_sample_neither_a_tensor_nor_holding_tensors(
    profiler: Callable[..., list[int]], model: nn.Sequential, sample: object
) -> None:
    with pytest.raises(TypeError, match=r"sample must be a Tensor or hold tensors .*, got \w+"):
        profiler(2, model, sample, device=CPU)
    assert Counted.calls == 0


# F16: an empty sample is refused before profiling, worded like the Pipe's empty batch.


@pytest.mark.parametrize("profiler", [by_time, by_size])
@pytest.mark.parametrize(
    ("sample", "where"),
    [
        (torch.randn(0, 4), "sample"),
        (torch.randn(0), "sample"),
        ((torch.randn(0, 4), 3), r"sample\[0\]"),
        ([torch.randn(2, 4), torch.zeros(0, dtype=torch.long)], r"sample\[1\]"),
        ({"x": torch.randn(0, 4), "mask": NoChunk(torch.ones(4, 4))}, r"sample\['x'\]"),
        ({"x": (torch.randn(0, 4),)}, r"sample\['x'\]\[0\]"),
    ],
)
def test_empty_sample(
    profiler: Callable[..., list[int]], model: nn.Sequential, sample: object, where: str
) -> None:
    message = (
        rf"^{where} is empty \(dim 0 has size 0\): balance needs at least one row to profile "
        r"the layers on, .*; pass one non-empty micro-batch"
    )
    with pytest.raises(BalanceError, match=message):
        profiler(2, model, sample, device=CPU)
    assert Counted.calls == 0


@pytest.mark.parametrize("profiler", [by_time, by_size])
@pytest.mark.parametrize(
    "sample",
    [(), [], {}, (1, "a"), {"n": 2}, torch.tensor(1.0), NoChunk(torch.ones(2, 4))],
    ids=["tuple", "list", "dict", "values", "dict-of-int", "0-dim", "no-chunk"],
)
def test_sample_without_rows(
    profiler: Callable[..., list[int]], model: nn.Sequential, sample: object
) -> None:
    message = (
        r"^sample \(\w+\) holds no tensor with a batch dimension .*: balance needs at least "
        r"one row"
    )
    with pytest.raises(BalanceError, match=message):
        profiler(2, model, sample, device=CPU)
    assert Counted.calls == 0


def test_by_params_takes_no_sample(model: nn.Sequential) -> None:
    # Nothing runs, so there is no sample to refuse: an empty batch cannot reach it.
    assert balance_by_params(3, model) == [1, 1, 1]
    with pytest.raises(TypeError):
        balance_by_params(3, model, torch.randn(0, 4))  # type: ignore[call-arg]


# F12: a layer that cannot be deep-copied is named, with the fix.


class Holder(nn.Module):
    """A layer holding a lock, which copy.deepcopy cannot copy."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.lock = threading.Lock()

    def forward(self, x: Tensor) -> Tensor:
        with self.lock:
            return self.linear(x)


class CopyableHolder(Holder):
    """A Holder whose copies get a lock of their own."""

    def __deepcopy__(self, memo: dict[int, Any]) -> "CopyableHolder":
        copied = CopyableHolder()
        copied.linear = copy.deepcopy(self.linear, memo)
        return copied


@pytest.mark.parametrize("profiler", [by_time, by_size])
def test_a_layer_that_cannot_be_copied(profiler: Callable[..., list[int]]) -> None:
    model = nn.Sequential(nn.Linear(4, 4), Holder(), nn.ReLU())
    message = (
        r"^layer 1 \(Holder\) cannot be copied: copy.deepcopy raised TypeError: cannot pickle "
        r"'_thread.lock' object; profiling runs a deep copy of each layer .* Give Holder a "
        r"__deepcopy__ .*, profile a copyable stand-in .*, or pass the balance yourself "
        r"\(balance_by_params copies nothing\)$"
    )
    with pytest.raises(BalanceError, match=message) as caught:
        profiler(2, model, device=CPU)
    assert isinstance(caught.value.__cause__, TypeError)
    assert "_thread.lock" in str(caught.value.__cause__)
    assert balance_by_params(2, model) == [1, 2]


@pytest.mark.parametrize("profiler", [by_time, by_size])
def test_a_layer_with_its_own_deepcopy_profiles(profiler: Callable[..., list[int]]) -> None:
    model = nn.Sequential(nn.Linear(4, 4), CopyableHolder(), nn.ReLU())
    assert sum(profiler(2, model, device=CPU)) == 3


@pytest.mark.parametrize("profiler", [by_time, by_size])
def test_a_layer_on_the_meta_device(profiler: Callable[..., list[int]]) -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    message = r"^layer 0 \(Linear\) cannot be moved to cpu: NotImplementedError: .*; a layer on "
    with pytest.raises(BalanceError, match=message + r"the meta device .*use balance_by_params$"):
        profiler(2, model, device=CPU)
    assert balance_by_params(2, model) == [1, 1]


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
