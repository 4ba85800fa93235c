"""Which layouts the device tier runs: chosen by PIPELINE_TEST_DEVICE and the machine."""

from __future__ import annotations

import pytest

from tests.device.layouts import layouts_for


def names(choice: str | None, cuda: bool, gpus: int) -> list[str]:
    return [layout.name for layout in layouts_for(choice, cuda, gpus)]


def test_the_cpu_unless_cuda_is_there_or_asked_for() -> None:
    assert names(None, cuda=False, gpus=0) == ["cpu"]
    assert names("cpu", cuda=True, gpus=2) == ["cpu"]
    one_gpu = [
        "cuda:0 shared, one thread",
        "cuda:0 shared, a thread each",
        "cuda:0 alone",
        "cuda:0 and cpu in turn",
    ]
    assert names(None, cuda=True, gpus=1) == names("cuda", cuda=True, gpus=1) == one_gpu
    assert names("cuda", cuda=True, gpus=2) == [*one_gpu, "one per GPU (2)"]


def test_each_layout_places_the_partitions_it_promises() -> None:
    shared, threaded, alone, mixed, per_gpu = layouts_for("cuda", cuda_available=True, gpus=2)
    assert shared.devices(3) == threaded.devices(3) == ["cuda:0"] * 3
    assert (shared.threads, threaded.threads) == ("auto", "partition")
    assert alone.devices(4) == ["cuda:0"]
    assert mixed.devices(3) == ["cuda:0", "cpu", "cuda:0"]
    assert per_gpu.devices(3) == ["cuda:0", "cuda:1", "cuda:0"]
    assert [layout.cuda for layout in (shared, alone, mixed)] == [True] * 3
    (cpu,) = layouts_for(None, cuda_available=False, gpus=0)
    assert cpu.devices(3) == ["cpu"] * 3 and not cpu.cuda


def test_cuda_asked_for_without_cuda_or_an_unknown_choice_is_refused() -> None:
    with pytest.raises(RuntimeError, match=r"PIPELINE_TEST_DEVICE=cuda, but torch.cuda"):
        layouts_for("cuda", cuda_available=False, gpus=0)
    with pytest.raises(RuntimeError, match=r"must be 'cpu', 'cuda' or unset, got 'gpu'"):
        layouts_for("gpu", cuda_available=True, gpus=1)
