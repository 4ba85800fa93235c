"""Skip tensors are freed at their last use and never outlive a training step."""

from __future__ import annotations

import weakref
from collections.abc import Generator
from typing import Any

import pytest
import torch
from skip_models import BALANCE, WIDTH, Down, stashed_refs, unet
from torch import Tensor, nn

import pipeline.clock.skips
from pipeline import Pipe
from pipeline.clock.portal import Portal
from pipeline.skip import pop, skippable, stash

ALTERNATING = ["cpu", "cpu:0", "cpu", "cpu:0"]


@pytest.fixture
def portals(monkeypatch: pytest.MonkeyPatch) -> list[Portal]:
    """Every portal the Pipe creates from now on."""
    created: list[Portal] = []

    class RecordedPortal(Portal):
        __slots__ = ()

        def __init__(self) -> None:
            super().__init__()
            created.append(self)

    monkeypatch.setattr(pipeline.clock.skips, "Portal", RecordedPortal)
    return created


@pytest.mark.parametrize("checkpoint", ["never", "always", "except_last"])
def test_no_skip_tensor_survives_a_training_step(portals: list[Portal], checkpoint: str) -> None:
    model = unet()
    pipe = Pipe(model, BALANCE, devices=ALTERNATING, chunks=3, checkpoint=checkpoint)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(6):
        optimizer.zero_grad()
        loss = pipe(torch.randn(6, WIDTH, dtype=torch.double)).square().mean()
        loss.backward()
        optimizer.step()
        del loss
        refs = stashed_refs(model)
        recomputed = {"never": 0, "always": 3, "except_last": 2}[checkpoint]
        assert len(refs) == 4 * (3 + recomputed)  # four Down layers, three micro-batches
        assert refs and all(ref() is None for ref in refs)
        assert all(p.tensor is None and p.grad is None for p in portals)
        for layer in model.modules():
            if isinstance(layer, Down):
                layer.stashed.clear()
    assert len(portals) == 6 * 3 * 3


@pytest.mark.parametrize("devices", [["cpu"] * 4, ALTERNATING], ids=["same-device", "copied"])
def test_portals_are_empty_after_forward_without_checkpointing(
    portals: list[Portal], devices: list[str]
) -> None:
    pipe = Pipe(unet(), BALANCE, devices=devices, chunks=3, checkpoint="never")
    out = pipe(torch.randn(6, WIDTH, dtype=torch.double))
    # Three skips leave their partition, for each of three micro-batches.
    assert len(portals) == 9
    assert all(p.tensor is None for p in portals)
    out.sum().backward()
    assert all(p.tensor is None and p.grad is None for p in portals)


@pytest.mark.parametrize("checkpoint", ["always", "except_last"])
def test_checkpointed_portals_let_go_at_the_pop_and_the_popping_task_keeps_its_tensor(
    portals: list[Portal], checkpoint: str
) -> None:
    pipe = Pipe(unet(), BALANCE, devices=ALTERNATING, chunks=3, checkpoint=checkpoint)
    out = pipe(torch.randn(6, WIDTH, dtype=torch.double))
    assert all(p.tensor is None for p in portals)
    # What a checkpointed popping task popped stays with it, for its
    # recomputation, until backward frees the task's graph.
    popped = [weakref.ref(t) for t in _popped_by_checkpointed_tasks(out)]
    assert len(popped) == 3 * {"always": 3, "except_last": 2}[checkpoint]
    out.sum().backward()
    del out
    assert all(ref() is None for ref in popped)


def _popped_by_checkpointed_tasks(output: Tensor) -> list[Tensor]:
    """The tensors held by the skip trackers of the checkpointed tasks in ``output``'s graph."""
    import gc

    from pipeline.clock.skips import PortalTracker

    trackers = [o for o in gc.get_objects() if type(o) is PortalTracker]
    return [t for tracker in trackers for t in tracker.popped.values()]


class Probe(nn.Module):
    """Checks, when it runs, that the tensor stashed for its micro-batch is gone.

    A micro-batch is named by its input value ``v``: WatchedStash stashes
    ``2v`` and outputs ``v + 1``, so PopAdd outputs ``3v + 1``.
    """

    def __init__(self) -> None:
        super().__init__()
        self.watched: dict[int, weakref.ref[Tensor]] = {}
        self.checks: dict[int, bool] = {}

    def forward(self, x: Tensor) -> Tensor:
        v = int((x[0, 0] - 1) / 3)
        self.checks[v] = self.watched.pop(v)() is None
        return x


@skippable(stash=["skip"])
class WatchedStash(nn.Module):
    def __init__(self, probe: Probe) -> None:
        super().__init__()
        self.probe = [probe]  # a list, so the probe is not a submodule

    def forward(self, x: Tensor) -> Generator[Any, Any, Tensor]:
        skip = x * 2
        self.probe[0].watched[int(x[0, 0])] = weakref.ref(skip)
        yield stash("skip", skip)
        return x + 1


@skippable(pop=["skip"])
class PopAdd(nn.Module):
    def forward(self, x: Tensor) -> Generator[Any, Any, Tensor]:
        skip = yield pop("skip")
        return x + skip


@pytest.mark.parametrize("devices", [["cpu"] * 3, ["cpu", "cpu", "cpu:0"]], ids=["same", "copied"])
def test_skip_tensor_is_freed_as_soon_as_it_is_popped(devices: list[str]) -> None:
    probe = Probe()
    model = nn.Sequential(WatchedStash(probe), nn.Identity(), nn.Identity(), PopAdd(), probe)
    pipe = Pipe(model, [1, 2, 2], devices=devices, chunks=4).eval()
    with torch.no_grad():
        out = pipe(torch.arange(4.0).view(4, 1).expand(4, 2))
    torch.testing.assert_close(out, torch.arange(4.0).view(4, 1).expand(4, 2) * 3 + 1)
    assert probe.checks == dict.fromkeys(range(4), True)
