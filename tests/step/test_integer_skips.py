"""A skip that needs no gradient (integer labels) into a stage whose backward is held.

With a hook on one of its tensors, a stage computes its gradients with
``autograd.grad``, which refuses targets that need no gradient: such a skip
gets None back instead.
"""

from __future__ import annotations

import copy
from collections.abc import Generator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pipeline import Pipe
from pipeline.skip import pop, skippable, stash


@skippable(stash=["classes"])
class StashClasses(nn.Module):
    """Splits the input into features and integer classes; the classes skip to the head."""

    def forward(self, x: Tensor) -> Generator[Any, Any, Tensor]:
        yield stash("classes", x[:, -1].long())
        return x[:, :-1]


@skippable(pop=["classes"])
class WeighedHead(nn.Module):
    """A linear head whose output is weighed by the classes it pops."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, 3)

    def forward(self, x: Tensor) -> Generator[Any, Any, Tensor]:
        classes = yield pop("classes")
        return self.linear(x) * (1 + classes).unsqueeze(1)


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(StashClasses(), nn.Linear(4, 4), nn.Tanh(), WeighedHead(4)).double()


def test_an_integer_skip_into_a_held_stage() -> None:
    plain = model()
    pipe = Pipe(copy.deepcopy(plain), [2, 2], chunks=3)
    x = torch.cat([torch.randn(6, 4), torch.randint(0, 3, (6, 1))], dim=1).double()
    target = torch.randn(6, 3).double()
    head = pipe.partitions[1][1].linear.weight
    calls: list[Tensor] = []
    handle = head.register_hook(calls.append)
    try:
        for schedule in ("gpipe", "1f1b", "zb-h1"):
            pipe.zero_grad()
            plain.zero_grad()
            calls.clear()
            loss = pipe.step(x, target, F.mse_loss, schedule=schedule)
            expected = F.mse_loss(plain(x), target)
            expected.backward()
            torch.testing.assert_close(loss, expected.detach())
            for (name, mine), theirs in zip(
                pipe.named_parameters(), plain.parameters(), strict=True
            ):
                torch.testing.assert_close(mine.grad, theirs.grad, msg=f"{schedule}: {name}")
            assert len(calls) == 1, f"{schedule}: the hook sees the whole gradient once"
    finally:
        handle.remove()
        pipe.close()
