"""Small skippable layers and a U-Net-like model shared by the skip tests."""

from __future__ import annotations

import weakref
from collections.abc import Generator
from typing import Any

import torch
from torch import Tensor, nn

from pipeline.skip import Namespace, pop, skippable, stash

WIDTH = 8
# Each level's skip has its own width, so a skip tensor is recognisable by shape.
SKIP_WIDTHS = {"level1": 3, "level2": 4, "level3": 5, "level4": 6}
BALANCE = [2, 2, 3, 5]


@skippable(stash=["skip"])
class Down(nn.Module):
    """Stashes a projection of its input; passes a transformed input on."""

    def __init__(self, skip_width: int) -> None:
        super().__init__()
        self.side = nn.Linear(WIDTH, skip_width)
        self.main = nn.Linear(WIDTH, WIDTH)
        self.stashed: list[weakref.ref[Tensor]] = []

    def forward(self, x: Tensor) -> Generator[Any, Any, Tensor]:
        skip = torch.tanh(self.side(x))
        self.stashed.append(weakref.ref(skip))
        yield stash("skip", skip)
        return torch.tanh(self.main(x))


@skippable(pop=["skip"])
class Up(nn.Module):
    """Pops the skip of its level and merges it into the main path."""

    def __init__(self, skip_width: int) -> None:
        super().__init__()
        self.merge = nn.Linear(WIDTH + skip_width, WIDTH)

    def forward(self, x: Tensor) -> Generator[Any, Any, Tensor]:
        skip = yield pop("skip")
        return torch.tanh(self.merge(torch.cat([x, skip], dim=1)))


class Recorder(nn.Module):
    """A layer between a stash and its pop that records the shapes it receives."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.seen: list[object] = []

    def forward(self, x: Tensor) -> Tensor:
        self.seen.append(tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__)
        return self.linear(x)


def unet(seed: int = 0) -> nn.Sequential:
    """Four nested skips; with BALANCE they cross 3, 2 and 1 partitions, and one stays put.

    ::

        partition 0        1                 2                  3
        Down1 Down2 | Rec Down3 | Rec Up3 Up2 | Rec Down4 Up4 Up1 Head
          |     |          |__________|   |          |____|    |
          |     |_________________________|                    |
          |____________________________________________________|
    """
    torch.manual_seed(seed)
    ns = {level: Namespace(level) for level in SKIP_WIDTHS}

    def down(level: str) -> nn.Module:
        return Down(SKIP_WIDTHS[level]).isolate(ns[level])

    def up(level: str) -> nn.Module:
        return Up(SKIP_WIDTHS[level]).isolate(ns[level])

    return nn.Sequential(
        down("level1"),
        down("level2"),
        Recorder(),
        down("level3"),
        Recorder(),
        up("level3"),
        up("level2"),
        Recorder(),
        down("level4"),
        up("level4"),
        up("level1"),
        nn.Linear(WIDTH, 2),
    ).double()


def stashed_refs(model: nn.Module) -> list[weakref.ref[Tensor]]:
    return [ref for m in model.modules() if isinstance(m, Down) for ref in m.stashed]
