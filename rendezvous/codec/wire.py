"""Minimal protobuf wire-format helpers.

The data path writes message headers by hand (so a tensor's bytes are never
re-serialized by protobuf) and walks received messages by offset (so they are
never copied out). Only what that needs is here: varints, tags, length
prefixes, and a field iterator that yields offsets into the buffer.

Buffers may be ``bytes``, ``bytearray`` or ``memoryview`` (any other object
exporting the buffer protocol is read through a byte memoryview). All offsets
are byte offsets.
"""

from __future__ import annotations

from collections.abc import Iterator

from ..errors import InvalidArgument
from .fields import PAD

__all__ = [
    "VARINT",
    "I64",
    "LEN",
    "I32",
    "encode_varint",
    "decode_varint",
    "tag",
    "len_field_header",
    "varint_field",
    "iter_fields",
    "to_signed64",
    "byte_buffer",
    "Pieces",
    "GATHER_BYTES",
    "frame",
    "align_pad",
    "padding",
    "ALIGN",
]

VARINT, I64, LEN, I32 = 0, 1, 2, 5

_MASK64 = (1 << 64) - 1
# One-byte varints, the common case for tags, dtypes and small lengths.
_SMALL = tuple(bytes((i,)) for i in range(128))


def encode_varint(value: int) -> bytes:
    """Unsigned LEB128; a negative int64 becomes its 10-byte two's complement, as protobuf writes it."""
    if 0 <= value < 128:
        return _SMALL[value]
    if value < 0:
        if value < -(1 << 63):
            raise ValueError(f"varint value {value} is below the int64 range")
        value &= _MASK64
    elif value > _MASK64:
        raise ValueError(f"varint value {value} exceeds 64 bits")
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def decode_varint(buf, pos: int) -> tuple[int, int]:
    """(value, new_pos) of the varint at ``pos``; InvalidArgument if truncated or over 10 bytes.

    Values are unsigned 64-bit (bits past the 64th of a 10-byte varint are
    dropped, as protobuf does); use :func:`to_signed64` for int64 fields.
    """
    try:
        b = buf[pos]
    except IndexError:
        raise InvalidArgument(f"truncated varint at offset {pos}") from None
    if b < 0x80:
        return b, pos + 1
    result = b & 0x7F
    shift = 7
    i = pos + 1
    try:
        while True:
            b = buf[i]
            i += 1
            result |= (b & 0x7F) << shift
            if b < 0x80:
                return result & _MASK64, i
            shift += 7
            if shift >= 70:
                raise InvalidArgument(f"varint at offset {pos} is longer than 10 bytes")
    except IndexError:
        raise InvalidArgument(f"truncated varint at offset {pos}") from None


def tag(field_number: int, wire_type: int) -> bytes:
    return encode_varint((field_number << 3) | wire_type)


def len_field_header(field_number: int, length: int) -> bytes:
    """The tag and length prefix of a length-delimited field; the payload follows."""
    return tag(field_number, LEN) + encode_varint(length)


def varint_field(field_number: int, value: int) -> bytes:
    """A whole varint field, or ``b""`` for 0 (proto3 omits defaults)."""
    if value == 0:
        return b""
    return tag(field_number, VARINT) + encode_varint(value)


#: what :func:`align_pad` aligns to: the largest alignment of a dtype that travels
ALIGN = 8
#: the field number of padding: declared by none of the messages padded
#: (fields.PAD checks that against the generated modules)
PAD_FIELD = PAD


def padding(n: int) -> bytes:
    """A field of exactly ``n`` bytes (0, or 2 to 129) that every reader skips."""
    if n == 0:
        return b""
    if not 2 <= n <= 129:
        raise ValueError(f"a padding field takes 2 to 129 bytes, not {n}")
    return bytes(((PAD_FIELD << 3) | LEN, n - 2)) + bytes(n - 2)


#: by (-offset) % ALIGN: the padding that moves the next byte to an aligned
#: offset (one byte cannot be a field: nine bytes do it instead)
_PADS = (b"", padding(9), *(padding(n) for n in range(2, ALIGN)))


def align_pad(offset: int) -> bytes:
    """The field to write at ``offset`` so that what follows it starts at a
    multiple of :data:`ALIGN` (``b""`` if it already does)."""
    return _PADS[-offset % ALIGN]


def to_signed64(v: int) -> int:
    """An unsigned 64-bit varint value read as int64."""
    v &= _MASK64
    return v - (1 << 64) if v >= (1 << 63) else v


def byte_buffer(buf):
    """``buf`` as something whose items are byte values: bytes and bytearray as
    they are, anything else as a flat unsigned-byte memoryview (no copy)."""
    t = type(buf)
    if t is bytes or t is bytearray:
        return buf
    mv = buf if t is memoryview else memoryview(buf)
    if mv.format != "B" or mv.ndim != 1:
        if not mv.c_contiguous:
            raise InvalidArgument("message buffer is not contiguous")
        mv = mv.cast("B")
    return mv


def iter_fields(buf, start: int = 0, end: int | None = None) -> Iterator[tuple[int, int, int, int]]:
    """Walk the fields of the message in ``buf[start:end]``.

    Yields ``(field_number, wire_type, a, b)``: for VARINT ``a`` is the value
    and ``b`` the offset after it; for LEN, I64 and I32, ``(a, b)`` is the
    span of the payload in ``buf`` (nothing is copied). Raises InvalidArgument
    on truncated or malformed input, groups, and lengths that run past ``end``.
    """
    buf = byte_buffer(buf)
    n = len(buf)
    if end is None:
        end = n
    if not 0 <= start <= end <= n:
        raise InvalidArgument(f"message span [{start}, {end}) is outside a buffer of {n} bytes")
    pos = start
    while pos < end:
        key = buf[pos]
        if key < 0x80:
            pos += 1
        else:
            key, pos = decode_varint(buf, pos)
            if pos > end:
                raise InvalidArgument("truncated field tag")
            if key > 0xFFFFFFFF:
                raise InvalidArgument(f"field tag {key} is out of range")
        field = key >> 3
        wt = key & 7
        if field == 0:
            raise InvalidArgument(f"field number 0 at offset {pos}")
        if wt == VARINT:
            b = buf[pos] if pos < end else 0x80
            if b < 0x80:
                value = b
                pos += 1
            else:
                value, pos = decode_varint(buf, pos)
                if pos > end:
                    raise InvalidArgument(f"field {field}: truncated varint")
            yield field, wt, value, pos
        elif wt == LEN:
            b = buf[pos] if pos < end else 0x80
            if b < 0x80:
                length = b
                pos += 1
            else:
                length, pos = decode_varint(buf, pos)
                if pos > end:
                    raise InvalidArgument(f"field {field}: truncated length")
            stop = pos + length
            if stop > end:
                raise InvalidArgument(
                    f"field {field}: length {length} runs past the end of the message "
                    f"({end - pos} bytes left)")
            yield field, wt, pos, stop
            pos = stop
        elif wt == I64 or wt == I32:
            stop = pos + (8 if wt == I64 else 4)
            if stop > end:
                raise InvalidArgument(f"field {field}: truncated fixed-width value")
            yield field, wt, pos, stop
            pos = stop
        else:
            raise InvalidArgument(f"field {field}: unsupported wire type {wt}")


#: messages carrying at least this many bytes of tensor content are made as
#: :class:`Pieces`, joined only by the writer that sends them
GATHER_BYTES = 64 << 10


class Pieces:
    """One message as the pieces it is made of (headers, and views of tensors'
    own memory), not yet joined. The writer that sends it joins them once,
    together with any envelope it puts in front (an MPI stream's head): the
    tensor's bytes are copied once on their way to the wire, not once per layer."""

    __slots__ = ("parts", "nbytes")

    def __init__(self, parts: list) -> None:
        self.parts = parts
        self.nbytes = sum(map(len, parts))  # byte-format views: len is bytes

    def __len__(self) -> int:
        return self.nbytes

    def join(self, head: bytes = b"") -> bytes:
        return b"".join([head, *self.parts]) if head else b"".join(self.parts)


def frame(parts: list, content: int) -> "bytes | Pieces":
    """A message of ``parts`` carrying ``content`` bytes of tensor data: joined
    now, or left as :class:`Pieces` for its writer from ``GATHER_BYTES`` up."""
    return Pieces(parts) if content >= GATHER_BYTES else b"".join(parts)


def pack(messages: list, field_number: int, aligned: bool = False) -> bytes:
    """``messages`` (bytes or :class:`Pieces`) as the repeated field ``field_number``
    of one message; with ``aligned`` each entry starts at an offset aligned to
    ``ALIGN`` (a padding field before it)."""
    parts: list = []
    pos = 0
    for m in messages:
        header = len_field_header(field_number, len(m))
        if aligned:  # each entry starts at an aligned offset (a padding field before it)
            pad = align_pad(pos + len(header))
            if pad:
                parts.append(pad)
            pos += len(pad) + len(header) + len(m)
        parts.append(header)
        if type(m) is Pieces:
            parts += m.parts
        else:
            parts.append(m)
    return b"".join(parts)
