"""A U-Net-like model with long skips gives the same outputs and gradients in a Pipe."""

from __future__ import annotations

import copy
from collections.abc import Generator
from typing import Any

import pytest
import torch
from skip_models import BALANCE, unet
from torch import Tensor, nn

from pipeline import Pipe
from pipeline.skip import pop, skippable, stash
from tests.helpers import (
    AddsShared,
    StashesWhatItReturns,
    WritesItsInput,
    shared_skip_model,
)

CPU = ["cpu"] * 4
# 'cpu' and 'cpu:0' compare unequal, so the driver copies at every boundary
# and skips between them take the fence's copy path.
ALTERNATING = ["cpu", "cpu:0", "cpu", "cpu:0"]


def run_plain(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.detach().clone().requires_grad_()
    out = model(x)
    (out * out).sum().backward()
    assert x.grad is not None
    return out.detach(), x.grad


@pytest.mark.parametrize("devices", [CPU, ALTERNATING], ids=["same-device", "copied"])
@pytest.mark.parametrize("checkpoint", ["never", "always", "except_last"])
@pytest.mark.parametrize("chunks", [1, 2, 4])
def test_outputs_and_gradients_equal_the_plain_model(
    devices: list[str], checkpoint: str, chunks: int
) -> None:
    model = unet()
    plain = copy.deepcopy(model)
    x = torch.randn(10, 8, dtype=torch.double)
    expected_out, expected_grad = run_plain(plain, x)

    pipe = Pipe(model, BALANCE, devices=devices, chunks=chunks, checkpoint=checkpoint)
    out, grad = run_plain(pipe, x)

    torch.testing.assert_close(out, expected_out)
    torch.testing.assert_close(grad, expected_grad)
    for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_input_without_grad_still_trains_every_layer() -> None:
    model = unet()
    plain = copy.deepcopy(model)
    x = torch.randn(6, 8, dtype=torch.double)
    plain(x).sum().backward()
    pipe = Pipe(model, BALANCE, devices=ALTERNATING, chunks=3, checkpoint="except_last")
    pipe(x).sum().backward()
    for p, q in zip(model.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)


@skippable(stash=["side"])
class StashesBeside(nn.Module):
    """Stashes a layer of its input and passes the input on unchanged."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> Generator[Any, Any, torch.Tensor]:
        yield stash("side", self.linear(x))
        return x


@skippable(pop=["side"])
class PopsBeside(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> Generator[Any, Any, torch.Tensor]:
        side = yield pop("side")
        return self.linear(x) + side * side


class WithoutGrad(nn.Module):
    """A frozen feature extractor run without grad."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return torch.tanh(self.linear(x))


@pytest.mark.parametrize("devices", [CPU[:2], ALTERNATING[:2]], ids=["same-device", "copied"])
@pytest.mark.parametrize("balance", [[1, 2], [2, 1]])
def test_a_skip_whose_main_path_carries_no_gradient_still_trains_its_stash(
    devices: list[str], balance: list[int]
) -> None:
    # The main path from the stash to the pop runs frozen: the pop's input
    # needs no gradient, and its portal had no edge back to the stash (the
    # stashing layer's .grad stayed None), or, with several micro-batches, an
    # edge through the clock's ordering that never reached it (wrong values).
    torch.manual_seed(0)
    model = nn.Sequential(StashesBeside(), WithoutGrad(), PopsBeside()).double()
    plain = copy.deepcopy(model)
    x = torch.randn(8, 8, dtype=torch.double)
    plain(x).square().sum().backward()
    for chunks in (1, 2, 4):
        model.zero_grad()
        pipe = Pipe(model, balance, devices=devices, chunks=chunks, checkpoint="never")
        pipe(x).square().sum().backward()
        for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
            assert (p.grad is None) == (q.grad is None) == name.startswith("1."), name
            if q.grad is not None:
                torch.testing.assert_close(p.grad, q.grad, msg=f"{chunks} chunks: {name}")


@pytest.mark.parametrize("checkpoint", ["always", "except_last"])
def test_a_stash_that_gives_its_output_a_gradient_is_recomputed_alike(checkpoint: str) -> None:
    # The input needs no gradient; the stash's join gives the stashing layer's
    # output one in the forward, and the recomputation, which sends no skip,
    # gave it none: the next Linear saved other tensors (torch's CheckpointError
    # in the backward, after some .grad were written).
    torch.manual_seed(0)
    model = nn.Sequential(StashesBeside(), nn.Linear(8, 8), PopsBeside()).double()
    plain = copy.deepcopy(model)
    x = torch.randn(4, 8, dtype=torch.double)
    plain(x).square().sum().backward()
    Pipe(model, [2, 1], devices=CPU[:2], chunks=2, checkpoint=checkpoint)(
        x
    ).square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


@skippable(stash=["h"])
class StashesItsOutput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> Generator[Any, Any, torch.Tensor]:
        h = self.linear(x)
        yield stash("h", h)
        return h


@skippable(pop=["h"])
class AddsIt(nn.Module):
    def forward(self, x: torch.Tensor) -> Generator[Any, Any, torch.Tensor]:
        h = yield pop("h")
        return x + h


@pytest.mark.parametrize("call", ["pipe(x)", "step", "evaluate"])
@pytest.mark.parametrize(
    ("balance", "refusal"),
    [
        ([2, 2], "was written in place after it was stashed"),
        ([1, 3], "is also what partition 0 returns, and partition 1 starts with a layer that"),
    ],
)
def test_a_skip_written_in_place_after_its_stash_is_refused_when_it_leaves(
    call: str, balance: list[int], refusal: str
) -> None:
    # The plain model's pop saw the write (and its place in the graph); a
    # portal's or a message's did not: gradients 0.18 off in pipe(x), outputs
    # 1.2 off across processes. Where the in-place layer starts the next
    # partition, it wrote a copy: losses 1.609 against 1.589, in every engine.
    torch.manual_seed(0)
    layers = [StashesItsOutput(), nn.ReLU(inplace=True), nn.Linear(8, 8), AddsIt()]
    pipe = Pipe(nn.Sequential(*layers).double(), balance, devices=CPU[:2], chunks=2)
    x = torch.randn(4, 8, dtype=torch.double)
    with pytest.raises(RuntimeError, match=f"'h' .* {refusal}"):
        if call == "step":
            pipe.step(x, x, torch.nn.functional.mse_loss)
        elif call == "evaluate":
            pipe.evaluate(x)
        else:
            pipe(x)
    assert all(p.grad is None for p in pipe.parameters())


@skippable(stash=["k"])
class StashesAHalf(nn.Module):
    """Stashes one half of a projection and returns the other: two views of one base."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> Generator[Any, Any, torch.Tensor]:
        h = self.linear(x)
        q, k = h[:, :4], h[:, 4:]
        yield stash("k", k)
        return q


class DoublesInPlace(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mul_(2)


@skippable(pop=["k"])
class AddsK(nn.Module):
    def forward(self, x: torch.Tensor) -> Generator[Any, Any, torch.Tensor]:
        k = yield pop("k")
        return x + k


def test_a_write_into_another_view_of_a_stashed_tensors_base_passes() -> None:
    # The views share their base's version counter: the write into q moved k's
    # too, and the skip was refused although its values never changed.
    torch.manual_seed(0)
    layers = [StashesAHalf(), DoublesInPlace(), nn.Linear(4, 4), AddsK()]
    model = nn.Sequential(*layers).double()
    plain = copy.deepcopy(model)
    x = torch.randn(4, 8, dtype=torch.double)
    expected = plain(x)
    expected.square().sum().backward()
    pipe = Pipe(model, [2, 2], devices=CPU[:2], chunks=2, checkpoint="never")
    out = pipe(x)
    out.square().sum().backward()
    torch.testing.assert_close(out, expected)
    for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


SHARED_WRITTEN = (
    r"(wrote in place into (its input's leaf \d+|the skip 'shared')|'shared' .* was written in "
    "place after it was stashed)"
)


@skippable(stash=["b"])
class StashesItsInputAsB(nn.Module):
    def forward(self, x: Tensor) -> Generator[Any, Any, Tensor]:
        yield stash("b", x)
        return x + 0


@skippable(pop=["b"])
class WritesB(nn.Module):
    def forward(self, x: Tensor) -> Generator[Any, Any, Tensor]:
        b = yield pop("b")
        return x + b.mul_(3)


@skippable(stash=["p", "q"])
class StashesTwice(nn.Module):
    def forward(self, x: Tensor) -> Generator[Any, Any, Tensor]:
        yield stash("p", x)
        yield stash("q", x)
        return x * 2


@skippable(pop=["p"])
class ReturnsP(nn.Module):
    def forward(self, x: Tensor) -> Generator[Any, Any, Tensor]:
        p = yield pop("p")
        return p


@skippable(pop=["q"])
class AddsQ(nn.Module):
    def forward(self, x: Tensor) -> Generator[Any, Any, Tensor]:
        q = yield pop("q")
        return x + q


def shared_model(writes: str) -> nn.Sequential:
    """A frozen layer, then a skip sharing memory with another path, written on one.

    "main", "pop": ``shared_skip_model``'s; "restashed": a later partition stashes its
    input (the first skip's memory) as a second skip, whose pop writes into it;
    "returned": a popped skip (one memory with another skip) returned as the main path,
    which the next partition writes into.
    """
    if writes in ("main", "pop", "none"):
        return shared_skip_model(writes)
    torch.manual_seed(0)
    frozen = nn.Linear(8, 8).requires_grad_(False)
    if writes == "restashed":
        layers = [frozen, StashesWhatItReturns(), StashesItsInputAsB(), WritesB(), AddsShared()]
    else:
        layers = [frozen, StashesTwice(), ReturnsP(), WritesItsInput(), AddsQ()]
    return nn.Sequential(*layers, nn.Linear(8, 8)).double()


SHARED_CASES = [
    ("main", [2, 4]),
    ("main", [2, 2, 2]),
    ("main", [2, 1, 3]),
    ("pop", [2, 4]),
    ("pop", [3, 3]),
    ("restashed", [2, 1, 3]),
    ("returned", [2, 1, 3]),
]
SHARED_WRITTEN = (
    r"(wrote in place into (its input's leaf \d+|the skip '\w+')|'\w+' .* was written in "
    "place after it was stashed)"
)


def step_evaluate_or_call(pipe: Pipe, x: Tensor, call: str) -> Tensor:
    if call == "step":
        return pipe.step(x, x, torch.nn.functional.mse_loss)
    if call == "evaluate":
        return pipe.evaluate(x)
    return pipe(x)


@pytest.mark.parametrize("call", ["pipe(x)", "step", "evaluate"])
@pytest.mark.parametrize(("writes", "balance"), SHARED_CASES)
def test_a_write_into_a_skip_sharing_memory_with_another_path_is_refused_between_devices(
    call: str, writes: str, balance: list[int]
) -> None:
    # A skip stashed as what its partition returns (or as another skip): the plain model
    # writes into one memory, which both paths see. Between devices and processes they
    # travel apart, and the write showed in one: gradients 2.0 (main path written) and
    # 434 (pop written) off, silently, in DistributedPipe; 3.5 and 1.08 where the memory
    # was stashed again, or popped and passed on.
    pipe = Pipe(shared_model(writes), balance, devices=ALTERNATING[: len(balance)], chunks=2)
    x = torch.randn(4, 8, dtype=torch.double)
    with pytest.raises(RuntimeError, match=SHARED_WRITTEN):
        out = step_evaluate_or_call(pipe, x, call)
        out.sum().backward() if call == "pipe(x)" else None
    assert all(p.grad is None for p in pipe.parameters())


@pytest.mark.parametrize("call", ["pipe(x)", "step", "evaluate"])
@pytest.mark.parametrize(("writes", "balance"), [*SHARED_CASES, ("none", [2, 4]), ("none", [3, 3])])
def test_on_one_device_a_write_shows_on_both_paths_as_in_the_plain_model(
    call: str, writes: str, balance: list[int]
) -> None:
    # One memory on both paths, as in the plain model: nothing to refuse (before, every
    # such write was refused, and a write beside a stashed view too).
    model = shared_model(writes)
    plain = copy.deepcopy(model)
    x = torch.randn(4, 8, dtype=torch.double)
    expected = plain(x)
    pipe = Pipe(model, balance, devices=CPU[: len(balance)], chunks=2, checkpoint="never")
    if call == "pipe(x)" and writes in ("main", "returned", "restashed"):
        # The write before the pop: the portal's tensor was written since its stash
        # (refused in pipe(x), whose pop would take the gradient from the stash on).
        with pytest.raises(RuntimeError, match=SHARED_WRITTEN):
            pipe(x)
        return
    out = step_evaluate_or_call(pipe, x, call)
    if call == "step":
        torch.nn.functional.mse_loss(expected, x).backward()
        torch.testing.assert_close(out, torch.nn.functional.mse_loss(expected, x))
        for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, msg=name)
    else:
        torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("devices", [CPU, ALTERNATING])
@pytest.mark.parametrize("balance", [[2, 4], [2, 2, 2], [2, 1, 3], [3, 3]])
def test_a_skip_that_shares_memory_with_the_main_path_and_is_not_written_passes(
    balance: list[int], devices: list[str]
) -> None:
    model = shared_skip_model("none")
    plain = copy.deepcopy(model)
    x = torch.randn(4, 8, dtype=torch.double)
    expected = plain(x)
    torch.nn.functional.mse_loss(expected, x).backward()
    pipe = Pipe(model, balance, devices=devices[: len(balance)], chunks=2)
    torch.testing.assert_close(pipe(x), expected)
    loss = pipe.step(x, x, torch.nn.functional.mse_loss)
    torch.testing.assert_close(loss, torch.nn.functional.mse_loss(expected, x))
    torch.testing.assert_close(pipe.evaluate(x), expected)
    for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_eval_without_grad_equals_the_plain_model() -> None:
    model = unet()
    plain = copy.deepcopy(model)
    x = torch.randn(6, 8, dtype=torch.double)
    pipe = Pipe(model, BALANCE, devices=ALTERNATING, chunks=3).eval()
    with torch.no_grad():
        torch.testing.assert_close(pipe(x), plain(x))
    with torch.inference_mode():
        torch.testing.assert_close(pipe(x), plain(x))


def test_several_steps_keep_matching_the_plain_model() -> None:
    model = unet()
    plain = copy.deepcopy(model)
    pipe = Pipe(model, BALANCE, devices=ALTERNATING, chunks=4, checkpoint="except_last")
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, plain)]
    for step in range(3):
        x = torch.randn(8, 8, dtype=torch.double, generator=torch.Generator().manual_seed(step))
        for module, optimizer in zip((pipe, plain), optimizers, strict=True):
            optimizer.zero_grad()
            module(x).pow(2).mean().backward()
            optimizer.step()
    for p, q in zip(model.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p, q)


@skippable(stash=["s"])
class StashesFromTheInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Generator[Any, Any, Tensor]:
        yield stash("s", x * 2)  # needs no gradient: the input needs none
        return self.linear(x)


@skippable(pop=["s"])
class SeesThePop(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[bool] = []

    def forward(self, h: Tensor) -> Generator[Any, Any, Tensor]:
        s = yield pop("s")
        self.seen.append(s.requires_grad)
        return h * s


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_a_skip_that_needs_no_gradient_is_popped_needing_none(checkpoint: str) -> None:
    # Its portal's exit hung on the popping input's edge, which needs a gradient: the
    # popping layer saw a skip requiring grad where the plain model's needs none.
    torch.manual_seed(0)
    model = nn.Sequential(StashesFromTheInput(), nn.Tanh(), SeesThePop()).double()
    pipe = Pipe(model, [2, 1], devices=["cpu"] * 2, chunks=2, checkpoint=checkpoint)  # type: ignore[arg-type]
    out = pipe(torch.randn(4, 4, dtype=torch.double))
    assert isinstance(out, Tensor)
    out.sum().backward()
    assert model[2].seen and not any(model[2].seen)


@skippable(stash=["h"])
class MaskFirst(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, pair: tuple[Tensor, Tensor]) -> Generator[Any, Any, tuple[Tensor, Tensor]]:
        mask, x = pair
        h = self.linear(x)
        yield stash("h", h)
        return mask, h


@skippable(pop=["h"])
class SeesTheMask(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[bool] = []

    def forward(self, pair: tuple[Tensor, Tensor]) -> Generator[Any, Any, Tensor]:
        mask, h = pair
        self.seen.append(mask.requires_grad)
        skipped = yield pop("h")
        return h * mask + skipped


@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_a_skips_edge_rides_on_the_tensor_that_carries_a_gradient(checkpoint: str) -> None:
    # The join carrying the skip's gradient went on the first floating tensor, a mask
    # that needs none, and made it need one for every layer after.
    torch.manual_seed(0)
    model = nn.Sequential(MaskFirst(), SeesTheMask()).double()
    pipe = Pipe(model, [1, 1], devices=["cpu"] * 2, chunks=2, checkpoint=checkpoint)  # type: ignore[arg-type]
    mask = torch.ones(4, 4, dtype=torch.double)
    out = pipe((mask, torch.randn(4, 4, dtype=torch.double)))
    assert isinstance(out, Tensor)
    out.sum().backward()
    assert model[1].seen and not any(model[1].seen)


@skippable(stash=["side"])
class SideBranch(nn.Module):
    """A trainable branch beside a frozen trunk: the trunk passes through untouched."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Generator[Any, Any, Tensor]:
        yield stash("side", self.linear(x))
        return x


class Reentrant(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.seen: list[bool] = []

    def forward(self, x: Tensor) -> Tensor:
        self.seen.append(x.requires_grad)
        out: Tensor = torch.utils.checkpoint.checkpoint(self.linear, x, use_reentrant=True)
        return out


@skippable(pop=["side"])
class Merge(nn.Module):
    def forward(self, x: Tensor) -> Generator[Any, Any, Tensor]:
        side = yield pop("side")
        return x + side


@pytest.mark.parametrize("devices", [["cpu", "cpu"], ["cpu:0", "cpu:1"]])
@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_a_trainable_branch_stashed_beside_a_frozen_trunk_trains_as_in_the_plain_model(
    checkpoint: str, devices: list[str]
) -> None:
    # The join carrying the skip's gradient made the trunk require grad: a reentrant
    # checkpoint after it trained weights the plain model leaves without a gradient.
    def model() -> nn.Sequential:
        torch.manual_seed(0)
        layers = [nn.Linear(4, 4), SideBranch(), nn.Tanh(), Reentrant(), Merge(), nn.Linear(4, 2)]
        built = nn.Sequential(*layers).double()
        built[0].requires_grad_(False)
        return built

    x, y = torch.randn(8, 4, dtype=torch.double), torch.randn(8, 2, dtype=torch.double)
    plain = model()
    for xi, yi in zip(x.chunk(2), y.chunk(2), strict=True):
        (nn.functional.mse_loss(plain(xi), yi) / 2).backward()
    piped = model()
    pipe = Pipe(piped, [2, 4], devices=devices, chunks=2, checkpoint=checkpoint)  # type: ignore[arg-type]
    nn.functional.mse_loss(pipe(x), y).backward()
    assert not any(piped[3].seen)
    for (name, p), q in zip(plain.named_parameters(), piped.parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            torch.testing.assert_close(q.grad, p.grad, msg=name)


@skippable(stash=["needs", "needs_none"])
class StashesTwo(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Generator[Any, Any, Tensor]:
        h = self.linear(x)
        yield stash("needs", h)
        yield stash("needs_none", x * 2)  # the input needs none
        return h


@skippable(pop=["needs", "needs_none"])
class PopsTwo(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[bool] = []

    def forward(self, h: Tensor) -> Generator[Any, Any, Tensor]:
        needs = yield pop("needs")
        needs_none = yield pop("needs_none")
        self.seen.append(needs_none.requires_grad)
        return h + needs * needs_none


@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_skips_moved_together_to_another_device_each_need_a_gradient_as_their_own(
    checkpoint: str,
) -> None:
    # Moved by one Copy, the skip that needs no gradient came out needing one.
    torch.manual_seed(0)
    model = nn.Sequential(StashesTwo(), nn.Tanh(), PopsTwo()).double()
    pipe = Pipe(model, [2, 1], devices=["cpu:0", "cpu:1"], chunks=2, checkpoint=checkpoint)  # type: ignore[arg-type]
    out = pipe(torch.randn(4, 4, dtype=torch.double))
    assert isinstance(out, Tensor)
    out.sum().backward()
    assert model[2].seen and not any(model[2].seen)


@skippable(stash=["s"])
class BranchAndTrunk(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(4, 4)
        self.branch = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Generator[Any, Any, Tensor]:
        yield stash("s", self.branch(x))
        return self.trunk(x)


@skippable(pop=["s"])
class Both(nn.Module):
    def forward(self, h: Tensor) -> Generator[Any, Any, tuple[Tensor, Tensor]]:
        s = yield pop("s")
        return h, s * 1


def test_a_skips_gradient_left_by_an_earlier_backward_is_not_taken_by_a_later_one() -> None:
    # autograd.grad of the output that pops the skip, for the trunk's weight, ran the pop's
    # exit but not the stash's enter: a later backward of the other output, which does not
    # depend on the skip, reached the enter and gave the branch that leftover gradient.
    torch.manual_seed(0)
    model = nn.Sequential(BranchAndTrunk(), nn.Tanh(), Both()).double()
    pipe = Pipe(model, [2, 1], devices=["cpu"] * 2, chunks=2, checkpoint="never")
    a, b = pipe(torch.randn(4, 4, dtype=torch.double))
    torch.autograd.grad(b.sum(), [model[0].trunk.weight], retain_graph=True)
    a.sum().backward()
    assert model[0].branch.weight.grad is None
    assert model[0].trunk.weight.grad is not None


@pytest.mark.parametrize("inner_checkpoint", ["always", "never"])
def test_a_pipe_with_skips_nested_in_a_recomputed_partition_equals_the_plain_model(
    inner_checkpoint: str,
) -> None:
    # The outer recomputation ran the inner pipe with the outer task's flags: its stash
    # sent nothing, its pop found no portal, and the backward failed.
    def layers() -> list[nn.Module]:
        torch.manual_seed(0)
        return [nn.Linear(4, 4), SideBranch(), nn.Tanh(), Merge(), nn.Linear(4, 2)]

    def built(nested: bool) -> nn.Sequential:
        first, side, tanh, merge, last = layers()
        if not nested:
            return nn.Sequential(first, side, tanh, merge, last).double()
        inner = Pipe(
            nn.Sequential(side, tanh, merge).double(),
            [2, 1],
            devices=["cpu"] * 2,
            chunks=2,
            checkpoint=inner_checkpoint,  # type: ignore[arg-type]
        )
        return nn.Sequential(first.double(), inner, last.double())

    x = torch.randn(8, 4, dtype=torch.double)
    plain, nested = built(nested=False), built(nested=True)
    plain(x).sum().backward()
    outer = Pipe(nested, [2, 1], devices=["cpu"] * 2, chunks=2, checkpoint="always")
    out = outer(x)
    assert isinstance(out, Tensor)
    out.sum().backward()
    for (name, p), q in zip(plain.named_parameters(), nested.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, msg=name)
