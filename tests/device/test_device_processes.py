"""DistributedPipe and DataParallel in process groups of two ranks, on the tier's devices.

Gloo on the CPU always; on a CUDA layout also gloo with both ranks on
``cuda:0`` (tensors cross through the CPU), and NCCL with a GPU per rank
where there are two GPUs (NCCL refuses two ranks on one GPU).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

from tests.device.layouts import selected_layouts

if TYPE_CHECKING:
    from tests.gloo_groups import GroupRunner

SCENARIOS = Path(__file__).with_name("process_scenarios.py")
NAMES = [
    "distributed_pipe_with_skips_equals_the_plain_model",
    "distributed_pipe_replays_dropout_exactly",
    "data_parallel_over_pipes_equals_the_full_batch",
]


def groups() -> list[tuple[str, str]]:
    """(backend, DEVICE_TIER_DEVICE) of each group this run starts."""
    found = [("gloo", "cpu")]
    if any(layout.cuda for layout in selected_layouts()):
        found.append(("gloo", "cuda:0"))
        if torch.cuda.device_count() >= 2:
            found.append(("nccl", "rank"))
    return found


@pytest.mark.parametrize(("backend", "device"), groups())
def test_stages_and_replicas_in_processes_equal_the_plain_model(
    group_runner: GroupRunner, monkeypatch: pytest.MonkeyPatch, backend: str, device: str
) -> None:
    monkeypatch.setenv("DEVICE_TIER_DEVICE", device)
    # A CUDA group's ranks start afresh, not forked from a rank server, as GPU programs do.
    fresh = device != "cpu"
    outcomes = group_runner(
        NAMES, script=SCENARIOS, backend=backend, wall_timeout_s=180, fresh=fresh
    )
    failures = [
        f"rank {r}, {n}:\n{o.get(n)}"
        for r, o in enumerate(outcomes)
        for n in NAMES
        if o.get(n) != "ok"
    ]
    assert not failures, "\n".join(failures)
