"""Benchmark: the planner's predictions against the measured grid, for the GPT of examples/gpt.py.

``pipeline.plan`` profiles the GPT (``gpt.build_model``: embedding, blocks,
tied head; character batches of the pydoc text; cross-entropy) and predicts
every configuration of the grid (schedule x chunks x checkpoint mode, each
with its balance) on two CPU partitions. Then every configuration is built
as a Pipe and measured:

- *time*: one ``pipe.step`` (gradients zeroed), every configuration once
  per round, in turn (``pipe_common.round_times``), the median over the
  rounds; one intra-op thread;
- *activations*: each stage's peak saved-for-backward bytes, from one step
  with ``measure_memory=True`` (``pipe.last_step``), against the memory
  model's activation term.

It prints a row per configuration (predicted and measured step time and
their error, the largest stage's predicted and measured activations), then
the plan's choice: its measured time against the best measured time of the
grid, among the configurations whose predicted memory fits
``--memory-limit``. The last line is JSON.

Run: python examples/benchmarks/plan_quality.py [--quick] [--memory-limit MIB]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
from pathlib import Path
from typing import Any

from pipe_common import print_json, round_times, start_single_threaded

import pipeline
from pipeline.plan import Candidate

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # examples/: gpt
import gpt

MiB = 2**20


def options(quick: bool) -> dict[str, Any]:
    """The model's size and the grid: small and short with ``--quick``."""
    if quick:
        model = {"width": 32, "heads": 2, "layers": 2, "context": 16, "batch": 8}
        grid = {"chunks": [2], "schedules": ["gpipe", "1f1b"], "checkpoints": ["never", "always"]}
        return {**model, **grid, "rounds": 2, "repeats": 1}
    model = {"width": 64, "heads": 4, "layers": 4, "context": 64, "batch": 16}
    grid = {
        "chunks": [1, 2, 4, 8],
        "schedules": ["gpipe", "1f1b", "interleaved", "zb-h1"],
        "checkpoints": ["never", "except_last", "always"],
    }
    return {**model, **grid, "rounds": 7, "repeats": 5}


def built(model: Any, c: Candidate) -> pipeline.Pipe:
    """Candidate ``c`` as a Pipe over a copy of ``model``."""
    devices = [str(d) for d in c.devices]
    checkpoint: Any = c.checkpoint
    return pipeline.Pipe(copy.deepcopy(model), list(c.balance), devices=devices,
                         chunks=c.chunks, checkpoint=checkpoint)  # fmt: skip


def measured_activations(pipe: pipeline.Pipe, x: Any, y: Any, schedule: str) -> list[int]:
    """Each stage's peak saved bytes in one step measured with ``measure_memory=True``."""
    pipe.zero_grad(set_to_none=True)
    pipe.step(x, y, gpt.language_model_loss, schedule=schedule, measure_memory=True)
    report = pipe.last_step
    assert report is not None
    return [p.peak_activation_bytes or 0 for p in report.partitions]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small GPT and a small grid")
    parser.add_argument("--memory-limit", type=float, default=1024.0, help="MiB per device")
    args = parser.parse_args(argv)
    o = options(args.quick)
    info, _ = start_single_threaded()
    corpus = gpt.Corpus(gpt.load_text(), o["context"], seed=0)
    shape = argparse.Namespace(width=o["width"], heads=o["heads"], layers=o["layers"],
                               context=o["context"], dropout=0.0)  # fmt: skip
    model = gpt.build_model(len(corpus.chars), shape)
    x, y = corpus.batch(o["batch"])
    limit = int(args.memory_limit * MiB)
    plan = pipeline.plan(
        copy.deepcopy(model), x, y, gpt.language_model_loss, devices=["cpu", "cpu"],
        batch_size=o["batch"], memory_limit=limit, chunks=o["chunks"], schedules=o["schedules"],
        checkpoints=o["checkpoints"], optimizer_bytes_per_param=8, repeats=o["repeats"],
    )  # fmt: skip
    print(plan, flush=True)
    grid: list[Candidate] = plan.candidates
    pipes = [built(model, c) for c in grid]
    pairs = list(zip(pipes, grid, strict=True))
    activations = [measured_activations(p, x, y, c.schedule) for p, c in pairs]

    def stepper(pipe: pipeline.Pipe, schedule: str) -> Any:
        def run() -> None:
            pipe.zero_grad(set_to_none=True)
            pipe.step(x, y, gpt.language_model_loss, schedule=schedule)

        return run

    runs = {str(k): stepper(p, c.schedule) for k, (p, c) in enumerate(pairs)}
    times = round_times(runs, o["rounds"])
    measured = [statistics.median(times[str(k)]) for k in range(len(grid))]
    rows = []
    print("| configuration | predicted ms | measured ms | time error | predicted activations "
          "(largest stage, KiB) | measured | memory error |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for c, seconds, saved in zip(grid, measured, activations, strict=True):
        predicted = [s.activations for s in c.memory]
        worst = max(range(len(saved)), key=lambda j: abs(saved[j] - predicted[j]))
        memory_error = saved[worst] / predicted[worst] - 1 if predicted[worst] else 0.0
        time_error = seconds / c.seconds - 1
        print(f"| {c.describe()} | {c.seconds * 1e3:.2f} | {seconds * 1e3:.2f} | "
              f"{time_error:+.0%} | {max(predicted) / 1024:.1f} | {max(saved) / 1024:.1f} | "
              f"{memory_error:+.1%} |")  # fmt: skip
        rows.append({"configuration": c.describe(), "predicted_ms": c.seconds * 1e3,
                     "measured_ms": seconds * 1e3, "time_error": time_error,
                     "predicted_activations": predicted, "measured_activations": saved,
                     "memory_error": memory_error, "fits": c.fits})  # fmt: skip
    fitting = [k for k, c in enumerate(grid) if c.fits]
    best = min(fitting, key=lambda k: measured[k])
    chosen = grid.index(plan.chosen)
    print(f"chosen: {plan.chosen.describe()}, measured {measured[chosen] * 1e3:.2f} ms; best "
          f"measured: {grid[best].describe()}, {measured[best] * 1e3:.2f} ms; chosen / best "
          f"{measured[chosen] / measured[best]:.2f}")  # fmt: skip
    errors = [abs(r["time_error"]) for r in rows]
    memory = [abs(r["memory_error"]) for r in rows]
    print(f"time error: median {statistics.median(errors):.0%}, largest {max(errors):.0%}; "
          f"activation error: largest {max(memory):.1%} "
          f"({sum(m == 0 for m in memory)} of {len(memory)} exact)")  # fmt: skip
    for pipe in pipes:
        pipe.close()
    print_json({"benchmark": "plan_quality", "quick": args.quick, "machine": info,
                "memory_limit": limit, "chosen": plan.chosen.describe(),
                "chosen_over_best_measured": measured[chosen] / measured[best],
                "best_measured": grid[best].describe(), "rows": rows})  # fmt: skip


if __name__ == "__main__":
    main()
