"""Subsets and splits of a packed dataset: which samples a :meth:`Dataset.subset` holds.

A subset is the same packed dataset (the same index, blocks, cache and content version: nothing
is re-packed or copied) restricted to some of its samples, kept as their sample ids in the packed
dataset, ascending (the original order). :func:`select` turns what a user names (ids, keys, a
boolean mask or a predicate over the index columns) into those ids; :func:`split_positions`
deals a dataset's samples into disjoint parts; :func:`selection_digest` names a selection in a
Loader's resume state, so that a state of one subset is never resumed on another.

:class:`stoker.store.dataset.Dataset` is read through ``ds.index`` (a
:class:`~stoker.store.index.DatasetIndex`), ``ds.selection`` and ``ds.url`` only.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import xxhash

from .keytable import KeyTable

__all__ = ["columns", "select", "selection_digest", "split_positions"]

#: Salt of the split's random stream (so that it is not the epoch permutation of the same seed).
_SPLIT_SALT = 0x5B117


def columns(ds) -> pa.Table:
    """The index columns a subset predicate gets: one row per sample of ``ds`` (a subset: its
    samples only), in order. ``sample_id`` int64 (the packed dataset's id), ``key`` string,
    ``label`` int64 (-1: none), ``class_name`` string (null without a label; dictionary-encoded),
    ``shard`` string (the shard as the index names it, ``shards/shard-000000.tar``;
    dictionary-encoded), ``length`` int64 (primary payload bytes)."""
    index = ds.index
    ids = np.arange(len(index), dtype=np.int64) if ds.selection is None else ds.selection
    labels = np.asarray(index.labels[ids], dtype=np.int64)
    names = pa.array(list(index.classes) or [""], type=pa.string())
    no_class = (labels < 0) | (labels >= max(len(index.classes), 1)) if index.classes else np.ones(len(ids), bool)
    class_name = pa.DictionaryArray.from_arrays(
        pa.array(np.where(no_class, 0, labels).astype(np.int32), mask=no_class), names
    )
    shard_names = pa.array([index.shard_name(s) for s in range(len(index.shards))] or [""], type=pa.string())
    shard = pa.DictionaryArray.from_arrays(pa.array(np.asarray(index.shard[ids], dtype=np.int32)), shard_names)
    keys = index.keys if ds.selection is None else index.keys.take(pa.array(ids))
    return pa.table(
        {
            "sample_id": pa.array(ids),
            "key": keys,
            "label": pa.array(labels),
            "class_name": class_name,
            "shard": shard,
            "length": pa.array(np.asarray(index.length[ids], dtype=np.int64)),
        }
    )


def select(ds, selection: Any) -> np.ndarray:
    """The packed dataset's sample ids (int64, ascending) of the samples of ``ds`` that ``selection`` names.

    ``selection`` is one of:

    - sample ids (ints: a list, a range, an integer numpy array): positions in ``ds``, ``0..len(ds)-1``
      (the packed dataset's ids for a whole dataset; ``ds.read(i)``'s ``i`` for a subset);
    - sample keys (strs: a list, a numpy or pyarrow string array);
    - a boolean mask, a numpy bool array of ``len(ds)``;
    - a predicate ``fn(table) -> mask``: ``table`` is :func:`columns` (a ``pyarrow.Table``), the
      mask a bool array of one entry per row (numpy, a pyarrow boolean array, where a null is
      False, or a list).

    Raises:
        TypeError: a selection of another kind (a single str; ids and keys mixed; a float array;
            a predicate that returns something else), naming it.
        IndexError: an id outside ``0..len(ds)-1``, naming it and the dataset.
        KeyError: a key that is not a sample of ``ds`` (not in the packed dataset, or not in this
            subset), naming it.
        ValueError: an id or key named twice (a subset holds each sample once), or a mask or
            predicate result of the wrong length, naming it.
    """
    if callable(selection):
        return _from_mask(ds, _predicate_mask(ds, selection), f"the predicate {_name(selection)}")
    if isinstance(selection, (str, bytes)):
        raise TypeError(f"subset: pass a list of keys, not one key string {selection!r}")
    if isinstance(selection, (pa.Array, pa.ChunkedArray)):
        if not pa.types.is_string(selection.type) and not pa.types.is_large_string(selection.type):
            selection = selection.to_numpy(zero_copy_only=False)
        else:
            return _from_keys(ds, selection)
    if isinstance(selection, np.ndarray):
        if selection.dtype == bool:
            return _from_mask(ds, selection, "the mask")
        if selection.dtype.kind in "iu":
            return _from_positions(ds, selection.astype(np.int64, copy=False).reshape(-1))
        if selection.dtype.kind in "UO" and all(isinstance(k, str) for k in selection.reshape(-1).tolist()):
            return _from_keys(ds, selection.reshape(-1).tolist())
        raise TypeError(f"subset: a numpy array of sample ids, keys or a bool mask, got dtype {selection.dtype}")
    if not isinstance(selection, (Sequence, range)) and not hasattr(selection, "__iter__"):
        raise TypeError(f"subset: sample ids, keys or a predicate, got {type(selection).__name__} {selection!r}")
    items = list(selection)
    if all(isinstance(i, numbers.Integral) and not isinstance(i, bool) for i in items):
        return _from_positions(ds, np.asarray(items, dtype=np.int64))
    if all(isinstance(k, str) for k in items):
        return _from_keys(ds, items)
    kinds = sorted({type(i).__name__ for i in items})
    raise TypeError(f"subset: sample ids (ints) or keys (strs), not a mix of {', '.join(kinds)}")


def split_positions(n: int, fractions: Sequence[float], seed: int) -> list[np.ndarray]:
    """Deal ``range(n)`` into ``len(fractions)`` disjoint parts that cover it: a uniform random
    permutation of PCG64 seeded by (``seed``, a salt), cut into runs of ``fractions[k] * n``
    samples rounded by the largest-remainder (Hamilton) method, so the counts sum to ``n`` and
    each is within one sample of its share; each part ascending. A pure function of
    (``n``, ``fractions``, ``seed``): every rank and process gets the same parts.

    Raises:
        TypeError: ``fractions`` is not a sequence of numbers, or ``seed`` not an int.
        ValueError: a fraction not in (0, 1], or the fractions not summing to 1 (within 1e-6).
    """
    if isinstance(fractions, (str, bytes)) or not isinstance(fractions, Sequence) or not fractions:
        raise TypeError(f"split: fractions must be a non-empty list of numbers, e.g. [0.9, 0.1]; got {fractions!r}")
    if not all(isinstance(f, numbers.Real) and not isinstance(f, bool) for f in fractions):
        raise TypeError(f"split: fractions must be numbers, got {list(fractions)!r}")
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"split: seed must be an int, got {type(seed).__name__} {seed!r}")
    fr = [float(f) for f in fractions]
    bad = [f for f in fr if not 0.0 < f <= 1.0]
    if bad:
        raise ValueError(f"split: each fraction must be in (0, 1], got {bad[0]} in {fr}")
    if not math.isclose(sum(fr), 1.0, abs_tol=1e-6):
        raise ValueError(f"split: fractions must sum to 1, got {fr} (sum {sum(fr):.6g})")
    exact = np.asarray(fr) * n
    counts = np.floor(exact).astype(np.int64)
    left = n - int(counts.sum())
    counts[np.argsort(-(exact - counts), kind="stable")[:left]] += 1  # largest remainders, first on ties
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([int(seed), _SPLIT_SALT])))
    perm = rng.permutation(n).astype(np.int64)
    cuts = np.cumsum(counts)[:-1]
    return [np.sort(part) for part in np.split(perm, cuts)]


def selection_digest(ids: np.ndarray | None) -> str | None:
    """Name of a selection for a resume state: ``"<count>:<xxh3-64 hex of the int64 ids>"``, or
    None for a whole dataset (None)."""
    if ids is None:
        return None
    ids = np.ascontiguousarray(ids, dtype="<i8")
    return f"{len(ids)}:{xxhash.xxh3_64_hexdigest(ids.tobytes())}"


def _name(fn) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__


def _base(ds) -> np.ndarray | None:
    return ds.selection


def _from_positions(ds, pos: np.ndarray) -> np.ndarray:
    n = len(ds)
    if pos.size and (pos.min() < 0 or pos.max() >= n):
        bad = int(pos[(pos < 0) | (pos >= n)][0])
        raise IndexError(f"subset: sample id {bad} out of range for the {n} samples of {_what(ds)}")
    ordered = np.sort(pos)
    dup = ordered[1:][ordered[1:] == ordered[:-1]]
    if dup.size:
        raise ValueError(f"subset: sample id {int(dup[0])} is named twice (a subset holds each sample once)")
    base = _base(ds)
    return ordered if base is None else base[ordered]


def _from_keys(ds, keys) -> np.ndarray:
    ids = KeyTable(ds.index).ids_of(keys, default=-1)
    listed = keys.to_pylist() if isinstance(keys, (pa.Array, pa.ChunkedArray)) else list(keys)
    missing = np.flatnonzero(ids < 0)
    if missing.size:
        shown = ", ".join(repr(listed[int(i)]) for i in missing[:3])
        more = f" and {missing.size - 3} more" if missing.size > 3 else ""
        raise KeyError(f"subset: no sample with key {shown}{more} in {ds.url}")
    base = _base(ds)
    if base is not None:
        outside = np.flatnonzero(~np.isin(ids, base))
        if outside.size:
            raise KeyError(f"subset: key {listed[int(outside[0])]!r} is a sample of {ds.url} but not of {_what(ds)}")
    order = np.argsort(ids, kind="stable")
    ordered = ids[order]
    dup = np.flatnonzero(ordered[1:] == ordered[:-1])
    if dup.size:
        raise ValueError(f"subset: key {listed[int(order[dup[0]])]!r} is named twice (a subset holds each sample once)")
    return ordered


def _from_mask(ds, mask, what: str) -> np.ndarray:
    mask = np.asarray(mask)
    if mask.dtype != bool:
        raise TypeError(f"subset: {what} must give a bool array, got dtype {mask.dtype}")
    if mask.shape != (len(ds),):
        raise ValueError(f"subset: {what} gives {mask.shape} flags, not one per sample ({len(ds)}) of {_what(ds)}")
    return _from_positions(ds, np.flatnonzero(mask).astype(np.int64))


def _predicate_mask(ds, fn) -> np.ndarray:
    out = fn(columns(ds))
    if isinstance(out, (pa.Array, pa.ChunkedArray)):
        if not pa.types.is_boolean(out.type):
            raise TypeError(f"subset: the predicate {_name(fn)} must return booleans, got {out.type}")
        out = out.fill_null(False).to_numpy(zero_copy_only=False)
    elif isinstance(out, list):
        out = np.asarray(out, dtype=object)
        if not all(isinstance(v, (bool, np.bool_)) for v in out.tolist()):
            raise TypeError(f"subset: the predicate {_name(fn)} must return booleans")
        out = out.astype(bool)
    if not isinstance(out, np.ndarray):
        raise TypeError(
            f"subset: the predicate {_name(fn)} must return a bool array (one per row of its table), "
            f"got {type(out).__name__}"
        )
    return out


def _what(ds) -> str:
    return ds.url if ds.selection is None else f"this subset of {ds.url}"
