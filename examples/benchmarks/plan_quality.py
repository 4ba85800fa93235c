"""Benchmark: the planner's predictions against the measured grid, for the examples' models.

``pipeline.plan`` profiles a model and predicts every configuration of the
grid (schedule x chunks x checkpoint mode, each with its balance) on two
CPU partitions. ``--model`` picks it:

- ``gpt``: the GPT of ``examples/gpt.py`` (embedding, blocks, tied head;
  character batches of the pydoc text; cross-entropy);
- ``unet``: the U-Net of ``examples/unet.py``, whose skip connections cross
  partitions (noisy blobs, their masks, binary cross-entropy);
- ``gpt2`` and ``llama``: transformers' GPT-2 and Llama (``examples/hf_gpt2.py``,
  ``examples/hf_llama.py``, float64 as there) cut by ``pipeline.split``, the
  attention mask a keyword argument split like the input (needs the ``hf``
  extra).

With ``--processes`` (under ``torchrun --nproc_per_node=N``), the same for
a ``DistributedPipe`` of N processes, one stage each (two with the
interleaved schedule): every process plans (``processes=N``). With
``--shards D`` too, N / D processes per pipeline and each stage sharded
with FSDP2 over D replicas, a ``(dp, pp)`` mesh (``mesh=``), each replica
stepping on the whole batch.

Then every configuration is built as a Pipe (a DistributedPipe) and measured:

- *time*: every configuration in turn, the order turning each round, is
  built, stepped once to warm up, then for three steps (``pipe.step``,
  gradients zeroed first), and closed: one pipe alive at a time, as a
  training script has (with the grid's other 44 open and idle, a
  DistributedPipe's step took a third longer, and a Pipe's idle threads
  slowed the GPT's steps too). The median over the rounds' steps; one
  intra-op thread. For processes, a configuration's time is the longest of
  the processes' medians, and each stage's activations are measured in its
  own process;
- *activations*: each stage's peak saved-for-backward bytes, from one step
  with ``measure_memory=True`` (``pipe.last_step``), against the memory
  model's activation term.

It prints a row per configuration (predicted and measured step time and
their error, the largest stage's predicted and measured activations), then
the plan's choice: its measured time against the best measured time of the
grid, among the configurations whose predicted memory fits
``--memory-limit``. The last line is JSON.

Run: python examples/benchmarks/plan_quality.py [--model gpt|unet|gpt2|llama] [--quick]
     [--memory-limit MIB]
     torchrun --nproc_per_node=2 examples/benchmarks/plan_quality.py --processes [...]
     torchrun --nproc_per_node=4 examples/benchmarks/plan_quality.py --processes --shards 2
"""

from __future__ import annotations

import argparse
import copy
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from pipe_common import print_json, start_single_threaded
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import pipeline
from pipeline.distributed import DistributedPipe, init_process_group_from_env
from pipeline.plan import Candidate, Plan
from pipeline.plan.sharding import shard_stages

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # examples/
import gpt
import unet

MiB = 2**20
# Steps measured per pipe built: one alone read a tenth apart between configurations
# that run the same programs.
STEPS_PER_BUILD = 3
MODELS = ("gpt", "unet", "gpt2", "llama")


@dataclass
class Workload:
    """A model as the Pipe's Sequential, one mini-batch, its loss and keyword arguments."""

    model: nn.Sequential
    x: Any
    y: Any
    loss_fn: Callable[[Any, Any], Tensor]
    kwargs: dict[str, Tensor] | None = None


def grid(quick: bool) -> dict[str, Any]:
    """The configurations measured and how: small and short with ``--quick``."""
    if quick:
        return {"chunks": [2], "schedules": ["gpipe", "1f1b"], "checkpoints": ["never", "always"],
                "rounds": 2, "repeats": 1}  # fmt: skip
    return {
        "chunks": [1, 2, 4, 8],
        "schedules": ["gpipe", "1f1b", "interleaved", "zb-h1"],
        "checkpoints": ["never", "except_last", "always"],
        "rounds": 7,
        "repeats": 5,
    }


def shape(quick: bool) -> argparse.Namespace:
    """The transformers' size: 4 blocks of width 64, context 64, batch 16 (2, 32, 16, 8 quick)."""
    if quick:
        return argparse.Namespace(width=32, heads=2, kv_heads=1, layers=2, context=16, batch=8,
                                  dropout=0.0)  # fmt: skip
    return argparse.Namespace(width=64, heads=4, kv_heads=2, layers=4, context=64, batch=16,
                              dropout=0.0)  # fmt: skip


def gpt_workload(quick: bool) -> Workload:
    size = shape(quick)
    corpus = gpt.Corpus(gpt.load_text(), size.context, seed=0)
    x, y = corpus.batch(size.batch)
    return Workload(gpt.build_model(len(corpus.chars), size), x, y, gpt.language_model_loss)


def unet_workload(quick: bool) -> Workload:
    rows, side = (4, 16) if quick else (16, 32)
    x, y = unet.generated_data(1, rows, side)[0]
    torch.manual_seed(0)
    return Workload(unet.unet(), x, y, F.binary_cross_entropy_with_logits)


def split_workload(quick: bool, build: Callable[[int, argparse.Namespace], nn.Module]) -> Workload:
    """A transformers model cut by ``pipeline.split`` at one micro-batch of the largest chunks."""
    import transformers
    from hf_gpt2 import lm_loss

    transformers.logging.set_verbosity_error()
    size = shape(quick)
    corpus = gpt.Corpus(gpt.load_text(), size.context, seed=0)
    x, y = corpus.batch(size.batch)
    torch.manual_seed(0)
    model = build(len(corpus.chars), size)
    example = x[: size.batch // max(grid(quick)["chunks"])]
    seq = pipeline.split(model, (example,), {"attention_mask": torch.ones_like(example)})
    return Workload(seq, x, y, lm_loss, {"attention_mask": torch.ones_like(x)})


def workload(name: str, quick: bool) -> Workload:
    if name == "gpt":
        return gpt_workload(quick)
    if name == "unet":
        return unet_workload(quick)
    if name == "gpt2":
        from hf_gpt2 import gpt2

        return split_workload(quick, gpt2)
    from hf_llama import llama

    return split_workload(quick, llama)


def built(
    model: Any, c: Candidate, processes: bool, mesh: DeviceMesh | None = None
) -> pipeline.Pipe | DistributedPipe:
    """Candidate ``c`` as a Pipe (or this process's stages of a DistributedPipe, sharded over
    ``mesh``'s "dp" as the plan's are) over a copy of ``model``."""
    checkpoint: Any = c.checkpoint
    if processes:
        group = None if mesh is None else mesh["pp"].get_group()
        pipe = DistributedPipe(copy.deepcopy(model), list(c.balance), chunks=c.chunks,
                               checkpoint=checkpoint, group=group)  # fmt: skip
        if mesh is not None:
            shard_stages(pipe, mesh["dp"])
        return pipe
    devices = [str(d) for d in c.devices]
    return pipeline.Pipe(copy.deepcopy(model), list(c.balance), devices=devices,
                         chunks=c.chunks, checkpoint=checkpoint)  # fmt: skip


def planned(
    w: Workload, o: dict[str, Any], limit: int, processes: bool, mesh: DeviceMesh | None
) -> Plan:
    """The plan of the grid ``o`` for two CPU partitions, or for this group's processes (in
    pipelines on ``mesh``, if given)."""
    where: dict[str, Any] = (
        {"processes": dist.get_world_size()} if processes else {"devices": ["cpu", "cpu"]}
    )
    if mesh is not None:
        where = {"mesh": mesh}
    return pipeline.plan(
        copy.deepcopy(w.model), w.x, w.y, w.loss_fn, **where, kwargs=w.kwargs,
        batch_size=len(w.x), memory_limit=limit, chunks=o["chunks"], schedules=o["schedules"],
        checkpoints=o["checkpoints"], optimizer_bytes_per_param=8, repeats=o["repeats"],
    )  # fmt: skip


def stepper(
    pipe: pipeline.Pipe | DistributedPipe, w: Workload, schedule: str
) -> Callable[[], None]:
    """One training step of ``pipe`` on the workload's batch, gradients zeroed first."""

    def run() -> None:
        pipe.zero_grad(set_to_none=True)
        pipe.step(w.x, w.y, w.loss_fn, kwargs=w.kwargs, schedule=schedule)

    return run


def measured_activations(
    pipe: pipeline.Pipe | DistributedPipe, w: Workload, schedule: str, stages: int
) -> list[int]:
    """Each stage's peak saved bytes in one step measured with ``measure_memory=True``, from
    the process that runs it."""
    pipe.zero_grad(set_to_none=True)
    pipe.step(w.x, w.y, w.loss_fn, kwargs=w.kwargs, schedule=schedule, measure_memory=True)
    report = pipe.last_step
    assert report is not None
    mine = {p.partition: p.peak_activation_bytes or 0 for p in report.partitions}
    if not isinstance(pipe, DistributedPipe):
        return [mine[j] for j in range(stages)]
    everyone: list[dict[int, int]] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(everyone, mine)
    return [next(found[j] for found in everyone if j in found) for j in range(stages)]


def one_alive(
    w: Workload,
    candidates: list[Candidate],
    rounds: int,
    processes: bool,
    mesh: DeviceMesh | None = None,
) -> tuple[list[list[int]], list[float]]:
    """Each configuration's activations and median step time: its pipe (``processes``: a
    DistributedPipe) built afresh each round and closed after ``STEPS_PER_BUILD`` steps
    measured (a warm-up step first), the order turning each round."""
    activations = []
    for c in candidates:
        pipe = built(w.model, c, processes, mesh)
        activations.append(measured_activations(pipe, w, c.schedule, len(c.balance)))
        pipe.close()
    times: list[list[float]] = [[] for _ in candidates]
    for r in range(rounds):
        turn = r % len(candidates)
        for k in [*range(turn, len(candidates)), *range(turn)]:
            pipe = built(w.model, candidates[k], processes, mesh)
            run = stepper(pipe, w, candidates[k].schedule)
            run()
            for _ in range(STEPS_PER_BUILD):
                start = time.perf_counter()
                run()
                times[k].append(time.perf_counter() - start)
            pipe.close()
    return activations, [statistics.median(t) for t in times]


def longest(seconds: list[float], processes: bool) -> list[float]:
    """Each configuration's time: here, or the longest of the processes' (a step of a
    DistributedPipe ends when its last process does)."""
    if not processes:
        return seconds
    times = torch.tensor(seconds, dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return times.tolist()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=MODELS, default="gpt", help="what is planned")
    parser.add_argument("--quick", action="store_true", help="a small model and a small grid")
    parser.add_argument("--memory-limit", type=float, default=1024.0, help="MiB per device")
    parser.add_argument(
        "--processes", action="store_true", help="a DistributedPipe, a stage per process (torchrun)"
    )
    parser.add_argument(
        "--shards", type=int, default=1, help="with --processes: stages sharded D ways (FSDP2)"
    )
    args = parser.parse_args(argv)
    if args.shards != 1 and not args.processes:
        parser.error("--shards shards a DistributedPipe's stages: pass --processes too")
    o = grid(args.quick)
    info, _ = start_single_threaded()
    mesh = None
    if args.processes:
        init_process_group_from_env()
    if args.shards != 1:
        stages = dist.get_world_size() // args.shards
        mesh = init_device_mesh("cpu", (args.shards, stages), mesh_dim_names=("dp", "pp"))
    shown = not args.processes or dist.get_rank() == 0
    w = workload(args.model, args.quick)
    limit = int(args.memory_limit * MiB)
    plan = planned(w, o, limit, args.processes, mesh)
    candidates = per_configuration(plan)
    activations, seconds = one_alive(w, candidates, o["rounds"], args.processes, mesh)
    measured = longest(seconds, args.processes)
    if shown:
        report(args, info, limit, plan, candidates, measured, activations)
    if args.processes:
        dist.destroy_process_group()


def _relative_error(measured: int, predicted: int) -> float:
    """Measured over predicted, less one; a stage predicted to hold nothing that held
    something is infinitely off, not exact."""
    if predicted:
        return measured / predicted - 1
    return 0.0 if measured == 0 else math.inf


def per_configuration(plan: Plan) -> list[Candidate]:
    """One candidate per schedule, chunks and checkpoint mode: the plan's choice where it is
    of that configuration, else the one the plan would take there (the fastest predicted
    that fits, or the least predicted where none fits). The planner weighs several cuts of
    each configuration; measuring all of them would multiply the grid (270 for the GPT)."""
    groups: dict[tuple[str, int, str], list[Candidate]] = {}
    for c in plan.candidates:
        groups.setdefault((c.schedule, c.chunks, c.checkpoint), []).append(c)
    return [
        plan.chosen if plan.chosen in group else min(group, key=lambda c: (not c.fits, c.seconds))
        for group in groups.values()
    ]


def report(
    args: argparse.Namespace,
    info: dict[str, Any],
    limit: int,
    plan: Plan,
    candidates: list[Candidate],
    measured: list[float],
    activations: list[list[int]],
) -> None:
    """The table of predicted against measured, the plan's choice against the best, JSON."""
    print(plan, flush=True)
    rows = []
    print("| configuration | predicted ms | measured ms | time error | predicted activations "
          "(largest stage, KiB) | measured | memory error |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for c, seconds, saved in zip(candidates, measured, activations, strict=True):
        predicted = [s.activations for s in c.memory]
        worst = max(range(len(saved)), key=lambda j: abs(saved[j] - predicted[j]))
        memory_error = _relative_error(saved[worst], predicted[worst])
        time_error = seconds / c.seconds - 1
        print(f"| {c.describe()} | {c.seconds * 1e3:.2f} | {seconds * 1e3:.2f} | "
              f"{time_error:+.0%} | {max(predicted) / 1024:.1f} | {max(saved) / 1024:.1f} | "
              f"{memory_error:+.1%} |")  # fmt: skip
        rows.append({"configuration": c.describe(), "predicted_ms": c.seconds * 1e3,
                     "measured_ms": seconds * 1e3, "time_error": time_error,
                     "predicted_activations": predicted, "measured_activations": saved,
                     "memory_error": memory_error, "fits": c.fits})  # fmt: skip
    fitting = [k for k, c in enumerate(candidates) if c.fits]
    best = min(fitting, key=lambda k: measured[k])
    chosen = candidates.index(plan.chosen)
    print(f"chosen: {plan.chosen.describe()}, measured {measured[chosen] * 1e3:.2f} ms; best "
          f"measured: {candidates[best].describe()}, {measured[best] * 1e3:.2f} ms; chosen / "
          f"best {measured[chosen] / measured[best]:.2f}")  # fmt: skip
    errors = [abs(r["time_error"]) for r in rows]
    memory = [abs(r["memory_error"]) for r in rows]
    print(f"time error: median {statistics.median(errors):.0%}, largest {max(errors):.0%}; "
          f"activation error: largest {max(memory):.1%} "
          f"({sum(m == 0 for m in memory)} of {len(memory)} exact)")  # fmt: skip
    print_json({"benchmark": "plan_quality", "model": args.model, "quick": args.quick,
                "processes": plan.processes.count if plan.processes else None,
                "shards": args.shards,
                "machine": info, "memory_limit": limit, "chosen": plan.chosen.describe(),
                "chosen_over_best_measured": measured[chosen] / measured[best],
                "best_measured": candidates[best].describe(), "rows": rows})  # fmt: skip


if __name__ == "__main__":
    main()
