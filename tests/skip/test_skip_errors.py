"""Every misuse of skips fails with a clear error, at Pipe construction where it can."""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import pipeline
from pipeline import Pipe
from pipeline.skip import Namespace, pop, skippable, stash, verify_skippables


@skippable(stash=["x"])
class StashX(nn.Module):
    def forward(self, x: Tensor) -> Generator[Any, Any, Tensor]:
        yield stash("x", x)
        return x


@skippable(pop=["x"])
class PopX(nn.Module):
    def forward(self, x: Tensor) -> Generator[Any, Any, Tensor]:
        skip = yield pop("x")
        return x + skip


class Generating(nn.Module):
    def forward(self, x: Tensor) -> Generator[Any, Any, Tensor]:
        yield stash("x", x)
        return x


def test_pipe_refuses_mismatched_skips_listing_each() -> None:
    y = Namespace("y")
    model = nn.Sequential(
        PopX(), StashX(), StashX().isolate(y), PopX().isolate(Namespace("z")), Generating()
    )
    with pytest.raises(TypeError) as error:
        Pipe(model, [1, 1, 1, 1, 1])
    assert str(error.value) == (
        "the skip connections of this model do not match:\n"
        "  - layer '4' (Generating) has a generator forward but is not skippable; decorate its "
        "class with @skippable(stash=[...], pop=[...])\n"
        "  - 'x' (default) popped by layer '0' (PopX) before layer '1' (StashX) stashes it; a pop "
        "must come after its stash\n"
        "  - 'x' (z) popped by layer '3' (PopX) is never stashed\n"
        "  - 'x' (y) stashed by layer '2' (StashX) is never popped"
    )


def test_pipe_refuses_a_name_stashed_twice_in_one_namespace() -> None:
    model = nn.Sequential(StashX(), StashX(), PopX())
    with pytest.raises(
        TypeError,
        match=r"'x' \(default\) stashed by both layer '0' \(StashX\) "
        r"and layer '1' \(StashX\); give each use .* layer.isolate\(Namespace\(\)\)",
    ):
        Pipe(model, [1, 1, 1])


def test_nested_layers_are_verified_by_path() -> None:
    model = nn.Sequential(nn.Sequential(nn.ReLU(), StashX()), nn.ReLU())
    with pytest.raises(
        TypeError,
        match=r"'x' \(default\) stashed by layer '0.1' \(StashX\) is "
        "never popped",
    ):
        verify_skippables(model)


@skippable(stash=["x"], pop=["y"])
class Sloppy(nn.Module):
    """Does at run time whatever ``self.plan`` says."""

    def __init__(self) -> None:
        super().__init__()
        self.plan: list[Any] = []
        self.replies: list[Any] = []

    def forward(self, x: Tensor) -> Generator[Any, Any, Tensor]:
        for command in self.plan:
            self.replies.append((yield command))
        return x


@skippable(stash=["y"])
class StashY(nn.Module):
    def forward(self, x: Tensor) -> Generator[Any, Any, Tensor]:
        yield stash("y", x)
        return x


def sloppy_pipe(*plan: Any) -> Pipe:
    sloppy = Sloppy()
    sloppy.plan = list(plan)
    return Pipe(nn.Sequential(StashY(), sloppy, PopX()), [1, 1, 1], chunks=2)


def test_undeclared_names_fail_at_run_time_naming_the_layer() -> None:
    x = torch.ones(2, 1)
    declared = r"layer Sloppy \(stash=\['x'\], pop=\['y'\]\)"
    with pytest.raises(ValueError, match=f"{declared} stashes 'z', which it does not declare"):
        sloppy_pipe(stash("z", x))(x)
    with pytest.raises(ValueError, match=f"{declared} pops 'z', which it does not declare"):
        sloppy_pipe(pop("z"))(x)


def test_declared_skips_must_be_used_once_per_call() -> None:
    x = torch.ones(2, 1)
    with pytest.raises(RuntimeError, match="returned without doing what it declares: stash 'x'"):
        sloppy_pipe(pop("y"))(x)
    with pytest.raises(RuntimeError, match="returned without doing what it declares: pop 'y'"):
        sloppy_pipe(stash("x", x))(x)
    with pytest.raises(RuntimeError, match="stashes 'x' twice in one call"):
        sloppy_pipe(pop("y"), stash("x", x), stash("x", x))(x)
    with pytest.raises(RuntimeError, match="pops 'y' twice in one call"):
        sloppy_pipe(pop("y"), pop("y"), stash("x", x))(x)


def test_only_tensors_can_be_stashed() -> None:
    with pytest.raises(TypeError, match=r"layer Sloppy .* stashes 'x' as int; only tensors"):
        sloppy_pipe(pop("y"), stash("x", 3))(torch.ones(2, 1))


def test_a_forward_must_yield_only_commands() -> None:
    with pytest.raises(TypeError, match=r"layer Sloppy .* yielded Tensor; a skippable forward"):
        sloppy_pipe(torch.ones(1))(torch.ones(2, 1))


def test_pipe_works_again_after_a_failed_call() -> None:
    x = torch.ones(2, 1)
    pipe = sloppy_pipe(pop("y"), stash("x", 3))
    with pytest.raises(TypeError):
        pipe(x)
    pipe[1].plan = [pop("y"), stash("x", torch.full((1, 1), 5.0))]
    torch.testing.assert_close(pipe(x), x * 6)


def test_pop_without_stash_outside_a_pipe() -> None:
    with pytest.raises(
        RuntimeError,
        match=r"layer PopX pops 'x' \(default\) but "
        "no earlier layer of this forward pass has stashed it",
    ):
        PopX()(torch.ones(1))


def test_a_skip_between_partitions_needs_a_floating_point_carrier() -> None:
    @skippable(stash=["x"])
    class ToIndices(nn.Module):
        def forward(self, x: Tensor) -> Generator[Any, Any, Tensor]:
            yield stash("x", x)
            return x.long()

    pipe = Pipe(nn.Sequential(ToIndices(), nn.Identity(), PopX()), [1, 1, 1])
    with pytest.raises(
        TypeError,
        match="the output of layer ToIndices must hold a floating-point "
        r"tensor .* got \(Tensor\) without a floating-point tensor",
    ):
        pipe(torch.ones(2, 1))


def test_decorator_misuse() -> None:
    with pytest.raises(TypeError, match="must be a generator"):
        skippable(stash=["x"])(nn.Linear)
    with pytest.raises(TypeError, match=r"decorates an nn\.Module class"):
        skippable(stash=["x"])(int)
    with pytest.raises(TypeError, match="already skippable"):
        skippable(stash=["x"])(StashX)
    with pytest.raises(TypeError, match="stash must be a list of names, got 'x'"):
        skippable(stash="x")
    with pytest.raises(TypeError, match="pop names must be non-empty strings"):
        skippable(pop=[""])
    with pytest.raises(ValueError, match="stash lists a name twice"):
        skippable(stash=["x", "x"])
    with pytest.raises(ValueError, match=r"\['x'\] both stashed and popped by one layer"):
        skippable(stash=["x"], pop=["x"])


@skippable(stash=["s"])
class StashesItsInput(nn.Module):
    def forward(self, x: Tensor) -> Generator[Any, Any, Tensor]:
        yield stash("s", x)  # needs no gradient; nothing saves it
        return x * 2


@skippable(pop=["s"])
class WritesThePop(nn.Module):
    def forward(self, h: Tensor) -> Generator[Any, Any, Tensor]:
        s = yield pop("s")
        if not pipeline.is_recomputing():
            s.mul_(3)  # the plain model's write: nothing saved s
        return h + 0


def written_pop() -> nn.Sequential:
    torch.manual_seed(0)
    layers = [StashesItsInput(), nn.Linear(4, 4), nn.Tanh(), WritesThePop(), nn.Linear(4, 4)]
    return nn.Sequential(*layers).double()


@pytest.mark.parametrize("call", ["step", "pipe(x)"])
@pytest.mark.parametrize("checkpoint", ["always", "except_last"])
def test_a_skip_a_checkpointed_partition_writes_into_is_refused(checkpoint: str, call: str) -> None:
    # Its recomputation popped the written values (43 off), and the stashing partition's
    # input, the skip itself, was what that one's recomputation started from (2.6 off):
    # both silently, in Pipe.step; pipe(x) failed in the backward, on a leaf.
    x = torch.randn(8, 4, dtype=torch.double)
    pipe = Pipe(written_pop(), [3, 2], devices=["cpu"] * 2, chunks=2, checkpoint=checkpoint)  # type: ignore[arg-type]
    # pipe(x) runs micro-batch 1's partition 0 beside micro-batch 0's write, into a view of
    # the same input, whose version counter they share: either check may see it first.
    written = r"modified (the skip 's' .* it popped|its input) in place"
    with pytest.raises(RuntimeError, match=written):
        if call == "step":
            pipe.step(x, x, lambda o, t: o.sum(), loss_reduction="sum", schedule="gpipe")
        else:
            pipe(x)
    assert all(p.grad is None for p in pipe.parameters())
    pipe.close()
