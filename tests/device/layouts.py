"""The device layouts of the device tier: where its Pipes put their partitions.

The CPU by default. With ``PIPELINE_TEST_DEVICE=cuda``, or by itself when
``torch.cuda.is_available()``, the CUDA layouts instead: several partitions
sharing ``cuda:0`` (on one worker thread, the default for a GPU, and on a
thread each), one partition alone on ``cuda:0``, ``cuda:0`` and the CPU in
turn (copies both ways), and with two or more GPUs one partition per GPU.
``PIPELINE_TEST_DEVICE=cpu`` keeps the CPU on a machine with a GPU.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

__all__ = ["ENVIRONMENT", "Layout", "cuda_layouts", "layouts_for", "selected_layouts"]

ENVIRONMENT = "PIPELINE_TEST_DEVICE"


@dataclass(frozen=True)
class Layout:
    """Devices taken in turn from ``cycle``; ``alone``: one partition, whatever is asked."""

    name: str
    cycle: tuple[str, ...]
    threads: str = "auto"
    alone: bool = False

    def devices(self, partitions: int) -> list[str]:
        """The devices of ``partitions`` partitions (one, if this layout is a partition alone)."""
        count = 1 if self.alone else partitions
        return [self.cycle[k % len(self.cycle)] for k in range(count)]

    @property
    def first(self) -> torch.device:
        """The device of partition 0, where the plain model runs for comparison."""
        return torch.device(self.cycle[0])

    @property
    def cuda(self) -> bool:
        return any(d.startswith("cuda") for d in self.cycle)


CPU = (Layout("cpu", ("cpu",)),)


def cuda_layouts(gpus: int) -> tuple[Layout, ...]:
    """The CUDA layouts on a machine with ``gpus`` GPUs."""
    layouts = [
        Layout("cuda:0 shared, one thread", ("cuda:0",)),
        Layout("cuda:0 shared, a thread each", ("cuda:0",), threads="partition"),
        Layout("cuda:0 alone", ("cuda:0",), alone=True),
        Layout("cuda:0 and cpu in turn", ("cuda:0", "cpu")),
    ]
    if gpus >= 2:
        layouts.append(Layout(f"one per GPU ({gpus})", tuple(f"cuda:{k}" for k in range(gpus))))
    return tuple(layouts)


def layouts_for(choice: str | None, cuda_available: bool, gpus: int) -> tuple[Layout, ...]:
    """The layouts for ``PIPELINE_TEST_DEVICE=choice`` (None: unset) on this machine."""
    if choice in (None, ""):
        return cuda_layouts(gpus) if cuda_available else CPU
    if choice == "cpu":
        return CPU
    if choice == "cuda":
        if not cuda_available:
            raise RuntimeError(
                f"{ENVIRONMENT}=cuda, but torch.cuda.is_available() is False (torch "
                f"{torch.__version__}); unset {ENVIRONMENT} to run the device tier on the CPU"
            )
        return cuda_layouts(gpus)
    raise RuntimeError(f"{ENVIRONMENT} must be 'cpu', 'cuda' or unset, got {choice!r}")


def selected_layouts() -> tuple[Layout, ...]:
    """The layouts of this run: from the environment and the machine."""
    available = torch.cuda.is_available()
    gpus = torch.cuda.device_count() if available else 0
    return layouts_for(os.environ.get(ENVIRONMENT), available, gpus)
