"""A block's output learned from a real run on stand-in values, where a fake run cannot go.

A capture learns what a block returns by running it on fake tensors
(``opaque.py``). A block whose code depends on tensor values cannot run
there: Mixture-of-Experts routing (``for expert in experts_hit:``) asks which
experts the router chose, and fake tensors have no values. What such a
block returns (structure, dtypes, shapes) does not depend on the routing, so
it runs once for real instead, outside the capture's fake mode::

    fake inputs (s0, s1, 16), (s0, 1, s1, s1)        the capture's symbols
         | hints: the example's sizes
    stand-ins (2, 6, 16), (2, 1, 6, 6)               real tensors, made up
         | the block's forward, on copies of its state
    real outputs (2, 6, 16)
         | each size that an input size also had: that input's symbol
    fake outputs (s0, s1, 16)                        what the graph continues with

The stand-ins hold made-up values (normal floats, zero integers, true
booleans), and the block runs on copies of its parameters and buffers
(random ones for a model on ``meta``), under a forked random state: the
model and the random streams are as they were after it. Where two input
sizes were equal in the example, an output size is taken to be the first of
them, and a size no input had stays fixed; both are assumptions, and every
real call checks its output's shapes against them (``BlockCall._check``), so
a block whose output shape follows another size, or its values, is refused
at that call, never run on.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import unset_fake_temporarily

__all__ = ["real_run", "state_of"]

# What a stand-in holds: values that make no code fail (no NaN, valid indices, a full mask).
_FILL = {torch.bool: True}


def state_of(module: nn.Module) -> dict[str, Tensor]:
    """The module's parameters and buffers by every name they have (ties under each)."""
    return {
        **dict(module.named_parameters(remove_duplicate=False)),
        **dict(module.named_buffers(remove_duplicate=False)),
    }


def real_run(
    module: nn.Module,
    state: dict[str, Tensor],
    arguments: Any,
    tensors: Sequence[Tensor],
    sizes: Sequence[Any],
) -> tuple[Any, list[Tensor], list[int]]:
    """Run ``module.forward`` on stand-ins for the fake ``tensors`` and ``sizes``.

    ``arguments(tensors, sizes)`` builds the call's ``(args, kwargs)``. Returns
    the real output, fake
    tensors shaped as the real output's tensors in terms of the fake inputs'
    sizes (to be returned to the capture), and which of ``tensors`` it changed in place.
    """
    if not tensors:
        raise ValueError("a block's real run stands in for its tensor arguments; it took none")
    devices = sorted({t.device for t in tensors if t.device.type == "cuda"}, key=str)
    with unset_fake_temporarily(), torch.random.fork_rng(devices=devices), torch.no_grad():
        stand_ins = [_stand_in(tensor) for tensor in tensors]
        hints = [_hint(size) for size in sizes]
        with _holding(module, _copies(state, stand_ins)):
            args, kwargs = arguments(stand_ins, hints)
            versions = [t._version for t in stand_ins]
            output = module.forward(*args, **kwargs)
        # A write into an input, or into a view of it, counts on the input's version.
        written = [i for i, t in enumerate(stand_ins) if t._version != versions[i]]
    outputs = [leaf for leaf in torch.utils._pytree.tree_leaves(output) if isinstance(leaf, Tensor)]
    known, shared = _sizes_by_hint(tensors, sizes)
    alike = sorted({size for real in outputs for size in real.shape if size in shared})
    if alike:
        raise ValueError(
            f"its output has a size of {alike[0]}, which several of its inputs' sizes had in the "
            "example (a batch of 8 sequences of 8), so split cannot tell which one it follows: "
            "split on an example whose sizes differ (a batch of 4 sequences of 8)"
        )
    # Made from a fake input, so in the capture's fake mode, on the inputs' device.
    fakes = [
        tensors[0].new_empty([known.get(size, size) for size in real.shape], dtype=real.dtype)
        for real in outputs
    ]
    return output, fakes, written


def _hint(size: Any) -> int:
    """The example's value of a (symbolic) size."""
    if isinstance(size, torch.SymInt):
        hint = size.node.hint
        assert isinstance(hint, int), "a capture's sizes come from the example, so have values"
        return hint
    return int(size)


def _stand_in(fake: Tensor) -> Tensor:
    shape = [_hint(size) for size in fake.shape]
    device = torch.device("cpu") if fake.device.type == "meta" else fake.device
    if fake.dtype.is_floating_point or fake.dtype.is_complex:
        return torch.randn(shape, dtype=fake.dtype, device=device)
    return torch.full(shape, _FILL.get(fake.dtype, 0), dtype=fake.dtype, device=device)


def _copies(state: dict[str, Tensor], stand_ins: Sequence[Tensor]) -> dict[str, Tensor]:
    """Copies of ``state`` (ties kept), on the stand-ins' device where the state is on meta."""
    device = stand_ins[0].device if stand_ins else torch.device("cpu")
    made: dict[int, Tensor] = {}
    for tensor in state.values():
        if id(tensor) not in made:
            if tensor.device.type == "meta":
                made[id(tensor)] = torch.randn(tensor.shape, device=device).to(tensor.dtype) * 0.02
            else:
                made[id(tensor)] = tensor.detach().clone()
    return {name: made[id(tensor)] for name, tensor in state.items()}


@contextmanager
def _holding(module: nn.Module, state: dict[str, Tensor]) -> Iterator[None]:
    """``module`` with ``state`` in its parameters' and buffers' places, put back after."""
    saved: list[tuple[dict[str, Any], str, Any]] = []
    try:
        for name, value in state.items():
            owner, _, attribute = name.rpartition(".")
            holder = module.get_submodule(owner)
            slots: dict[str, Any] = (
                holder._parameters if attribute in holder._parameters else holder._buffers
            )
            saved.append((slots, attribute, slots[attribute]))
            slots[attribute] = value
        yield
    finally:
        for slots, attribute, value in reversed(saved):
            slots[attribute] = value


def _sizes_by_hint(
    tensors: Sequence[Tensor], sizes: Sequence[Any]
) -> tuple[dict[int, Any], set[int]]:
    """Each value an input size had in the example, to the first input size that had it; and
    the values that several of the sizes had (which an output's size cannot be told by)."""
    found: dict[int, Any] = {}
    shared: set[int] = set()
    for size in [*(size for tensor in tensors for size in tensor.shape), *sizes]:
        if isinstance(size, torch.SymInt):
            first = found.setdefault(_hint(size), size)
            if str(first.node.expr) != str(size.node.expr):
                shared.add(_hint(size))
    return found, shared
