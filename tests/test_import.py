"""``import pipeline`` loads none of torch's heavy optional parts, so it stays close to torch's.

torch.distributed.checkpoint, FSDP and DTensor each take seconds to import
(sympy among them); the library reaches them only when a program uses them
(``pipeline/runtime/lazy.py``, the checkpoint functions on first use).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = [
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torch._dynamo",
    "torch._inductor",
    "sympy",
    "transformers",
]


def modules_after(*steps: str) -> list[set[str]]:
    """The modules loaded after each step of code, run in turn in one fresh interpreter."""
    show = "print(json.dumps(sorted(sys.modules)))"
    probe = "\n".join(["import sys, json", *(f"{step}\n{show}" for step in steps)])
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, check=True
    )
    return [set(json.loads(line)) for line in done.stdout.splitlines()[-len(steps) :]]


@pytest.fixture(scope="module")
def loaded() -> list[set[str]]:
    # One interpreter for both tests: each start imports torch again (seconds).
    return modules_after(
        "import pipeline, pipeline.distributed",
        "from pipeline.distributed import load_checkpoint, save_checkpoint",
    )


def test_import_pipeline_loads_no_heavy_part_of_torch(loaded: list[set[str]]) -> None:
    assert "pipeline.distributed.pipe" in loaded[0]
    assert [m for m in HEAVY if m in loaded[0]] == []


def test_the_checkpoint_functions_load_on_first_use(loaded: list[set[str]]) -> None:
    assert {"pipeline.distributed.checkpoints", "torch.distributed.checkpoint"} <= loaded[1]
