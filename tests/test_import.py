"""``import pipeline`` loads none of torch's heavy optional parts, so it stays close to torch's.

torch.distributed.checkpoint, FSDP and DTensor each take seconds to import
(sympy among them); the library reaches them only when a program uses them
(``pipeline/runtime/lazy.py``, the checkpoint functions on first use).
"""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = [
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torch._dynamo",
    "torch._inductor",
    "sympy",
    "transformers",
]


def modules_after(code: str) -> list[str]:
    probe = f"import sys, json\n{code}\nprint(json.dumps(sorted(sys.modules)))"
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, check=True
    )
    loaded: list[str] = json.loads(done.stdout.splitlines()[-1])
    return loaded


def test_import_pipeline_loads_no_heavy_part_of_torch() -> None:
    loaded = set(modules_after("import pipeline, pipeline.distributed"))
    assert "pipeline.distributed.pipe" in loaded
    assert [m for m in HEAVY if m in loaded] == []


def test_the_checkpoint_functions_load_on_first_use() -> None:
    code = "from pipeline.distributed import load_checkpoint, save_checkpoint"
    loaded = set(modules_after(code))
    assert {"pipeline.distributed.checkpoints", "torch.distributed.checkpoint"} <= loaded
