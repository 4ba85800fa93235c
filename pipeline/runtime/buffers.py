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

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _NormBase

from pipeline.runtime.lazy import instance_of

__all__ = [
    "BufferSnapshot",
    "PartitionBuffers",
    "check_shared_kept",
    "shared_buffers",
    "updated_in_forward",
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

    def __init__(self, versions: dict[str, int], values: dict[str, Tensor]) -> None:
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
        return BufferSnapshot({name: b._version for name, b in buffers.items()}, values)

    def after_forward(self, snapshot: BufferSnapshot) -> None:
        """Keep only the buffers the forward changed; learn them on the first call."""
        buffers = self._buffers()
        changed = {
            name
            for name, b in buffers.items()
            if b._version != snapshot.versions.get(name, b._version)
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

        Each buffer that changes is swapped, for the recomputation, for the copy
        the forward kept, and swapped back after: the buffers of now are never
        written. So a micro-batch not checkpointed that saved a buffer for its
        backward (batch norm saves its running statistics) finds it as it was;
        what the recomputation saves is the copy, which nothing changes later;
        a layer that rebinds its buffer (``self.ema = self.ema * 0.9 + ...``)
        leaves the one of now in place; and one that resizes it (an observer's
        first statistics) resizes the copy.
        """
        if not snapshot.values:
            yield
            return
        buffers = self._buffers()
        # Every module holding each buffer (layers may share one), and what it holds now.
        swapped = [
            (module, leaf, module._buffers[leaf], value.clone())
            for name, value in snapshot.values.items()
            for module, leaf in self._holders(buffers[name])
        ]
        for module, leaf, _, copy in swapped:
            module._buffers[leaf] = copy
        try:
            yield
        finally:
            for module, leaf, now, _ in swapped:
                module._buffers[leaf] = now

    def _holders(self, buffer: Tensor) -> list[tuple[nn.Module, str]]:
        """Each module of the partition holding ``buffer`` as its own, with the name."""
        return [
            (module, leaf)
            for module in self.partition.modules()
            for leaf, held in module._buffers.items()
            if held is buffer
        ]
