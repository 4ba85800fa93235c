"""A block's output learned from a real run on stand-in values, where a fake run cannot go.

A capture learns what a block returns by running it on fake tensors
(``opaque.py``). A block whose code depends on tensor values cannot run
there: Mixture-of-Experts routing (``for expert in experts_hit:``) asks which
experts the router chose, and fake tensors have no values. What such a
block returns (structure, dtypes, shapes) does not depend on the routing, so
it runs for real instead, outside the capture's fake mode::

    fake inputs (s0, s1, 16), (s0, 1, s1, s1)        the capture's symbols
         | hints: the example's sizes
    stand-ins (2, 6, 16), (2, 1, 6, 6)               real tensors, made up
         | the block's forward, on copies of its state
    real outputs (2, 6, 16)
         | again, each symbol moved to a size nothing had
    stand-ins (3, 7, 16)  ->  real outputs (3, 7, 16)
         | each size that moved with an input size: that input's symbol
    fake outputs (s0, s1, 16)                        what the graph continues with

The stand-ins hold made-up values (normal floats, zero integers, true
booleans), and the block runs on copies of its parameters and buffers
(random ones for a model on ``meta``), under a forked random state: the
model and the random streams are as they were after it. The second run
tells apart sizes equal in the example (a batch of 16 beside a hidden size
of 16); symbols that the block needs equal move together, and an output
size follows the first input size that moved as it did. A size that did
not move, or moved with none, stays fixed. These are assumptions, and every
real call checks its output's shapes against them (``BlockCall._check``), so
a block whose output shape follows another size, or its values, is refused
at that call, never run on.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import unset_fake_temporarily

__all__ = ["real_run", "state_of"]

# What a stand-in holds: values that make no code fail (no NaN, valid indices, a full mask).
_FILL = {torch.bool: True}

# A run's output tensors: each one's shape and dtype.
_Shapes = list[tuple[list[int], torch.dtype]]


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
    inputs = [*(size for tensor in tensors for size in tensor.shape), *sizes]
    run = partial(_run, module, state, arguments, tensors, sizes)
    output, written, shapes = run({})
    symbols = {_symbol(size): _hint(size) for size in inputs if _symbol(size) is not None}
    told = _told_apart(run, shapes, symbols, inputs, (tensors, sizes))
    # Made from a fake input, so in the capture's fake mode, on the inputs' device.
    fakes = [
        tensors[0].new_empty([told(k, d, size) for d, size in enumerate(shape)], dtype=dtype)
        for k, (shape, dtype) in enumerate(shapes)
    ]
    return output, fakes, written


def _run(
    module: nn.Module,
    state: dict[str, Tensor],
    arguments: Any,
    tensors: Sequence[Tensor],
    sizes: Sequence[Any],
    moved: dict[Any, int],
) -> tuple[Any, list[int], _Shapes]:
    """The block on stand-ins whose symbolic sizes are the example's, but for those ``moved``:
    its output, which inputs it wrote into, and its output tensors' shapes and dtypes."""
    devices = sorted({t.device for t in tensors if t.device.type == "cuda"}, key=str)
    with unset_fake_temporarily(), torch.random.fork_rng(devices=devices), torch.no_grad():
        stand_ins = [_stand_in(tensor, moved) for tensor in tensors]
        values = [_value(size, moved) for size in sizes]
        with _holding(module, _copies(state, stand_ins)):
            args, kwargs = arguments(stand_ins, values)
            versions = [t._version for t in stand_ins]
            output = module.forward(*args, **kwargs)
        # A write into an input, or into a view of it, counts on the input's version.
        written = [i for i, t in enumerate(stand_ins) if t._version != versions[i]]
    leaves = torch.utils._pytree.tree_leaves(output)
    shapes = [(list(leaf.shape), leaf.dtype) for leaf in leaves if isinstance(leaf, Tensor)]
    return output, written, shapes


def _told_apart(
    run: Callable[[dict[Any, int]], tuple[Any, list[int], _Shapes]],
    shapes: _Shapes,
    symbols: dict[Any, int],
    inputs: list[Any],
    example: tuple[Sequence[Tensor], Sequence[Any]],
) -> Any:
    """Which input size each output size follows, told apart by a second run on other sizes.

    An output size equal to an input's symbolic size in the example may
    follow it, or another size that happens to be equal (a batch of 16
    beside a hidden size of 16). So the block runs again with every symbol
    moved to a value nothing had: a size that moves with one follows it.
    Symbols equal in the example move apart first; if the block then fails
    (its code needs them equal, as a cache position's length and the
    sequence's), together. Returns ``told(k, d, size)``: dim ``d`` of output
    ``k``, ``size`` in the example, as the input size it follows, or fixed.
    """
    outputs = {size for shape, _ in shapes for size in shape}
    if not outputs & set(symbols.values()):
        return lambda k, d, size: size
    taken = {size for size in inputs if isinstance(size, int)} | outputs | set(symbols.values())
    failures = []
    for moves in (_moved(symbols, taken, together=False), _moved(symbols, taken, together=True)):
        try:
            _, _, again = run(moves)
        except Exception as error:
            failures.append(error)
            continue
        if [len(shape) for shape, _ in again] != [len(shape) for shape, _ in shapes]:
            failures.append(ValueError("its outputs were others on other sizes"))
            continue
        pairs = [(size, _hint(size), _value(size, moves)) for size in inputs]

        def told(k: int, d: int, size: int, again: list[Any] = again, pairs: Any = pairs) -> Any:
            moved = again[k][0][d]
            follows = [x for x, before, after in pairs if (before, after) == (size, moved)]
            return follows[0] if follows and moved != size else size

        return told
    known, shared = _sizes_by_hint(*example)
    alike = sorted(size for shape, _ in shapes for size in shape if size in shared)
    if alike:
        raise ValueError(
            f"its output has a size of {alike[0]}, which several of its inputs' sizes had in the "
            f"example, and it failed on stand-ins of other sizes ({failures[-1]}), so split "
            "cannot tell which of those sizes it follows: split on an example where its "
            f"inputs' sizes differ from each other (none of them {alike[0]})"
        )
    return lambda k, d, size: known.get(size, size)


def _moved(symbols: dict[Any, int], taken: set[int], together: bool) -> dict[Any, int]:
    """A value for each symbol that no size had: apart, or the same for symbols that were equal.

    Smaller than the example's where one is free (a sequence longer than the
    example's may pass a model's largest), else larger.
    """
    moved: dict[Any, int] = {}
    chosen: dict[int, int] = {}
    used = set(taken)
    for symbol, hint in symbols.items():
        if together and hint in chosen:
            moved[symbol] = chosen[hint]
            continue
        free = itertools.chain(range(hint - 1, 1, -1), itertools.count(hint + 1))
        value = next(v for v in free if v not in used)
        used.add(value)
        moved[symbol] = chosen[hint] = value
    return moved


def _symbol(size: Any) -> Any:
    """The symbol a size is, if it is one alone (not fixed, nor made of several)."""
    if isinstance(size, torch.SymInt) and size.node.expr.is_Symbol:
        return size.node.expr
    return None


def _value(size: Any, moved: dict[Any, int]) -> int:
    """A (symbolic) size with its symbols ``moved``: the example's value where one of them
    is not (a size made of a symbol that is no input's size alone)."""
    if isinstance(size, torch.SymInt) and moved:
        expr = size.node.expr
        if expr.free_symbols <= moved.keys():
            return int(expr.subs(moved))
    return _hint(size)


def _hint(size: Any) -> int:
    """The example's value of a (symbolic) size."""
    if isinstance(size, torch.SymInt):
        hint = size.node.hint
        assert isinstance(hint, int), "a capture's sizes come from the example, so have values"
        return hint
    return int(size)


def _stand_in(fake: Tensor, moved: dict[Any, int]) -> Tensor:
    shape = [_value(size, moved) for size in fake.shape]
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
