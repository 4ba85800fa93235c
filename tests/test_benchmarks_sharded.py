"""examples/benchmarks/sharded_stages.py: its quick run under torchrun passes its gate and reports.

The run's own gate asserts that both libraries' full gradients equal the
plain model's in float64; here the JSON line must hold every figure the
docs' table takes, with the memory of a rank half a stage's (fsdp = 2).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tests.gloo_groups import Torchrun

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "benchmarks" / "sharded_stages.py"
SCHEDULES = ("gpipe", "1f1b")
TORCH = tuple(f"{torch_} {s}" for s in SCHEDULES for torch_ in ("torch", "torch kept"))
OURS = tuple(f"{ours} {s}" for s in SCHEDULES for ours in ("ours", "ours resharded"))
CANDIDATES = set(OURS) | set(TORCH)


def test_quick_run_prints_the_comparison_as_json(torchrun: Torchrun) -> None:
    # Four processes on a shared machine: the bound is generous.
    done = torchrun(4, SCRIPT, "--quick", timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["benchmark"] == "sharded_stages"
    assert result["mesh"] == {"dp": 2, "pp": 2}
    (figures,) = result["results"]
    assert figures["chunks"] == 4
    assert set(figures["ms"]) == CANDIDATES
    assert set(figures["ours_over_torch_throughput"]) == set(TORCH)
    assert all(ratio > 0 for ratio in figures["ours_over_torch_throughput"].values())
    resharded = figures["ours_resharded_over_torch_throughput"]
    assert set(resharded) == {f"torch {s}" for s in SCHEDULES}
    assert all(ratio > 0 for ratio in resharded.values())
    assert all(d <= 1e-12 for d in figures["max_grad_difference_from_plain"].values())
    for name in CANDIDATES:
        counts = figures["collectives_per_step_rank0"][name]
        # Each of stage 0's four FSDP units reduce-scatters its gradients once a step.
        assert counts["reduce_scatter_single"] == 4, (name, counts)
        assert counts["send"] > 0 and counts["recv"] > 0, (name, counts)
        assert all(b > 0 for b in figures["saved_peak_bytes_per_rank"][name])
        if name.startswith("ours resharded"):
            # Sharded as torch's default: the same gathers, the same memory.
            twin = name.replace("ours resharded", "torch")
            for key in ("collectives_per_step_rank0", "saved_and_gathered_peak_bytes_per_rank"):
                expected = figures[key][twin]
                if key == "collectives_per_step_rank0":
                    # The step's agreement, over the pipeline and over the dp group; its
                    # end, a message up to rank 1 and one back.
                    ends = {"send": expected["send"] + 1, "recv": expected["recv"] + 1}
                    expected = expected | {"all_gather": 2} | ends
                assert figures[key][name] == expected, (name, key)
        states = figures["state_bytes_per_rank"][name]
        assert len(states) == 4
        assert all(2 * b == figures["stage_state_bytes"] for b in states), (name, states)
