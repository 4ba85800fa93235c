"""examples/benchmarks/plan_quality.py --quick: the grid measured, activations as predicted,
for the GPT, the U-Net (skips across partitions) and a split Llama (tables that need no
gradient between its pieces); and the GPT's DistributedPipe across two processes."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.plan.plan_models import one_thread

if TYPE_CHECKING:
    from tests.gloo_groups import Torchrun

pytestmark = pytest.mark.usefixtures(one_thread.__name__)

BENCHMARKS = Path(__file__).resolve().parents[2] / "examples" / "benchmarks"


@pytest.mark.parametrize("model", ["gpt", "unet", "llama"])
def test_quick_run_measures_every_configuration_and_its_activations_are_the_predicted(
    model: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    monkeypatch.syspath_prepend(str(BENCHMARKS.parent))
    spec = importlib.util.spec_from_file_location("plan_quality", BENCHMARKS / "plan_quality.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "plan_quality", module)  # its dataclass looks itself up
    spec.loader.exec_module(module)
    module.main(["--quick", "--model", model])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["benchmark"] == "plan_quality" and result["quick"] is True
    assert result["model"] == model
    rows = result["rows"]
    configurations = {row["configuration"].split(", balance")[0] for row in rows}
    assert configurations == {
        f"{s}, 2 chunks, {mode}" for s in ("gpipe", "1f1b") for mode in ("never", "always")
    }
    assert len(rows) == len(configurations)  # one cut measured per configuration
    assert result["chosen"] in {row["configuration"] for row in rows}
    for row in rows:
        assert row["measured_activations"] == row["predicted_activations"], row
        assert row["measured_ms"] > 0 and row["predicted_ms"] > 0
    assert result["chosen_over_best_measured"] > 0


def test_quick_run_across_two_processes_measures_each_stage_where_it_runs(
    torchrun: Torchrun,
) -> None:
    done = torchrun(
        2, BENCHMARKS / "plan_quality.py", "--quick", "--processes", "--model", "gpt", timeout=240
    )
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])  # rank 0 alone reports
    assert result["benchmark"] == "plan_quality" and result["processes"] == 2
    rows = result["rows"]
    assert {row["configuration"].split(", balance")[0] for row in rows} == {
        f"{s}, 2 chunks, {mode}" for s in ("gpipe", "1f1b") for mode in ("never", "always")
    }
    for row in rows:
        # Each stage's peak, measured in the process that ran it, is the memory model's.
        assert len(row["measured_activations"]) == 2
        assert row["measured_activations"] == row["predicted_activations"], row
        assert row["measured_ms"] > 0 and row["predicted_ms"] > 0
