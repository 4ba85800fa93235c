"""Process groups for DataParallel: set one up from torchrun's environment, find the one to use."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")

# Long enough for a slow first step, short enough that a rank which stalls
# mid-step turns into an error on the others within minutes, not after
# torch's default of 30.
DEFAULT_TIMEOUT = timedelta(minutes=5)


@dataclass(frozen=True)
class TorchrunEnv:
    """Where this process sits in a job started by torchrun."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int


def read_torchrun_env(environ: Mapping[str, str] | None = None) -> TorchrunEnv:
    """Read RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT.

    Raises RuntimeError naming the missing or malformed variables, which
    usually means the script was started with `python` instead of `torchrun`.
    """
    env = os.environ if environ is None else environ
    missing = [name for name in TORCHRUN_VARIABLES if name not in env]
    if missing:
        raise RuntimeError(
            f"environment variables {', '.join(missing)} are not set: start the script "
            "with `torchrun --nproc_per_node=N script.py`, which sets them for every process"
        )
    try:
        return TorchrunEnv(
            rank=int(env["RANK"]),
            world_size=int(env["WORLD_SIZE"]),
            local_rank=int(env["LOCAL_RANK"]),
            master_addr=env["MASTER_ADDR"],
            master_port=int(env["MASTER_PORT"]),
        )
    except ValueError as error:
        raise RuntimeError(f"malformed torchrun environment variable: {error}") from error


def init_process_group_from_env(
    backend: str | None = None,
    timeout: timedelta = DEFAULT_TIMEOUT,
    environ: Mapping[str, str] | None = None,
) -> TorchrunEnv:
    """Initialise the default process group from torchrun's variables and return them.

    The backend defaults to NCCL when CUDA is available (and then selects the
    GPU numbered LOCAL_RANK) and to gloo otherwise. `timeout` bounds both the
    rendezvous and every later collective, so a missing or crashed rank
    becomes an error instead of a hang.
    """
    env = read_torchrun_env(environ)
    chosen = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if chosen == "nccl":
        torch.cuda.set_device(env.local_rank)
    dist.init_process_group(
        chosen,
        init_method=f"tcp://{env.master_addr}:{env.master_port}",
        rank=env.rank,
        world_size=env.world_size,
        timeout=timeout,
    )
    return env


def resolve_group(process_group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    """The group DataParallel should use: the one given, else the default group.

    Raises RuntimeError when torch.distributed has not been initialised, before
    any collective could wait for peers that will never come.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "DataParallel needs an initialised process group: call "
            "pipeline.distributed.init_process_group_from_env() in a script started by "
            "torchrun, or torch.distributed.init_process_group(...) yourself, first"
        )
    if process_group is not None:
        return process_group
    world = dist.group.WORLD
    assert world is not None  # is_initialized() guarantees the default group exists
    return world


def collective_device(group: dist.ProcessGroup) -> torch.device:
    """Where a tensor that belongs to no parameter must live to take part in `group`'s collectives.

    NCCL only moves CUDA tensors, and the current device is the GPU that
    init_process_group_from_env (or the user's torch.cuda.set_device) gave
    this rank. Every other backend, a "cpu:gloo,cuda:nccl" group included,
    takes CPU tensors, which spares a copy to the GPU and back.
    """
    if dist.get_backend(group) == dist.Backend.NCCL:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
