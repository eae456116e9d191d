"""Group replies (rendezvous/fused.py): many tensors in one frame, read back as
views; every lie a producer could tell in a group is refused before anything
is allocated or read."""

from __future__ import annotations

import numpy as np
import pytest

from rendezvous import fields as F
from rendezvous import fused, wire
from rendezvous.dtypes import DT_STRING
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


def _span(frame: bytes) -> tuple[int, int]:
    (num, _, a, b), = list(wire.iter_fields(frame))
    return a, b


def test_a_group_round_trips_every_fixed_size_dtype_as_aligned_views():
    lay = fused.layout(ARRAYS)
    assert all(o % fused.ALIGN == 0 for o in lay.offsets[:-1])
    frame = fused.group_frame(list(range(40, 40 + len(ARRAYS))), ARRAYS, lay, 123)
    group = fused.parse_group(frame, *_span(frame))
    assert group.call_ids == list(range(40, 48)) and group.send_start_micros == 123
    got = fused.views(group, frame, group.payload[0])
    for want, have in zip(ARRAYS, got):
        assert have.dtype == want.dtype and have.shape == want.shape
        np.testing.assert_array_equal(have, want)
    assert all(v.base is not None for v in got if v.size)  # views on the frame: nothing copied


def test_a_payload_announced_elsewhere_is_filled_at_the_same_offsets():
    lay = fused.layout(ARRAYS)
    buffer = np.empty(lay.nbytes, np.uint8)
    fused.fill(buffer, lay)
    frame = fused.group_frame(list(range(len(ARRAYS))), None, lay, 0, b"\x0a\x01x")
    group = fused.parse_group(frame, *_span(frame))
    assert group.payload is None and group.transport_options is not None and group.nbytes == lay.nbytes
    for want, have in zip(ARRAYS, fused.views(group, buffer)):
        np.testing.assert_array_equal(have, want)


def test_which_tensors_may_be_packed():
    assert fused.fusable(np.ones(10), 80) and not fused.fusable(np.ones(11), 80)
    assert not fused.fusable(np.array([b"a"], dtype=object), 1 << 20)
    assert not fused.fusable(np.array([b"a"]), 1 << 20)  # bytes strings: DT_STRING
    assert not fused.fusable([1.0], 1 << 20) and not fused.fusable(None, 1 << 20)


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
    group = fused.parse_group(frame, *_span(frame))
    assert [v.tolist() for v in fused.views(group, frame, group.payload[0])] == [[0, 1, 2, 3], [4, 5, 6, 7]]


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
        fused.parse_group(frame, *_span(frame))


def test_a_group_announcing_more_than_the_limit_is_refused_before_any_allocation():
    value = np.ones(1000, np.float64)
    lay = fused.layout([value])
    frame = fused.group_frame([1], None, lay, 0, b"\x0a\x01x")
    with pytest.raises(ResourceExhausted, match="8000 bytes"):
        fused.parse_group(frame, *_span(frame), max_bytes=4096)
    fused.parse_group(frame, *_span(frame), max_bytes=8000)
