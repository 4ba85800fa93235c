"""DistributedPipe scenarios of closing: pipelines dropped in any order, at exit, by a script
that raised; many pipelines closed one after another, giving back all they made.

Registered by importing this module from stage_scenarios.py, and run in its
group of two processes: closing a pipeline must never wait for a peer, so the
group's wall-clock bound, far below the pipelines' timeout here, fails a
process that did.
"""

from __future__ import annotations

import atexit
import gc
import os
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pipeline.distributed import DistributedPipe, PeerError
from tests.distributed.checkpoint_scenarios import TIED
from tests.gloo_groups import (
    SimulatedScriptError,
    breaks_group,
    expect_error,
    rank,
    scenario,
    world,
)

WIDTH = 4
# Far above the group's wall-clock bound: a process that waited for it would fail the test.
TIMEOUT_S = 600

# Pipelines that stay open until this process exits, as a script's do.
KEPT: list[object] = []


def stepped_pipeline() -> Callable[[], Tensor]:
    """A pipeline after one step, held by the closure returned alone (as a training loop's)."""
    model = nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(2 * world())))
    pipe = DistributedPipe(model, [2] * world(), chunks=2, timeout=TIMEOUT_S)
    x = y = torch.ones(4, WIDTH)

    def step() -> Tensor:
        loss = pipe.step(x, y, F.mse_loss)
        assert isinstance(loss, Tensor)
        return loss

    step()
    return step


# Enough for a leak to show clearly (one fd per pipeline would be 30), in a few seconds.
PIPELINES = 30


def descriptors_and_threads() -> tuple[int, int]:
    """This process's open file descriptors and its threads (the native ones too)."""
    return len(os.listdir("/proc/self/fd")), len(os.listdir("/proc/self/task"))


def build_step_close(failing: bool = False) -> None:
    """A pipeline whose embedding is tied to its head across the processes: stepped, closed.

    ``failing``: its step fails on the last rank (the loss raises), and on the
    others by that failure's abort.
    """
    pipe = DistributedPipe(TIED.build(0), TIED.balances[0], chunks=2, timeout=TIMEOUT_S)
    x, y = TIED.batch(0)
    if not failing:
        pipe.step(x, y, TIED.loss)
    elif rank() == world() - 1:
        expect_error(ValueError, lambda: pipe.step(x, y, refusing_loss), "no loss today")
    else:
        expect_error(RuntimeError, lambda: pipe.step(x, y, TIED.loss), "no loss today")
    pipe.close()


def refusing_loss(output: Tensor, target: Tensor) -> Tensor:
    raise ValueError("no loss today")


@scenario
def many_pipelines_closed_one_after_another_give_back_every_descriptor_and_thread() -> None:
    """Each pipeline's process groups (messages, tied weights) and listeners go with it.

    Every fifth pipeline's step fails on one rank, and one pipeline is left
    to garbage collection instead of closed: its groups go at a later close.
    """
    build_step_close()  # what the first pipeline makes once (torch's thread pools)
    before = descriptors_and_threads()
    dropped = DistributedPipe(TIED.build(0), TIED.balances[0], chunks=2, timeout=TIMEOUT_S)
    del dropped
    gc.collect()
    for k in range(PIPELINES):
        build_step_close(failing=k % 5 == 4)
    after = descriptors_and_threads()
    assert after == before, (
        f"(descriptors, threads) {before} before {PIPELINES + 1} pipelines, {after} after"
    )


@scenario
def pipelines_collected_in_different_orders_or_at_exit_let_every_process_end() -> None:
    dropped: list[Callable[[], Tensor] | None] = [stepped_pipeline() for _ in range(3)]
    kept = [stepped_pipeline() for _ in range(2)]
    # Rank 0 drops the first three first to last, the others last to first:
    # each process closes a pipeline while its peers close another.
    order = list(range(3)) if rank() == 0 else [2, 1, 0]
    for k in order:
        start = time.monotonic()
        dropped[k] = None
        gc.collect()
        assert time.monotonic() - start < 60, f"collecting pipeline {k} waited for a peer"
    # The last two: rank 0 keeps them open until it exits, the others drop them now.
    if rank() == 0:
        KEPT.extend(kept)
    else:
        kept.clear()
        gc.collect()


@breaks_group
@scenario
def a_process_whose_script_raises_exits_at_once_and_the_others_name_it() -> None:
    step = stepped_pipeline()
    if rank() == 1:
        KEPT.append(step)  # still open when the process exits
        raise SimulatedScriptError("a bug in rank 1's script, outside step()")
    start = time.monotonic()
    expect_error(PeerError, step, "rank 1 closed its pipeline")
    # Rank 1's exit waits up to 30 s for this process's stop: far less means the
    # wait for its missing message ended at its stop, not at its exit.
    assert time.monotonic() - start < 20, "the error waited for rank 1's exit or the timeout"


class SlowTeardown:
    """Kept until the interpreter tears its modules down, which it then slows down."""

    def __del__(self) -> None:
        time.sleep(3)


@scenario
def a_process_that_exits_before_its_peer_closes_waits_for_it_and_exits_cleanly() -> None:
    """A listener woken while its interpreter finalizes would abort the process (SIGABRT).

    Rank 0 exits at once and spends seconds finalizing; rank 1 closes its
    pipeline a second into that. The group runner fails a rank that dies
    of a signal.
    """
    KEPT.append(stepped_pipeline())
    if rank() == 0:
        KEPT.append(SlowTeardown())
    else:
        atexit.register(time.sleep, 1)  # runs before the pipelines close at exit
