"""Group replies (rendezvous/groups.py): many tensors in one frame, read back as
views; every lie a producer could tell in a group is refused before anything
is allocated or read."""

from __future__ import annotations

import numpy as np
import pytest

from rendezvous.codec import fields as F
from rendezvous.codec import groups, wire
from rendezvous.codec.dtypes import DT_STRING
from rendezvous.errors import InvalidArgument, ResourceExhausted

pytestmark = pytest.mark.timeout(30)

ARRAYS = [
    np.arange(3, dtype=np.float32),
    np.ones((2, 3), np.int64),
    np.zeros((0, 4), np.float64),     # empty
    np.array(7, np.int8),             # a scalar
    np.arange(5, dtype=np.float16),
    np.array([True, False]),
    np.array([1 + 2j], np.complex128),
    np.arange(12, dtype=np.int32).reshape(3, 4)[:, ::2],  # not contiguous
]


def _skipped_field(n: int) -> bytes:
    """``n`` bytes (2 or more) of a field no reader knows (field 15, length-delimited): skipped."""
    return bytes((15 << 3 | 2, n - 2)) + bytes(n - 2)


def _span(frame: bytes) -> tuple[int, int]:
    (num, _, a, b), = list(wire.iter_fields(frame))
    return a, b


def test_a_group_round_trips_every_fixed_size_dtype_as_aligned_views():
    lay = groups.layout(ARRAYS)
    assert all(o % groups.ALIGN == 0 for o in lay.offsets[:-1])
    frame = groups.group_frame(list(range(40, 40 + len(ARRAYS))), ARRAYS, lay, 123)
    group = groups.parse_group(frame, *_span(frame))
    assert group.call_ids == list(range(40, 48)) and group.send_start_micros == 123
    got = groups.views(group, frame, group.payload[0])
    for want, have in zip(ARRAYS, got):
        assert have.dtype == want.dtype and have.shape == want.shape
        np.testing.assert_array_equal(have, want)
    assert all(v.base is not None for v in got if v.size)  # views on the frame: nothing copied


def test_a_payload_announced_elsewhere_is_filled_at_the_same_offsets():
    lay = groups.layout(ARRAYS)
    buffer = np.empty(lay.nbytes, np.uint8)
    groups.fill(buffer, lay)
    frame = groups.group_frame(list(range(len(ARRAYS))), None, lay, 0, b"\x0a\x01x")
    group = groups.parse_group(frame, *_span(frame))
    assert group.payload is None and group.transport_options is not None and group.nbytes == lay.nbytes
    for want, have in zip(ARRAYS, groups.views(group, buffer)):
        np.testing.assert_array_equal(have, want)


def test_which_tensors_may_be_packed():
    assert groups.fusable(np.ones(10), 80) and not groups.fusable(np.ones(11), 80)
    assert not groups.fusable(np.array([b"a"], dtype=object), 1 << 20)
    assert not groups.fusable(np.array([b"a"]), 1 << 20)  # bytes strings: DT_STRING
    assert not groups.fusable([1.0], 1 << 20) and not groups.fusable(None, 1 << 20)


def _lie(**change) -> bytes:
    """A group of two float32[4] whose fields are as given in ``change``,
    written field by field, so that it is well-formed protobuf whatever it says."""
    g = {"call_ids": [1, 2], "dtypes": bytes([1, 1]), "ranks": [1, 1], "dims": [4, 4], "offsets": [0, 16, 32],
         "payload": np.arange(8, dtype=np.float32).tobytes(), "options": None, **change}
    body = b""
    ids = g["call_ids"] if isinstance(g["call_ids"], bytes) else np.array(g["call_ids"], "<u8").tobytes()
    for field, value in ((F.GROUP_CALL_IDS, ids),
                         (F.GROUP_DTYPES, g["dtypes"]),
                         (F.GROUP_RANKS, np.array(g["ranks"], "<u4").tobytes()),
                         (F.GROUP_DIMS, np.array(g["dims"], "<u8").tobytes()),
                         (F.GROUP_OFFSETS, np.array(g["offsets"], "<u8").tobytes()),
                         (F.GROUP_PAYLOAD, g["payload"]), (F.GROUP_TRANSPORT_OPTIONS, g["options"])):
        if value is not None:
            body += wire.len_field_header(field, len(value)) + value
    return wire.len_field_header(F.STREAM_RESPONSE_GROUP, len(body)) + body


def test_the_hand_written_group_of_the_lies_below_is_valid_as_it_stands():
    frame = _lie()
    group = groups.parse_group(frame, *_span(frame))
    assert [v.tolist() for v in groups.views(group, frame, group.payload[0])] == [[0, 1, 2, 3], [4, 5, 6, 7]]


@pytest.mark.parametrize("frame, words", [
    (_lie(dtypes=bytes([1])), "dtypes"),
    (_lie(ranks=[1]), "ranks"),
    (_lie(offsets=[0, 16]), "offsets"),
    (_lie(call_ids=[]), "no call"),
    (_lie(call_ids=[3, 3]), "a call twice"),
    (_lie(dims=[4, 5]), "does not fit"),           # more bytes than the payload has
    (_lie(offsets=[4, 20, 36], payload=bytes(36)), "does not fit"),  # not aligned
    (_lie(offsets=[0, 8, 32]), "does not fit"),    # the first runs into the second
    (_lie(offsets=[16, 0, 32]), "does not fit"),   # going backwards
    (_lie(offsets=[0, 16, 40]), "payload has 32 bytes"),
    (_lie(ranks=[1, 70], dims=[4] + [1] * 70), "dimensions"),
    (_lie(ranks=[1, 2]), "dims"),
    (_lie(dtypes=bytes([1, DT_STRING])), "cannot be packed"),
    (_lie(dtypes=bytes([1, 250])), "DataType 250"),
    (_lie(payload=None), "exactly one"),
    (_lie(options=b"\x0a\x01x"), "exactly one"),
    (_lie(call_ids=np.array([1, 2], "<u8").tobytes()[:12]), "whole number"),
])
def test_a_group_that_lies_is_refused(frame, words):
    with pytest.raises(InvalidArgument, match=words):
        groups.parse_group(frame, *_span(frame))


def test_a_group_announcing_more_than_the_limit_is_refused_before_any_allocation():
    value = np.ones(1000, np.float64)
    lay = groups.layout([value])
    frame = groups.group_frame([1], None, lay, 0, b"\x0a\x01x")
    with pytest.raises(ResourceExhausted, match="8000 bytes"):
        groups.parse_group(frame, *_span(frame), max_bytes=4096)
    groups.parse_group(frame, *_span(frame), max_bytes=8000)


@pytest.mark.parametrize("frame", [
    _lie(ranks=[1, 2], dims=[4, 0, 2**62]),  # no bytes at all, but numpy has no such shape
    _lie(ranks=[1, 3], dims=[4, 2**40, 0, 2**40]),
    # a payload announced elsewhere, parsed without a limit (a daemon's SEND_MANY parser)
    _lie(payload=None, options=b"\x0a\x01x", dtypes=bytes([1, 6]), dims=[4, 2**63 + 5], offsets=[0, 16, 2**64 - 1]),
], ids=["empty-but-vast", "two-vast-dims", "past-int64"])
def test_a_group_whose_shape_no_array_can_have_is_refused(frame):
    """Shape (0, 2**62) once passed (its size, 0, fits any payload) and numpy
    raised ValueError when the views were made: a consumer's stream reader
    died with it, and a daemon's SEND_MANY parser raised it too."""
    with pytest.raises(InvalidArgument, match="larger than any array"):
        group = groups.parse_group(frame, *_span(frame))
        groups.views(group, frame, group.payload[0]) if group.payload else None


def _group_span(buf: bytes) -> tuple[int, int]:
    (a, b), = [(a, b) for num, _, a, b in wire.iter_fields(buf) if num == F.STREAM_RESPONSE_GROUP]
    return a, b


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 13])
@pytest.mark.parametrize("extra", [0, 100, 16_300])
def test_a_groups_payload_starts_aligned_in_its_frame(n, extra):
    """The payload starts at a multiple of ALIGN from the frame's start,
    whatever the lengths of the fields before it (here: the number of calls,
    and payloads around the sizes where the group's length takes another
    byte): a frame that arrives at an aligned address is read in place."""
    for grow in range(0, 24, 3):
        arrays = [np.arange(i + 1, dtype=np.float64) for i in range(n)] + [np.zeros(extra + grow, np.uint8)]
        frame = groups.group_frame(list(range(7, 7 + len(arrays))), arrays, groups.layout(arrays), 10**n)
        group = groups.parse_group(frame, *_group_span(frame))
        assert group.payload[0] % groups.ALIGN == 0, (n, extra, grow, group.payload[0])
        for want, have in zip(arrays, groups.views(group, frame, group.payload[0])):
            np.testing.assert_array_equal(have, want)


@pytest.mark.parametrize("shift", [0, 2, 5, 7, 9, 11])
def test_views_are_aligned_to_their_dtypes_wherever_the_payload_lies(shift):
    """A payload at an address that is not a multiple of ALIGN (a frame behind
    a field of ``shift`` bytes, as a producer that does not align its frames
    sends it) is copied once and the views made on the copy; an aligned one
    is read in place."""
    arrays = [np.arange(5, dtype=np.float64) + 0.25, np.array([1 + 2j], np.complex128), np.arange(3, dtype=np.int16),
              np.arange(6, dtype=np.int64).reshape(3, 2)]
    frame = (_skipped_field(shift) if shift else b"") + groups.group_frame([1, 2, 3, 4], arrays, groups.layout(arrays))
    group = groups.parse_group(frame, *_group_span(frame))
    got = groups.views(group, frame, group.payload[0])
    for want, have in zip(arrays, got):
        assert have.ctypes.data % have.dtype.alignment == 0, (shift, have.dtype, have.ctypes.data % 8)
        np.testing.assert_array_equal(have, want)
    if shift == 0:  # bytes objects keep their data 16-byte aligned: nothing was copied
        assert all(v.base is frame for v in got)
