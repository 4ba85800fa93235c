"""Benchmark: Pipe.step's schedules against the plain model and the pipe(x) path, 2 CPU partitions.

Two models, each split over two CPU partitions with one intra-op thread
(torch's setting is process-wide), so the partitions can overlap on two
cores: 8 blocks of Linear(1024, 1024) + ReLU (``--rows`` rows per
micro-batch), and the GPT of ``examples/gpt.py`` (``--sequences`` sequences of
64 characters per micro-batch). For each model, at ``--chunks`` micro-batches,
one training step (forward and backward) is timed as:

- the plain model on the whole batch, and on the same micro-batches one after
  another (the baseline of the speedups: it isolates what pipelining adds);
- ``pipe(x)`` then ``loss.backward()`` (the autograd engine runs the CPU
  backward on one thread);
- ``pipe.step`` with each schedule: ``gpipe``, ``1f1b``, ``interleaved`` (4
  partitions, 2 per worker) and ``zb-h1``;

with checkpoint ``never`` and ``except_last``. For ``never`` it also measures
the peak bytes of activations that autograd holds (saved tensors, counted by
storage, parameters excluded) over both partitions, 1F1B's against GPipe's.
GPipe's bound for the speedup is 2m/(m+1). The last line is JSON.

Every candidate runs once per round, in turn, after a warm-up round: times
are medians over the rounds, and each ratio is the median of the rounds'
ratios.

Run: python examples/benchmarks/step_efficiency.py [--chunks 8] [--rounds 5]
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from pipe_common import (
    Run,
    median_ratio,
    median_times,
    print_json,
    round_times,
    start_single_threaded,
)
from torch import Tensor, nn

import pipeline
from pipeline.schedules import Interleaved1F1B
from pipeline.step.activations import ActivationMeter

LossFn = Callable[[Any, Tensor], Tensor]
SCHEDULES: dict[str, Callable[[], Any]] = {
    "gpipe": lambda: "gpipe",
    "1f1b": lambda: "1f1b",
    "interleaved": lambda: Interleaved1F1B(virtual=2),
    "zb-h1": lambda: "zb-h1",
}


def mlp() -> nn.Sequential:
    layers: list[nn.Module] = []
    for _ in range(8):
        layers += [nn.Linear(1024, 1024), nn.ReLU()]
    return nn.Sequential(*layers)


def load_gpt() -> Any:
    path = Path(__file__).resolve().parents[1] / "gpt.py"
    spec = importlib.util.spec_from_file_location("gpt", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpt"] = module
    spec.loader.exec_module(module)
    return module


def micro_batches(model: nn.Module, x: Tensor, y: Tensor, loss_fn: LossFn, m: int) -> Run:
    def run() -> None:
        for xs, ys in zip(x.chunk(m), y.chunk(m), strict=True):
            (loss_fn(model(xs), ys) * len(xs) / len(x)).backward()

    return run


def whole_batch(model: nn.Module, x: Tensor, y: Tensor, loss_fn: LossFn) -> Run:
    return lambda: loss_fn(model(x), y).backward()


def pipe_call(pipe: pipeline.Pipe, x: Tensor, y: Tensor, loss_fn: LossFn) -> Run:
    return lambda: loss_fn(pipe(x), y).backward()


def pipe_step(pipe: pipeline.Pipe, x: Tensor, y: Tensor, loss_fn: LossFn, schedule: Any) -> Run:
    return lambda: pipe.step(x, y, loss_fn, schedule=schedule)


def halves(layers: int, parts: int) -> list[int]:
    return [layers // parts + (j < layers % parts) for j in range(parts)]


def measure(
    name: str, model: nn.Module, x: Tensor, y: Tensor, loss_fn: LossFn, m: int, rounds: int
) -> dict[str, Any]:
    n = len(model)
    result: dict[str, Any] = {"model": name}
    for checkpoint in ("never", "except_last"):
        pipes = {
            schedule: pipeline.Pipe(
                copy.deepcopy(model),
                halves(n, 4 if schedule == "interleaved" else 2),
                devices=["cpu"] * (4 if schedule == "interleaved" else 2),
                chunks=m,
                checkpoint=checkpoint,  # type: ignore[arg-type]
            )
            for schedule in ["call", *SCHEDULES]
        }
        runs: dict[str, Run] = {
            "whole batch": whole_batch(model, x, y, loss_fn),
            "micro-batches": micro_batches(model, x, y, loss_fn, m),
            "pipe(x)": pipe_call(pipes["call"], x, y, loss_fn),
        }
        runs |= {s: pipe_step(pipes[s], x, y, loss_fn, SCHEDULES[s]()) for s in SCHEDULES}
        times = round_times(runs, rounds)
        result[checkpoint] = {
            label: {
                "ms": t * 1e3,
                "vs_micro": median_ratio(times, "micro-batches", label),
                "vs_whole": median_ratio(times, "whole batch", label),
            }
            for label, t in median_times(times).items()
        }
        if checkpoint == "never":
            result["activation_peak_bytes"] = {
                s: activation_peak(pipes[s], x, y, loss_fn, SCHEDULES[s]())
                for s in ("gpipe", "1f1b")
            }
        for pipe in pipes.values():
            pipe.close()
    return result


def activation_peak(
    pipe: pipeline.Pipe, x: Tensor, y: Tensor, loss_fn: LossFn, schedule: Any
) -> int:
    """Peak bytes saved for backward over both partitions together, in the second of two steps.

    One meter for the whole pipe (a step's ``measure_memory`` counts each
    stage on its own). Saved-tensor hooks are thread-local, so each layer's
    forward enters the meter's hooks on whichever worker runs it. The
    caller's batch is not counted, as ``last_step`` does not count it: every
    micro-batch is a view of it, held by the caller whatever the schedule.
    """
    meter = ActivationMeter([*pipe.parameters(), x, y])
    entered: dict[nn.Module, list[AbstractContextManager[None]]] = {}

    def enter(layer: nn.Module, args: Any) -> None:
        hooks = meter.hooks()
        hooks.__enter__()
        entered.setdefault(layer, []).append(hooks)

    def leave(layer: nn.Module, args: Any, output: Any) -> None:
        entered[layer].pop().__exit__(None, None, None)

    handles = [
        handle
        for layer in pipe.children()
        for handle in (
            layer.register_forward_pre_hook(enter),
            layer.register_forward_hook(leave, always_call=True),
        )
    ]
    pipe.step(x, y, loss_fn, schedule=schedule)
    meter.peak = meter.current
    pipe.step(x, y, loss_fn, schedule=schedule)
    for handle in handles:
        handle.remove()
    return meter.peak


@contextmanager
def section(title: str) -> Iterator[None]:
    print(title, flush=True)
    yield


def print_result(result: dict[str, Any], m: int) -> None:
    print(f"\n{result['model']}: m = {m}, bound 2m/(m+1) = {2 * m / (m + 1):.2f}")
    print("                 |  checkpoint never     |  checkpoint except_last")
    print("                 |   ms   /micro /whole  |   ms   /micro /whole")
    for label in result["never"]:
        never, last = result["never"][label], result["except_last"][label]
        print(
            f"{label:16s} | {never['ms']:6.1f} {never['vs_micro']:5.2f}x {never['vs_whole']:5.2f}x "
            f"| {last['ms']:6.1f} {last['vs_micro']:5.2f}x {last['vs_whole']:5.2f}x"
        )
    peaks = result["activation_peak_bytes"]
    ratio = peaks["1f1b"] / peaks["gpipe"]
    print(
        f"activations held at the peak (never): GPipe {peaks['gpipe'] / 2**20:.1f} MiB, "
        f"1F1B {peaks['1f1b'] / 2**20:.1f} MiB, ratio {ratio:.2f} (target <= (n+1)/m = "
        f"{3 / m:.2f})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--rows", type=int, default=256, help="MLP rows per micro-batch")
    parser.add_argument("--sequences", type=int, default=16, help="GPT sequences per micro-batch")
    parser.add_argument(
        "--rounds", type=int, default=5, help="timed rounds after a warm-up; medians count"
    )
    args = parser.parse_args()
    info, _ = start_single_threaded()
    m = args.chunks
    results = []
    x = torch.randn(args.rows * m, 1024)
    results.append(
        measure("8 x Linear(1024)+ReLU", mlp(), x, torch.randn_like(x), F.mse_loss, m, args.rounds)
    )
    gpt = load_gpt()
    gpt_args = gpt.parse_args(["--layers", "8", "--width", "128"])
    corpus = gpt.Corpus(gpt.load_text(), gpt_args.context, seed=0)
    tokens, targets = corpus.batch(args.sequences * m)
    model = gpt.build_model(len(corpus.chars), gpt_args)
    results.append(
        measure(
            "GPT (8 blocks of 128)", model, tokens, targets, gpt.language_model_loss, m, args.rounds
        )
    )
    for result in results:
        print_result(result, m)
    print_json({"benchmark": "step_efficiency", "machine": info, "chunks": m, "results": results})


if __name__ == "__main__":
    main()
