"""The device tier's one source of devices: a layout per test run, from ``layouts.py``.

``layout`` runs a test on every layout of this run; ``several`` on those
with more than one partition (skips across partitions, interleaved stages).
"""

from __future__ import annotations

import pytest

from tests.device.layouts import Layout, selected_layouts

LAYOUTS = selected_layouts()


@pytest.fixture(params=LAYOUTS, ids=[layout.name for layout in LAYOUTS])
def layout(request: pytest.FixtureRequest) -> Layout:
    chosen: Layout = request.param
    return chosen


SEVERAL = [layout for layout in LAYOUTS if not layout.alone]


@pytest.fixture(params=SEVERAL, ids=[layout.name for layout in SEVERAL])
def several(request: pytest.FixtureRequest) -> Layout:
    chosen: Layout = request.param
    return chosen
