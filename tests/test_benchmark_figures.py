"""Figures the benchmarks compute, against counts made here by hand (a figure is a result)."""

from __future__ import annotations

import importlib
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import pipeline

BENCHMARKS = Path(__file__).resolve().parents[1] / "examples" / "benchmarks"


def benchmark(name: str) -> object:
    sys.path.insert(0, str(BENCHMARKS))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCHMARKS))


def test_step_efficiencys_activations_leave_the_callers_batch_out() -> None:
    step_efficiency = benchmark("step_efficiency")
    width, rows, m = 16, 4, 4
    model = nn.Sequential(
        *(layer for _ in range(4) for layer in (nn.Linear(width, width), nn.ReLU()))
    )
    x, y = torch.randn(rows * m, width), torch.randn(rows * m, width)
    saved_per_micro_batch = 4 * rows * width * 4  # each ReLU's output, float32
    pipe = pipeline.Pipe(model, [4, 4], devices=["cpu"] * 2, chunks=m, checkpoint="never")
    gpipe = step_efficiency.activation_peak(pipe, x, y, F.mse_loss, "gpipe")  # type: ignore[attr-defined]
    pipe.close()
    assert gpipe == m * saved_per_micro_batch  # every micro-batch through both halves


def test_plan_qualitys_memory_error_of_a_stage_predicted_empty_is_not_exact() -> None:
    relative_error = benchmark("plan_quality")._relative_error  # type: ignore[attr-defined]
    assert relative_error(8192, 0) == math.inf
    assert relative_error(0, 0) == 0.0
    assert relative_error(4096, 4096) == 0.0
