"""Pipe.step gives every leaf its gradient once per step, with the hooks of one backward."""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from step_models import MODES, SCHEDULES, WIDTH, assert_same, block, grads
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from pipeline import Pipe
from pipeline.step import held_hooks
from pipeline.step.gradients import StepGradients

FLAT = ["gpipe", "1f1b", "zb-h1"]


def cpu_pipe(model: nn.Sequential, balance: list[int], checkpoint: str, chunks: int = 4) -> Pipe:
    return Pipe(
        model,
        balance,
        devices=["cpu"] * len(balance),
        chunks=chunks,
        checkpoint=checkpoint,  # type: ignore[arg-type]
    )


def run(
    model: nn.Sequential, x: Tensor, y: Tensor, schedule: str | None, checkpoint: str = "never"
) -> None:
    """One step of ``model`` on 4 partitions of 1 layer (None: the plain model's backward)."""
    if schedule is None:
        F.mse_loss(model(x), y).backward()
    else:
        cpu_pipe(model, [1] * len(model), checkpoint).step(
            x, y, F.mse_loss, schedule=SCHEDULES[schedule]()
        )


def data(rows: int = 8) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(rows, WIDTH, dtype=torch.double, generator=gen)
    return x, torch.randn(rows, WIDTH, dtype=torch.double, generator=gen)


# G7: tensors that require grad but are not parameters of the partition.

temperature = nn.Parameter(torch.tensor(2.0, dtype=torch.double))  # owned by the script


class Scaled(nn.Module):
    """A layer whose learnable gain is a plain tensor and whose temperature is the script's."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH).double()
        self.gain = torch.ones(WIDTH, dtype=torch.double, requires_grad=True)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear(x) * self.gain / temperature


def scaled_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(block(), Scaled(), block(), nn.Linear(WIDTH, WIDTH)).double()


@pytest.mark.parametrize("checkpoint", MODES)
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_tensors_that_are_not_parameters_of_the_partition_get_their_gradient(
    schedule: str, checkpoint: str
) -> None:
    x, y = data()
    plain, model = scaled_model(), scaled_model()
    temperature.grad = None
    run(plain, x, y, None)
    expected = (temperature.grad, plain[1].gain.grad)
    temperature.grad = None
    run(model, x, y, schedule, checkpoint)
    assert expected[0] is not None and temperature.grad is not None
    torch.testing.assert_close(temperature.grad, expected[0], rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(model[1].gain.grad, expected[1], rtol=1e-12, atol=1e-14)
    assert_same(grads(model), grads(plain), f"{schedule}, {checkpoint}")


class Shifted(nn.Module):
    """Adds a tensor it does not own: the same tensor in several layers."""

    def __init__(self, shift: Tensor) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH).double()
        self.shift = shift

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(self.linear(x) + self.shift)


@pytest.mark.parametrize("schedule", FLAT)
def test_a_tensor_used_by_two_stages_gets_the_sum_of_both_once(schedule: str) -> None:
    x, y = data()
    found: dict[str, list[Tensor]] = {}
    for name in ("plain", schedule):
        shift = torch.zeros(WIDTH, dtype=torch.double, requires_grad=True)
        seen = found.setdefault(name, [])
        shift.register_post_accumulate_grad_hook(lambda t, seen=seen: seen.append(t.grad.clone()))
        torch.manual_seed(1)
        model = nn.Sequential(Shifted(shift), block(), Shifted(shift), block()).double()
        run(model, x, y, None if name == "plain" else schedule)
    assert len(found["plain"]) == len(found[schedule]) == 1
    torch.testing.assert_close(found[schedule][0], found["plain"][0], rtol=1e-12, atol=1e-14)


# G8: hooks that one backward calls once are called once per step.


def train_with_optimizer_in_backward(
    model: nn.Sequential, step: Callable[[nn.Sequential], None]
) -> tuple[int, Tensor]:
    """PyTorch's optimizer-step-in-backward recipe: an Adam step in each parameter's hook."""
    optimizers = {p: torch.optim.Adam([p], lr=0.01) for p in model.parameters()}
    calls = [0]

    def step_in_backward(p: Tensor) -> None:
        calls[0] += 1
        optimizers[p].step()
        optimizers[p].zero_grad()

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(step_in_backward)
    step(model)
    return calls[0], torch.cat([p.detach().flatten() for p in model.parameters()])


@pytest.mark.parametrize("checkpoint", MODES)
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_the_optimizer_step_in_backward_recipe_equals_the_plain_model(
    schedule: str, checkpoint: str
) -> None:
    torch.manual_seed(0)
    base = nn.Sequential(block(), block(), block(), block()).double()
    x, y = data(16)
    calls, weights = train_with_optimizer_in_backward(
        copy.deepcopy(base), lambda m: F.mse_loss(m(x), y).backward()
    )
    pipe_calls, pipe_weights = train_with_optimizer_in_backward(
        copy.deepcopy(base), lambda m: run(m, x, y, schedule, checkpoint)
    )
    assert pipe_calls == calls == len(list(base.parameters()))
    torch.testing.assert_close(pipe_weights, weights, rtol=1e-12, atol=1e-14)


def normalized(grad: Tensor) -> Tensor:
    """Not linear: a hook called per micro-batch would give another sum."""
    return grad / grad.norm()


@pytest.mark.parametrize("schedule", FLAT)
def test_a_parameters_register_hook_gets_the_whole_gradient_once_and_may_replace_it(
    schedule: str,
) -> None:
    x, y = data()
    torch.manual_seed(2)
    base = nn.Sequential(block(), block(), block(), block()).double()
    seen: dict[str, dict[int, list[Tensor]]] = {}
    results = {}
    for name in ("plain", schedule):
        model = copy.deepcopy(base)
        calls = seen.setdefault(name, {})
        for k, p in enumerate(model.parameters()):
            p.register_hook(lambda g, k=k, calls=calls: calls.setdefault(k, []).append(g.clone()))
            p.register_hook(normalized)
        run(model, x, y, None if name == "plain" else schedule)
        results[name] = grads(model)
    assert seen[schedule].keys() == seen["plain"].keys() == set(range(8))
    for k, wanted in seen["plain"].items():
        assert len(seen[schedule][k]) == len(wanted) == 1, f"parameter {k}"
        torch.testing.assert_close(seen[schedule][k][0], wanted[0], rtol=1e-12, atol=1e-14)
    assert_same(results[schedule], results["plain"], "the hooks' normalized gradients")


@pytest.mark.parametrize("schedule", FLAT)
def test_module_backward_hooks_fire_per_micro_batch_as_with_the_pipe_call(schedule: str) -> None:
    x, y = data()
    x.requires_grad_()  # else torch warns that the first layer's hook sees no input gradient
    counts: dict[str, int] = {}
    for name in ("pipe(x)", schedule):
        torch.manual_seed(0)
        model = nn.Sequential(block(), block()).double()
        counts[name] = 0

        def hook(*_: object, name: str = name) -> None:
            counts[name] += 1

        for layer in model:
            layer.register_full_backward_hook(hook)
        pipe = cpu_pipe(model, [1, 1], "never")
        if name == "pipe(x)":
            F.mse_loss(pipe(x), y).backward()  # type: ignore[arg-type]
        else:
            pipe.step(x, y, F.mse_loss, schedule=schedule)
    assert counts[schedule] == counts["pipe(x)"] == 2 * 4  # two layers, four micro-batches


@pytest.mark.parametrize("schedule", FLAT)
def test_a_module_between_two_uses_of_a_layer_is_hooked_twice_only_under_zero_bubble(
    schedule: str,
) -> None:
    # As docs/schedules.md says: W walks the input path from the upper use of the shared
    # layer down to the lower one, so the hook of the module between fires again, with the
    # same gradients; the gradients themselves are the plain model's.
    x, y = data()
    torch.manual_seed(0)
    shared = nn.Linear(WIDTH, WIDTH)
    middle = [shared, nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh(), shared]
    base = nn.Sequential(nn.Linear(WIDTH, WIDTH), *middle).double()  # a stage with an input path
    plain, model = copy.deepcopy(base), copy.deepcopy(base)
    seen: dict[str, list[tuple[Tensor, ...]]] = {"plain": [], schedule: []}
    for name, layers in (("plain", plain), (schedule, model)):
        layers[3].register_full_backward_hook(
            lambda _, inputs, outputs, name=name: seen[name].append((*inputs, *outputs))
        )
    F.mse_loss(plain(x), y).backward()
    cpu_pipe(model, [1, 5], "never", chunks=1).step(x, y, F.mse_loss, schedule=schedule)
    assert len(seen[schedule]) == (2 if schedule == "zb-h1" else 1) and len(seen["plain"]) == 1
    for fired in seen[schedule]:
        assert_same(list(fired), list(seen["plain"][0]), "the hook's gradients")
    assert_same(grads(model), grads(plain), "the model")


@pytest.mark.parametrize("schedule", FLAT)
def test_the_callers_graph_gets_one_backward_per_step(schedule: str) -> None:
    x, y = data()
    torch.manual_seed(4)
    embed, model = nn.Linear(WIDTH, WIDTH).double(), nn.Sequential(block(), block()).double()
    plain_embed, plain = copy.deepcopy(embed), copy.deepcopy(model)
    calls = {"plain": 0, schedule: 0}

    def count(name: str) -> Callable[[Tensor], None]:
        return lambda _: calls.__setitem__(name, calls[name] + 1)

    plain_embed.weight.register_post_accumulate_grad_hook(count("plain"))
    embed.weight.register_post_accumulate_grad_hook(count(schedule))
    F.mse_loss(plain(plain_embed(x)), y).backward()
    cpu_pipe(model, [1, 1], "except_last").step(embed(x), y, F.mse_loss, schedule=schedule)
    assert calls[schedule] == calls["plain"] == 1
    assert_same(grads(embed), grads(plain_embed), "the layer before the pipe")
    assert_same(grads(model), grads(plain), "the pipe")


@pytest.mark.parametrize("schedule", FLAT)
def test_a_weight_tied_across_partitions_accumulates_once_its_last_partition_ends(
    schedule: str,
) -> None:
    x, y = data()
    torch.manual_seed(5)
    tied = nn.Linear(WIDTH, WIDTH)
    base = nn.Sequential(tied, nn.Tanh(), block(), tied).double()
    plain, model = copy.deepcopy(base), copy.deepcopy(base)
    seen: dict[str, list[Tensor]] = {"plain": [], schedule: []}
    plain[0].weight.register_post_accumulate_grad_hook(lambda p: seen["plain"].append(p.grad))
    model[0].weight.register_post_accumulate_grad_hook(lambda p: seen[schedule].append(p.grad))
    F.mse_loss(plain(x), y).backward()
    cpu_pipe(model, [2, 1, 1], "never").step(x, y, F.mse_loss, schedule=schedule)
    assert len(seen["plain"]) == len(seen[schedule]) == 1
    torch.testing.assert_close(seen[schedule][0], seen["plain"][0], rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_a_layer_under_reentrant_checkpointing_trains_like_the_plain_model(schedule: str) -> None:
    # Under ZB-H1 the stage's I is a whole backward: autograd.grad refuses the
    # reentrant checkpoint's own backward (it failed mid-step, other stages' W done).
    class Reentrant(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = block()

        def forward(self, x: Tensor) -> Tensor:
            return checkpoint(self.inner, x, use_reentrant=True)  # type: ignore[no-any-return]

    x, y = data()
    torch.manual_seed(6)
    model = nn.Sequential(block(), Reentrant(), block()).double()
    plain = copy.deepcopy(model)
    F.mse_loss(plain(x), y).backward()
    cpu_pipe(model, [1, 1, 1], "never").step(x, y, F.mse_loss, schedule=schedule)
    assert_same(grads(model), grads(plain), schedule)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_hooked_weight_tied_into_a_reentrant_checkpoint_gets_its_whole_gradient_once(
    schedule: str,
) -> None:
    # The reentrant checkpoint's own backward accumulates into .grad while the
    # other partition holds the weight's hooks back: its part missed the hook.
    class Reentrant(nn.Module):
        def __init__(self, linear: nn.Linear) -> None:
            super().__init__()
            self.linear = linear  # the first layer's: tied

        def forward(self, x: Tensor) -> Tensor:
            return checkpoint(lambda t: torch.tanh(self.linear(t)), x, use_reentrant=True)  # type: ignore[no-any-return]

    x, y = data()
    torch.manual_seed(8)
    shared = nn.Linear(WIDTH, WIDTH)
    model = nn.Sequential(shared, nn.Tanh(), block(), Reentrant(shared), block()).double()
    plain = copy.deepcopy(model)
    seen: dict[str, list[Tensor]] = {"plain": [], schedule: []}
    for name, net in (("plain", plain), (schedule, model)):
        net[0].weight.register_hook(lambda g, calls=seen[name]: calls.append(g) or g * 3)
    F.mse_loss(plain(x), y).backward()
    cpu_pipe(model, [3, 2], "never").step(x, y, F.mse_loss, schedule=schedule)
    assert_same(grads(model), grads(plain), schedule)
    assert len(seen[schedule]) == 1  # once, with the whole gradient (the plain model: per part)
    torch.testing.assert_close(seen[schedule][0], sum(seen["plain"]), rtol=1e-12, atol=1e-14)


class SlowBackward(torch.autograd.Function):
    """The identity, whose backward takes a moment: stages' backwards then overlap."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        time.sleep(0.002)
        return grad


def test_a_weight_tied_into_reentrant_checkpoints_of_two_threads_accumulates_right() -> None:
    # Both stages set the tied weight's .grad aside around their reentrant
    # backward: on threads of their own, one put back or read the other's in
    # the middle (15 of 20 runs wrong, by up to 0.92, with gradients accumulated).
    class Reentrant(nn.Module):
        def __init__(self, linear: nn.Linear) -> None:
            super().__init__()
            self.linear = linear

        def forward(self, x: Tensor) -> Tensor:
            inner = lambda t: torch.tanh(self.linear(t))  # noqa: E731
            return checkpoint(inner, SlowBackward.apply(x), use_reentrant=True)  # type: ignore[no-any-return]

    def model() -> nn.Sequential:
        torch.manual_seed(8)
        shared = nn.Linear(WIDTH, WIDTH)
        shared.weight.register_hook(lambda g: g * 0.5)  # held until every part is in
        return nn.Sequential(shared, Reentrant(shared), block(), Reentrant(shared)).double()

    x, y = data(12)
    plain = model()
    expected = []
    for _ in range(3):  # accumulated, no zero_grad
        F.mse_loss(plain(x), y).backward()
        expected.append(grads(plain))
    for run in range(4):  # the race is the threads': each run may meet it
        pipe = Pipe(model(), [2, 2], devices=["cpu"] * 2, chunks=6, threads="partition")
        for step, reference in enumerate(expected):
            pipe.step(x, y, F.mse_loss, schedule="1f1b")
            assert_same(grads(pipe), reference, f"run {run}, step {step}")
        pipe.close()


class Borrowing(nn.Module):
    """Uses another layer's weight through a list: a parameter it does not register."""

    def __init__(self, lender: nn.Linear) -> None:
        super().__init__()
        self.borrowed = [lender.weight]

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(x @ self.borrowed[0])


def test_a_parameter_used_without_being_registered_is_accumulated_once_more() -> None:
    x, y = data()
    torch.manual_seed(7)
    lender = nn.Linear(WIDTH, WIDTH).double()
    model = nn.Sequential(lender, nn.Tanh(), Borrowing(lender), block()).double()
    plain = copy.deepcopy(model)
    calls = []
    lender.weight.register_post_accumulate_grad_hook(lambda p: calls.append(p.grad.clone()))
    F.mse_loss(plain(x), y).backward()
    cpu_pipe(model, [2, 1, 1], "never").step(x, y, F.mse_loss, schedule="1f1b")
    assert len(calls) == 2  # with its partition, then at the end of the step for the rest
    torch.testing.assert_close(calls[-1], plain[0].weight.grad, rtol=1e-12, atol=1e-14)


def test_a_torch_that_keeps_hooks_elsewhere_is_refused_before_any_work(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(held_hooks, "_works", lambda: False)
    calls = []
    model = nn.Sequential(block(), block()).double()
    model[0].register_forward_hook(lambda *_: calls.append(1))
    x, y = data()
    with pytest.raises(RuntimeError, match="keeps them elsewhere"):
        cpu_pipe(model, [1, 1], "never").step(x, y, F.mse_loss)
    assert calls == [] and all(p.grad is None for p in model.parameters())


class FailInBackward(nn.Module):
    """Raises in the backward of its second micro-batch, while armed."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = True
        self.backwards = 0

    def forward(self, x: Tensor) -> Tensor:
        out = x.view_as(x)
        if self.armed:
            out.register_hook(self.count)
        return out

    def count(self, grad: Tensor) -> None:
        self.backwards += 1
        if self.backwards == 2:
            raise KeyError("failed in backward")


@pytest.mark.parametrize("schedule", FLAT)
def test_hooks_are_given_back_after_a_failed_step_and_removed_ones_stay_removed(
    schedule: str,
) -> None:
    x, y = data()
    torch.manual_seed(3)
    first, failing = block(), FailInBackward()
    model = nn.Sequential(nn.Sequential(first, failing), block()).double()
    calls = {"kept": 0, "removed": 0}
    first[0].weight.register_post_accumulate_grad_hook(
        lambda _: calls.__setitem__("kept", calls["kept"] + 1)
    )
    removed = first[0].bias.register_post_accumulate_grad_hook(
        lambda _: calls.__setitem__("removed", calls["removed"] + 1)
    )
    # Removed in the first micro-batch's backward of its partition, which holds it back.
    first.register_full_backward_hook(lambda *_: removed.remove())
    x.requires_grad_()  # else torch warns that the hook sees no input gradient
    pipe = cpu_pipe(model, [1, 1], "never")
    with pytest.raises(KeyError, match="failed in backward"):
        pipe.step(x, y, F.mse_loss, schedule=schedule)
    assert failing.backwards == 2 and calls == {"kept": 0, "removed": 0}
    failing.armed = False
    F.mse_loss(model(x), y).backward()
    assert calls == {"kept": 1, "removed": 0}


@pytest.mark.parametrize("checkpoint", MODES)
@pytest.mark.parametrize("schedule", FLAT)
def test_hooks_on_some_parameters_only_and_accumulation_over_steps_equal_the_plain_model(
    schedule: str, checkpoint: str
) -> None:
    """Stages whose leaves have no hooks accumulate into ``.grad`` at once; a stage with a
    hooked parameter sums its backwards (the bias beside it too). Together, over two steps
    without ``zero_grad``, they equal the plain model, and the hooks fire once per step."""
    x, y = data(16)
    torch.manual_seed(4)
    base = nn.Sequential(block(), block(), block(), block()).double()
    seen: dict[str, list[Tensor]] = {}
    results = {}
    for name in ("plain", schedule):
        model = copy.deepcopy(base)
        hooked = model[1][0].weight
        calls = seen.setdefault(name, [])
        hooked.register_hook(normalized)
        hooked.register_post_accumulate_grad_hook(
            lambda p, calls=calls: calls.append(p.grad.clone())
        )
        for _ in range(2):
            run(model, x, y, None if name == "plain" else schedule, checkpoint)
        results[name] = grads(model)
    assert len(seen[schedule]) == len(seen["plain"]) == 2, "once per step"
    for found, wanted in zip(seen[schedule], seen["plain"], strict=True):
        torch.testing.assert_close(found, wanted, rtol=1e-12, atol=1e-14)
    assert_same(results[schedule], results["plain"], f"{schedule}, {checkpoint}, two steps")


@pytest.mark.parametrize("ends", [(0, 1, 2), (0, 2, 1), (2, 1, 0), (1, 2, 0)])
def test_a_weight_shared_by_stages_adds_their_sums_in_stage_order_whichever_ends_first(
    ends: tuple[int, int, int],
) -> None:
    # Workers end in whatever order the machine gives; the sum must not follow it. In
    # float32, 1e8 + 1 rounds to 1e8, so the order of (1e8, 1, -1e8) decides the result.
    shared = nn.Linear(1, 1, bias=False)
    partitions = [nn.Sequential(shared) for _ in range(3)]
    gradients = StepGradients(partitions, [0, 1, 2], at_end=[])
    for j, value in enumerate((1e8, 1.0, -1e8)):
        gradients.add(j, [shared.weight], [torch.full((1, 1), value)])
    finished = [gradients.stage_done(j) for j in ends]
    assert finished == [[], [], [0, 1, 2]]
    assert shared.weight.grad is not None
    assert shared.weight.grad.item() == 0.0  # (1e8 + 1) - 1e8 in float32; 1.0 in another order


@pytest.mark.parametrize("through", ["input", "target"])
@pytest.mark.parametrize("schedule", FLAT)
def test_a_parameter_the_callers_graph_reaches_too_is_accumulated_once(
    schedule: str, through: str
) -> None:
    # An embedding computed by the caller, tied to the head inside the pipe: the head's
    # stage accumulated its part, then the caller's graph the rest, and a post-accumulate
    # hook (an optimizer in backward) fired twice, first with a partial gradient (0.29
    # off); the partition's completion hook was called before the gradient was whole.
    def model_and_embedding() -> tuple[nn.Sequential, nn.Embedding]:
        torch.manual_seed(0)
        embedding = nn.Embedding(WIDTH, WIDTH).double()
        head = nn.Linear(WIDTH, WIDTH, bias=False).double()
        head.weight = embedding.weight
        return nn.Sequential(nn.Linear(WIDTH, WIDTH).double(), nn.Tanh(), head), embedding

    ids = torch.randint(WIDTH, (8,), generator=torch.Generator().manual_seed(1))
    x, y = data()

    def call(model: nn.Module, embedding: nn.Embedding) -> tuple[Tensor, Tensor]:
        if through == "input":
            return embedding(ids), y
        return x, torch.tanh(embedding(ids))

    plain, plain_embedding = model_and_embedding()
    F.mse_loss(plain(call(plain, plain_embedding)[0]), call(plain, plain_embedding)[1]).backward()
    whole = plain_embedding.weight.grad
    assert whole is not None
    model, embedding = model_and_embedding()
    seen: list[Tensor] = []
    embedding.weight.register_post_accumulate_grad_hook(lambda p: seen.append(cast_grad(p).clone()))
    pipe = cpu_pipe(model, [2, 1], "never")
    final: list[bool] = []
    pipe.register_partition_backward_hook(
        lambda j: final.append(j == 0 or torch.allclose(cast_grad(embedding.weight), whole))
    )
    pipe.step(*call(model, embedding), F.mse_loss, schedule=SCHEDULES[schedule]())
    assert len(seen) == 1
    torch.testing.assert_close(seen[0], whole)
    assert_same(grads(model), grads(plain), schedule)
    assert sorted(final) == [True, True]


def cast_grad(p: Tensor) -> Tensor:
    assert p.grad is not None
    return p.grad
