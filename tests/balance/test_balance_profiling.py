"""balance_by_time, balance_by_size and balance_by_params on CPU models."""

import time
import weakref
from typing import Any, NamedTuple

import pytest
import torch
from torch import Tensor, nn

from balance import balance_by_params, balance_by_size, balance_by_time
from balance.checks import check_sample
from balance.errors import BalanceError
from balance.profile import profile_activations
from pipeline import NoChunk, PositionalSequential

CPU = torch.device("cpu")


class Sleep(nn.Module):
    """A layer far slower than a small Linear: it sleeps 20 ms in its forward pass."""

    def forward(self, x: Tensor) -> Tensor:
        time.sleep(0.02)
        return x


class SleepInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        time.sleep(0.02)
        return grad


class SlowBackward(nn.Module):
    """A layer whose forward pass is quick and whose backward pass sleeps 20 ms."""

    def forward(self, x: Tensor) -> Tensor:
        result: Tensor = SleepInBackward.apply(x)
        return result


class HugeActivation(nn.Module):
    """Keeps 1024 times its input's size for backward (the output of a sigmoid)."""

    def forward(self, x: Tensor) -> Tensor:
        wide = x.unsqueeze(-1).expand(*x.shape, 1024).contiguous()
        return torch.sigmoid(wide).mean(-1)


class HeavyParameters(nn.Module):
    """Holds one million parameters (4 MB) and passes its input through."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1_000_000))

    def forward(self, x: Tensor) -> Tensor:
        return x


class ScaleInPlace(nn.Module):
    """Doubles the first columns of its input in place, through a view."""

    def forward(self, x: Tensor) -> Tensor:
        x[:, :4].mul_(2)
        return x


class ShiftInPlace(nn.Module):
    """Adds one to integer token ids in place."""

    def forward(self, tokens: Tensor) -> Tensor:
        return tokens.add_(1)


class Tag(nn.Module):
    """Turns a tensor into a tuple of a tensor, an integer tensor, a string and an int."""

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor, str, int]:
        return x, (x > 0).long(), "tag", 3


class UseTag(nn.Module):
    """Consumes the tuple of Tag and returns a tuple of two tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16)

    def forward(self, values: tuple[Tensor, Tensor, str, int]) -> tuple[Tensor, Tensor]:
        x, mask, tag, factor = values
        assert tag == "tag"
        return self.linear(x) * factor, mask


class Merge(nn.Module):
    """Consumes a tuple of a float and an integer tensor and returns one tensor."""

    def forward(self, values: tuple[Tensor, Tensor]) -> Tensor:
        x, mask = values
        return x + mask


def linears(count: int) -> list[nn.Module]:
    return [nn.Linear(16, 16) for _ in range(count)]


def test_by_time_puts_a_slow_layer_alone() -> None:
    model = nn.Sequential(*linears(3), Sleep(), *linears(4))
    balance = balance_by_time(3, model, torch.randn(8, 16), timeout=0.1, device=CPU)
    assert balance == [3, 1, 4]


def test_by_time_counts_the_backward_pass() -> None:
    model = nn.Sequential(*linears(4), SlowBackward(), *linears(3))
    balance = balance_by_time(3, model, torch.randn(8, 16), timeout=0.1, device=CPU)
    assert balance == [4, 1, 3]


def test_by_size_puts_a_layer_with_huge_activations_alone() -> None:
    model = nn.Sequential(*linears(3), HugeActivation(), *linears(4))
    balance = balance_by_size(3, model, torch.randn(8, 16), device=CPU)
    assert balance == [3, 1, 4]


def test_by_size_weighs_parameters_against_activations() -> None:
    # Parameters: 4 MB; activations of HugeActivation: 512 kB per micro-batch.
    model = nn.Sequential(
        *linears(1), HeavyParameters(), *linears(2), HugeActivation(), *linears(2)
    )
    sample = torch.randn(8, 16)
    assert balance_by_size(3, model, sample, param_scale=2.0, device=CPU) == [1, 1, 5]
    assert balance_by_size(3, model, sample, param_scale=0.0, device=CPU) == [4, 1, 2]
    assert balance_by_size(3, model, sample, chunks=100, device=CPU) == [4, 1, 2]


def test_activation_sizes_count_saved_tensors_without_parameters() -> None:
    model = nn.Sequential(nn.Linear(16, 32), nn.Sigmoid(), nn.ReLU(inplace=True), nn.Identity())
    sizes = profile_activations(model, torch.randn(8, 16), CPU)
    # Linear keeps its input (not its weight); Sigmoid and ReLU keep their outputs.
    assert sizes == [8 * 16 * 4, 8 * 32 * 4, 8 * 32 * 4, 0]


def test_by_params_counts_parameter_bytes() -> None:
    model = nn.Sequential(
        nn.Linear(100, 100), nn.ReLU(), nn.Linear(100, 100), nn.ReLU(), nn.Linear(100, 10)
    )
    assert balance_by_params(2, model) == [2, 3]
    assert balance_by_params(5, model) == [1, 1, 1, 1, 1]
    double = nn.Sequential(nn.Linear(100, 100).double(), nn.Linear(100, 100), nn.Linear(100, 100))
    assert balance_by_params(2, double) == [1, 2]


def test_by_params_works_on_the_meta_device() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4096, 4096), *[nn.Linear(4096, 1024) for _ in range(4)])
    assert balance_by_params(2, model) == [1, 4]


def snapshot(model: nn.Module) -> dict[str, Any]:
    return {
        "parameters": {name: p.detach().clone() for name, p in model.named_parameters()},
        "identities": [id(p) for p in model.parameters()],
        "grads": {
            name: None if p.grad is None else p.grad.clone() for name, p in model.named_parameters()
        },
        "requires_grad": {name: p.requires_grad for name, p in model.named_parameters()},
        "buffers": {name: b.clone() for name, b in model.named_buffers()},
        "training": {name: m.training for name, m in model.named_modules()},
        "devices": {name: p.device for name, p in model.named_parameters()},
    }


def assert_same(before: dict[str, Any], after: dict[str, Any]) -> None:
    assert before.keys() == after.keys()
    for key in ("identities", "requires_grad", "training", "devices"):
        assert before[key] == after[key], key
    for key in ("parameters", "buffers", "grads"):
        assert before[key].keys() == after[key].keys(), key
        for name, tensor in before[key].items():
            other = after[key][name]
            if tensor is None:
                assert other is None, (key, name)
            else:
                assert torch.equal(tensor, other), (key, name)


def tricky_model() -> nn.Sequential:
    model = nn.Sequential(
        nn.Linear(16, 16),
        nn.BatchNorm1d(16),
        nn.Dropout(0.5),
        nn.ReLU(inplace=True),
        nn.Linear(16, 16),
        nn.BatchNorm1d(16),
        nn.Linear(16, 4),
    )
    model[4].weight.requires_grad_(False)
    model(torch.randn(8, 16)).sum().backward()
    model.eval()
    model[5].train()
    return model


@pytest.mark.parametrize("profile", ["time", "size"])
def test_profiling_leaves_model_sample_and_random_state_unchanged(profile: str) -> None:
    model = tricky_model()
    sample = torch.randn(8, 16)
    sample_before = sample.clone()
    before = snapshot(model)
    random_state = torch.get_rng_state()
    if profile == "time":
        balance = balance_by_time(3, model, sample, timeout=0.05, device=CPU)
    else:
        balance = balance_by_size(3, model, sample, device=CPU)
    assert sum(balance) == len(model)
    assert len(balance) == 3
    assert min(balance) >= 1
    assert_same(before, snapshot(model))
    assert torch.equal(sample, sample_before)
    assert not sample.requires_grad
    assert sample.grad is None
    assert torch.equal(torch.get_rng_state(), random_state)


def in_place_model() -> nn.Sequential:
    return nn.Sequential(
        nn.ReLU(inplace=True),
        ScaleInPlace(),
        nn.Linear(16, 16),
        nn.ReLU(inplace=True),
        ScaleInPlace(),
        nn.Linear(16, 16),
        nn.ReLU(inplace=True),
    )


def test_in_place_layers_profile() -> None:
    model = in_place_model()
    sample = torch.randn(8, 16)
    sample_before = sample.clone()
    for balance in (
        balance_by_time(2, model, sample, timeout=0.05, device=CPU),
        balance_by_size(2, model, sample, device=CPU),
    ):
        assert sum(balance) == len(model)
        assert min(balance) >= 1
    assert torch.equal(sample, sample_before)


def test_in_place_layers_on_integer_tensors_leave_the_sample_unchanged() -> None:
    model = nn.Sequential(ShiftInPlace(), nn.Embedding(10, 16), nn.Linear(16, 2))
    tokens = torch.tensor([0, 3, 8, 8])
    assert sum(balance_by_time(2, model, tokens, timeout=0.05, device=CPU)) == 3
    assert sum(balance_by_size(2, model, tokens, device=CPU)) == 3
    assert tokens.tolist() == [0, 3, 8, 8]


def tuple_model() -> nn.Sequential:
    return nn.Sequential(nn.Embedding(10, 16), Tag(), UseTag(), Merge(), nn.Linear(16, 2))


@pytest.mark.parametrize("profile", ["time", "size"])
def test_layers_taking_and_returning_tuples_profile(profile: str) -> None:
    model = tuple_model()
    tokens = torch.randint(0, 10, (8,))
    if profile == "time":
        balance = balance_by_time(5, model, tokens, timeout=0.05, device=CPU)
    else:
        balance = balance_by_size(5, model, tokens, device=CPU)
    assert balance == [1, 1, 1, 1, 1]


def test_a_tuple_sample_reaches_the_first_layer_as_a_tuple() -> None:
    model = nn.Sequential(Merge(), nn.Linear(16, 16), nn.Linear(16, 16))
    sample = (torch.randn(8, 16), torch.ones(8, 16, dtype=torch.long))
    assert sum(balance_by_size(2, model, sample, device=CPU)) == 3
    assert sum(balance_by_time(2, model, sample, timeout=0.05, device=CPU)) == 3


class Masked(nn.Module):
    """Takes two positional arguments and returns both, as PositionalSequential passes them."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16)

    def forward(self, x: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        return torch.tanh(self.linear(x)) * mask, mask


class Unmask(nn.Module):
    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        return x + mask


@pytest.mark.parametrize("profile", ["time", "size"])
def test_a_positional_sequential_is_profiled_as_it_calls_its_layers(profile: str) -> None:
    # As the model runs: PositionalSequential(...)(x, mask) calls Masked()(x, mask).
    model = PositionalSequential(Masked(), Masked(), Unmask())
    sample = (torch.randn(8, 16), torch.rand(8, 16))
    model(*sample)
    if profile == "time":
        balance = balance_by_time(2, model, sample, timeout=0.01, device=CPU)
    else:
        balance = balance_by_size(2, model, sample, device=CPU)
    assert sum(balance) == 3 and len(balance) == 2
    # The same layers in an nn.Sequential take the tuple whole, and fail naming the layer.
    with pytest.raises(BalanceError, match=r"layer 0 \(Masked\) failed on input"):
        balance_by_size(2, nn.Sequential(*model), sample, device=CPU)


# Nested values, as pipeline.Pipe takes them: tuples, namedtuples, lists, dicts.


class Pair(NamedTuple):
    x: Tensor
    mask: Tensor


class FromNested(nn.Module):
    """Takes ``{"pair": Pair(x, mask), "extra": [bias, scale]}``; returns a dict with a list."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16)

    def forward(self, value: dict[str, Any]) -> dict[str, Any]:
        assert type(value) is dict and type(value["pair"]) is Pair, type(value)
        assert type(value["extra"]) is list, type(value["extra"])
        bias, scale = value["extra"]
        h = torch.sigmoid(self.linear(value["pair"].x + value["pair"].mask) + bias) * scale
        return {"h": h, "aux": [h * 2, "tag"]}


class FromDict(nn.Module):
    """Takes the dict of FromNested; checks its floating tensors join autograd."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16)

    def forward(self, value: dict[str, Any]) -> Tensor:
        assert type(value) is dict and type(value["aux"]) is list, type(value)
        doubled, tag = value["aux"]
        assert tag == "tag"
        assert value["h"].requires_grad and doubled.requires_grad
        return torch.tanh(self.linear(value["h"] + doubled))


def nested_sample() -> dict[str, Any]:
    pair = Pair(torch.randn(8, 16), torch.ones(8, 16, dtype=torch.long))
    return {"pair": pair, "extra": [NoChunk(torch.randn(16)), 0.5]}


@pytest.mark.parametrize("profile", ["time", "size"])
def test_nested_samples_and_outputs_profile(profile: str) -> None:
    model = nn.Sequential(FromNested(), FromDict(), nn.Linear(16, 2))
    sample = nested_sample()
    before = [sample["pair"].x.clone(), sample["extra"][0].tensor.clone()]
    if profile == "time":
        balance = balance_by_time(3, model, sample, timeout=0.05, device=CPU)
    else:
        balance = balance_by_size(3, model, sample, device=CPU)
    assert balance == [1, 1, 1]
    assert torch.equal(sample["pair"].x, before[0])
    assert torch.equal(sample["extra"][0].tensor, before[1])
    assert not sample["pair"].x.requires_grad


def test_nested_tensors_count_in_the_sizes() -> None:
    model = nn.Sequential(FromNested(), FromDict())
    sizes = profile_activations(model, check_sample(nested_sample()), CPU)
    # Each keeps its Linear input and its activation's output (float32[8, 16] each),
    # nothing of the layer before: the nested inputs are fresh copies, as flat ones are.
    assert sizes == [8 * 16 * 4 * 2, 8 * 16 * 4 * 2]


def test_by_time_counts_the_backward_pass_of_nested_outputs() -> None:
    class SlowInDict(nn.Module):
        def forward(self, x: Tensor) -> dict[str, list[Tensor]]:
            return {"x": [SleepInBackward.apply(x)]}

    class Unwrap(nn.Module):
        def forward(self, value: dict[str, list[Tensor]]) -> Tensor:
            return value["x"][0]

    model = nn.Sequential(*linears(4), SlowInDict(), Unwrap(), *linears(2))
    balance = balance_by_time(3, model, torch.randn(8, 16), timeout=0.1, device=CPU)
    assert balance == [4, 1, 3]


def test_no_chunk_tensors_reach_the_first_layer_unwrapped() -> None:
    seen: list[Any] = []

    class Record(nn.Module):
        def forward(self, value: tuple[Tensor, Tensor]) -> Tensor:
            seen.append(value)
            x, mask = value
            return x @ mask

    mask = torch.randn(16, 16)
    balance_by_size(1, nn.Sequential(Record()), (torch.randn(8, 16), NoChunk(mask)), device=CPU)
    assert len(seen) == 1 and type(seen[0]) is tuple
    assert isinstance(seen[0][1], Tensor) and torch.equal(seen[0][1], mask)


def test_profiling_records_autograd_even_where_the_caller_turned_it_off() -> None:
    model = nn.Sequential(nn.Linear(16, 32), nn.Sigmoid())
    sample = torch.randn(8, 16)
    expected = profile_activations(model, sample, CPU)
    assert min(expected) > 0
    with torch.no_grad():
        assert profile_activations(model, sample, CPU) == expected
    with torch.inference_mode():
        assert profile_activations(model, sample, CPU) == expected
        inference_sample = torch.randn(8, 16)
    assert profile_activations(model, inference_sample, CPU) == expected
    with torch.inference_mode():
        assert sum(balance_by_time(2, model, inference_sample, timeout=0.01, device=CPU)) == 2


def test_each_layer_gets_the_previous_layers_real_output() -> None:
    seen: list[Tensor] = []

    class Record(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            seen.append(x.detach().clone())
            return x

    model = nn.Sequential(nn.Linear(16, 16), Record())
    sample = torch.randn(8, 16)
    balance_by_size(1, model, sample, device=CPU)
    assert len(seen) == 1
    assert torch.allclose(seen[0], model[0](sample).detach())


def test_one_layer_copy_at_a_time() -> None:
    weights: list[weakref.ref[Tensor]] = []
    alive_at_each_forward: list[int] = []

    class Tracked(nn.Linear):
        def forward(self, x: Tensor) -> Tensor:
            alive_at_each_forward.append(sum(ref() is not None for ref in weights))
            weights.append(weakref.ref(self.weight))
            return super().forward(x)

    model = nn.Sequential(*[Tracked(16, 16) for _ in range(4)])
    balance_by_size(2, model, torch.randn(8, 16), device=CPU)
    assert alive_at_each_forward == [0, 0, 0, 0]
