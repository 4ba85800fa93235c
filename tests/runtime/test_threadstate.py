"""The caller's thread-local state reaches every partition's worker."""

from __future__ import annotations

import os

import pytest
import torch
from torch import Tensor, nn

from pipeline import Pipe, is_checkpointing, is_recomputing


class Probe(nn.Module):
    """Records the state seen on each call, and computes a matmul."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.seen: list[dict[str, object]] = []

    def forward(self, x: Tensor) -> Tensor:
        y = self.linear(x)
        self.seen.append(
            {
                "grad": torch.is_grad_enabled(),
                "inference": torch.is_inference_mode_enabled(),
                "autocast": torch.is_autocast_enabled("cpu"),
                "dtype": y.dtype,
                "checkpointing": is_checkpointing(),
                "recomputing": is_recomputing(),
            }
        )
        return y


def probed_pipe(
    checkpoint: str = "never", chunks: int = 2, threads: str = "auto"
) -> tuple[Pipe, list[Probe]]:
    probes = [Probe(), Probe()]
    pipe = Pipe(
        nn.Sequential(*probes),
        [1, 1],
        devices=["cpu"] * 2,
        chunks=chunks,
        checkpoint=checkpoint,  # type: ignore[arg-type]
        threads=threads,  # type: ignore[arg-type]
    )
    return pipe, probes


# "device": one thread runs both partitions, the clock cycles' fences included.
THREADS = ["partition", "device"]


@pytest.mark.parametrize("threads", THREADS)
def test_autocast_reaches_every_partition_in_forward_and_recompute(threads: str) -> None:
    pipe, probes = probed_pipe(checkpoint="always", threads=threads)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = pipe(torch.randn(4, 4))
    assert isinstance(out, Tensor) and out.dtype == torch.bfloat16
    out.float().sum().backward()  # recomputation runs outside the caller's autocast block
    for probe in probes:
        forward = [s for s in probe.seen if s["checkpointing"]]
        recompute = [s for s in probe.seen if s["recomputing"]]
        assert len(forward) == 2 and len(recompute) == 2
        assert all(s["autocast"] and s["dtype"] == torch.bfloat16 for s in probe.seen)
        # Non-reentrant checkpointing records the forward's graph (without its activations).
        assert all(s["grad"] for s in probe.seen)


def test_no_autocast_leaks_into_the_next_call() -> None:
    pipe, probes = probed_pipe()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        pipe(torch.randn(4, 4))
    out = pipe(torch.randn(4, 4))
    assert isinstance(out, Tensor) and out.dtype == torch.float32
    assert [s["autocast"] for s in probes[1].seen] == [True, True, False, False]


@pytest.mark.parametrize("threads", THREADS)
def test_no_grad_reaches_workers_and_disables_checkpointing(threads: str) -> None:
    pipe, probes = probed_pipe(checkpoint="always", threads=threads)
    with torch.no_grad():
        out = pipe(torch.randn(4, 4))
    assert isinstance(out, Tensor) and not out.requires_grad
    assert all(not s["grad"] and not s["checkpointing"] for p in probes for s in p.seen)


@pytest.mark.parametrize("threads", THREADS)
def test_inference_mode_reaches_workers(threads: str) -> None:
    pipe, probes = probed_pipe(threads=threads)
    with torch.inference_mode():
        out = pipe(torch.randn(4, 4))
    assert isinstance(out, Tensor) and out.is_inference()
    assert all(s["inference"] for p in probes for s in p.seen)


def test_grad_mode_is_on_in_workers_by_default() -> None:
    pipe, probes = probed_pipe()
    pipe(torch.randn(4, 4))
    assert all(s["grad"] and not s["inference"] for p in probes for s in p.seen)


@pytest.mark.parametrize(
    ("checkpoint", "expected"), [("always", 2), ("except_last", 1), ("never", 0)]
)
def test_checkpoint_modes_choose_micro_batches(checkpoint: str, expected: int) -> None:
    pipe, probes = probed_pipe(checkpoint=checkpoint)
    pipe(torch.randn(4, 4)).sum().backward()  # type: ignore[union-attr]
    for probe in probes:
        assert sum(bool(s["checkpointing"]) for s in probe.seen) == expected
        assert sum(bool(s["recomputing"]) for s in probe.seen) == expected


def test_eval_mode_disables_checkpointing() -> None:
    pipe, probes = probed_pipe(checkpoint="always")
    pipe.eval()
    pipe(torch.randn(4, 4))
    assert not any(s["checkpointing"] for p in probes for s in p.seen)


def test_torch_config_set_by_the_caller_reaches_every_task() -> None:
    # torch keeps config overrides in context variables, which a new thread does not inherit.
    import torch._functorch.config as functorch_config

    seen: list[bool] = []
    pipe, probes = probed_pipe()
    for probe in probes:
        probe.register_forward_hook(lambda *_: seen.append(functorch_config.donated_buffer))
    with functorch_config.patch(donated_buffer=False):
        pipe(torch.randn(4, 4))
        pipe.step(torch.randn(4, 4), torch.randn(4, 4), torch.nn.functional.mse_loss)
    pipe.step(torch.randn(4, 4), torch.randn(4, 4), torch.nn.functional.mse_loss)
    assert seen == [False] * 8 + [True] * 4


def threads_of_this_process() -> set[int]:
    return {int(tid) for tid in os.listdir("/proc/self/task")}


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="lists threads in /proc")
@pytest.mark.parametrize("call", ["pipe(x)", "step"])
def test_workers_use_the_callers_intra_op_threads_and_start_no_thread_team(call: str) -> None:
    """A worker's first matrix product starts no OpenMP team of the machine's size.

    ``torch.set_num_threads(1)`` reaches OpenMP and MKL on the calling thread
    only; a worker left with their defaults starts a team whose threads spin
    beside the other workers' (kernels then took 5 to 10 times as long).
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = nn.Sequential(*(nn.Linear(64, 64) for _ in range(4)))
        x, y = torch.randn(16, 64), torch.randn(16, 64)
        existing = threads_of_this_process()
        pipe = Pipe(model, [1] * 4, devices=["cpu"] * 4, chunks=4, threads="partition")
        if call == "step":
            pipe.step(x, y, nn.functional.mse_loss)
        else:
            nn.functional.mse_loss(pipe(x), y).backward()
        workers = {worker.thread.native_id for worker in pipe._workers}
        assert len(workers) == 4
        assert threads_of_this_process() - existing - workers == set(), "workers started threads"
        pipe.close()
    finally:
        torch.set_num_threads(before)
