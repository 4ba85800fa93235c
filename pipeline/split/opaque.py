"""Opaque block calls: during capture, each call of a block becomes one graph node.

``torch.export`` would inline every module into aten ops. The blocks (the
modules a split keeps whole) must instead run as themselves, so while the
model is captured each block's call is answered by ``pipegrad::block``, a
custom op that the graph records as one node with the block's tensors (and
sizes) as inputs and its output tensors as outputs::

    h = embedding(...)                      h = embedding(...)
    h = self.h[0](h, mask=m)     ---->      out = pipegrad::block(0, [h, m], [])
    h = self.h[1](h, mask=m)                h = out[0]
                                            out_1 = pipegrad::block(1, [h, m], [])

What is not a tensor or a size (``mask=None``, ``use_cache=False``) is kept
in the call's ``BlockCall`` record, and the structure of the output (a
tuple, a ``ModelOutput``) too. At run time a piece rebuilds the call from the
record and calls the module itself (``instructions.py``); the op never runs.

The op's fake implementation runs the block's eager ``forward`` on the fake
inputs, so that the graph learns the shapes of its outputs, and records
which input tensors the block changes in place (``checks.py`` refuses that
where something else reads them). Symbolic shapes make a fake run slow (a
transformer layer takes a good part of a second), so blocks alike (one
class, parameters of the same shapes, arguments of the same sizes) share
the first one's result; every real call checks its output against it
(``BlockCall.call``).

The interception sets the block's ``_compiled_call_impl``, the attribute
``nn.Module.__call__`` consults before anything else, so the block's hooks do
not fire at capture (they fire at every real call), and a compiled block's
own compiled call is put back afterwards.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch
from torch import Tensor, nn
from torch._guards import detect_fake_mode
from torch.fx._symbolic_trace import _orig_module_call
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import TreeSpec, tree_flatten, tree_structure, tree_unflatten

from pipeline.split.attributes import paused
from pipeline.split.dims import Dimension, bind, dimension, expected
from pipeline.split.errors import SplitError, is_data_dependent
from pipeline.split.standin import real_run, state_of
from pipeline.split.where import argument_names, failure_location

__all__ = ["TENSOR", "BlockCall", "Result", "opaque_blocks"]


class _Marker(Enum):
    TENSOR = "tensor"
    SIZE = "size"


# Where a record's leaves held a tensor or a size that the graph carries.
TENSOR = _Marker.TENSOR
SIZE = _Marker.SIZE

# Values that may pass into or out of a block as they are, fixed at capture.
CONSTANT_TYPES = (type(None), bool, int, float, str, torch.dtype, torch.device, torch.layout)


@dataclass(frozen=True)
class Result:
    """What a block call returned at capture: its structure, and its tensors' sizes and dtypes.

    ``outputs`` holds the flattened output, ``TENSOR`` where a tensor was;
    ``inputs`` and ``sizes`` are the sizes of the call's tensors in terms of
    the capture's free sizes, so that a real call can be checked against them.
    """

    spec: TreeSpec
    outputs: list[Any]
    inputs: list[list[Dimension]]
    sizes: list[list[Dimension]]
    dtypes: list[torch.dtype]
    # Which of the call's tensors the block changes in place.
    written: list[int]
    # Learned from a run on stand-in values (``standin.py``), not from a fake run.
    stand_in: bool = False


@dataclass
class BlockCall:
    """One call of a block: the module, the structure of its arguments, and its ``Result``.

    ``leaves`` holds the flattened ``(args, kwargs)``: ``TENSOR`` and
    ``SIZE`` where the graph node passes a value, constants elsewhere.
    """

    module: nn.Module
    name: str
    spec: TreeSpec
    leaves: list[Any]
    result: Result | None = None

    def __deepcopy__(self, memo: dict[int, Any]) -> BlockCall:
        # A copy calls the copied module; the rest is immutable and shared.
        return BlockCall(
            copy.deepcopy(self.module, memo), self.name, self.spec, self.leaves, self.result
        )

    @property
    def done(self) -> Result:
        assert self.result is not None, "a block call's result is known once it is captured"
        return self.result

    def arguments(self, tensors: Sequence[Any], sizes: Sequence[Any]) -> tuple[Any, Any]:
        """The ``(args, kwargs)`` of the call, with ``tensors`` and ``sizes`` filled in."""
        found = {TENSOR: iter(tensors), SIZE: iter(sizes)}
        leaves = [next(found[leaf]) if isinstance(leaf, _Marker) else leaf for leaf in self.leaves]
        args, kwargs = tree_unflatten(leaves, self.spec)
        return args, kwargs

    def call(self, tensors: Sequence[Tensor], sizes: Sequence[Any]) -> list[Tensor]:
        """Call the module as the captured call did; its output tensors, checked."""
        args, kwargs = self.arguments(tensors, sizes)
        leaves, spec = tree_flatten(self.module(*args, **kwargs))
        result = self.done
        if spec != result.spec or any(
            not isinstance(leaf, Tensor) and leaf != kept
            for leaf, kept in zip(leaves, result.outputs, strict=True)
        ):
            raise RuntimeError(
                f"block {self.name} ({type(self.module).__name__}) returned {spec}, but when the "
                f"model was split it returned {result.spec} (constants {result.outputs}); a "
                "block must return the same structure at every call: split the model again "
                "with arguments that make it return what it returns now"
            )
        outputs = [leaf for leaf in leaves if isinstance(leaf, Tensor)]
        self._check(tensors, outputs)
        return outputs

    def _check(self, tensors: Sequence[Tensor], outputs: Sequence[Tensor]) -> None:
        result = self.done
        bound: dict[str, int] = {}
        for dims, tensor in zip(result.inputs, tensors, strict=True):
            bind(dims, tensor.shape, bound)
        for k, (dims, dtype, tensor) in enumerate(
            zip(result.sizes, result.dtypes, outputs, strict=True)
        ):
            sizes = [expected(dim, bound) for dim in dims]
            fits = len(sizes) == tensor.dim() and all(
                size is None or size == real for size, real in zip(sizes, tensor.shape, strict=True)
            )
            if not fits or tensor.dtype != dtype:
                remedy = (
                    _AUTOCAST
                    if fits and torch.is_autocast_enabled(tensor.device.type)
                    else _remedy(result)
                )
                raise RuntimeError(
                    f"block {self.name} ({type(self.module).__name__}) returned a {tensor.dtype} "
                    f"tensor of shape {tuple(tensor.shape)} as output tensor {k}, where the "
                    f"captured call returned {dtype} of shape {sizes} for these inputs; the code "
                    f"after it was captured for that. {remedy}"
                )

    def output(self, tensors: Sequence[Tensor]) -> Any:
        """The call's output rebuilt around ``tensors``."""
        found = iter(tensors)
        result = self.done
        leaves = [next(found) if leaf is TENSOR else leaf for leaf in result.outputs]
        return tree_unflatten(leaves, result.spec)


class _Capture(threading.local):
    calls: list[BlockCall] | None = None
    # Blocks of one class, alike in parameters and arguments, return alike: a
    # capture runs the first on fake tensors and reuses its result (checked at run time).
    results: dict[Any, tuple[Result, list[Tensor]]] | None = None
    # Each block's real parameters and buffers (a capture swaps fake ones in), for a real run.
    states: dict[nn.Module, dict[str, Tensor]] | None = None


_active = _Capture()
_one_at_a_time = threading.Lock()


@torch.library.custom_op("pipegrad::block", mutates_args=())
def _block(call: int, tensors: list[Tensor], sizes: list[int]) -> list[Tensor]:
    raise RuntimeError(
        "pipegrad::block stands for a block while a model is captured and never runs; a split "
        "piece calls the block itself"
    )


@_block.register_fake
def _(call: int, tensors: list[Tensor], sizes: list[int]) -> list[Tensor]:
    record = _calls()[call]
    assert _active.results is not None
    # A block runs as itself: what its code reads and assigns is followed, not captured.
    with paused():
        key = _likeness(record, tensors, sizes)
        found = _active.results.get(key)
        if found is None:
            found = _active.results[key] = _run_fake(record, tensors, sizes)
    record.result, fakes = found
    # A custom op's outputs may not alias its inputs: the fake ones are copies.
    return [fake.clone() for fake in fakes]


_AUTOCAST = (
    "autocast is on here: split captures the code between blocks without it (in the dtypes "
    "the example traced), and that code may read its inputs' dtype (an upcast for a "
    "normalisation), so a split model runs under autocast only where every block still "
    "returns the dtypes of the split. Run the split model without autocast, or make the "
    "blocks return those dtypes (cast their outputs back inside them)"
)


def _remedy(result: Result) -> str:
    if result.stand_in:
        return (
            "Its code depends on tensor values, so split learned its output from a run on "
            "stand-in values, whose shapes this call's output does not follow: its output's "
            "shape depends on the values too, or on a size none of its inputs has. Such a "
            "block cannot be a piece's block: give it outputs shaped like its inputs (keep "
            "the value-dependent shapes inside it)"
        )
    return "Split the model again after changing the block (or the hooks that change its output)"


def _run_fake(
    record: BlockCall, tensors: list[Tensor], sizes: list[int]
) -> tuple[Result, list[Tensor]]:
    fake_mode = detect_fake_mode(tensors)
    shape_env = fake_mode.shape_env if fake_mode is not None else None
    pending = len(shape_env.pending_fresh_unbacked_symbols) if shape_env is not None else 0
    stand_in = False
    try:
        output, outputs, written = _fake_forward(record, tensors, sizes)
    except Exception as error:
        if not is_data_dependent(error):
            raise
        if shape_env is not None:
            # The sizes the failed run made from values are no output of the op: forget them.
            del shape_env.pending_fresh_unbacked_symbols[pending:]
        output, outputs, written = _real_forward(record, tensors, sizes, error)
        stand_in = True
    leaves, _ = tree_flatten(output)
    result = Result(
        tree_structure(output),
        [_output_leaf(record, leaf) for leaf in leaves],
        [[dimension(size) for size in tensor.shape] for tensor in tensors],
        [[dimension(size) for size in tensor.shape] for tensor in outputs],
        [tensor.dtype for tensor in outputs],
        written,
        stand_in,
    )
    return result, outputs


def _fake_forward(
    record: BlockCall, tensors: list[Tensor], sizes: list[int]
) -> tuple[Any, list[Tensor], list[int]]:
    args, kwargs = record.arguments(tensors, sizes)
    # Below autograd (where fake kernels run) in-place ops bump no version counter.
    with _Writes(tensors) as writes, _untraced_module_calls():
        output = _eager(record.module).forward(*args, **kwargs)
    outputs = [leaf for leaf in tree_flatten(output)[0] if isinstance(leaf, Tensor)]
    return output, outputs, sorted(writes.found)


def _real_forward(
    record: BlockCall, tensors: list[Tensor], sizes: list[int], error: Exception
) -> tuple[Any, list[Tensor], list[int]]:
    """The block run for real on stand-ins, where its fake run depended on tensor values."""
    assert _active.states is not None
    module = _eager(record.module)
    try:
        # Untraced: a run that fails in a submodule (the second, on moved sizes, may) would
        # leave the module call on the tracer's stack.
        with _untraced_module_calls():
            return real_run(module, _active.states[module], record.arguments, tensors, sizes)
    except Exception as failure:
        raise _data_dependent(record, error, failure) from failure


@contextmanager
def _untraced_module_calls() -> Iterator[None]:
    """Module calls as torch defines them, not through the capture's tracer (put back after).

    torch.export's tracer patches ``nn.Module.__call__`` to keep a stack of the
    modules being called, and an exception inside one (a block's fake run
    failing on data-dependent code) leaves its entry there. A fake kernel
    makes no graph nodes, so its module calls need no tracking.
    """
    patched = nn.Module.__call__
    nn.Module.__call__ = _orig_module_call  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.__call__ = patched  # type: ignore[method-assign]


class _Writes(TorchDispatchMode):
    """Records which of ``tensors`` an op writes to (in place, or into a view of them)."""

    def __init__(self, tensors: Sequence[Tensor]) -> None:
        super().__init__()
        self.storages = {StorageWeakRef(t.untyped_storage()): i for i, t in enumerate(tensors)}
        self.found: set[int] = set()

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        schema = func._schema
        if schema.is_mutable:
            for i, argument in enumerate(schema.arguments):
                if argument.alias_info is None or not argument.alias_info.is_write:
                    continue
                value = args[i] if i < len(args) else kwargs.get(argument.name)
                if isinstance(value, Tensor):
                    found = self.storages.get(StorageWeakRef(value.untyped_storage()))
                    if found is not None:
                        self.found.add(found)
        return func(*args, **kwargs)


def _data_dependent(record: BlockCall, error: Exception, failure: Exception) -> SplitError:
    block = _eager(record.module)
    inside = {module: _join(record.name, name) for name, module in block.named_modules()}
    module, line = failure_location(error, inside)
    where = f"{module} at {line}" if module else line
    first = str(failure).strip().splitlines()[0] if str(failure).strip() else ""
    return SplitError(
        f"cannot capture block {record.name} ({type(block).__name__}): its code in {where} "
        "depends on the values of tensors, so split cannot learn its output on fake tensors, "
        "and a run on stand-in values (random floats, zero integers, true booleans, copies of "
        f"its parameters) failed with {type(failure).__name__}: {first}. Make the block run on "
        "such values, or its shapes independent of tensor values (for a transformers "
        "Mixture-of-Experts model, experts_implementation='batched_mm' in its config, or "
        "transformers' default 'grouped_mm' for float32 and bfloat16)"
    )


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if name else prefix


def _likeness(record: BlockCall, tensors: list[Tensor], sizes: list[int]) -> Any:
    """What makes two block calls return alike: class, parameters, arguments (not values)."""
    module = _eager(record.module)
    state = [
        (name, tuple(t.shape), t.dtype)
        for name, t in [*module.named_parameters(), *module.named_buffers()]
    ]
    inputs = [(str(tuple(t.shape)), t.dtype, t.device) for t in tensors]
    constants = [leaf for leaf in record.leaves if not isinstance(leaf, _Marker)]
    return (type(module), record.spec, repr(constants), tuple(state), tuple(inputs), str(sizes))


def _calls() -> list[BlockCall]:
    if _active.calls is None:
        raise RuntimeError("pipegrad::block was traced outside pipeline.split's capture")
    return _active.calls


def _eager(module: nn.Module) -> nn.Module:
    """The module whose ``forward`` runs eagerly (``torch.compile(m)`` wraps ``m``)."""
    original = getattr(module, "_orig_mod", None)
    return original if isinstance(original, nn.Module) else module


def _output_leaf(record: BlockCall, leaf: Any) -> Any:
    if isinstance(leaf, Tensor):
        return TENSOR
    if isinstance(leaf, CONSTANT_TYPES):
        return leaf
    raise SplitError(
        f"block {record.name} ({type(record.module).__name__}) returns a "
        f"{type(leaf).__name__}; a split block may return tensors and constants (None, bools, "
        "numbers, strings) only, since pieces pass nothing else between them. For a "
        "transformers model pass use_cache=False"
    )


def _argument_leaf(record: BlockCall, path: str, leaf: Any) -> Any:
    if isinstance(leaf, Tensor):
        return TENSOR
    if isinstance(leaf, torch.SymInt):
        return SIZE
    if isinstance(leaf, CONSTANT_TYPES):
        return leaf
    raise SplitError(
        f"block {record.name} ({type(record.module).__name__}) is called with a "
        f"{type(leaf).__name__} (as {path}); a split block may take tensors, sizes and constants "
        "(None, bools, numbers, strings) only, since pieces pass nothing else between them. "
        "For a transformers model pass use_cache=False (a cache object is passed to every layer)"
    )


def _opaque_call(record_of: tuple[nn.Module, str], *args: Any, **kwargs: Any) -> Any:
    module, name = record_of
    calls = _calls()
    leaves, spec = tree_flatten((args, kwargs))
    record = BlockCall(module, name, spec, [])
    paths = argument_names(_eager(module), args, kwargs)
    record.leaves = [_argument_leaf(record, p, v) for p, v in zip(paths, leaves, strict=True)]
    calls.append(record)
    tensors = [leaf for leaf in leaves if isinstance(leaf, Tensor)]
    sizes = [leaf for leaf in leaves if isinstance(leaf, torch.SymInt)]
    outputs = torch.ops.pipegrad.block(len(calls) - 1, tensors, sizes)
    return record.output(outputs)


@contextmanager
def opaque_blocks(blocks: dict[nn.Module, str]) -> Iterator[list[BlockCall]]:
    """Within the block, each call of a module in ``blocks`` is recorded as one graph node.

    Yields the list that receives the ``BlockCall`` of every call, in order.
    """
    calls: list[BlockCall] = []
    with _one_at_a_time:
        saved = {module: module._compiled_call_impl for module in blocks}
        _active.calls, _active.results = calls, {}
        _active.states = {_eager(module): state_of(_eager(module)) for module in blocks}
        try:
            for module, name in blocks.items():
                module._compiled_call_impl = _bind(module, name)
            yield calls
        finally:
            _active.calls, _active.results, _active.states = None, None, None
            for module, impl in saved.items():
                module._compiled_call_impl = impl


def _bind(module: nn.Module, name: str) -> Any:
    def call(*args: Any, **kwargs: Any) -> Any:
        return _opaque_call((module, name), *args, **kwargs)

    return call
