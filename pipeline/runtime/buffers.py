"""Buffers that a partition's forward changes, put back for recomputation.

A checkpointed task runs its partition twice: in forward, and again in
backward. Some layers change buffers in every training forward: BatchNorm
and InstanceNorm update their running statistics, spectral norm advances its
power-iteration vectors. Run again, such a layer would update them a second
time, and would compute from values that later micro-batches have changed
since. So a checkpointed forward notes which buffers it changed and keeps
what they held before; recomputation runs with a copy of those values in
their place, and the buffers of now are put back, untouched::

    forward (i):   snapshot B  ->  run: B changes to B'       (B kept)
    forward (i+1): ...             B' changes to B''
    recompute (i): a copy of B swapped in -> run -> B'' swapped back

The recomputation sees what the forward saw and leaves no trace. Which
buffers change is learned on a partition's first checkpointed forward, by
comparing values (kernels such as batch norm's update running statistics
without bumping their version counters), so that constant buffers (masks,
tables) are never copied afterwards; and learned again after a layer of the
partition changed between training and eval (a BatchNorm frozen for a
while, then trained), or the partition's buffers changed (a spectral norm
added to a layer). Later forwards only check version counters for a
buffer that starts changing.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _NormBase

from pipeline.runtime.batchnorm import DeferredBatchNorm
from pipeline.runtime.lazy import instance_of

__all__ = [
    "BufferSnapshot",
    "PartitionBuffers",
    "check_shared_kept",
    "shared_buffers",
    "updated_buffers",
    "updated_in_forward",
    "updating_layer",
]


def updated_in_forward(module: nn.Module) -> str | None:
    """What ``module`` itself updates in every training forward, or None: where two
    partitions (or processes) run it, the updates would come in their order, not the
    plain model's.

    >>> updated_in_forward(nn.BatchNorm1d(4))
    'running statistics'
    >>> updated_in_forward(nn.utils.spectral_norm(nn.Linear(4, 4)))
    'power-iteration vectors'
    >>> updated_in_forward(nn.LayerNorm(4)) is None
    True
    """
    if isinstance(module, _NormBase) and module.track_running_stats:
        return "running statistics"
    hooks = module._forward_pre_hooks.values()
    if instance_of(module, "torch.nn.utils.parametrizations", "_SpectralNorm") or any(
        instance_of(hook, "torch.nn.utils.spectral_norm", "SpectralNorm") for hook in hooks
    ):
        return "power-iteration vectors"
    return None


def updated_buffers(module: nn.Module) -> list[Tensor]:
    """The buffers of ``module``'s layers that update them in training (``updated_in_forward``),
    each once; by the layers' kinds, not their modes, so that replicas choose alike."""
    found = {
        id(buffer): buffer
        for layer in module.modules()
        if updated_in_forward(layer) is not None
        for buffer in layer.buffers(recurse=False)
    }
    return list(found.values())


def updating_layer(partition: nn.Module) -> tuple[str, str] | None:
    """The first layer of ``partition`` (its name, and what) that updates state in each of its
    forwards now, in training (``updated_in_forward``); or None.

    A ``DeferredBatchNorm`` updates its statistics once a step, from every
    micro-batch's, in no order: it is not one.
    """
    for name, module in partition.named_modules():
        what = updated_in_forward(module)
        if what is not None and module.training and not isinstance(module, DeferredBatchNorm):
            return name, what
    return None


def shared_buffers(partitions: Sequence[nn.Module]) -> dict[int, list[str]]:
    """By partition, the names of its buffers that another partition holds too.

    >>> shared = torch.nn.Linear(2, 2)
    >>> shared.register_buffer("seen", torch.zeros(()))
    >>> shared_buffers([nn.Sequential(shared), nn.Sequential(nn.Tanh(), shared)])
    {0: ['0.seen'], 1: ['1.seen']}
    """
    holders: dict[int, list[tuple[int, str]]] = {}
    for j, partition in enumerate(partitions):
        for name, buffer in partition.named_buffers(remove_duplicate=False):
            holders.setdefault(id(buffer), []).append((j, name))
    found: dict[int, list[str]] = {}
    for held in holders.values():
        if len({j for j, _ in held}) > 1:
            for j, name in held:
                found.setdefault(j, []).append(name)
    return found


def check_shared_kept(j: int, partition: nn.Module, names: list[str], versions: list[int]) -> None:
    """Refuse partition ``j``'s forward that wrote into one of its buffers ``names`` (held by
    another partition or process too) since their ``versions`` were taken."""
    buffers = dict(partition.named_buffers(remove_duplicate=False))
    written = [n for n, v in zip(names, versions, strict=True) if buffers[n]._version != v]
    if written:
        raise RuntimeError(
            f"partition {j} wrote into its buffer {written[0]!r} in its forward, and another "
            "partition (or a stage of another process) holds that buffer too: the updates "
            "would come in the order the partitions run their micro-batches, or apart in "
            "each process, not the plain model's; give each use a buffer of its own, or keep "
            "its uses in one partition"
        )


class BufferSnapshot:
    """The buffers a task's forward may change, as they were before it ran."""

    __slots__ = ("values", "versions")

    def __init__(self, versions: dict[str, tuple[int, int]], values: dict[str, Tensor]) -> None:
        self.versions = versions
        self.values = values


class PartitionBuffers:
    """The buffers of one partition, and the names of those its forward changes."""

    def __init__(self, partition: nn.Module, index: int) -> None:
        self.partition = partition
        self.index = index
        self.changing: set[str] | None = None
        # Each layer's training flag, and the buffers' names, when ``changing`` was learned.
        self.learned_in: tuple[list[bool], list[str]] = ([], [])

    def _buffers(self) -> dict[str, Tensor]:
        # Looked up every time: .to(dtype) and friends replace buffer tensors.
        return dict(self.partition.named_buffers())

    def before_forward(self) -> BufferSnapshot:
        buffers = self._buffers()
        now = ([layer.training for layer in self.partition.modules()], list(buffers))
        if now != self.learned_in:
            self.changing, self.learned_in = None, now
        keep = buffers.keys() if self.changing is None else self.changing
        with torch.no_grad():
            values = {name: buffers[name].clone() for name in keep}
        # Each buffer's tensor and version: a layer may write into it, or rebind it.
        marks = {name: (id(b), b._version) for name, b in buffers.items()}
        return BufferSnapshot(marks, values)

    def after_forward(self, snapshot: BufferSnapshot) -> None:
        """Keep only the buffers the forward changed; learn them on the first call."""
        buffers = self._buffers()
        changed = {
            name
            for name, b in buffers.items()
            if snapshot.versions.get(name, (id(b), b._version)) != (id(b), b._version)
        }
        if self.changing is None:
            changed |= {
                name
                for name, value in snapshot.values.items()
                if name in buffers and not torch.equal(buffers[name], value)
            }
            self.changing = changed
        else:
            changed |= self.changing
        unknown = changed - snapshot.values.keys()
        if unknown:
            raise RuntimeError(
                f"partition {self.index} changed buffers {sorted(unknown)} in a checkpointed "
                "forward although its first checkpointed forward left them alone, so their "
                "values before this forward were not kept and recomputation cannot replay "
                "it; use checkpoint='never', or change such buffers in every training forward"
            )
        snapshot.values = {name: snapshot.values[name] for name in changed}

    @contextmanager
    def replayed(self, snapshot: BufferSnapshot) -> Iterator[None]:
        """Run with the buffers as the forward saw them; then the buffers of now again.

        Each buffer that changes is given the kept values in place (through
        ``.data``, which moves no version counter: a micro-batch not
        checkpointed may have saved it for its backward, batch norm's running
        statistics, and finds them back in place before that backward runs),
        so that a layer reading it by any reference (an attribute, a closure,
        a view) reads what the forward read; and, but for a buffer sharing its
        memory with another (a view: a copy would part them), every module
        holding it is given, for the recomputation, a copy of those values in
        its place, swapped back after. So what the recomputation saves is the
        copy, which nothing changes later; a layer that rebinds its buffer
        (``self.ema = self.ema * 0.9 + ...``) leaves the buffer of now in
        place; and one that sizes it at its first forward (an observer's
        statistics, kept empty) sizes the copy. The values of now are put back
        in place after.
        """
        if not snapshot.values:
            yield
            return
        buffers = self._buffers()
        live = [(buffers[name], value) for name, value in snapshot.values.items()]
        viewed = _sharing_memory(buffers.values())
        with torch.no_grad():
            now = [buffer.clone() for buffer, _ in live]
            for buffer, value in live:
                if buffer.shape == value.shape:
                    buffer.data.copy_(value)
        swapped = [
            (module, leaf, buffer, value.clone())
            for buffer, value in live
            if id(buffer) not in viewed
            for module, leaf in self._holders(buffer)
        ]
        for module, leaf, _, copy in swapped:
            module._buffers[leaf] = copy
        try:
            yield
        finally:
            for module, leaf, buffer, _ in swapped:
                module._buffers[leaf] = buffer
            with torch.no_grad():
                for (buffer, _), value in zip(live, now, strict=True):
                    if buffer.shape == value.shape:
                        buffer.data.copy_(value)

    def _holders(self, buffer: Tensor) -> list[tuple[nn.Module, str]]:
        """Each module of the partition holding ``buffer`` as its own, with the name."""
        return [
            (module, leaf)
            for module in self.partition.modules()
            for leaf, held in module._buffers.items()
            if held is buffer
        ]


def _sharing_memory(buffers: Iterable[Tensor]) -> set[int]:
    """The ids of the buffers whose memory another of them shares (a view of another)."""
    by_storage: dict[int, list[int]] = {}
    for buffer in buffers:
        if buffer.layout == torch.strided and buffer.device.type != "meta" and buffer.numel():
            by_storage.setdefault(buffer.untyped_storage().data_ptr(), []).append(id(buffer))
    return {i for found in by_storage.values() if len(found) > 1 for i in found}


def refuse_lazy(partitions: Iterable[nn.Module]) -> None:
    """Refuse a lazy layer's buffer not yet materialised in partitions that recompute: each
    keeps a copy of its buffers from before its forward, and the buffer has no values yet."""
    for j, partition in enumerate(partitions):
        for name, buffer in partition.named_buffers():
            if isinstance(buffer, nn.parameter.UninitializedBuffer):
                raise RuntimeError(
                    f"buffer {name!r} of partition {j} is not materialised yet (a lazy "
                    "layer's), and this partition recomputes its forward, so it keeps a copy of "
                    "its buffers from before it: run the model once on an example batch before "
                    "building the pipe (as torch asks of lazy modules before an optimizer), or "
                    "pass checkpoint='never'"
                )
