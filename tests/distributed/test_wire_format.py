"""Messages between processes as bytes: what crosses, what is refused, and peers' bytes checked."""

from __future__ import annotations

import os
import pickle
import struct
from collections import OrderedDict, namedtuple
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._pytree import tree_flatten

from pipeline.distributed.wire_format import (
    ABORT,
    DATA,
    ENVELOPE_BYTES,
    HEAD_BYTES,
    MAX_DESCRIPTION_BYTES,
    MAX_ROOM_BYTES,
    ROOM_SLACK_BYTES,
    STOP,
    KnownValues,
    MalformedMessageError,
    TensorSlot,
    decode,
    encode,
    head,
    layout,
    read_head,
)

KEY = (3, ("act", 1, 0))


def where() -> str:
    return "the activation of micro-batch 0 that stage 0 sends to stage 1 (rank 1)"


def round_trip(value: Any) -> tuple[Any, list[torch.Tensor]]:
    """``value`` through the format; each tensor back as its slot, as a receiver gets it."""
    leaves, spec = tree_flatten(value)
    data, tensors = encode(KEY, leaves, spec, [False] * len(leaves), where)
    described = decode(data, DATA, len(tensors))
    assert described.key == KEY
    assert described.spec == spec
    return described.leaves, tensors


def test_structures_and_plain_values_cross_as_they_were() -> None:
    x, y = torch.randn(2, 3), torch.arange(4, dtype=torch.int64)
    value = (
        x,
        {"scale": y, "times": 3, 7: [None, True, 1.5, 2 - 1j, "é", torch.bfloat16]},
        [torch.device("cpu"), -(2**63), 2**63 - 1],
    )
    leaves, tensors = round_trip(value)
    expected, _ = tree_flatten(value)
    assert tensors == [x, y]
    assert leaves[0] == TensorSlot(torch.float32, (2, 3), 24)
    assert leaves[1] == TensorSlot(torch.int64, (4,), 32)
    assert leaves[2:] == expected[2:]
    assert [type(v) for v in leaves[2:]] == [type(v) for v in expected[2:]]


def test_every_dtype_and_shape_of_a_tensor_is_described() -> None:
    for dtype in (torch.bool, torch.uint8, torch.float16, torch.complex64, torch.float64):
        for shape in ((), (0,), (3, 0, 2), (1, 2, 3, 4)):
            leaves, _ = round_trip(torch.zeros(shape, dtype=dtype))
            numel = torch.Size(shape).numel()
            assert leaves == [TensorSlot(dtype, shape, numel * dtype.itemsize)]


Pair = namedtuple("Pair", "x y")


class Opaque:
    pass


class Marked(torch.Tensor):
    """A tensor subclass: a stage may branch on it (``isinstance(x, Marked)``)."""


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        ((torch.ones(1), Pair(torch.ones(1), 2)), f"a namedtuple {__name__}.Pair at [1]"),
        ({"a": [Opaque()]}, f"a value of type {__name__}.Opaque at ['a'][0]"),
        (OrderedDict(a=torch.ones(1)), "a value of type collections.OrderedDict"),
        ((torch.ones(1), 2**64), "an int beyond 64 bits at [1]"),
        ((torch.ones(1), {(1, 2): 3}), "a key of type tuple"),
        ((torch.ones(1), slice(1)), "a value of type slice at [1]"),
        # Each would arrive as a plain dense tensor, or not at all.
        ((torch.ones(2).as_subclass(Marked),), f"a tensor of type {__name__}.Marked at [0]"),
        ((torch.ones(2), torch.eye(2).to_sparse()), "a torch.sparse_coo tensor at [1]"),
        ((torch.empty(2, device="meta"),), "a tensor on the meta device at [0]"),
    ],
)
def test_what_cannot_cross_is_refused_by_the_sender_naming_its_type_and_where(
    value: Any, fragment: str
) -> None:
    leaves, spec = tree_flatten(value)
    with pytest.raises(TypeError) as caught:
        encode(KEY, leaves, spec, [], where)
    message = str(caught.value)
    assert message.startswith(where() + " holds ")
    assert fragment in message
    assert "cannot be sent to another process" in message


def test_a_message_over_the_size_limit_is_refused_by_the_sender() -> None:
    with pytest.raises(ValueError, match="max_message_bytes"):
        encode(KEY, [torch.zeros(10)], None, [], where, max_bytes=39)


def test_a_pickled_payload_is_refused_and_runs_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "payload-ran"

    class Payload:
        def __reduce__(self) -> tuple[Any, ...]:
            return os.mkdir, (str(marker),)

    with pytest.raises(MalformedMessageError, match="unknown tag"):
        decode(pickle.dumps((KEY, False, [], [Payload()])), DATA, 0)
    assert not marker.exists()


def described(value: Any, count: int | None = None, kind: int = DATA) -> Any:
    """Encode ``value``, then decode it announcing ``count`` tensors (its own by default)."""
    leaves, spec = tree_flatten(value)
    data, tensors = encode(KEY if kind == DATA else 0, leaves, spec, [], where)
    return decode(data, kind, len(tensors) if count is None else count)


def tensor_description(dtype: bytes, shape: list[int], nbytes: int) -> bytes:
    """A description of one tensor, written by hand: any dtype name, shape and size."""
    empty, _ = encode(KEY, [], None, [], where)
    head = empty[: -len(b"[" + struct.pack("<I", 0))]  # the key and flags, without the list
    dims = b"".join(struct.pack("<q", n) for n in [*shape, nbytes])
    tensor = b"t" + bytes([len(dtype)]) + dtype + bytes([len(shape)]) + dims
    return head + b"[" + struct.pack("<I", 1) + tensor


def test_the_groups_of_leaves_that_shared_memory_cross_and_bad_ones_are_refused() -> None:
    # The receiver gets such tensors apart: the groups let it refuse a write into one.
    leaves = [torch.zeros(2), torch.zeros(2), torch.zeros(3)]
    # A group of one: a leaf that shared memory with a skip.
    groups = [frozenset({2, 0}), frozenset({1})]
    data, tensors = encode(KEY, leaves, None, [False] * 3, where, sharing=groups)
    assert decode(data, DATA, len(tensors)).sharing == [frozenset({0, 2}), frozenset({1})]
    for bad in [frozenset({0, 3}), frozenset()]:  # beyond the leaves; an empty group
        data, tensors = encode(KEY, leaves, None, [False] * 3, where, sharing=[bad])
        with pytest.raises(MalformedMessageError, match="sharing memory are not lists"):
            decode(data, DATA, len(tensors))


def test_the_hand_written_description_is_a_valid_one() -> None:
    # The malformed variants below differ from this one in one field each.
    good = decode(tensor_description(b"float32", [2, 3], 24), DATA, 1)
    assert good.leaves == [TensorSlot(torch.float32, (2, 3), 24)]


@pytest.mark.parametrize(
    ("data", "count", "fragment"),
    [
        (
            tensor_description(b"float32", [2, 3], 24),
            2,
            "announcing 2 tensors for a description of 1",
        ),
        (
            tensor_description(b"float99", [2, 3], 24),
            1,
            "dtype 'float99', which torch does not have",
        ),
        (tensor_description(b"float32", [2, 3], 25), 1, "announced as 25 bytes"),
        (tensor_description(b"float32", [2, -3], -24), 1, "shape (2, -3)"),
        (tensor_description(b"uint8", [2**40, 2**40], 2**62), 1, "announced as 4611686"),
        (tensor_description(b"uint8", [1] * 65, 1), 1, "a tensor of 65 dimensions"),
        (tensor_description(b"float32", [2, 3], 24)[:-3], 1, "ends at byte"),
        (tensor_description(b"float32", [2, 3], 24) + b"N", 1, "1 bytes after the description"),
        (b"(" + struct.pack("<I", 2**31) + b"N", 0, "more than the bytes left"),
        ((b"(" + struct.pack("<I", 1)) * 100 + b"N", 0, "nested deeper than"),
    ],
)
def test_a_malformed_description_is_refused_naming_what_is_wrong(
    data: bytes, count: int, fragment: str
) -> None:
    with pytest.raises(MalformedMessageError) as caught:
        decode(data, DATA, count)
    assert fragment in str(caught.value)


def test_tensors_beyond_the_receivers_limit_are_refused_before_any_allocation() -> None:
    data = tensor_description(b"float32", [2**20, 2**20], 2**42)
    with pytest.raises(MalformedMessageError, match="more than 1024 bytes in one message"):
        decode(data, DATA, 1, max_bytes=1024)


@pytest.mark.parametrize(
    ("kind", "value", "fragment"),
    [
        (ABORT, [torch.ones(1)], "an abort that is not a step and a text"),
        (STOP, ["bye"], "a stop that carries values"),
    ],
)
def test_a_message_of_the_wrong_form_for_its_kind_is_refused(
    kind: int, value: Any, fragment: str
) -> None:
    with pytest.raises(MalformedMessageError, match=fragment):
        described(value, kind=kind)


def test_an_unusable_key_is_refused() -> None:
    data, _ = encode((1, ["act", 1]), [], None, [], where)
    with pytest.raises(MalformedMessageError, match="not \\(step, name\\)"):
        decode(data, DATA, 0)


def test_an_envelope_head_is_read_back_and_bad_ones_are_refused() -> None:
    small = b"x" * 10
    first = head(DATA, small, 2, inline=True)
    assert first[HEAD_BYTES:] == small and read_head(first) == (DATA, 10, 2)
    assert head(DATA, small, 2, inline=False) == first[:HEAD_BYTES]
    bad = [
        (struct.pack("<qqq", 7, 0, 0), "unknown message kind 7"),
        (struct.pack("<qqq", DATA, 2**62, 0), f"at most {MAX_DESCRIPTION_BYTES} are accepted"),
        (struct.pack("<qqq", DATA, -1, 0), "a description of -1 bytes"),
        (struct.pack("<qqq", DATA, 0, -5), "a tensor count of -5"),
    ]
    for data, fragment in bad:
        with pytest.raises(MalformedMessageError) as caught:
            read_head(data + bytes(1000))
        assert fragment in str(caught.value)


def test_a_message_travels_whole_in_its_envelope_when_it_fits_the_room() -> None:
    laid = layout(ENVELOPE_BYTES, 100, [8, 0, 300])
    # Each tensor at a multiple of 64 (any dtype can view it there), after the description.
    assert laid.description_inline and laid.offsets == (128, 192, 192)
    assert laid.size == 492 and laid.next_room == ENVELOPE_BYTES


def test_what_does_not_fit_goes_apart_and_the_next_room_is_the_whole_message() -> None:
    tensors_apart = layout(ENVELOPE_BYTES, 100, [4096])
    assert tensors_apart.description_inline and tensors_apart.offsets is None
    whole = 128 + 4096
    assert tensors_apart.size == HEAD_BYTES + 100
    assert tensors_apart.next_room == whole + ROOM_SLACK_BYTES
    # The next message alike then fits, whole; so does one whose description is longer by
    # what fits in the slack (a stage's last gradients carry the step's loss).
    assert layout(tensors_apart.next_room, 100, [4096]).offsets == (128,)
    longer = 100 + ROOM_SLACK_BYTES - 64  # its tensor starts at most 64 bytes further on
    assert layout(tensors_apart.next_room, longer, [4096]).offsets is not None
    all_apart = layout(ENVELOPE_BYTES, 5000, [])
    assert not all_apart.description_inline and all_apart.offsets is None
    assert all_apart.size == HEAD_BYTES
    assert all_apart.next_room == HEAD_BYTES + 5000 + ROOM_SLACK_BYTES


def test_the_room_stays_within_its_bounds() -> None:
    assert layout(MAX_ROOM_BYTES, 10, [2 * MAX_ROOM_BYTES]).next_room == MAX_ROOM_BYTES
    assert layout(MAX_ROOM_BYTES, 10, []).next_room == ENVELOPE_BYTES


def test_a_known_value_serves_the_next_message_and_its_checks_still_run() -> None:
    known = KnownValues()
    x = torch.randn(4, 8)
    first, _ = encode((3, ("act", 1, 0)), [x], None, [True], where)
    second, _ = encode((3, ("act", 1, 1)), [x], None, [True], where)
    a = decode(first, DATA, 1, known=known)
    b = decode(second, DATA, 1, known=known)
    assert (a.key, b.key) == ((3, ("act", 1, 0)), (3, ("act", 1, 1)))
    assert a.leaves == b.leaves == [TensorSlot(torch.float32, (4, 8), 128)]
    assert a.leaves is not b.leaves
    assert len(known._values) == 1  # the second message's value came from the first's
    with pytest.raises(MalformedMessageError, match="announcing 2 tensors"):
        decode(second, DATA, 2, known=known)


def test_a_value_with_containers_among_its_leaves_is_decoded_anew_each_time() -> None:
    # Only a peer that does not follow the stages sends this; a receiver that
    # changes the list it got must not change what the next message decodes to.
    known = KnownValues()
    data, _ = encode(KEY, [[1, 2]], None, [], where)
    first = decode(data, DATA, 0, known=known)
    first.leaves[0].append(3)
    assert decode(data, DATA, 0, known=known).leaves == [[1, 2]]
    assert len(known._values) == 0


def test_known_values_stay_few_and_small() -> None:
    known = KnownValues()
    for n in range(KnownValues.ENTRIES + 4):
        data, _ = encode(KEY, [torch.zeros(n + 1)], None, [], where)
        decode(data, DATA, 1, known=known)
    large, _ = encode(KEY, ["x" * KnownValues.LARGEST], None, [], where)
    decode(large, DATA, 0, known=known)
    assert len(known._values) == KnownValues.ENTRIES
    assert all(len(data) <= KnownValues.LARGEST for _, data in known._values)


def test_a_parameter_crosses_as_the_plain_tensor_it_is() -> None:
    leaves, tensors = round_trip(torch.nn.Parameter(torch.ones(2, 3)))
    assert leaves == [TensorSlot(torch.float32, (2, 3), 24)] and len(tensors) == 1


def test_a_conjugate_or_negative_view_travels_as_its_values() -> None:
    from pipeline.distributed.p2p import _raw_bytes

    z = torch.complex(torch.randn(3), torch.randn(3))
    for view in (z.conj(), z.conj().imag):  # a conjugate view, then a negative one
        assert view.is_conj() or view.is_neg()
        sent = _raw_bytes(view)
        values = view.resolve_conj().resolve_neg().contiguous()
        assert torch.equal(sent.view(values.dtype).reshape(values.shape), values)


@pytest.mark.parametrize("fits", [True, False], ids=["in the envelope", "sent apart"])
def test_a_message_that_cannot_be_framed_whole_sends_nothing_and_moves_no_room(
    fits: bool,
) -> None:
    from pipeline.distributed.p2p import P2PTransport

    # Framing (every part on the wire) comes before the first send and the room's move: a
    # wire it cannot reach stands for any part that fails after its envelope.
    transport = object.__new__(P2PTransport)
    transport._room = {1: ENVELOPE_BYTES}
    transport.wire = torch.device("cuda", 99)
    tensor = torch.ones(4 if fits else 4096)
    description, tensors = encode(KEY, [tensor], None, [False], where)
    with pytest.raises((RuntimeError, AssertionError)):
        transport._parts(1, DATA, description, tensors)
    assert transport._room == {1: ENVELOPE_BYTES}
