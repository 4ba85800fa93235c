"""Micro-batches: scatter a mini-batch into micro-batches and gather them back.

A partition takes and returns any value a layer can: a tensor, or tuples,
namedtuples, lists and dicts of values nested at will. Every tensor in it,
at any depth, is split along dim 0; other values (and tensors wrapped in
``NoChunk``) reach every micro-batch unchanged. Between partitions a
micro-batch is kept flat (``Batch``: its leaves and the structure that
rebuilds the value), so that copies, dependency edges and checkpointing see
every tensor, and the next partition gets the value back with its types.

The first partition may be called with keyword arguments too: ``Arguments``
holds the positional and keyword arguments of that call, and scatters like
any value (keyword tensors split along dim 0, other keywords given to every
micro-batch).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from functools import partial
from typing import Any, TypeAlias

import torch
from torch import Tensor
from torch.utils._pytree import (
    KeyEntry,
    MappingKey,
    SequenceKey,
    TreeSpec,
    keystr,
    register_pytree_node,
    tree_flatten,
    tree_flatten_with_path,
    tree_leaves,
    tree_map,
    tree_unflatten,
)

__all__ = [
    "Arguments",
    "Batch",
    "NoChunk",
    "Value",
    "check_gatherable",
    "check_input",
    "check_rows",
    "gather",
    "refuse_attributes",
    "refuse_attributes_in",
    "scatter",
    "shared_leaves",
    "to_device",
]

# What a partition takes and returns: a tensor or a structure holding tensors.
Value: TypeAlias = Any


class NoChunk:
    """Wraps a tensor that every micro-batch receives whole, unsplit.

    Example::

        mask = torch.ones(seq_len, seq_len)
        out = pipe((tokens, NoChunk(mask)))  # tokens split, mask shared
    """

    __slots__ = ("tensor",)

    def __init__(self, tensor: Tensor) -> None:
        if not isinstance(tensor, Tensor):
            raise TypeError(f"NoChunk wraps a tensor, got {type(tensor).__name__}")
        self.tensor = tensor

    def __repr__(self) -> str:
        return f"NoChunk({self.tensor!r})"


class Arguments:
    """The call of a first layer: its positional and keyword arguments, as one value.

    A value like any other for the pipeline: its tensors, at any depth, are
    split along dim 0 and its other values reach every micro-batch; a
    partition given one calls its first layer with ``(*args, **kwargs)``.

    >>> call = Arguments((torch.zeros(4, 2),), {"mask": torch.ones(4), "p": 0.5})
    >>> [b.value for b in scatter(call, 2)][1]
    Arguments(tensor([[0., 0.],
            [0., 0.]]), mask=tensor([1., 1.]), p=0.5)
    """

    __slots__ = ("args", "kwargs")

    def __init__(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> None:
        self.args = tuple(args)
        self.kwargs = dict(kwargs)

    def call(self, function: Callable[..., Any]) -> Any:
        return function(*self.args, **self.kwargs)

    def parts(self) -> list[tuple[str, Any]]:
        """Each argument with the name error messages give it."""
        named = [(f"argument {i}", value) for i, value in enumerate(self.args)]
        return named + [(f"keyword argument {key!r}", value) for key, value in self.kwargs.items()]

    def __repr__(self) -> str:
        shown = [repr(value) for value in self.args]
        shown += [f"{key}={value!r}" for key, value in self.kwargs.items()]
        return f"Arguments({', '.join(shown)})"


def _flatten_arguments(arguments: Arguments) -> tuple[list[Any], Any]:
    values = [*arguments.args, *arguments.kwargs.values()]
    return values, (len(arguments.args), tuple(arguments.kwargs))


def _flatten_arguments_with_keys(arguments: Arguments) -> tuple[list[tuple[KeyEntry, Any]], Any]:
    values, context = _flatten_arguments(arguments)
    keys: list[KeyEntry] = [SequenceKey(i) for i in range(context[0])]
    keys += [MappingKey(key) for key in context[1]]
    return list(zip(keys, values, strict=True)), context


def _unflatten_arguments(values: Iterable[Any], context: Any) -> Arguments:
    count, keys = context
    values = list(values)
    return Arguments(tuple(values[:count]), dict(zip(keys, values[count:], strict=True)))


register_pytree_node(
    Arguments,
    _flatten_arguments,
    _unflatten_arguments,
    serialized_type_name="pipeline.Arguments",
    flatten_with_keys_fn=_flatten_arguments_with_keys,
)


_TENSOR_SPEC = tree_flatten(torch.empty(0))[1]


class Batch:
    """One micro-batch as it travels between partitions: the leaves of its value.

    ``leaves`` holds the value's tensors and other leaves in a fixed order;
    ``value`` rebuilds the value a partition receives (same types, same
    nesting). Code that moves or links tensors edits ``leaves`` in place.
    """

    __slots__ = ("leaves", "spec", "split_rows")

    def __init__(self, value: Value) -> None:
        if type(value) is Tensor:  # the common value, a pytree leaf: no flattening to do
            self.leaves, self.spec = [value], _TENSOR_SPEC
        else:
            self.leaves, self.spec = tree_flatten(value, is_leaf=_is_leaf)
        self.split_rows: int | None = None

    @classmethod
    def of(cls, leaves: list[Any], spec: TreeSpec, split_rows: int | None = None) -> Batch:
        batch = cls.__new__(cls)
        batch.leaves, batch.spec, batch.split_rows = leaves, spec, split_rows
        return batch

    @property
    def value(self) -> Value:
        """What a partition receives: the tensor, or the structure of values."""
        if self.spec.is_leaf():
            return self.leaves[0]
        return tree_unflatten(self.leaves, self.spec)

    def call(self, function: Callable[[Value], Value]) -> Batch:
        return Batch(function(self.value))

    def tensor_indices(self) -> Iterator[int]:
        return (i for i, v in enumerate(self.leaves) if isinstance(v, Tensor))

    def rows(self) -> int:
        """The micro-batch's size: the rows ``scatter`` gave it (its first split tensor's),
        else dim 0 of its first tensor that has one (0 if none)."""
        if self.split_rows is not None:
            return self.split_rows
        for i in self.tensor_indices():
            if self.leaves[i].dim() > 0:
                return int(self.leaves[i].size(0))
        return 0

    def first_differentiable(self) -> int | None:
        """Index of the first floating tensor: the carrier of phony edges."""
        for i in self.tensor_indices():
            if self.leaves[i].is_floating_point() or self.leaves[i].is_complex():
                return i
        return None

    def __len__(self) -> int:
        return len(self.leaves)

    def __getitem__(self, index: int) -> Any:
        return self.leaves[index]

    def __setitem__(self, index: int, value: Any) -> None:
        self.leaves[index] = value

    def __repr__(self) -> str:
        return f"Batch({self.value!r})"


def _is_leaf(value: Any) -> bool:
    """A value kept whole: a ``NoChunk``, and a ``torch.Size``, which pytree flattens as
    a tuple and would rebuild as one."""
    return isinstance(value, (NoChunk, torch.Size))


def check_input(input: Value, name: str = "input") -> None:
    """Raise a clear error unless ``input`` (``name``: the input, the target) can be split."""
    sizes: dict[str, int] = {}
    parts = input.parts() if isinstance(input, Arguments) else [(name, input)]
    tensors = [
        (name + keystr(path), leaf)
        for name, part in parts
        for path, leaf in tree_flatten_with_path(part, is_leaf=_is_leaf)[0]
        if isinstance(leaf, Tensor)
    ]
    for where, leaf in tensors:
        refuse_attributes(leaf, where, "its micro-batches, new tensors,")
        if leaf.layout not in (torch.strided, torch.jagged) or (
            leaf.is_nested and leaf.layout != torch.jagged
        ):
            kind = "nested" if leaf.is_nested else str(leaf.layout).removeprefix("torch.")
            raise TypeError(
                f"{where} is a {kind} tensor, which torch cannot split into micro-batches "
                "along dim 0; pass it dense (.to_dense()), or as a nested tensor of the "
                "jagged layout (torch.nested.nested_tensor(..., layout=torch.jagged))"
            )
        if leaf.dim() == 0:
            raise ValueError(
                f"{where} is a 0-dim tensor and cannot be split into micro-batches; wrap it "
                "in NoChunk to pass it to every micro-batch"
            )
        sizes[where] = leaf.size(0)
    if not sizes:
        what = "the arguments" if isinstance(input, Arguments) else type(input).__name__
        raise TypeError(
            f"Pipe {name} ({what}) holds no tensor to split into micro-batches "
            "(NoChunk tensors are not split); pass at least one tensor with a batch dimension"
        )
    if 0 in sizes.values():
        raise ValueError(
            f"{name} batch is empty (dim 0 has size 0): a Pipe needs at least one row to split "
            "into micro-batches; skip empty batches before calling it"
        )


def refuse_attributes(tensor: Tensor, where: str, losing: str) -> None:
    """Refuse a tensor carrying Python attributes (``h.mask = m``) that ``losing`` (what the
    pipe makes of it) would not carry: the plain model's layers could read them.

    >>> h = torch.zeros(2)
    >>> h.scale = 2.0
    >>> refuse_attributes(h, "input", "its micro-batches")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    TypeError: input carries the Python attribute(s) scale, which its micro-batches would not: ...
    """
    if torch.compiler.is_compiling():
        return  # dynamo traces up to the pipe's own break; it cannot read a tensor's dict
    found = _attributes(tensor)
    if found:
        raise TypeError(
            f"{where} carries the Python attribute(s) {', '.join(found)}, "
            f"which {losing} would not: a later layer reading them would get an "
            "AttributeError or a default; pass them as tensors or values beside it, or keep "
            "the layers that read them with the one that sets them"
        )


def _attributes(value: Any) -> list[str]:
    """The Python attributes set on a plain tensor (or parameter) ``value``, but torch's
    own, private ones (``_dynamo_dynamic_indices``, set by ``mark_dynamic`` and by
    compiled layers on their outputs), which only tune compilation."""
    if type(value) not in (Tensor, torch.nn.Parameter):
        return []
    return sorted(name for name in vars(value) if not name.startswith("_"))


def refuse_attributes_in(value: Value, where: str, losing: str) -> None:
    """``refuse_attributes`` for every tensor in ``value``, named by its place in it."""
    if torch.compiler.is_compiling():
        return
    if any(_attributes(leaf) for leaf in tree_leaves(value)):
        for path, leaf in tree_flatten_with_path(value)[0]:
            if isinstance(leaf, Tensor):
                refuse_attributes(leaf, where + keystr(path), losing)


def scatter(input: Value, chunks: int, name: str = "input") -> list[Batch]:
    """Split ``input`` into at most ``chunks`` micro-batches along dim 0.

    Follows ``Tensor.chunk``: 10 rows in 4 chunks gives 3, 3, 3 and 1 rows,
    and 3 rows in 4 chunks gives 3 micro-batches of one row. Each tensor is
    split on its own, so tensors of different sizes in dim 0 are fine as long
    as they split into the same number of micro-batches (as in torch's Pipe);
    else a ``ValueError`` names each tensor of ``name`` (the input, the
    target) with its rows and pieces.

    >>> [b.rows() for b in scatter(torch.zeros(10, 2), 4)]
    [3, 3, 3, 1]
    >>> [b.rows() for b in scatter((torch.zeros(10, 2), torch.zeros(12)), 4)]
    [3, 3, 3, 1]
    """
    if isinstance(input, Tensor):
        return [Batch(piece) for piece in input.chunk(chunks)]
    paths, spec = tree_flatten_with_path(input, is_leaf=_is_leaf)
    leaves = [leaf for _, leaf in paths]
    columns = [leaf.chunk(chunks) if isinstance(leaf, Tensor) else None for leaf in leaves]
    counts = {len(column) for column in columns if column is not None}
    if len(counts) > 1:
        listed = ", ".join(
            f"{name}{keystr(path)}: {leaf.size(0)} rows in {len(column)}"
            for (path, leaf), column in zip(paths, columns, strict=True)
            if column is not None
        )
        raise ValueError(
            f"the tensors of the {name} split into different numbers of micro-batches with "
            f"chunks={chunks} ({listed}): each is split on its own (Tensor.chunk) and all must "
            "give the same number; give them sizes in dim 0 that do, or wrap the ones not to "
            "split in NoChunk"
        )
    count = min(counts, default=0)
    # A NoChunk tensor before the first split one does not say the rows.
    split = next((column for column in columns if column is not None), None)
    return [
        Batch.of(
            [_piece(leaf, column, i) for leaf, column in zip(leaves, columns, strict=True)],
            spec,
            None if split is None else len(split[i]),
        )
        for i in range(count)
    ]


def shared_leaves(batches: list[Batch]) -> list[Tensor]:
    """The tensors every micro-batch holds as one object (``NoChunk`` ones): a write into
    one would be made once per micro-batch, where the plain model makes it once."""
    if len(batches) < 2:
        return []
    first = batches[0].leaves
    return [
        leaf
        for i, leaf in enumerate(first)
        if isinstance(leaf, Tensor) and all(b.leaves[i] is leaf for b in batches[1:])
    ]


def _piece(leaf: Any, column: Sequence[Tensor] | None, index: int) -> Any:
    if column is not None:
        return column[index]
    if isinstance(leaf, NoChunk):
        return leaf.tensor
    return leaf


def gather(batches: list[Batch], rows: Sequence[int] | None = None) -> Value:
    """Concatenate the micro-batches' outputs back into one mini-batch.

    Tensors are concatenated along dim 0, wherever they sit in the output,
    but for one that every micro-batch returns as the same memory (a
    ``NoChunk`` input, a buffer), returned once as from the plain model.
    ``rows``, the micro-batches' input rows, tells that memory apart from a
    tensor expanded to each micro-batch's rows (``h.expand(rows, -1)``,
    stride 0 in dim 0), which is the micro-batch's own. A non-tensor output
    must be equal in every micro-batch and is returned once.
    """
    _check_structures(batches)
    columns = zip(*(batch.leaves for batch in batches), strict=True)
    leaves = [_gather_column(list(column), k, rows) for k, column in enumerate(columns)]
    return Batch.of(leaves, batches[0].spec).value


def check_gatherable(batches: list[Batch], rows: Sequence[int] | None = None) -> None:
    """Refuse, before the step's backwards end, outputs that ``gather`` could not
    concatenate: structures that differ, shapes beyond dim 0, non-tensors that differ
    between micro-batches or count each one's ``rows``."""
    _check_structures(batches)
    for k, column in enumerate(zip(*(batch.leaves for batch in batches), strict=True)):
        tensors = [x for x in column if isinstance(x, Tensor)]
        if len(tensors) == len(column) and not all(_same_memory(x, tensors[0]) for x in tensors):
            _check_concatenable(tensors, k)
        elif not isinstance(column[0], Tensor):
            _check_non_tensor(list(column), k, rows)


def _check_structures(batches: list[Batch]) -> None:
    spec = batches[0].spec
    for i, batch in enumerate(batches[1:], start=1):
        if batch.spec != spec:
            raise TypeError(
                "the last partition returned outputs of different structure per micro-batch: "
                f"micro-batch 0 gave {spec}, micro-batch {i} gave {batch.spec}"
            )


def _gather_column(column: list[Any], position: int, rows: Sequence[int] | None) -> Any:
    first = column[0]
    if isinstance(first, Tensor):
        if all(_same_memory(x, first) for x in column[1:]) and not _expanded(column, rows):
            # Not the micro-batch's own rows (a NoChunk input, a buffer returned as it is):
            # the plain model returns it once.
            return first
        _check_concatenable(column, position)
        for tensor in column:
            refuse_attributes(tensor, f"output leaf {position}", "the micro-batches' concatenation")
        return torch.cat(column)
    _check_non_tensor(column, position, rows)
    return first


def _check_non_tensor(column: list[Any], position: int, rows: Sequence[int] | None) -> None:
    """Refuse a non-tensor output that differs between micro-batches, or counts their rows
    (the plain model's would count the batch's)."""
    first = column[0]
    if any(not _same_value(value, first) for value in column[1:]):
        raise ValueError(
            f"output leaf {position} is a non-tensor that differs between micro-batches "
            f"({column!r}); return it as a tensor with a batch dimension to gather it"
        )
    if rows is not None and len(rows) > 1 and all(_counts_rows(first, n) for n in rows):
        raise ValueError(
            f"output leaf {position} is {first!r} in every micro-batch, which holds its "
            f"micro-batch's rows ({rows[0]}): the plain model's would hold the batch's "
            f"({sum(rows)}); take it from the pipe's output tensors (out.shape, out.size(0)), "
            "not from inside the model"
        )


def _counts_rows(value: Any, rows: int) -> bool:
    """Whether ``value`` (a non-tensor output) is a row count: ``rows``, or a shape of them."""
    if isinstance(value, torch.Size):
        return len(value) > 0 and value[0] == rows
    return type(value) is int and value == rows


def _expanded(column: list[Tensor], rows: Sequence[int] | None) -> bool:
    """Whether ``column`` is one memory expanded to each micro-batch's rows (stride 0)."""
    first = column[0]
    if first.dim() == 0 or first.stride(0) != 0:
        return False
    return rows is None or all(t.size(0) == n for t, n in zip(column, rows, strict=True))


def _same_memory(a: Any, b: Tensor) -> bool:
    """Whether ``a`` is a tensor viewing exactly ``b``'s memory (``b`` itself, detached).

    A tensor with no memory to point at (a meta tensor, or a wrapper such as the
    ``AsyncCollectiveTensor`` a tensor-parallel layer returns: address 0) is no
    other's: every micro-batch's looked like one memory, and the gather returned
    micro-batch 0's rows alone.
    """
    return (
        isinstance(a, Tensor)
        and a.device == b.device
        and a.dtype == b.dtype
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.numel() > 0
        and b.data_ptr() != 0
        and a.data_ptr() == b.data_ptr()
    )


def _same_value(a: Any, b: Any) -> bool:
    """Whether two plain values are the same, a NaN the same as a NaN."""
    return bool(a == b) or (isinstance(a, float) and isinstance(b, float) and a != a and b != b)


def check_rows(leaves: Sequence[Any]) -> None:
    """Raise ValueError if a tensor among one micro-batch's output ``leaves`` has no rows.

    ``gather`` would refuse it at the end; a step checks each output as the
    last stage makes it, before any backward has written a gradient.
    """
    for position, leaf in enumerate(leaves):
        if isinstance(leaf, Tensor) and leaf.dim() == 0:
            raise _without_rows(position)


def _without_rows(position: int) -> ValueError:
    return ValueError(
        f"the last partition returned a 0-dim tensor (output leaf {position}); the outputs of "
        "the micro-batches are concatenated along dim 0, so return one value per row (e.g. a "
        "per-sample loss, reduced after the Pipe) instead of a reduced scalar. A transformers "
        "model given labels= returns its loss so: where you ask for the outputs (pipe(x), "
        "return_outputs=True, evaluate without a loss_fn), leave the labels out of its inputs "
        "and compute the loss in loss_fn from the logits"
    )


def _check_concatenable(column: list[Tensor], position: int) -> None:
    if column[0].dim() == 0:
        raise _without_rows(position)
    shapes = [tuple(t.shape[1:]) for t in column]
    if any(shape != shapes[0] for shape in shapes) or any(t.dim() == 0 for t in column):
        listed = ", ".join(f"micro-batch {i}: {tuple(t.shape)}" for i, t in enumerate(column))
        raise ValueError(
            f"the last partition's output leaf {position} has shapes that cannot be "
            f"concatenated along dim 0 ({listed}); every micro-batch must return the same "
            "shape beyond dim 0 (a squeeze() on a 1-row micro-batch is a common cause)"
        )


def to_device(input: Value, device: torch.device) -> Value:
    """``input`` with every tensor in it (``NoChunk`` ones included) on ``device``."""
    if isinstance(input, torch.Tensor):
        return input.to(device)
    return tree_map(partial(_value_to_device, device), input, is_leaf=_is_leaf)


def _value_to_device(device: torch.device, value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, NoChunk):
        return NoChunk(value.tensor.to(device))
    return value
