"""numpy arrays to Arrow arrays and back over the same bytes, without pandas.

``pa.array(ndarray)``, ``Array.to_numpy()`` and ``np.asarray(array)`` import pandas wherever it
is installed (pyarrow 26 checks for it on those paths), which adds about 30 MB of RSS to every
process that opens a dataset: the training process and each spawned worker. The index's
columns are plain fixed-width integers and bitmaps, so they are viewed through their buffers
here instead (no copy where the layouts agree).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

__all__ = ["from_bools", "from_numpy", "from_strings", "to_numpy"]


def from_numpy(arr: np.ndarray) -> pa.Array:
    """A 1-d numpy array of fixed-width integers or floats as an Arrow array of the same type,
    over the same bytes (a contiguous copy first if it is strided). ValueError: another dtype."""
    arr = np.ascontiguousarray(arr)
    if arr.ndim != 1 or arr.dtype.kind not in "iuf":
        raise ValueError(f"from_numpy takes a 1-d integer or float array, got {arr.dtype} of shape {arr.shape}")
    return pa.Array.from_buffers(pa.from_numpy_dtype(arr.dtype), len(arr), [None, pa.py_buffer(arr)])


def from_bools(mask: np.ndarray) -> pa.Array:
    """A 1-d numpy bool array as an Arrow boolean array (packed bits, least significant first)."""
    mask = np.asarray(mask, dtype=bool)
    return pa.Array.from_buffers(pa.bool_(), len(mask), [None, pa.py_buffer(np.packbits(mask, bitorder="little"))])


def from_strings(values) -> pa.Array:
    """Python strings as an Arrow string array (UTF-8 bytes and int32 offsets). ValueError: more
    than 2 GiB of bytes in all (int32 offsets); TypeError: a value that is not a str (named);
    UnicodeEncodeError: a lone surrogate."""
    data = []
    for v in values:
        if not isinstance(v, str):
            raise TypeError(f"expected strings, got {type(v).__name__} {v!r}")
        data.append(v.encode("utf-8"))
    offsets = np.zeros(len(data) + 1, np.int64)
    np.cumsum([len(d) for d in data], out=offsets[1:])
    if offsets[-1] >= 2**31:
        raise ValueError(f"{len(data)} strings of {int(offsets[-1])} bytes: more than an Arrow string array holds")
    buffers = [None, pa.py_buffer(offsets.astype(np.int32)), pa.py_buffer(b"".join(data))]
    return pa.Array.from_buffers(pa.string(), len(data), buffers)


def _bits(buf: pa.Buffer, off: int, n: int) -> np.ndarray:
    """Bits ``[off, off + n)`` of an Arrow bitmap (least significant first) as a bool array."""
    return np.unpackbits(np.frombuffer(buf, np.uint8), bitorder="little")[off : off + n].astype(bool)


def to_numpy(arr: pa.Array | pa.ChunkedArray, null: float | bool | None = None) -> np.ndarray:
    """The values of an Arrow integer, float or boolean array as a 1-d numpy array: a read-only
    view of its buffer for numbers without nulls (dtype as Arrow's: int8..uint64, float32/64), a
    new array otherwise.

    Args:
        arr: the array (a chunked one is combined first).
        null: the value a null reads as (``pyarrow.compute.fill_null`` with a Python value makes
            an Arrow scalar, which imports pandas); None: nulls are an error.

    Raises:
        ValueError: the array has nulls and ``null`` is None, or it is of another type (strings,
            lists, dictionaries: their indices are an integer array).
    """
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    if arr.null_count and null is None:
        raise ValueError(f"an Arrow {arr.type} array with {arr.null_count} null(s) has no numpy form here")
    n, off = len(arr), arr.offset
    validity, buf = arr.buffers()[:2]
    if pa.types.is_boolean(arr.type):
        out = _bits(buf, off, n) if buf is not None and n else np.zeros(n, bool)
    elif (pa.types.is_integer(arr.type) or pa.types.is_floating(arr.type)) and not pa.types.is_float16(arr.type):
        dtype = np.dtype(arr.type.to_pandas_dtype())  # a numpy type for these; imports nothing
        out = np.frombuffer(buf, dtype)[off : off + n] if buf is not None and n else np.zeros(n, dtype)
    else:
        raise ValueError(f"to_numpy takes an integer, float or boolean Arrow array, got {arr.type}")
    if arr.null_count and validity is not None:
        out = np.where(_bits(validity, off, n), out, np.asarray(null, out.dtype))
    return out
