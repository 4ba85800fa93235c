"""Evaluation: the plain model in ``eval()`` under ``no_grad``, leaving the module as it was.

``pipe.evaluate`` runs inside ``evaluating(module, devices, seed)``:

- every submodule's ``training`` flag is kept and put back afterwards, so
  mixed modes (a frozen BatchNorm in eval inside a training model) survive;
  in between, the module is in ``eval()``;
- no graph is recorded, so nothing reaches ``.grad``, and no running
  statistics change (eval mode);
- the default generators of the CPU and of the module's CUDA devices are
  kept and put back: a layer that draws even in eval mode draws from them
  seeded with ``seed``, so the draws are fresh on each call (the pipe counts
  its evaluations) and reproducible under ``torch.manual_seed``, and the
  training run's random stream is the same as without the evaluation.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn

from pipeline.runtime.rng import default_generator

__all__ = ["evaluating", "evaluation_seed"]


def evaluation_seed(count: int) -> int:
    """The seed of a pipe's ``count``-th evaluation, from the process's initial seed.

    ``torch.initial_seed()`` is read, not drawn: the generators stay as they
    are, and a ``torch.manual_seed(s)`` before the pipe's first evaluation
    gives the same seeds every run.
    """
    text = f"pipeline.evaluate {torch.initial_seed()} {count}".encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 1


@contextmanager
def evaluating(module: nn.Module, devices: Sequence[torch.device], seed: int) -> Iterator[None]:
    """Within the block: ``module`` in eval mode, no grad, the default generators seeded."""
    modes = [(m, m.training) for m in module.modules()]
    generators = _default_generators(devices)
    states = [g.get_state() for g in generators]
    try:
        module.eval()
        for generator in generators:
            generator.manual_seed(seed)
        with torch.no_grad():
            yield
    finally:
        for generator, state in zip(generators, states, strict=True):
            generator.set_state(state)
        for m, training in modes:
            m.training = training


def _default_generators(devices: Sequence[torch.device]) -> list[torch.Generator]:
    """The CPU's default generator and those of the other devices among ``devices``."""
    found = [torch.default_generator, *(default_generator(d) for d in devices)]
    return list(dict.fromkeys(g for g in found if g is not None))
