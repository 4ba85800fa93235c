"""One command for a GPU machine: every CUDA path of the library, checked and timed in minutes.

On a machine with CUDA it:

1. prints the GPU, torch, CUDA and driver versions;
2. runs the device tier (``tests/device``) with ``PIPELINE_TEST_DEVICE=cuda``:
   pipe(x), every ``Pipe.step`` schedule, skips, DeferredBatchNorm, autocast,
   evaluate, compiled layers, split GPT-2, DistributedPipe and DataParallel
   (NCCL with a GPU per rank when there are two GPUs), on cuda:0 shared, a
   partition alone, cuda:0 and the CPU in turn, one partition per GPU;
3. runs the suite's other CUDA-only tests (``CUDA_ONLY``: copies between
   GPUs, DataParallel over NCCL with a rank per GPU);
4. times one training step of an MLP over 4 partitions sharing cuda:0:
   the plain model (whole batch, and its micro-batches one after another),
   ``pipe(x)`` and ``Pipe.step`` (gpipe, 1f1b, zb-h1) with no
   recomputation, so that the ratios are the library's own cost, and
   ``pipe(x)`` with the default checkpointing, after checking that each
   leaves the plain model's gradients; with two GPUs, ``pipe(x)`` over
   them with the copy streams against copies on the compute streams (the
   library has no switch: the driver's stream maker is patched here);
5. compiles each layer with inductor inside the partitions: frames
   compiled, gradients equal to the eager plain model's, time against eager;
6. plans an MLP on two partitions sharing cuda:0 (``pipeline.plan``) and
   steps the configurations it weighed with AdamW: the CUDA allocator's
   peak during a step against the plan's bytes for the device (within
   ``PLAN_MEMORY_TOLERANCE``), and the optimizer step's own peak, which
   the plan leaves out;

then writes every figure to one JSON file and a markdown table to paste into
docs/benchmarks.md. Every candidate runs once per round after a warm-up
round, in turn, synchronised: times are medians, ratios medians of the
rounds' ratios (``pipe_common.py``). About 4 minutes on one H100.

Without CUDA it says so and exits 0. ``--device cpu --quick`` runs steps
4 to 6 on the CPU with small sizes (the pytest steps are left to the CPU
suite; 6 predicts but cannot measure there, with no allocator peak), so
this script's code runs in every CI run.

Run: python examples/benchmarks/gpu_check.py [--out gpu_check.json] [--markdown gpu_check.md]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import re
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.nn.functional as F
from pipe_common import (
    Run,
    call_step,
    explicit_step,
    machine,
    median_ratio,
    median_times,
    plain_step,
    round_times,
)
from torch import Tensor, nn

import pipeline
from pipeline.runtime.stream import current_stream

ROOT = Path(__file__).resolve().parents[2]
TIER_TIMEOUT_S = 300
CUDA_ONLY_TIMEOUT_S = 90
SCHEDULES = ("gpipe", "1f1b", "zb-h1")
RECOMPUTING = "pipe(x), checkpoint='except_last' (the default)"
# float32 gradients summed over the micro-batches in another order than the
# plain model's (and, compiled, by fused kernels) are a few ulps of the
# largest gradient apart, not bit for bit: the bound, as a share of each
# parameter's largest |gradient|. (The device tier compares in float64.)
GRADIENT_TOLERANCE = 1e-5
# The plan's bytes for a device against the allocator's peak during a step:
# the bound of issue 29 (the allocator rounds and caches; the plan counts tensors).
PLAN_MEMORY_TOLERANCE = 0.10
PLANNED_CONFIGURATIONS = 8
PARTS = ("steps", "copy_streams", "compiled", "plan_memory")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--quick", action="store_true", help="small sizes, one round")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", type=Path, default=Path("gpu_check.json"))
    parser.add_argument("--markdown", type=Path, default=Path("gpu_check.md"))
    return parser.parse_args()


# Versions


def versions() -> dict[str, Any]:
    """The machine, torch, CUDA, the driver and each GPU."""
    found = machine()
    found["cuda_runtime"] = torch.version.cuda
    found["driver"] = _driver()
    found["gpus"] = [
        {
            "name": torch.cuda.get_device_name(k),
            "capability": ".".join(map(str, torch.cuda.get_device_capability(k))),
            "memory_gib": round(torch.cuda.get_device_properties(k).total_memory / 2**30, 1),
        }
        for k in range(torch.cuda.device_count())
    ]
    return found


def _driver() -> str:
    try:
        answer = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"unknown ({error})"
    return answer.stdout.strip().splitlines()[0] if answer.returncode == 0 else "unknown"


# The test suite's CUDA tests


def run_pytest(targets: list[str], timeout_s: int, env: dict[str, str]) -> dict[str, Any]:
    """Run pytest on ``targets`` in a subprocess, bounded by ``timeout_s``; its counts and tail.

    Pytest runs in a process group of its own: past the bound, the group is
    killed, the ranks of a process group test included.
    """
    # No log capture: a failing compiled test's report was dynamo's debug
    # records, which pushed its error out of the tail kept here.
    command = [
        *(sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:logging"),
        *("-rfE", *targets),
    ]
    start = time.perf_counter()
    process = subprocess.Popen(
        command,
        cwd=ROOT,
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output = process.communicate()[0][-3000:]
        return {"command": " ".join(targets), "ok": False, "timed_out_s": timeout_s, "tail": output}
    counts = {
        kind: int(number)
        for number, kind in re.findall(r"(\d+) (passed|failed|skipped|errors?)", output)
    }
    return {
        "command": " ".join(targets),
        "ok": process.returncode == 0,
        "seconds": round(time.perf_counter() - start, 1),
        "counts": counts,
        "tail": output[-3000:] if process.returncode else "",
    }


# The suite's tests that run only where CUDA is: copies between GPUs, a CPU
# partition before a GPU one, autocast's dtype, the input moved to the first
# GPU, DataParallel over NCCL (a rank per GPU; one GPU gives one rank).
CUDA_ONLY = [
    "tests/clock/test_device_copies.py",
    "tests/test_migration.py::test_the_input_is_moved_to_the_first_device",
    "tests/data_parallel/test_data_parallel.py::test_nccl_exchanges_on_the_current_gpu",
]


def run_test_steps() -> dict[str, Any]:
    """The device tier on CUDA, and the suite's CUDA-only tests."""
    tier = run_pytest(["tests/device"], TIER_TIMEOUT_S, {"PIPELINE_TEST_DEVICE": "cuda"})
    tier["distributed_pipe_nccl"] = (
        "in the tier (tests/device/test_device_processes.py, nccl-rank)"
        if torch.cuda.device_count() >= 2
        else "not run: NCCL needs a GPU per rank, this machine has one"
    )
    return {"device_tier": tier, "cuda_only_tests": run_pytest(CUDA_ONLY, CUDA_ONLY_TIMEOUT_S, {})}


# Timings


def synchronized(run: Run, device: torch.device) -> Run:
    """``run``, then wait for every GPU: a step's time is its kernels' too."""
    if device.type != "cuda":
        return run

    def timed() -> None:
        run()
        for k in range(torch.cuda.device_count()):
            torch.cuda.synchronize(k)

    return timed


def check_gradients(runs: dict[str, tuple[Run, nn.Module]]) -> None:
    """Each candidate's step leaves the plain model's gradients, to ``GRADIENT_TOLERANCE``."""
    run, plain = runs["plain"]
    run()
    expected = [p.grad.clone() for p in plain.parameters() if p.grad is not None]
    for name, (run, module) in runs.items():
        run()
        found = [p.grad for p in module.parameters() if p.grad is not None]
        assert len(found) == len(expected), f"{name}: {len(found)} of {len(expected)} gradients"
        for k, (grad, reference) in enumerate(zip(found, expected, strict=True)):
            error = (grad - reference).abs().max().item()
            bound = GRADIENT_TOLERANCE * reference.abs().max().item()
            if error > bound:
                raise AssertionError(
                    f"{name}: parameter {k}'s gradient is {error:.3g} off (> {bound:.3g})"
                )


def mlp(width: int, blocks: int) -> nn.Sequential:
    layers: list[nn.Module] = []
    for _ in range(blocks):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers)


def timed_figures(times: dict[str, list[float]], baseline: str) -> dict[str, dict[str, float]]:
    """Median ms of each candidate, and the median ratio of the baseline's time to its."""
    return {
        name: {"ms": round(t * 1e3, 3), "speedup": round(median_ratio(times, baseline, name), 3)}
        for name, t in median_times(times).items()
    }


def time_steps(device: torch.device, quick: bool, rounds: int) -> dict[str, Any]:
    """One training step: the plain model, pipe(x) and Pipe.step over 4 partitions on ``device``."""
    width, blocks, rows, chunks = (64, 4, 32, 4) if quick else (4096, 8, 1024, 8)
    torch.manual_seed(0)
    model = mlp(width, blocks).to(device)
    x = torch.randn(rows, width, device=device)
    # checkpoint="never": the pipes do the plain model's work, so the ratios
    # are the library's own cost; the default (except_last) recomputes every
    # micro-batch's forward but the last, timed apart.
    checkpoints = {name: "never" for name in ("pipe(x)", *SCHEDULES)}
    checkpoints[RECOMPUTING] = "except_last"
    pipes = {
        name: pipeline.Pipe(
            copy.deepcopy(model),
            [2 * blocks // 4] * 4,
            devices=[device] * 4,
            chunks=chunks,
            checkpoint=checkpoint,  # type: ignore[arg-type]
        )
        for name, checkpoint in checkpoints.items()
    }
    runs: dict[str, tuple[Run, nn.Module]] = {"plain": (plain_step(model, x, chunks), model)}
    runs |= {
        name: (call_step(pipe, x) if name not in SCHEDULES else explicit_step(pipe, x, name), pipe)
        for name, pipe in pipes.items()
    }
    check_gradients(runs)
    candidates = {"whole batch": call_step(model, x), "micro-batches": runs["plain"][0]}
    candidates |= {name: run for name, (run, _) in runs.items() if name != "plain"}
    times = round_times({k: synchronized(r, device) for k, r in candidates.items()}, rounds)
    for pipe in pipes.values():
        pipe.close()
    return {
        "model": f"{blocks} x (Linear({width}) + ReLU), {rows} rows, {chunks} micro-batches; "
        f"checkpoint='never' but in {RECOMPUTING!r}",
        "partitions": [str(device)] * 4,
        "gradients": "equal to the plain model's",
        "times": timed_figures(times, "micro-batches"),
    }


@contextlib.contextmanager
def copies_on_compute_streams() -> Iterator[None]:
    """Pipes whose copy streams are made inside take the compute stream instead."""
    with mock.patch("pipeline.clock.driver.new_stream", current_stream):
        yield


def time_copy_streams(devices: list[str], quick: bool, rounds: int) -> dict[str, Any]:
    """pipe(x) over two devices: copies on their own streams against copies on the compute streams.

    On the CPU (the dry run) both are the same: the CPU has no streams.
    """
    width, blocks, rows, chunks = (64, 2, 32, 4) if quick else (4096, 8, 2048, 8)
    torch.manual_seed(0)
    model = mlp(width, blocks)
    x = torch.randn(rows, width, device=devices[0])
    streams = pipeline.Pipe(copy.deepcopy(model), [blocks, blocks], devices=devices, chunks=chunks)
    compute = pipeline.Pipe(copy.deepcopy(model), [blocks, blocks], devices=devices, chunks=chunks)
    with copies_on_compute_streams():
        call_step(compute, x)()  # its copy streams are made now, in the first call
    plain = copy.deepcopy(model).to(devices[0])
    runs = {
        "plain": (plain_step(plain, x, chunks), plain),
        "copy streams": (call_step(streams, x), streams),
        "compute streams": (call_step(compute, x), compute),
    }
    check_gradients(runs)
    device = torch.device(devices[0])
    candidates = {
        name: synchronized(run, device) for name, (run, _) in runs.items() if name != "plain"
    }
    times = round_times(candidates, rounds)
    for pipe in (streams, compute):
        pipe.close()
    return {
        "model": f"{blocks} x Linear({width}) per device, {rows} rows, {chunks} micro-batches",
        "devices": devices,
        "times": timed_figures(times, "compute streams"),
    }


def copy_streams(device: torch.device, quick: bool, rounds: int) -> dict[str, Any]:
    """``time_copy_streams`` over two GPUs, or two CPU partitions in the dry run."""
    if device.type == "cpu":
        return time_copy_streams(["cpu", "cpu"], quick, rounds)
    if torch.cuda.device_count() < 2:
        return {"skipped": "one GPU: partitions sharing it exchange no copies"}
    return time_copy_streams(["cuda:0", "cuda:1"], quick, rounds)


# Inductor inside partitions


class Block(nn.Module):
    """x + gelu(linear(x)) * 0.5: a layer of the user's own, which dynamo compiles."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: Tensor) -> Tensor:
        return x + F.gelu(self.linear(x)) * 0.5


def compiled_frames() -> int:
    from torch._dynamo.utils import counters

    return int(counters["frames"]["ok"])


def check_compiled(device: torch.device, quick: bool, rounds: int) -> dict[str, Any]:
    """Each layer compiled in place inside 2 partitions: frames compiled, the eager gradients."""
    import torch._dynamo

    backend = "inductor" if device.type == "cuda" else "aot_eager"
    width, count, rows = (16, 4, 8) if quick else (2048, 8, 512)
    torch.manual_seed(0)
    model = nn.Sequential(*(Block(width) for _ in range(count))).to(device)
    x = torch.randn(rows, width, device=device)
    eager = pipeline.Pipe(copy.deepcopy(model), [count // 2] * 2, devices=[device] * 2, chunks=4)
    pipe = pipeline.Pipe(copy.deepcopy(model), [count // 2] * 2, devices=[device] * 2, chunks=4)
    for k in range(len(pipe)):
        pipe[k].compile(backend=backend)
    torch._dynamo.reset()
    before = compiled_frames()
    start = time.perf_counter()
    runs = {"plain": (plain_step(model, x, 4), model), "compiled": (call_step(pipe, x), pipe)}
    check_gradients(runs)  # the first call compiles
    compile_s = time.perf_counter() - start
    frames = compiled_frames() - before
    if frames == 0:
        raise AssertionError(f"no frame was compiled with {backend} inside the partitions")
    candidates = {"eager pipe(x)": call_step(eager, x), "compiled pipe(x)": runs["compiled"][0]}
    times = round_times({k: synchronized(r, device) for k, r in candidates.items()}, rounds)
    for each in (eager, pipe):
        each.close()
    return {
        "backend": backend,
        "frames_compiled": frames,
        "first_call_s": round(compile_s, 1),
        "gradients": "equal to the eager plain model's",
        "times": timed_figures(times, "eager pipe(x)"),
    }


# The report


def allocated(device: torch.device) -> int:
    """Bytes the CUDA allocator hands out now (0 off CUDA)."""
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def peak_during(device: torch.device, run: Callable[[], object]) -> int | None:
    """The allocator's peak bytes while ``run()`` runs; None off CUDA, where none is kept."""
    if device.type != "cuda":
        run()
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    run()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device)


def check_plan_memory(device: torch.device, quick: bool) -> dict[str, Any]:
    """The plan's peak per device against the allocator's, over the configurations it weighed."""
    width, blocks, rows, chunks = (16, 4, 16, [2]) if quick else (1024, 8, 512, [2, 4])
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(blocks)]
    model = nn.Sequential(*layers, nn.Linear(width, 8)).to(device)
    x, y = torch.randn(rows, width, device=device), torch.randn(rows, 8, device=device)
    plan = pipeline.plan(
        copy.deepcopy(model), x, y, F.mse_loss, devices=[device] * 2, batch_size=rows,
        memory_limit=2**40, chunks=chunks, optimizer_bytes_per_param=8, repeats=1,
        action_overhead=0.0, contention=1.0,  # times are not this part's: nothing measured for them
    )  # fmt: skip
    rows_out: list[dict[str, Any]] = []
    weighed = [plan.chosen, *(c for c in plan.candidates if c is not plan.chosen)]
    for candidate in weighed[: 2 if quick else PLANNED_CONFIGURATIONS]:
        rows_out.append(_measure_candidate(model, candidate, x, y, device))
    errors = [r["error"] for r in rows_out if r["error"] is not None]
    outside = [
        r for r in rows_out if r["error"] is not None and abs(r["error"]) > PLAN_MEMORY_TOLERANCE
    ]
    if outside:
        raise AssertionError(
            f"the plan's peak is off by more than {PLAN_MEMORY_TOLERANCE:.0%}: {outside}"
        )
    return {
        "model": f"{blocks} x (Linear({width}) + GELU) + Linear({width}, 8), {rows} rows, AdamW",
        "configurations": rows_out,
        "error_range": [min(errors), max(errors)] if errors else None,
    }


def _measure_candidate(
    model: nn.Sequential, candidate: Any, x: Tensor, y: Tensor, device: torch.device
) -> dict[str, Any]:
    """One configuration built anew and stepped twice with AdamW: the second step's peaks,
    above what was allocated before it was built (its gradients and state exist by then)."""
    outside = allocated(device)
    pipe = pipeline.Pipe(
        copy.deepcopy(model), list(candidate.balance), devices=list(candidate.devices),
        chunks=candidate.chunks, checkpoint=candidate.checkpoint,
    )  # fmt: skip
    optimizer = torch.optim.AdamW(pipe.parameters())
    peaks: list[int | None] = []
    for _ in range(2):
        optimizer.zero_grad(set_to_none=False)
        step = peak_during(device, lambda: pipe.step(x, y, F.mse_loss, schedule=candidate.schedule))
        peaks = [step, peak_during(device, optimizer.step)]
    pipe.close()
    predicted = sum(candidate.device_bytes.values())
    step_bytes, optimizer_bytes = (None if p is None else p - outside for p in peaks)
    return {
        "configuration": candidate.describe(),
        "predicted_bytes": predicted,
        "measured_bytes": step_bytes,
        "error": None if step_bytes is None else round(step_bytes / predicted - 1, 4),
        "optimizer_step_bytes": optimizer_bytes,
    }


def guarded(run: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``run()``'s figures, or its error: one failing part leaves the others' figures."""
    try:
        return run()
    except Exception as error:
        traceback.print_exc()
        return {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()}


def time_rows(label: str, part: dict[str, Any], against: str) -> list[str]:
    """The table's rows of one timed part: a row per candidate, or why there is none."""
    if "error" in part:
        return [f"| {label} | FAILED | {part['error'].splitlines()[0]} |"]
    if "skipped" in part:
        return [f"| {label} | not measured | {part['skipped']} |"]
    rows = [
        f"| {label}: {name} | {figures['ms']:.2f} ms | {figures['speedup']:.2f}x {against} |"
        for name, figures in part["times"].items()
    ]
    if "frames_compiled" in part:
        rows.append(f"| {label}: frames compiled | {part['frames_compiled']} | gradients equal |")
    return rows


def markdown(results: dict[str, Any]) -> str:
    """A table to paste into docs/benchmarks.md."""
    info = results["versions"]
    gpus = ", ".join(g["name"] for g in info.get("gpus", [])) or "no GPU (dry run on the CPU)"
    lines = [
        f"GPU check on {gpus}: torch {info['torch']}, CUDA {info.get('cuda_runtime')}, "
        f"driver {info.get('driver')}; {results['total_s']} s in all.",
        "",
        "| check | result | figures |",
        "| --- | --- | --- |",
    ]
    for name, step in results.get("tests", {}).items():
        counts = ", ".join(f"{n} {k}" for k, n in step.get("counts", {}).items())
        verdict = "passed" if step["ok"] else "FAILED"
        lines.append(f"| {name} (`{step['command']}`) | {verdict} | {counts} |")
    lines += time_rows("step", results["steps"], "the micro-batches one after another")
    copies = results["copy_streams"]
    over = " and ".join(copies.get("devices", ["two GPUs"]))
    lines += time_rows(f"pipe(x) over {over}", copies, "copies on the compute streams")
    compiled = results["compiled"]
    lines += time_rows(compiled.get("backend", "compiled"), compiled, "eager")
    lines += plan_memory_rows(results["plan_memory"])
    return "\n".join(lines) + "\n"


def plan_memory_rows(part: dict[str, Any]) -> list[str]:
    """A row per configuration planned: predicted, measured, and the optimizer step's peak."""
    if "error" in part:
        return [f"| plan memory | FAILED | {part['error'].splitlines()[0]} |"]
    rows = []
    for row in part["configurations"]:
        predicted = f"predicted {row['predicted_bytes'] / 2**20:.2f} MiB"
        if row["measured_bytes"] is None:
            figures = "not measured: no allocator peak off CUDA"
        else:
            figures = (
                f"step {row['measured_bytes'] / 2**20:.2f} MiB ({row['error']:+.1%}), "
                f"optimizer.step {row['optimizer_step_bytes'] / 2**20:.2f} MiB"
            )
        rows.append(f"| plan memory: {row['configuration']} | {predicted} | {figures} |")
    return rows


def main() -> int:
    args = parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(
            f"CUDA is not available (torch {torch.__version__}, built for CUDA "
            f"{torch.version.cuda}): nothing to check here; run this on a machine with a GPU"
        )
        return 0
    start = time.perf_counter()
    rounds = 1 if args.quick else args.rounds
    results: dict[str, Any] = {"benchmark": "gpu_check", "versions": versions()}
    print(f"versions: {json.dumps(results['versions'])}", flush=True)
    if device.type == "cuda":
        results["tests"] = run_test_steps()
        for name, step in results["tests"].items():
            print(f"{name}: {'passed' if step['ok'] else 'FAILED'} {step.get('counts')}")
            print(step["tail"], end="", flush=True)
    results["steps"] = guarded(lambda: time_steps(device, args.quick, rounds))
    results["copy_streams"] = guarded(lambda: copy_streams(device, args.quick, rounds))
    results["compiled"] = guarded(lambda: check_compiled(device, args.quick, rounds))
    results["plan_memory"] = guarded(lambda: check_plan_memory(device, args.quick))
    results["total_s"] = round(time.perf_counter() - start, 1)
    args.out.write_text(json.dumps(results, indent=1))
    table = markdown(results)
    args.markdown.write_text(table)
    print(table)
    print(f"wrote {args.out} and {args.markdown}")
    failed = [name for name, step in results.get("tests", {}).items() if not step["ok"]]
    failed += [name for name in PARTS if "error" in results[name]]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
