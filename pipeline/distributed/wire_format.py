"""Messages between processes as bytes: a fixed format that decodes to data, never to code.

A message travels as an envelope, then what did not fit in it: its
description, then each tensor's raw bytes, a send each::

    envelope     kind, description length, tensor count (int64 each), then
                 the description if it fits, then every tensor's bytes if
                 they all fit, each at an offset a multiple of 64
    description  encoded values: (key, structured, differentiable, sharing),
                 then the value, each of its tensors replaced by its dtype
                 name, shape and byte count; ``sharing`` lists the groups
                 of the value's leaves that shared memory in the sender (a
                 group of one: a leaf that shared memory with a skip)

What fits is decided by the room the receiver posted for the envelope
(``layout``): 1 KiB for a peer's first message, then the size the last
message from that peer would have taken whole and a little more, between
1 KiB and ``MAX_ROOM_BYTES``. Sender and receiver follow the same messages, so both
know the room, and a stage's activations of the same shape each step
travel in one send: one receive to post and wait for, not two.

An encoded value is a tag byte and what the tag says follows (little-endian)::

    N T F            None, True, False
    i f c            int (int64), float (float64), complex (2 float64)
    s                str: length (uint32), UTF-8
    y v              torch.dtype (by name), torch.device (as text)
    t                tensor: dtype name, ndim (uint8), dims and nbytes (int64)
    ( [              tuple, list: count (uint32), the items
    {                dict: count (uint32), then key and value, key by key

Nothing else can be encoded, so decoding never imports a module or calls
an object's constructor, as unpickling would: a peer can send data, never
code. Every size a peer announces is checked before anything is allocated:
the description's length, the tensor count, each tensor's dtype (one torch
has), shape and byte count (its dtype's item size times its element count)
and the message's total bytes. A value that cannot be encoded (any other
type, a namedtuple, an int beyond 64 bits) is refused by its sender, naming
its type, where it sits in the value and which message it is.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from pipeline.runtime.lazy import instance_of

__all__ = [
    "ABORT",
    "DATA",
    "DEFAULT_MAX_MESSAGE_BYTES",
    "ENVELOPE_BYTES",
    "HEAD_BYTES",
    "MAX_DESCRIPTION_BYTES",
    "MAX_ROOM_BYTES",
    "ROOM_SLACK_BYTES",
    "STOP",
    "Description",
    "KnownValues",
    "Layout",
    "MalformedMessageError",
    "TensorSlot",
    "decode",
    "encode",
    "head",
    "layout",
    "read_head",
]

# What a message is: values for a stage, a peer's failure, or its goodbye.
DATA, ABORT, STOP = 0, 1, 2
_HEAD = struct.Struct("<qqq")  # kind, description length, tensor count
HEAD_BYTES = _HEAD.size
# The room for a peer's first message, and the least ever posted.
ENVELOPE_BYTES = 1024
# The most a receiver posts ahead for a message: a buffer this large waits between
# steps for the next one, and what comes in it is copied out. Larger messages send
# their tensors apart, where a send more costs little beside the bytes and a copy would
# cost as much as it saves.
MAX_ROOM_BYTES = 2**20
# Tensors in an envelope start at multiples of this, so that any dtype can view them.
_ALIGN = 64
# The room posted for a peer's next message exceeds its last one's size by this much: a
# message whose description grows a little (a stage's last gradients carry the step's
# loss, ``step/stage.py``) still travels in one send.
ROOM_SLACK_BYTES = 256

# A description holds shapes, dtype names, keys and small plain values: a
# few dozen bytes per tensor. Larger ones are refused before allocating.
MAX_DESCRIPTION_BYTES = 16 * 2**20
# One message's tensors, together: far above any activation a stage sends,
# far below what a peer could make a process allocate without it.
DEFAULT_MAX_MESSAGE_BYTES = 16 * 2**30
# Deeper structures than any layer returns; decoding recurses this deep.
_MAX_DEPTH = 64
_MAX_DIMS = 64

_U8, _U32 = struct.Struct("<B"), struct.Struct("<I")
_I64, _F64 = struct.Struct("<q"), struct.Struct("<d")
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1

# Every dtype torch has, by the name it prints without "torch.".
_DTYPES = {
    str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)
}

_CARRIED = (
    "messages between processes carry dense tensors, None, bool, int, float, complex, str, "
    "torch.dtype and torch.device, in tuples, lists and dicts with str or int keys"
)


class MalformedMessageError(ValueError):
    """A peer's message does not follow the format, or announces sizes beyond the limits."""


@dataclass(frozen=True)
class TensorSlot:
    """Stands for a tensor in a decoded description: what the receiver allocates."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True)
class Description:
    """A decoded description: the message's key, leaves (tensors as slots), spec, flags,
    and the groups of leaves that shared memory."""

    key: Any
    leaves: list[Any]
    spec: TreeSpec | None
    differentiable: list[bool]
    sharing: list[frozenset[int]]

    def slots(self) -> Iterator[tuple[int, TensorSlot]]:
        """The leaves that are tensors, with their indices."""
        return ((k, x) for k, x in enumerate(self.leaves) if isinstance(x, TensorSlot))


# Envelopes


@dataclass(frozen=True)
class Layout:
    """What of a message its envelope holds, given the room its receiver posted.

    ``offsets`` are the tensors' places in the envelope when they all fit
    (else None: each follows in a send of its own); ``size`` is the
    envelope's length; ``next_room`` the room for the next message from the
    same peer.
    """

    description_inline: bool
    offsets: tuple[int, ...] | None
    size: int
    next_room: int


def layout(room: int, description_length: int, tensor_bytes: list[int]) -> Layout:
    """How a message of these sizes travels into ``room`` bytes (sender and receiver alike).

    >>> layout(1024, 40, [256])
    Layout(description_inline=True, offsets=(64,), size=320, next_room=1024)
    >>> layout(1024, 40, [4096])
    Layout(description_inline=True, offsets=None, size=64, next_room=4416)
    """
    start = HEAD_BYTES + description_length
    offsets, end = [], start
    for nbytes in tensor_bytes:
        at = -(-end // _ALIGN) * _ALIGN
        offsets.append(at)
        end = at + nbytes
    next_room = min(max(end + ROOM_SLACK_BYTES, ENVELOPE_BYTES), MAX_ROOM_BYTES)
    if end <= room:
        return Layout(True, tuple(offsets), end, next_room)
    if start <= room:
        return Layout(True, None, start, next_room)
    return Layout(False, None, HEAD_BYTES, next_room)


def head(kind: int, description: bytes, count: int, inline: bool) -> bytes:
    """An envelope's first bytes: its head, then the description if ``inline``."""
    return _HEAD.pack(kind, len(description), count) + (description if inline else b"")


def read_head(data: bytes) -> tuple[int, int, int]:
    """Kind, description length and tensor count of an envelope, all checked."""
    kind, length, count = _HEAD.unpack_from(data)
    if kind not in (DATA, ABORT, STOP):
        raise MalformedMessageError(f"unknown message kind {kind}")
    if not 0 <= length <= MAX_DESCRIPTION_BYTES:
        raise MalformedMessageError(
            f"a description of {length} bytes (at most {MAX_DESCRIPTION_BYTES} are accepted)"
        )
    if count < 0:
        raise MalformedMessageError(f"a tensor count of {count}")
    return kind, length, count


# Encoding


def encode(
    key: Any,
    leaves: list[Any],
    spec: TreeSpec | None,
    differentiable: list[bool],
    where: Callable[[], str],
    max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    sharing: Sequence[frozenset[int]] = (),
) -> tuple[bytes, list[torch.Tensor]]:
    """A message's description, and its tensors in the order their bytes follow.

    Raises TypeError naming the value's part that cannot be encoded (and
    ``where()``, the message), or ValueError if it is larger than the limits.
    """
    value = list(leaves) if spec is None else tree_unflatten(leaves, spec)
    writer = _Writer(where)
    groups = [sorted(group) for group in sharing]
    writer.value((key, spec is not None, list(differentiable), groups), "", 0)
    writer.value(value, "", 0)
    description = b"".join(writer.parts)
    total = sum(t.nbytes for t in writer.tensors)
    if len(description) > MAX_DESCRIPTION_BYTES or total > max_bytes:
        raise ValueError(
            f"{where()} takes {len(description)} bytes of description and {total} bytes of "
            f"tensors, over the limits of {MAX_DESCRIPTION_BYTES} and {max_bytes} (the "
            "pipeline's max_message_bytes): send fewer or smaller values between stages"
        )
    return description, writer.tensors


class _Writer:
    """Encodes values into ``parts``, collecting the tensors met on the way."""

    def __init__(self, where: Callable[[], str]) -> None:
        self.where = where
        self.parts: list[bytes] = []
        self.tensors: list[torch.Tensor] = []

    def value(self, x: Any, path: str, depth: int) -> None:
        if depth > _MAX_DEPTH:
            raise TypeError(f"{self.where()} nests deeper than {_MAX_DEPTH} levels at {path}")
        kind = type(x)
        if isinstance(x, torch.Tensor):
            self.tensor(x, path)
        elif x is None or kind is bool:
            self.parts.append(b"N" if x is None else b"T" if x else b"F")
        elif kind is int:
            if not _INT64_MIN <= x <= _INT64_MAX:
                self.refuse(path, "an int beyond 64 bits")
            self.parts += [b"i", _I64.pack(x)]
        elif kind is float:
            self.parts += [b"f", _F64.pack(x)]
        elif kind is complex:
            self.parts += [b"c", _F64.pack(x.real), _F64.pack(x.imag)]
        elif kind is str:
            self.text(b"s", x)
        elif kind is torch.dtype:
            self.dtype(x)
        elif kind is torch.device:
            self.text(b"v", str(x))
        elif kind is tuple or kind is list:
            self.parts += [b"(" if kind is tuple else b"[", _U32.pack(len(x))]
            for k, item in enumerate(x):
                self.value(item, f"{path}[{k}]", depth + 1)
        elif kind is dict:
            self.parts += [b"{", _U32.pack(len(x))]
            for name, item in x.items():
                if type(name) not in (str, int):
                    self.refuse(path, f"a key of type {_type_name(name)}")
                self.value(name, path, depth + 1)
                self.value(item, f"{path}[{name!r}]", depth + 1)
        else:
            self.refuse(path, _what(x), _hint(x))

    def tensor(self, x: torch.Tensor, path: str) -> None:
        if not _plain(x):
            # It would arrive as a plain tensor, and code that asks its type would change.
            self.refuse(
                path,
                f"a tensor of type {_type_name(x)}",
                "; it would arrive as a plain torch.Tensor: send x.as_subclass(torch.Tensor) "
                "(or the tensor it holds), or keep the layers that need the subclass in one stage",
            )
        if x.is_meta:
            self.refuse(path, "a tensor on the meta device", ", which holds no values to send")
        if x.is_nested or x.is_quantized or x.layout != torch.strided:
            form = "nested" if x.is_nested else "quantized" if x.is_quantized else str(x.layout)
            self.refuse(path, f"a {form} tensor", "; send a dense one (to_dense, dequantize)")
        if x.nbytes != x.numel() * x.dtype.itemsize:
            self.refuse(path, f"a {x.dtype} tensor, which is not whole bytes per element")
        self.parts.append(b"t")
        self.dtype(x.dtype, tag=b"")
        self.parts.append(_U8.pack(x.dim()))
        self.parts += [_I64.pack(n) for n in (*x.shape, x.nbytes)]
        self.tensors.append(x)

    def dtype(self, dtype: torch.dtype, tag: bytes = b"y") -> None:
        name = str(dtype).removeprefix("torch.").encode()
        self.parts += [tag, _U8.pack(len(name)), name]

    def text(self, tag: bytes, text: str) -> None:
        data = text.encode("utf-8", "surrogatepass")
        self.parts += [tag, _U32.pack(len(data)), data]

    def refuse(self, path: str, what: str, hint: str = "") -> NoReturn:
        at = f" at {path}" if path else ""
        raise TypeError(
            f"{self.where()} holds {what}{at}, which cannot be sent to another process: "
            f"{_CARRIED}{hint}"
        )


def _plain(x: torch.Tensor) -> bool:
    """Whether ``x`` is a tensor its receiver gets as it is: a plain one, a parameter (its
    plain tensor), or the result of a collective still under way (tensor parallelism's
    outputs), which is a plain tensor once waited for."""
    return type(x) in (torch.Tensor, torch.nn.Parameter) or instance_of(
        x, "torch.distributed._functional_collectives", "AsyncCollectiveTensor"
    )


def _type_name(x: Any) -> str:
    kind = type(x)
    if kind.__module__ == "builtins":
        return kind.__qualname__
    return f"{kind.__module__}.{kind.__qualname__}"


def _what(x: Any) -> str:
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        return f"a namedtuple {_type_name(x)}"
    return f"a value of type {_type_name(x)}"


def _hint(x: Any) -> str:
    if isinstance(x, tuple):
        return "; return a plain tuple (or a dict) instead"
    if isinstance(x, dict):
        return "; return a plain dict instead"
    return ""


# Decoding


def decode(
    data: bytes,
    kind: int,
    count: int,
    max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    known: KnownValues | None = None,
) -> Description:
    """A peer's description of a message of ``kind`` and ``count`` tensors, checked.

    ``known`` keeps the values of this peer's recent descriptions: a stage's
    messages differ from one micro-batch to the next in their key alone.

    Raises MalformedMessageError if it is not one, as this module encodes it.
    """
    reader = _Reader(data, max_bytes)
    header = reader.value(0)
    if not (isinstance(header, tuple) and len(header) == 4):
        raise MalformedMessageError("the description does not start with its key and flags")
    key, structured, differentiable, groups = header
    if type(structured) is not bool or not (
        isinstance(differentiable, list) and all(type(d) is bool for d in differentiable)
    ):
        raise MalformedMessageError("the description's flags are not booleans")
    rest = data[reader.position :]
    value = known.get(structured, rest) if known is not None else None
    if value is None:
        value = _value(reader, structured)
        if known is not None:
            known.add(structured, rest, value)
    leaves, spec = value
    if differentiable and len(differentiable) != len(leaves):
        raise MalformedMessageError(
            f"{len(differentiable)} differentiable flags for {len(leaves)} values"
        )
    sharing = _sharing(groups, len(leaves))
    described = Description(key, list(leaves), spec, differentiable, sharing)
    _check_form(kind, count, described)
    return described


def _sharing(groups: object, count: int) -> list[frozenset[int]]:
    """The groups of a message's ``count`` leaves that shared memory, checked."""
    if not (
        isinstance(groups, list)
        and all(
            isinstance(g, list) and len(g) > 0 and all(type(k) is int and 0 <= k < count for k in g)
            for g in groups
        )
    ):
        raise MalformedMessageError(
            f"the groups of leaves sharing memory are not lists of positions among {count}"
        )
    return [frozenset(g) for g in groups]


_Value = tuple[tuple[Any, ...], TreeSpec | None]
_CONTAINERS = (tuple, list, dict)


def _value(reader: _Reader, structured: bool) -> _Value:
    """The leaves and spec of the value that ends the description, checked."""
    value = reader.value(0)
    if reader.position != len(reader.data):
        raise MalformedMessageError(
            f"{len(reader.data) - reader.position} bytes after the description"
        )
    if structured:
        leaves, spec = tree_flatten(value)
        return tuple(leaves), spec
    if isinstance(value, list):
        return tuple(value), None
    raise MalformedMessageError("an unstructured message that is not a list of leaves")


class KnownValues:
    """The decoded values of a peer's last few descriptions, by their bytes.

    Only small descriptions are kept, and a few of them: what a peer sends
    cannot make this grow. Only values whose leaves are immutable (tensor
    slots and plain values, no containers) are kept, so that one decoded
    value serves every message it describes.
    """

    ENTRIES = 16
    LARGEST = 4096

    def __init__(self) -> None:
        self._values: dict[tuple[bool, bytes], _Value] = {}

    def get(self, structured: bool, data: bytes) -> _Value | None:
        return self._values.get((structured, data))

    def add(self, structured: bool, data: bytes, value: _Value) -> None:
        if len(data) > self.LARGEST or any(type(x) in _CONTAINERS for x in value[0]):
            return
        if len(self._values) >= self.ENTRIES:
            del self._values[next(iter(self._values))]
        self._values[structured, data] = value


def _check_form(kind: int, count: int, described: Description) -> None:
    """Raise MalformedMessageError unless ``described`` is a message of ``kind`` as sent."""
    tensors = sum(1 for _ in described.slots())
    if tensors != count:
        raise MalformedMessageError(
            f"an envelope announcing {count} tensors for a description of {tensors}"
        )
    key, leaves = described.key, described.leaves
    if kind == DATA:
        step_and_name = isinstance(key, tuple) and len(key) == 2 and type(key[0]) is int
        if not (step_and_name and _is_name(key[1])):
            raise MalformedMessageError(f"the key {key!r}, not (step, name) of a message")
    elif kind == ABORT:
        if not (type(key) is int and len(leaves) == 1 and type(leaves[0]) is str):
            raise MalformedMessageError("an abort that is not a step and a text")
    elif leaves:
        raise MalformedMessageError("a stop that carries values")


def _is_name(key: Any) -> bool:
    """Whether ``key`` names a message as stages do: a str, an int or a tuple of them."""
    if isinstance(key, tuple):
        return all(_is_name(part) for part in key)
    return type(key) in (str, int)


class _Reader:
    """Decodes values from ``data``, checking every size against what is left and the limits."""

    def __init__(self, data: bytes, max_bytes: int) -> None:
        self.data = data
        self.position = 0
        self.max_bytes = max_bytes
        self.tensor_bytes = 0

    def take(self, n: int) -> bytes:
        if n > len(self.data) - self.position:
            raise MalformedMessageError(
                f"the description ends at byte {len(self.data)}, before the {n} bytes that "
                f"byte {self.position} announces"
            )
        chunk = self.data[self.position : self.position + n]
        self.position += n
        return chunk

    def unpack(self, form: struct.Struct) -> Any:
        return form.unpack(self.take(form.size))[0]

    def value(self, depth: int) -> Any:
        if depth > _MAX_DEPTH:
            raise MalformedMessageError(f"values nested deeper than {_MAX_DEPTH} levels")
        at = self.position
        tag = self.take(1)
        simple = {b"N": None, b"T": True, b"F": False}
        if tag in simple:
            return simple[tag]
        if tag == b"i":
            return self.unpack(_I64)
        if tag == b"f":
            return self.unpack(_F64)
        if tag == b"c":
            return complex(self.unpack(_F64), self.unpack(_F64))
        if tag == b"s":
            return self.text()
        if tag == b"y":
            return self.dtype()
        if tag == b"v":
            return self.device()
        if tag == b"t":
            return self.tensor()
        if tag in (b"(", b"["):
            items = [self.value(depth + 1) for _ in range(self.count())]
            return tuple(items) if tag == b"(" else items
        if tag == b"{":
            return self.dict(depth)
        raise MalformedMessageError(f"unknown tag {tag!r} at byte {at}")

    def count(self) -> int:
        count: int = self.unpack(_U32)
        if count > len(self.data) - self.position:  # every item takes a byte at least
            raise MalformedMessageError(f"{count} items announced, more than the bytes left")
        return count

    def text(self) -> str:
        data = self.take(self.unpack(_U32))
        try:
            return data.decode("utf-8", "surrogatepass")
        except UnicodeDecodeError as error:
            raise MalformedMessageError(f"a text that is not UTF-8: {error}") from None

    def dtype(self) -> torch.dtype:
        name = self.take(self.unpack(_U8)).decode("ascii", "replace")
        if name not in _DTYPES:
            raise MalformedMessageError(f"dtype {name!r}, which torch does not have")
        return _DTYPES[name]

    def device(self) -> torch.device:
        text = self.text()
        try:
            return torch.device(text)
        except (RuntimeError, ValueError):
            raise MalformedMessageError(f"device {text!r}, which torch does not know") from None

    def tensor(self) -> TensorSlot:
        dtype = self.dtype()
        ndim = self.unpack(_U8)
        if ndim > _MAX_DIMS:
            raise MalformedMessageError(f"a tensor of {ndim} dimensions (at most {_MAX_DIMS})")
        shape = tuple(self.unpack(_I64) for _ in range(ndim))
        nbytes = self.unpack(_I64)
        if any(n < 0 for n in shape):
            raise MalformedMessageError(f"a tensor of shape {shape}")
        if nbytes != math.prod(shape) * dtype.itemsize:
            raise MalformedMessageError(
                f"a {dtype} tensor of shape {shape} announced as {nbytes} bytes"
            )
        self.tensor_bytes += nbytes
        if self.tensor_bytes > self.max_bytes:
            raise MalformedMessageError(
                f"tensors of more than {self.max_bytes} bytes in one message (this process's "
                "max_message_bytes)"
            )
        return TensorSlot(dtype, shape, nbytes)

    def dict(self, depth: int) -> dict[Any, Any]:
        result: dict[Any, Any] = {}
        for _ in range(self.count()):
            name = self.value(depth + 1)
            if type(name) not in (str, int) or name in result:
                raise MalformedMessageError(f"a dict key {name!r} (repeated, or not a str or int)")
            result[name] = self.value(depth + 1)
        return result
