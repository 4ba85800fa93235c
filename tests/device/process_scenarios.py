"""DistributedPipe and DataParallel in a real process group, on the device tier's devices.

Started by tests/device/test_device_processes.py through tests/gloo_groups.py's
``run_group``. Every rank works on ``DEVICE_TIER_DEVICE``: ``cpu``; ``cuda:0``
for every rank (gloo: messages and gradient buckets cross through the CPU);
or ``rank``: the GPU init_process_group_from_env gave the rank (NCCL, a GPU
per rank). Each compares with the plain model on that same device.
"""

from __future__ import annotations

import copy
import os

import torch
import torch.nn.functional as F

from pipeline import DataParallel, Pipe
from pipeline.distributed import DistributedPipe
from pipeline.runtime.process_group import collective_device
from tests.data_parallel.dp_scenarios import assert_grads_close, global_batch, mlp, shard
from tests.distributed.stage_scenarios import (
    assert_grads_equal,
    batch,
    noisy_model,
    skipping_model,
)
from tests.gloo_groups import main, rank, scenario, world

DEVICE = "DEVICE_TIER_DEVICE"
MODES = ("always", "except_last", "never")
FLAT = ("gpipe", "1f1b", "zb-h1")


def device() -> torch.device:
    chosen = os.environ.get(DEVICE, "cpu")
    if chosen == "rank":
        return collective_device(torch.distributed.group.WORLD)  # type: ignore[arg-type]
    return torch.device(chosen)


@scenario
def distributed_pipe_with_skips_equals_the_plain_model() -> None:
    here = device()
    model = skipping_model()
    plain = copy.deepcopy(model).to(here)
    x, y = (t.to(here) for t in batch())
    expected = F.mse_loss(plain(x), y)
    expected.backward()
    # Each schedule in another checkpoint mode: tests/distributed crosses them all.
    for schedule, mode in zip(FLAT, MODES, strict=True):
        what = f"{here}, {schedule}, {mode}"
        pipe = DistributedPipe(
            copy.deepcopy(model), [2] * world(), device=here, chunks=4, checkpoint=mode
        )
        first, last = 0 in pipe.local_stages, world() - 1 in pipe.local_stages
        loss = pipe.step(x if first else None, y if last else None, F.mse_loss, schedule=schedule)
        torch.testing.assert_close(loss.to(here), expected.detach(), msg=what)
        assert_grads_equal(pipe, plain, what)
        pipe.close()


@scenario
def distributed_pipe_replays_dropout_exactly() -> None:
    # A process runs its stages on its own thread: it owns its device's
    # generator and replays a checkpointed task's draws from captured states.
    here = device()
    x, y = (t.to(here) for t in batch(rows=12))
    for schedule in ("1f1b", "zb-h1"):
        found = {}
        for mode in ("always", "never"):
            model = noisy_model(torch.float64, dropout=0.5)
            pipe = DistributedPipe(model, [2] * world(), device=here, chunks=3, checkpoint=mode)
            torch.manual_seed(15 + rank())
            pipe.step(x, y, F.mse_loss, schedule=schedule)
            found[mode] = {name: p.grad for name, p in pipe.named_parameters()}
            pipe.close()
        for name, grad in found["never"].items():
            assert torch.equal(found["always"][name], grad), f"{here}, {schedule}: {name}"


@scenario
def data_parallel_over_pipes_equals_the_full_batch() -> None:
    here = device()
    for mode in MODES:
        model = mlp(seed=11)
        full_batch = copy.deepcopy(model).to(here)
        pipe = Pipe(model, [5, 4], devices=[here, here], chunks=2, checkpoint=mode)
        dp = DataParallel(pipe, bucket_cap_mb=2e-3, first_bucket_mb=5e-4)
        x, y = (t.to(here) for t in global_batch(0))
        F.mse_loss(dp(shard(x)), shard(y)).backward()
        F.mse_loss(full_batch(x), y).backward()
        assert_grads_close(pipe, full_batch, f"{here}, {mode}: DataParallel over pipes")
        pipe.close()


if __name__ == "__main__":
    main()
