"""Skip tensors go straight from the stashing partition to the popping one."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
from skip_models import BALANCE, SKIP_WIDTHS, WIDTH, Recorder, unet
from torch import nn

import pipeline.clock.copy
import pipeline.clock.skips
from pipeline import Pipe
from pipeline.skip import Route, SkipLayout

ALTERNATING = ["cpu", "cpu:0", "cpu", "cpu:0"]


def record_partition_inputs(pipe: Pipe) -> list[list[Any]]:
    seen: list[list[Any]] = [[] for _ in pipe.partitions]
    for partition, log in zip(pipe.partitions, seen, strict=True):

        def hook(module: nn.Module, args: tuple[Any, ...], log: list[Any] = log) -> None:
            (value,) = args
            log.append(tuple(value.shape) if isinstance(value, torch.Tensor) else value)

        partition.register_forward_pre_hook(hook)
    return seen


@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_partitions_receive_only_the_main_path(checkpoint: str) -> None:
    model = unet()
    pipe = Pipe(model, BALANCE, devices=ALTERNATING, chunks=2, checkpoint=checkpoint)
    seen = record_partition_inputs(pipe)
    pipe(torch.randn(4, WIDTH, dtype=torch.double)).sum().backward()

    # Two micro-batches of two rows, run again by recomputation if checkpointed.
    runs = 4 if checkpoint == "always" else 2
    assert seen == [[(2, WIDTH)] * runs] * 4
    recorders = [m for m in model if isinstance(m, Recorder)]
    assert [r.seen for r in recorders] == [[(2, WIDTH)] * runs] * 3


def test_each_skip_is_copied_once_and_only_across_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    copied: Counter[int] = Counter()
    real_copy = pipeline.clock.copy._copy

    def counting_copy(x: Any, source: Any, target: Any) -> Any:
        copied[x.shape[-1]] += 1
        return real_copy(x, source, target)

    monkeypatch.setattr(pipeline.clock.copy, "_copy", counting_copy)
    chunks = 3
    pipe = Pipe(unet(), BALANCE, devices=ALTERNATING, chunks=chunks, checkpoint="except_last")
    pipe(torch.randn(6, WIDTH, dtype=torch.double)).sum().backward()

    # Forward and backward, per micro-batch: the main path crosses three
    # boundaries; level1 (partition 0, cpu -> 3, cpu:0) and level3 (1 -> 2)
    # change device and are copied once, however many partitions they skip;
    # level2 (0 -> 2, both cpu) and level4 (within 3) are never copied.
    assert copied == {
        WIDTH: 2 * 3 * chunks,
        SKIP_WIDTHS["level1"]: 2 * chunks,
        SKIP_WIDTHS["level3"]: 2 * chunks,
    }


def test_layout_lists_where_each_skip_goes() -> None:
    pipe = Pipe(unet(), BALANCE, devices=ALTERNATING)
    layout = pipe.skip_layout
    assert isinstance(layout, SkipLayout)
    routes = [(r.namespace.label, r.name, r.source, r.target) for r in layout.routes()]
    assert routes == [
        ("level1", "skip", 0, 3),
        ("level2", "skip", 0, 2),
        ("level3", "skip", 1, 2),
        ("level4", "skip", 3, 3),
    ]
    assert all(isinstance(r, Route) for r in layout.routes())
    assert repr(layout) == (
        "SkipLayout(4 partitions):\n"
        "  'skip' (level1): partition 0 -> partition 3, copied cpu -> cpu:0\n"
        "  'skip' (level2): partition 0 -> partition 2, same device\n"
        "  'skip' (level3): partition 1 -> partition 2, copied cpu:0 -> cpu\n"
        "  'skip' (level4): within partition 3"
    )


def test_model_without_skips_has_an_empty_layout_and_no_skip_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def refuse(*args: Any) -> None:
        raise AssertionError("a model without skips must not build skip state")

    monkeypatch.setattr(pipeline.clock.skips, "SkipPortals", refuse)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    pipe = Pipe(model, [2, 1], chunks=2)
    pipe(torch.randn(4, 4)).sum().backward()
    assert not pipe.skip_layout
    assert repr(pipe.skip_layout) == "SkipLayout(2 partitions): no skips"
