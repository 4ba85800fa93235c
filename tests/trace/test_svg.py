"""Trace.save_svg: a traced step as an SVG picture, and the example that draws the schedules."""

from __future__ import annotations

import os
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch
import torch.nn.functional as F

import pipeline
from pipeline.trace.event import Event
from pipeline.trace.svg import COLOURS, render_svg
from tests.helpers import mlp

if TYPE_CHECKING:
    from tests.gloo_groups import ForkedPython

SVG = "{http://www.w3.org/2000/svg}"
ROOT = Path(__file__).resolve().parents[2]


def boxes(tree: ET.Element) -> list[ET.Element]:
    """The task boxes: rects with a tooltip (the background and legend have none)."""
    return [r for r in tree.iter(f"{SVG}rect") if r.find(f"{SVG}title") is not None]


def test_every_task_of_a_real_step_is_a_box_in_its_partitions_row_in_time_order(
    tmp_path: Path,
) -> None:
    pipe = pipeline.Pipe(mlp(), [3, 3], devices=["cpu", "cpu"], chunks=3, checkpoint="never")
    x, y = torch.randn(6, 8, dtype=torch.double), torch.randn(6, 8, dtype=torch.double)
    with pipeline.trace() as t:
        pipe.step(x, y, F.mse_loss, schedule="zb-h1")
    pipe.close()
    t.save_svg(tmp_path / "step.svg", title="zb-h1 <2 partitions>")
    tree = ET.parse(tmp_path / "step.svg").getroot()
    drawn = boxes(tree)
    events = [e for e in t.events if e.kind != "copy"]
    assert len(drawn) == len(events)
    names = [r.findtext(f"{SVG}title", "").split(":")[0] for r in drawn]
    assert sorted(names) == sorted(e.name for e in events)
    kinds = {e.kind for e in events}
    assert {"forward", "input_grad", "weight_grad"} <= kinds
    assert {r.get("fill") for r in drawn} == {COLOURS[k] for k in kinds}
    for e, r in zip(sorted(events, key=lambda e: e.kind == "wait"), drawn, strict=True):
        assert r.findtext(f"{SVG}title", "").startswith(e.name)
        assert r.get("y") == str(34 + e.partition * (28 + 6)), e.name
    # Placed by when they ran: in each row, a later start is further right.
    x = {r.findtext(f"{SVG}title", "").split(":")[0]: float(r.get("x", "")) for r in drawn}
    for j in (0, 1):
        row = sorted((e.start, e.name) for e in events if e.partition == j and e.kind != "wait")
        placed = [x[name] for _, name in row]
        assert placed == sorted(placed) and placed[0] >= 90, (j, row)
    assert "zb-h1 &lt;2 partitions&gt;" in (tmp_path / "step.svg").read_text()


def test_bad_calls_are_refused() -> None:
    with pytest.raises(ValueError, match="no tasks to draw: trace a step first"):
        render_svg([])
    event = Event("forward", 0, 0, 0, "t", 0.0, 1.0)
    with pytest.raises(ValueError, match="width must be at least 190 pixels, got 100"):
        render_svg([event], width=100)


def test_the_example_draws_gpipe_1f1b_and_zb_h1(
    tmp_path: Path, forked_python: ForkedPython
) -> None:
    script = ROOT / "examples" / "schedule_pictures.py"
    small = ["--rows", "4", "--width", "16", "--out", str(tmp_path)]
    done = forked_python([str(script), *small], dict(os.environ), 240)
    assert done.returncode == 0, done.stderr
    for schedule in ("gpipe", "1f1b", "zb-h1"):
        tree = ET.parse(tmp_path / f"{schedule}.svg").getroot()
        assert boxes(tree), schedule
        assert f"wrote {tmp_path / schedule}.svg" in done.stdout
