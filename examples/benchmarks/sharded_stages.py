"""Benchmark: FSDP2-sharded pipeline stages, DistributedPipe beside torch.distributed.pipelining.

Four gloo processes (``torchrun --nproc_per_node=4``), one intra-op thread
each, on one ``(dp=2, pp=2)`` DeviceMesh: ranks 0, 1 and 2, 3 are the two
pipelines, ranks 0, 2 and 1, 3 shard the same stage. The model is
``--blocks`` blocks of [Linear(W, W), GELU] (W = ``--width``), cut in two
stages of equal blocks; the batch of ``--batch`` rows is split between the
two replicas, each replica's half in m micro-batches; MSE loss, AdamW. Both
libraries shard a stage alike, with torch's own ``fully_shard`` on every
block and then on the stage (its root), FSDP's default settings:

- ours: ``DistributedPipe`` on ``mesh["pp"]``, sharded as
  docs/distributed_pipe.md says, ``step`` with ``gpipe`` and ``1f1b``;
- torch's: ``PipelineStage`` of the same blocks with ``ScheduleGPipe`` and
  ``Schedule1F1B`` (which run FSDP's post-backward in their REDUCE_GRAD);
- torch's again with its blocks sharded with ``reshard_after_forward=False``
  ("torch kept"), torchtitan's choice under pp: gathered once per step, as
  ours keeps a unit whose resharding was left to FSDP;
- ours again with its blocks sharded with ``reshard_after_forward=True``
  ("ours resharded"): gathered for every forward, as torch's default, so
  that each of torch's two has a partner with its collectives and memory.

For each m of ``--chunks``: first a gate, every candidate's full gradients
against the plain model's in float64; then, in float32, one counted step per
candidate (the calls of torch.distributed's collectives and of a process
group's send / recv, the peak of bytes saved for backward, the parameter,
gradient and AdamW bytes this rank holds); then timed training steps
(zero_grad, step, optimizer step), every candidate once per round in turn
after a warm-up round, and the ratio ours / torch's throughput as the median
of the rounds' ratios. The last line printed is JSON.

Run: torchrun --nproc_per_node=4 examples/benchmarks/sharded_stages.py [--chunks 4 8]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from pipe_common import machine, median_ratio, median_times, print_json, round_times
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.tensor import DTensor

from pipeline.distributed import DistributedPipe, init_process_group_from_env
from pipeline.step.activations import ActivationMeter

# (our schedule, torch's schedule class): the pairs compared.
PAIRS = (("gpipe", ScheduleGPipe), ("1f1b", Schedule1F1B))
# torch.distributed's collectives, counted where callers reach them (dist.<name>).
COLLECTIVES = (
    "all_gather_single",
    "all_gather_into_tensor",
    "all_gather",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "all_reduce",
    "broadcast",
    "barrier",
)
# Point-to-point calls, counted on the process group, which both dist.isend /
# dist.irecv and this library's wires call.
P2P = ("send", "recv")


@dataclass
class Shape:
    blocks: int
    width: int
    batch: int


@dataclass
class Candidate:
    """One library's sharded stage on this process, its optimizer and its training step."""

    stage: nn.Module  # this process's stage, whole-model parameter names
    optimizer: torch.optim.Optimizer
    step: Callable[[], None]  # zero_grad and the pipeline's step, no optimizer step
    close: Callable[[], None]


def blocks(shape: Shape, dtype: torch.dtype) -> nn.Sequential:
    torch.manual_seed(0)
    layers = [
        nn.Sequential(nn.Linear(shape.width, shape.width), nn.GELU()) for _ in range(shape.blocks)
    ]
    return nn.Sequential(*layers).to(dtype)


def shard(stage: nn.Module, mesh: DeviceMesh, reshard: bool | None = None) -> None:
    """fully_shard every block of ``stage`` (``reshard``: after forward), then the stage."""
    for block in stage.children():
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(stage, mesh=mesh)


def batch(shape: Shape, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """The whole batch, the same on every process."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(shape.batch, shape.width, generator=gen, dtype=dtype)
    return x, torch.randn(shape.batch, shape.width, generator=gen, dtype=dtype)


def half(tensor: Tensor, mesh: DeviceMesh) -> Tensor:
    """This replica's half of the batch."""
    return tensor.chunk(mesh["dp"].size())[mesh["dp"].get_local_rank()]


def ours(
    model: nn.Sequential,
    mesh: DeviceMesh,
    m: int,
    schedule: str,
    x: Tensor,
    y: Tensor,
    reshard: bool | None = None,
) -> Candidate:
    pipe = DistributedPipe(
        model, [len(model) // 2] * 2, chunks=m, checkpoint="never", group=mesh["pp"].get_group()
    )
    for s in pipe.local_stages:
        shard(pipe.partitions[s], mesh["dp"], reshard)
    optimizer = torch.optim.AdamW(pipe.parameters())

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        pipe.step(x, y, F.mse_loss, schedule=schedule)

    return Candidate(pipe, optimizer, step, pipe.close)


def torchs(
    model: nn.Sequential,
    mesh: DeviceMesh,
    m: int,
    kind: type[ScheduleGPipe | Schedule1F1B],
    x: Tensor,
    y: Tensor,
    reshard: bool | None = None,
) -> Candidate:
    index, stages = mesh["pp"].get_local_rank(), mesh["pp"].size()
    size = len(model) // stages
    part = model[size * index : size * (index + 1)]  # keeps the whole model's names
    shard(part, mesh["dp"], reshard)
    stage = PipelineStage(part, index, stages, torch.device("cpu"), group=mesh["pp"].get_group())
    schedule = kind(stage, n_microbatches=m, loss_fn=F.mse_loss)
    optimizer = torch.optim.AdamW(part.parameters())

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        if index == 0:
            schedule.step(x)
        else:
            schedule.step(target=y, losses=[])

    return Candidate(part, optimizer, step, lambda: None)


def candidates(shape: Shape, mesh: DeviceMesh, m: int, dtype: torch.dtype) -> dict[str, Candidate]:
    x, y = (half(t, mesh) for t in batch(shape, dtype))
    model = blocks(shape, dtype)
    built = {}
    for schedule, kind in PAIRS:
        built[f"ours {schedule}"] = ours(copy.deepcopy(model), mesh, m, schedule, x, y)
        built[f"ours resharded {schedule}"] = ours(
            copy.deepcopy(model), mesh, m, schedule, x, y, True
        )
        built[f"torch {schedule}"] = torchs(copy.deepcopy(model), mesh, m, kind, x, y)
        built[f"torch kept {schedule}"] = torchs(copy.deepcopy(model), mesh, m, kind, x, y, False)
    return built


def full(tensor: Tensor) -> Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def local(tensor: Tensor) -> Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def gate(shape: Shape, mesh: DeviceMesh, m: int) -> dict[str, float]:
    """Each candidate's largest difference of a full gradient from the plain model's, in float64.

    Raises when one differs by more than float64's rounding.
    """
    plain = blocks(shape, torch.float64)
    x, y = batch(shape, torch.float64)
    F.mse_loss(plain(x), y).backward()
    reference = dict(plain.named_parameters())
    differences = {}
    for name, candidate in candidates(shape, mesh, m, torch.float64).items():
        candidate.step()
        worst = 0.0
        for pname, param in candidate.stage.named_parameters():
            assert param.grad is not None, f"{name}: {pname} has no gradient"
            expected = reference[pname].grad
            assert expected is not None
            torch.testing.assert_close(full(param.grad), expected, msg=f"{name}: {pname}")
            worst = max(worst, float((full(param.grad) - expected).abs().max()))
        differences[name] = worst
        candidate.close()
    return differences


class SavedBytes(ActivationMeter):
    """An ActivationMeter that leaves out the stage's parameters as they are at each save.

    FSDP gathers a block's parameters into new storages and frees them when it
    reshards, so they cannot be listed once up front; a Linear saves a view of
    its gathered weight, which is parameter memory, not activation memory.
    ``with_gathered`` is the peak, over the saves, of the saved bytes plus
    the bytes of the parameters gathered at that moment (those that are not
    FSDP's shards): what a unit kept gathered through the forwards costs.
    """

    def __init__(self, stage: nn.Module, batch: tuple[Tensor, ...]) -> None:
        super().__init__(batch)
        self._stage = stage
        self._inputs = set(self._excluded)
        self.with_gathered = 0

    def _pack(self, tensor: Tensor) -> Any:
        params = list(self._stage.parameters())
        self._excluded = self._inputs | {local(p).untyped_storage().data_ptr() for p in params}
        saved = super()._pack(tensor)
        gathered = {
            p.untyped_storage().data_ptr(): p.untyped_storage().nbytes()
            for p in params
            if not isinstance(p, DTensor)
        }
        self.with_gathered = max(self.with_gathered, self.current + sum(gathered.values()))
        return saved


@contextlib.contextmanager
def counting(count: dict[str, int]) -> Iterator[None]:
    """Count, into ``count``, the calls of ``COLLECTIVES`` and ``P2P`` in the block."""
    originals: list[tuple[Any, str, Any]] = [(dist, n, getattr(dist, n)) for n in COLLECTIVES]
    # The class's own entries: getattr would give back functions that no longer bind.
    originals += [(dist.ProcessGroup, n, vars(dist.ProcessGroup)[n]) for n in P2P]

    def counted(name: str, original: Any) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            count[name] = count.get(name, 0) + 1
            return original(*args, **kwargs)

        return call

    for owner, name, original in originals:
        setattr(owner, name, counted(name, original))
    try:
        yield
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)


def state_bytes(candidate: Candidate) -> int:
    """Bytes of this rank's parameters, gradients and optimizer state (its shards)."""
    tensors = [local(p) for p in candidate.stage.parameters()]
    tensors += [local(p.grad) for p in candidate.stage.parameters() if p.grad is not None]
    for state in candidate.optimizer.state.values():
        tensors += [local(t) for t in state.values() if isinstance(t, Tensor) and t.dim() > 0]
    return sum(t.numel() * t.element_size() for t in tensors)


def counted_step(candidate: Candidate, x: Tensor, y: Tensor) -> dict[str, Any]:
    """A training step's collectives, peak saved bytes and state bytes on this rank.

    The step counted is the second: the first one's are once per pipeline
    (torch's stage infers its shapes with a forward and a backward).
    """
    candidate.step()
    candidate.optimizer.step()
    count: dict[str, int] = {}
    meter = SavedBytes(candidate.stage, (x, y))
    with counting(count), meter.hooks():
        candidate.step()
    candidate.optimizer.step()
    assert meter.peak > 0, "no tensor saved for backward was seen on this thread"
    return {
        "collectives": count,
        "saved_peak": meter.peak,
        "saved_and_gathered_peak": meter.with_gathered,
        "state": state_bytes(candidate),
    }


def per_rank(value: Any) -> list[Any]:
    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def measure(shape: Shape, mesh: DeviceMesh, m: int, rounds: int) -> dict[str, Any]:
    """Gate, count and time every candidate at ``m`` micro-batches per replica."""
    differences = gate(shape, mesh, m)
    built = candidates(shape, mesh, m, torch.float32)
    x, y = (half(t, mesh) for t in batch(shape, torch.float32))
    counts = {name: per_rank(counted_step(c, x, y)) for name, c in built.items()}

    def timed(candidate: Candidate) -> Callable[[], None]:
        def run() -> None:
            candidate.step()
            candidate.optimizer.step()
            dist.barrier()  # a step takes as long as its slowest process

        return run

    times = round_times({name: timed(c) for name, c in built.items()}, rounds)
    for candidate in built.values():
        candidate.close()
    stage_numel = sum(
        p.numel() for p in blocks(shape, torch.float32)[: shape.blocks // 2].parameters()
    )
    result = {
        "chunks": m,
        "ms": {name: round(t * 1e3, 2) for name, t in median_times(times).items()},
        "ours_over_torch_throughput": {
            f"{torch_} {schedule}": round(
                median_ratio(times, f"{torch_} {schedule}", f"ours {schedule}"), 3
            )
            for schedule, _ in PAIRS
            for torch_ in ("torch", "torch kept")
        },
        # Alike sharded: both gather a block for every forward.
        "ours_resharded_over_torch_throughput": {
            f"torch {schedule}": round(
                median_ratio(times, f"torch {schedule}", f"ours resharded {schedule}"), 3
            )
            for schedule, _ in PAIRS
        },
        "max_grad_difference_from_plain": differences,
        "collectives_per_step_rank0": {n: c[0]["collectives"] for n, c in counts.items()},
        "saved_peak_bytes_per_rank": {n: [r["saved_peak"] for r in c] for n, c in counts.items()},
        "saved_and_gathered_peak_bytes_per_rank": {
            n: [r["saved_and_gathered_peak"] for r in c] for n, c in counts.items()
        },
        "state_bytes_per_rank": {n: [r["state"] for r in c] for n, c in counts.items()},
        # A whole stage's float32 parameters, gradients and AdamW's two moments.
        "stage_state_bytes": stage_numel * 4 * 4,
    }
    del built
    gc.collect()
    return result


def report(result: dict[str, Any]) -> None:
    print(f"m = {result['chunks']} micro-batches per replica")
    for name, ms in result["ms"].items():
        saved = max(result["saved_peak_bytes_per_rank"][name]) / 2**20
        gathered = max(result["saved_and_gathered_peak_bytes_per_rank"][name]) / 2**20
        state = max(result["state_bytes_per_rank"][name]) / result["stage_state_bytes"]
        print(
            f"  {name:20s} {ms:8.1f} ms  saved peak {saved:6.2f} MiB"
            f" (+ gathered {gathered:6.2f})"
            f"  state {state:.2f} of a stage's"
            f"  {result['collectives_per_step_rank0'][name]}"
        )
    for name, ratio in result["ours_over_torch_throughput"].items():
        print(f"  ours {ratio:.3f}x the throughput of {name} (median of rounds' ratios)")
    for name, ratio in result["ours_resharded_over_torch_throughput"].items():
        print(f"  ours resharded {ratio:.3f}x the throughput of {name} (median of rounds' ratios)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--chunks", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch", type=int, default=256, help="rows, both replicas together")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, m = 4, one round")
    args = parser.parse_args(argv)
    if args.quick:
        args.chunks, args.width, args.batch, args.rounds = [4], 16, 16, 1
    env = init_process_group_from_env("gloo")
    if env.world_size != 4:
        raise SystemExit("run it with torchrun --nproc_per_node=4 (pp=2 x fsdp=2)")
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    shape = Shape(args.blocks, args.width, args.batch)
    info = machine()
    if env.rank == 0:
        print(f"machine: {info}")
    results = []
    for m in args.chunks:
        results.append(measure(shape, mesh, m, args.rounds))
        if env.rank == 0:
            report(results[-1])
    info["load_average_end"] = machine()["load_average"]
    if env.rank == 0:
        print_json(
            {
                "benchmark": "sharded_stages",
                "machine": info,
                "mesh": {"dp": 2, "pp": 2},
                "blocks": args.blocks,
                "width": args.width,
                "batch": args.batch,
                "rounds": args.rounds,
                "results": results,
            }
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
