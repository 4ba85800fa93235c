"""examples/benchmarks/gpu_check.py: says so and exits 0 without CUDA; its CPU dry run works.

Both run with CUDA hidden (``CUDA_VISIBLE_DEVICES=""``), so on a GPU machine
too they take seconds: the GPU run itself is the script's job. Each is forked by
a rank server (conftest.py's ``forked_python``): torch's import is not paid again.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tests.gloo_groups import ForkedPython

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "benchmarks" / "gpu_check.py"
TIMEOUT_S = 300


def run(python: ForkedPython, *arguments: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)}
    return python([str(SCRIPT), *arguments], env, TIMEOUT_S, cwd=ROOT)


def test_without_cuda_it_says_so_and_exits_0(forked_python: ForkedPython) -> None:
    done = run(forked_python)
    assert done.returncode == 0, done.stderr
    assert "CUDA is not available" in done.stdout
    assert "run this on a machine with a GPU" in done.stdout


def test_the_cpu_dry_run_times_checks_and_reports_every_part(
    tmp_path: Path, forked_python: ForkedPython
) -> None:
    out, table = tmp_path / "check.json", tmp_path / "check.md"
    done = run(
        forked_python, "--device", "cpu", "--quick", "--out", str(out), "--markdown", str(table)
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    results = json.loads(out.read_text())
    steps = results["steps"]["times"]
    assert list(steps) == [
        *("whole batch", "micro-batches", "pipe(x)", "gpipe", "1f1b", "zb-h1"),
        "pipe(x), checkpoint='except_last' (the default)",
    ]
    assert all(figures["ms"] > 0 and figures["speedup"] > 0 for figures in steps.values())
    assert list(results["copy_streams"]["times"]) == ["copy streams", "compute streams"]
    assert results["compiled"]["frames_compiled"] > 0
    assert results["compiled"]["backend"] == "aot_eager"
    planned = results["plan_memory"]["configurations"]
    assert len(planned) == 2 and all(row["predicted_bytes"] > 0 for row in planned)
    assert all(row["measured_bytes"] is None for row in planned)  # no allocator peak on the CPU
    assert "tests" not in results  # the pytest steps are the CPU suite's on the CPU
    markdown = table.read_text()
    assert markdown in done.stdout  # printed too
    assert "| check | result | figures |" in markdown
    for name in [*steps, "copy streams", "compiled pipe(x)", "frames compiled"]:
        assert f"{name} |" in markdown, name
    assert markdown.count("not measured: no allocator peak off CUDA |") == 2


def test_a_failing_part_is_a_failed_row_and_leaves_the_others() -> None:
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(SCRIPT.parent))

    def fails() -> dict[str, object]:
        raise AssertionError("gradients differ\nmore")

    failed = gpu_check.guarded(fails)
    assert failed["error"] == "AssertionError: gradients differ\nmore"
    results = {
        "versions": {"torch": "2.x", "gpus": [{"name": "H100"}]},
        "total_s": 1.0,
        "steps": failed,
        "copy_streams": {"skipped": "one GPU"},
        "compiled": {"backend": "inductor", "frames_compiled": 3,
                     "times": {"eager pipe(x)": {"ms": 2.0, "speedup": 1.0}}},
        "plan_memory": {"configurations": [
            {"configuration": "1f1b, 2 chunks, never, balance [5, 4]", "error": 0.03,
             "predicted_bytes": 100 * 2**20, "measured_bytes": 103 * 2**20,
             "optimizer_step_bytes": 110 * 2**20}]},
    }  # fmt: skip
    table = gpu_check.markdown(results)
    assert "| step | FAILED | AssertionError: gradients differ |" in table
    assert "| pipe(x) over two GPUs | not measured | one GPU |" in table
    assert "| inductor: eager pipe(x) | 2.00 ms | 1.00x eager |" in table
    assert (
        "| plan memory: 1f1b, 2 chunks, never, balance [5, 4] | predicted 100.00 MiB | "
        "step 103.00 MiB (+3.0%), optimizer.step 110.00 MiB |"
    ) in table
    assert table.startswith("GPU check on H100")
