"""Samples made in Python, as the bytes a packed dataset stores: each field's value encoded by its
type, and the check that every sample has the fields and types of the first.

A sample is a dict ``{"__key__": str, field name: value, ...}``. Each value is stored as one tar
member ``<key>.<field>`` (WebDataset's convention), byte-exact, in the form its type fixes:

============================== ======== ===================================== =====================================
value                          kind     stored bytes                          read back (``fields[name]`` is bytes)
============================== ======== ===================================== =====================================
bytes, bytearray, memoryview   bytes    as they are                           ``fields[name]``
str                            str      UTF-8                                 ``fields[name].decode()``
int, numpy integer scalar      int      decimal ASCII (WebDataset's ``.cls``) ``int(fields[name])``
float, numpy floating scalar   float    ``repr(float(v))``, exact for float64 ``float(fields[name])``
numpy.ndarray                  npy      NumPy's ``.npy`` format (no pickle):  ``np.load(io.BytesIO(fields[name]))``
                                        dtype and shape kept
dict, list                     json     ``json.dumps(v)`` as UTF-8            ``json.loads(fields[name])``
============================== ======== ===================================== =====================================

The ``int``/``str`` form of a field named ``cls``, and the ``label`` of a ``json`` dict, are the
sample's label, as for a WebDataset pack (:func:`stoker.store.wds.sample_label`). Anything else
(None, bool, tuple, an object array, a numpy scalar of another kind) is refused rather than
stored in a form that would read back as something else. The ``.npy`` format:
https://numpy.org/doc/stable/reference/generated/numpy.lib.format.html.
"""

from __future__ import annotations

import io
import json
import numbers
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..errors import SourceError
from .sources import check_utf8

__all__ = ["KEY", "describe", "encode_sample", "schema_mismatch"]

#: The name of a sample's key in the dict given to :meth:`stoker.Writer.write`.
KEY = "__key__"


def _kind(value: object) -> str | None:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return "bytes"
    if isinstance(value, str):
        return "str"
    if isinstance(value, (bool, np.bool_)):
        return None
    if isinstance(value, (numbers.Integral, np.integer)):
        return "int"
    if isinstance(value, (float, np.floating)):
        return "float"
    if isinstance(value, np.ndarray):
        return "npy"
    if isinstance(value, (dict, list)):
        return "json"
    return None


def _npy(value: np.ndarray, where: str) -> bytes:
    if value.dtype.hasobject:
        raise TypeError(f"{where}: a numpy array of dtype {value.dtype} holds Python objects, which are never stored")
    buf = io.BytesIO()
    np.lib.format.write_array(buf, value, allow_pickle=False)
    return buf.getvalue()


def _encode(value: Any, kind: str, where: str) -> bytes:
    if kind == "bytes":
        return bytes(value)
    if kind == "str":
        return check_utf8(str(value), where).encode("utf-8")
    if kind == "int":
        return str(int(value)).encode()
    if kind == "float":
        return repr(float(value)).encode()
    if kind == "npy":
        return _npy(value, where)
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False).encode("utf-8")
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{where}: a {type(value).__name__} that is not JSON ({exc})") from None


def _check_key(sample: Mapping) -> str:
    if not isinstance(sample, Mapping):
        raise TypeError(f"a sample is a dict of fields with a {KEY!r}, got {type(sample).__name__}")
    if KEY not in sample:
        raise SourceError(f"a sample has no {KEY!r} (fields {sorted(map(str, sample))})")
    key = sample[KEY]
    if not isinstance(key, str):
        raise TypeError(f"sample key {key!r}: {KEY!r} must be a str, got {type(key).__name__}")
    check_utf8(key, "sample key")
    stem = key.rsplit("/", 1)[-1]
    if not stem or "." in stem or key.startswith("/") or "//" in key:
        raise SourceError(
            f"sample key {key!r}: its last part must be non-empty and hold no '.', and it has no empty "
            "parts (its tar members are '<key>.<field>', split at the first '.' after the last '/')"
        )
    return key


def encode_sample(sample: Mapping) -> tuple[str, list[tuple[str, bytes]], dict[str, str]]:
    """``(key, [(field, bytes), ...] in the sample's order, {field: kind})`` of one sample (the
    module docstring's table; an array's kind is ``npy:<dtype>:<ndim>``, e.g. ``npy:<f2:2``).

    Raises:
        TypeError: the sample is not a dict, its key not a str, a value of a type that has no form
            (naming the key, field and type).
        stoker.SourceError: (a ValueError) no ``__key__``, no field, a key with an empty or dotted
            last part, a field name that is empty, holds a '/' or starts with ``__``.
    """
    key = _check_key(sample)
    members: list[tuple[str, bytes]] = []
    kinds: dict[str, str] = {}
    for name, value in sample.items():
        if name == KEY:
            continue
        where = f"sample {key!r} field {name!r}"
        if not isinstance(name, str) or not name or "/" in name or name.startswith("__"):
            raise SourceError(f"{where}: a field name is a non-empty str without '/' that does not start with '__'")
        check_utf8(name, where)
        kind = _kind(value)
        if kind is None:
            raise TypeError(
                f"{where}: a {type(value).__name__} has no stored form (bytes, str, int, float, "
                "numpy array, dict or list; a flag as int, a tuple as list)"
            )
        if kind == "npy":
            kinds[name] = f"npy:{value.dtype.str}:{value.ndim}"
        else:
            kinds[name] = kind
        members.append((name, _encode(value, kind, where)))
    if not members:
        raise SourceError(f"sample {key!r} has no field besides {KEY!r}")
    return key, members, kinds


_NAMES = {"bytes": "bytes", "str": "a str", "int": "an int", "float": "a float", "json": "a dict or list (JSON)"}


def describe(kind: str) -> str:
    """A kind for messages: ``npy:<f2:2`` -> ``a numpy array of dtype float16 and 2 dimensions``."""
    if kind.startswith("npy:"):
        _, dtype, ndim = kind.split(":")
        return f"a numpy array of dtype {np.dtype(dtype)} and {ndim} dimensions"
    return _NAMES[kind]


def schema_mismatch(kinds: Mapping[str, str], first: Mapping[str, str]) -> str | None:
    """How a sample's ``kinds`` differ from the first sample's ``first``: the field missing, extra
    or of another kind, or None when they agree."""
    for name, kind in first.items():
        if name not in kinds:
            return f"has no field {name!r} (the first sample's fields: {', '.join(first)})"
        if kinds[name] != kind:
            return f"field {name!r} is {describe(kinds[name])}, where the first sample's is {describe(kind)}"
    extra = [n for n in kinds if n not in first]
    if extra:
        return f"has field {extra[0]!r}, which the first sample has not (its fields: {', '.join(first)})"
    return None
