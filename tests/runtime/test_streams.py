"""The CPU stand-in for CUDA streams: one stream, every operation a no-op."""

from __future__ import annotations

import torch

from pipeline.runtime.stream import CPUStream, current_stream, new_stream, use_stream


def test_cpu_streams_are_a_no_op_stand_in() -> None:
    cpu = torch.device("cpu")
    stream = new_stream(cpu)
    assert isinstance(stream, CPUStream) and current_stream(cpu) is stream
    with use_stream(stream):
        pass
