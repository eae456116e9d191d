"""numpy dtypes and TensorFlow's ``DataType``: which travel, and how they are named.

The fixed-size dtypes (floats, ints, bool, complex, bfloat16 with
``ml_dtypes``) travel as raw little-endian bytes; strings as ``bytes``
objects. :func:`dtype_to_proto` and :func:`proto_to_dtype` map between the
two worlds; :func:`is_memcpyable` says whether an array's bytes are the wire
content as they are; :func:`as_array` makes anything array-like an array in
that layout.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import numpy as np

from ..errors import UnsupportedDType

__all__ = ["SUPPORTED_DTYPES", "DT_INVALID", "DT_FLOAT", "DT_DOUBLE", "DT_INT32", "DT_UINT8", "DT_INT16", "DT_INT8",
           "DT_STRING", "DT_COMPLEX64", "DT_INT64", "DT_BOOL", "DT_BFLOAT16", "DT_UINT16", "DT_COMPLEX128", "DT_HALF",
           "DT_UINT32", "DT_UINT64", "dtype_to_proto", "proto_to_dtype", "dt_name", "as_array", "is_memcpyable", "OBJECT"]

# TensorFlow's DataType values (tensorflow/core/framework/types.proto).
DT_INVALID = 0
DT_FLOAT = 1
DT_DOUBLE = 2
DT_INT32 = 3
DT_UINT8 = 4
DT_INT16 = 5
DT_INT8 = 6
DT_STRING = 7
DT_COMPLEX64 = 8
DT_INT64 = 9
DT_BOOL = 10
DT_BFLOAT16 = 14
DT_UINT16 = 17
DT_COMPLEX128 = 18
DT_HALF = 19
DT_UINT32 = 22
DT_UINT64 = 23

_DT_NAMES = {
    DT_INVALID: "DT_INVALID", DT_FLOAT: "DT_FLOAT", DT_DOUBLE: "DT_DOUBLE", DT_INT32: "DT_INT32",
    DT_UINT8: "DT_UINT8", DT_INT16: "DT_INT16", DT_INT8: "DT_INT8", DT_STRING: "DT_STRING",
    DT_COMPLEX64: "DT_COMPLEX64", DT_INT64: "DT_INT64", DT_BOOL: "DT_BOOL",
    DT_BFLOAT16: "DT_BFLOAT16", DT_UINT16: "DT_UINT16", DT_COMPLEX128: "DT_COMPLEX128",
    DT_HALF: "DT_HALF", DT_UINT32: "DT_UINT32", DT_UINT64: "DT_UINT64",
}

#: the dtype of string tensors (object arrays of bytes)
OBJECT = np.dtype(object)
_FIXED: dict[np.dtype, int] = {
    np.dtype(np.float16): DT_HALF,
    np.dtype(np.float32): DT_FLOAT,
    np.dtype(np.float64): DT_DOUBLE,
    np.dtype(np.int8): DT_INT8,
    np.dtype(np.int16): DT_INT16,
    np.dtype(np.int32): DT_INT32,
    np.dtype(np.int64): DT_INT64,
    np.dtype(np.uint8): DT_UINT8,
    np.dtype(np.uint16): DT_UINT16,
    np.dtype(np.uint32): DT_UINT32,
    np.dtype(np.uint64): DT_UINT64,
    np.dtype(np.bool_): DT_BOOL,
    np.dtype(np.complex64): DT_COMPLEX64,
    np.dtype(np.complex128): DT_COMPLEX128,
}
_SUPPORTED_NAMES = (
    "float16, float32, float64, bfloat16 (with ml_dtypes), int8, int16, int32, int64, "
    "uint8, uint16, uint32, uint64, bool, complex64, complex128, "
    "bytes (object arrays of bytes, or 'S' arrays)"
)

_bf16_loaded = False
_BFLOAT16: np.dtype | None = None


def _bfloat16() -> np.dtype | None:
    """ml_dtypes' bfloat16, imported on first need; None without ml_dtypes."""
    global _bf16_loaded, _BFLOAT16
    if not _bf16_loaded:
        try:
            import ml_dtypes
        except ImportError:
            _BFLOAT16 = None
        else:
            _BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
            _FIXED[_BFLOAT16] = DT_BFLOAT16
        _bf16_loaded = True
    return _BFLOAT16


class _SupportedDTypes(Mapping):
    """np.dtype -> DataType value; bfloat16 appears once ml_dtypes is importable."""

    def _table(self) -> dict[np.dtype, int]:
        _bfloat16()
        return {**_FIXED, OBJECT: DT_STRING, np.dtype("S"): DT_STRING}

    def __getitem__(self, key) -> int:
        try:
            dt = np.dtype(key)
        except TypeError:
            raise KeyError(key) from None
        return self._table()[dt]

    def __iter__(self) -> Iterator[np.dtype]:
        return iter(self._table())

    def __len__(self) -> int:
        return len(self._table())

    def __repr__(self) -> str:
        return f"SUPPORTED_DTYPES({self._table()!r})"


SUPPORTED_DTYPES: Mapping = _SupportedDTypes()


def _fixed_lookup(dt: np.dtype) -> int | None:
    v = _FIXED.get(dt)
    if v is None and not _bf16_loaded:
        _bfloat16()
        v = _FIXED.get(dt)
    return v


def _native(dt: np.dtype) -> np.dtype:
    return dt.newbyteorder("=") if dt.byteorder not in "=|" else dt


def dtype_to_proto(dtype) -> int:
    """The TensorFlow DataType value for a numpy dtype (any byte order)."""
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise UnsupportedDType(f"{dtype!r} is not a numpy dtype; supported: {_SUPPORTED_NAMES}") from None
    if dt.kind == "S" or dt == OBJECT:
        return DT_STRING
    v = _fixed_lookup(_native(dt)) if dt.fields is None else None
    if v is None and dt.kind == "U":
        raise UnsupportedDType(f"dtype {dt} (numpy unicode strings) has no TensorFlow DataType: send bytes "
                               "(numpy.char.encode(array, 'utf-8'), dtype S) or an object array of bytes; "
                               f"supported: {_SUPPORTED_NAMES}")
    if v is None:
        raise UnsupportedDType(f"dtype {dt} has no TensorFlow DataType; supported: {_SUPPORTED_NAMES}")
    return v


_BY_PROTO: dict[int, np.dtype] = {v: k for k, v in _FIXED.items()}
_BY_PROTO[DT_STRING] = OBJECT


def dt_name(value: int) -> str:
    return _DT_NAMES.get(value, f"DataType {value}")


def proto_to_dtype(value: int) -> np.dtype:
    """The numpy dtype for a DataType value (DT_STRING: object arrays of bytes)."""
    dt = _BY_PROTO.get(value)
    if dt is not None:
        return dt
    if value == DT_BFLOAT16:
        bf = _bfloat16()
        if bf is None:
            raise UnsupportedDType("DT_BFLOAT16 needs ml_dtypes (pip install ml_dtypes)")
        _BY_PROTO[DT_BFLOAT16] = bf
        return bf
    raise UnsupportedDType(f"{dt_name(value)} has no supported numpy dtype; supported: {_SUPPORTED_NAMES}")


def as_array(obj) -> np.ndarray:
    """``obj`` as an ndarray in little-endian layout (arrays pass through uncopied
    unless big-endian; scalars, lists, bytes and buffer exporters via np.asarray)."""
    arr = obj if type(obj) is np.ndarray else np.asarray(obj)
    dt = arr.dtype
    if dt.byteorder == ">" or (dt.byteorder == "=" and np.little_endian is False):
        arr = arr.astype(dt.newbyteorder("<"))
    return arr


def is_memcpyable(arr) -> bool:
    """True for arrays (or dtypes) of a fixed-size supported dtype in little-endian
    byte order: their bytes are the wire content as they are."""
    dt = arr if isinstance(arr, np.dtype) else arr.dtype
    if dt.kind in "OSU" or dt.byteorder == ">" or (dt.byteorder == "=" and not np.little_endian):
        return False
    return _fixed_lookup(_native(dt)) is not None
