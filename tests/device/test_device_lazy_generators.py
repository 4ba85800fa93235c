"""A GPU's default generator is found even when the pipe is planned before CUDA has started.

CUDA makes its generators at its first use. A pipe whose GPU partitions hold
no parameter can be built before that; its plan must still own the GPU's
generator, or a checkpointed task's recomputation would draw new masks from
it, unchecked. On the CPU, a stand-in for ``torch.cuda`` that starts lazily.
"""

from __future__ import annotations

import pytest
import torch

from pipeline.runtime import evaluation, ownership, rng

GPU = torch.device("cuda", 0)


@pytest.fixture
def lazy_cuda(monkeypatch: pytest.MonkeyPatch) -> torch.Generator:
    """``torch.cuda`` available, not started: its generator appears once ``init()`` runs."""
    generator = torch.Generator()

    def init() -> None:
        monkeypatch.setattr(torch.cuda, "default_generators", (generator,))

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "default_generators", ())
    monkeypatch.setattr(torch.cuda, "init", init)
    return generator


def test_a_plan_made_before_cuda_started_owns_the_gpus_generator(
    lazy_cuda: torch.Generator,
) -> None:
    (plan,) = ownership.randomness_plans([GPU], [[0]], [False], [False])
    assert not plan.seeded
    assert plan.generators == (lazy_cuda, torch.default_generator)
    assert rng.default_generator(GPU) is lazy_cuda


def test_evaluate_puts_back_the_generator_of_a_gpu_not_started_yet(
    lazy_cuda: torch.Generator,
) -> None:
    found = evaluation._default_generators([GPU, torch.device("cpu"), GPU])
    assert found == [torch.default_generator, lazy_cuda]
