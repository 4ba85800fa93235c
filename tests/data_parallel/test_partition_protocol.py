"""Which pipeline partition each parameter belongs to, and how ranks that disagree are told."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn
from torch.utils.hooks import RemovableHandle

from pipeline.data_parallel.buckets import NO_PARTITION, SignalsPartitionBackward, partition_of_each
from pipeline.data_parallel.replicas import first_difference, signature

OPTIONS = {"bucket_cap_mb": 25, "find_unused_parameters": False}


class FakePipe(nn.Module):
    """The partition protocol and nothing else: partitions that may share layers or weights."""

    def __init__(self, *partitions: list[nn.Module]) -> None:
        super().__init__()
        # As in Pipe, the layers' names do not depend on how they are split.
        layers = {id(layer): layer for partition in partitions for layer in partition}
        self.layers = nn.ModuleList(layers.values())
        self.partitions = [nn.Sequential(*partition) for partition in partitions]
        self._hooks: dict[int, Callable[[int], None]] = {}

    def register_partition_backward_hook(self, hook: Callable[[int], None]) -> RemovableHandle:
        handle = RemovableHandle(self._hooks)
        self._hooks[handle.id] = hook
        return handle


def partitions(module: nn.Module) -> list[int] | None:
    return partition_of_each(module, list(module.parameters()))


def test_fake_pipe_implements_the_protocol() -> None:
    assert isinstance(FakePipe([nn.Linear(2, 2)]), SignalsPartitionBackward)


def test_each_parameter_gets_its_partition() -> None:
    assert partitions(FakePipe([nn.Linear(2, 2)], [nn.Linear(2, 2)])) == [0, 0, 1, 1]


def test_a_module_without_the_protocol_has_no_partitions() -> None:
    assert partitions(nn.Sequential(nn.Linear(2, 2))) is None


def test_a_parameter_outside_every_partition_has_none() -> None:
    pipe = FakePipe([nn.Linear(2, 2)])
    pipe.extra = nn.Linear(2, 2)
    assert partitions(pipe) == [0, 0, NO_PARTITION, NO_PARTITION]


def test_a_layer_shared_by_two_partitions_belongs_to_the_first() -> None:
    # Backward leaves partition 1 before partition 0: only then is the shared
    # layer's gradient final.
    first, shared, last = nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2)
    pipe = FakePipe([first, shared], [shared, last])
    params = [shared.weight, last.weight, first.weight]
    assert partition_of_each(pipe, params) == [0, 1, 0]


def test_a_weight_tied_across_three_partitions_belongs_to_the_first() -> None:
    embed, middle, head = nn.Embedding(5, 2), nn.Linear(2, 2), nn.Linear(2, 5, bias=False)
    head.weight = embed.weight
    pipe = FakePipe([middle], [head], [embed])
    assert partition_of_each(pipe, [embed.weight, middle.weight, middle.bias]) == [1, 0, 0]


def test_different_partitions_are_a_difference_naming_the_balance() -> None:
    layers = [nn.Linear(2, 2) for _ in range(3)]
    reference, other = FakePipe(layers[:2], layers[2:]), FakePipe(layers[:1], layers[1:])
    message = first_difference(signature(reference, OPTIONS), signature(other, OPTIONS), rank=1)
    assert message is not None
    assert message.startswith(
        "parameter 'layers.1.weight' is in pipeline partition 0 on rank 0 but "
        "pipeline partition 1 on rank 1: build every replica's Pipe with the same balance"
    )


def test_a_pipeline_and_a_plain_module_are_a_difference() -> None:
    layer = nn.Linear(2, 2)
    message = first_difference(
        signature(FakePipe([layer]), OPTIONS),
        signature(nn.ModuleDict({"layers": nn.ModuleList([layer])}), OPTIONS),
        rank=1,
    )
    assert message is not None
    assert "pipeline partition 0 on rank 0 but no pipeline partition on rank 1" in message
