"""Built-in collates for :class:`stoker.Loader` ``collate=``: a list of decoded samples -> one batch.

A collate runs in the decode worker processes, after the user's ``decode``. The numpy arrays and
torch tensors of the batch it returns (alone, or in a dict, tuple or list, nested) move through a
shared-memory slot without pickling; its other leaves (strings, numbers) are pickled beside them
(:mod:`stoker.loader.workers.batches`).

- :func:`default`: torch's ``default_collate`` semantics, after a check that every sample has the
  same structure and shapes (:class:`CollateError` names the one that differs; the Loader, its key).
- :func:`pad`: variable-length 1-D arrays padded to the batch maximum, with their lengths.
- :func:`raw_bytes`: no decode: each sample's payload bytes, as they are stored, in one flat
  ``uint8`` tensor with the offsets of the samples (:class:`RawBatch`); a Loader's workers read
  such a batch straight into its shared-memory slot (:mod:`stoker.loader.workers.rawbatch`).
- :func:`on_raw`: the user's batch-level code over a :class:`RawBatch`: one call per batch in the
  workers, over the raw batch read as a batch (a batch decode, beside the per-sample ``decode=``).
- :func:`pack_tokens`: token sequences joined with an EOS separator and cut into rows of exactly
  ``seq_len`` tokens, the remainder carried to the next batch: the packing of LLM pre-training
  (e.g. GPT-2/3's training recipe, "Language Models are Few-Shot Learners", 2020, section 2.3:
  sequences of the full context length, documents separated by an end-of-text token).

Every function here is picklable (module-level functions and small classes), so they work with
every multiprocessing start method.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from .errors import CollateError

__all__ = [
    "CollateError",
    "OnRaw",
    "PackTokens",
    "Pad",
    "RawBatch",
    "default",
    "on_raw",
    "pack_tokens",
    "pad",
    "raw_bytes",
]


def _shape(x):
    """A comparable description of one sample's structure: shapes and dtypes of its arrays."""
    if isinstance(x, np.ndarray):
        return ("array", x.shape, x.dtype.str)
    if type(x).__module__ == "torch" and type(x).__name__ == "Tensor":
        return ("tensor", tuple(x.shape), str(x.dtype))
    if isinstance(x, Mapping):
        return ("dict", tuple((k, _shape(v)) for k, v in x.items()))
    if isinstance(x, (str, bytes)):
        return ("str",)
    if isinstance(x, Sequence):
        return (type(x).__name__, tuple(_shape(v) for v in x))
    return (type(x).__name__,)


def _describe(s) -> str:
    if s[0] in ("array", "tensor"):
        return f"{s[0]} of shape {tuple(s[1])} and dtype {s[2]}"
    if s[0] == "dict":
        return "dict {" + ", ".join(f"{k!r}: {_describe(v)}" for k, v in s[1]) + "}"
    if s[0] in ("list", "tuple"):
        return f"{s[0]} [" + ", ".join(_describe(v) for v in s[1]) + "]"
    return s[0]


def default(samples: list):
    """Collate like ``torch.utils.data.default_collate``: numpy arrays, tensors and numbers are
    stacked into tensors with a new batch dimension 0 (shape (N, ...)), dicts and tuples/lists are
    collated field by field, strings and bytes become lists.

    Raises:
        CollateError: a sample is None, or its structure, shapes or dtypes differ from the first
            sample's (``index`` is its position; the message gives both shapes).
    """
    from torch.utils.data import default_collate

    if not samples:
        raise CollateError(0, "empty batch")
    ref = None
    for j, s in enumerate(samples):
        if s is None:
            raise CollateError(j, "the sample is None")
        d = _shape(s)
        if ref is None:
            ref = d
        elif d != ref:
            raise CollateError(j, f"it is {_describe(d)}, the batch's first sample is {_describe(ref)}")
    return default_collate(samples)


def _field(sample, key, j: int) -> np.ndarray:
    x = sample if key is None else (sample.get(key) if isinstance(sample, Mapping) else None)
    if x is None:
        raise CollateError(j, f"has no field {key!r}" if key is not None else "the sample is None")
    arr = np.asarray(x)
    if arr.ndim != 1:
        raise CollateError(j, f"field {key!r} has shape {arr.shape}, expected a 1-D array")
    return arr


class Pad:
    """The collate :func:`pad` returns (a picklable callable)."""

    def __init__(self, key=None, pad_value=0, lengths_key: str = "lengths"):
        self.key, self.pad_value, self.lengths_key = key, pad_value, lengths_key

    def __call__(self, samples: list):
        """``samples``: 1-D arrays (``key=None``) or dicts holding one under ``key``. Returns a
        ``(padded (N, L_max), lengths (N,) int64)`` tuple of tensors for ``key=None``, else a dict
        with ``key`` -> padded (N, L_max) tensor, ``lengths_key`` -> (N,) int64 tensor and every
        other field collated by :func:`default`.

        Raises:
            CollateError: a sample lacks ``key`` or its value is not 1-D, or the dtypes differ.
        """
        import torch

        arrs = [_field(s, self.key, j) for j, s in enumerate(samples)]
        for j, a in enumerate(arrs):
            if a.dtype != arrs[0].dtype:
                raise CollateError(j, f"field {self.key!r} has dtype {a.dtype}, the first sample's is {arrs[0].dtype}")
        lengths = np.array([len(a) for a in arrs], dtype=np.int64)
        width = int(lengths.max()) if len(arrs) else 0
        out = np.full((len(arrs), width), self.pad_value, dtype=arrs[0].dtype if arrs else np.int64)
        for j, a in enumerate(arrs):
            out[j, : len(a)] = a
        padded, lens = torch.from_numpy(out), torch.from_numpy(lengths)
        if self.key is None:
            return padded, lens
        rest = [{k: v for k, v in s.items() if k != self.key} for s in samples]
        batch = dict(default(rest)) if rest and rest[0] else {}
        batch[self.key], batch[self.lengths_key] = padded, lens
        return batch


def pad(key=None, pad_value=0, lengths_key: str = "lengths") -> Pad:
    """A collate that pads variable-length 1-D arrays to the longest of the batch.

    Args:
        key: the field of each (dict) sample to pad, or None when each sample is the array itself.
        pad_value: the value of the padding positions.
        lengths_key: the output field holding each sample's length (dict samples only).

    Returns a :class:`Pad`; see :meth:`Pad.__call__` for the batch it makes.
    """
    return Pad(key, pad_value, lengths_key)


class PackTokens:
    """The collate :func:`pack_tokens` returns; it works in two steps.

    1. in the worker (``__call__``): the batch's documents (1-D integer token arrays, or dicts
       holding one under ``key``), each followed by ``eos_id``, concatenated into one
       ``{"tokens": (T,), "lengths": (N,) int64}`` batch of numpy arrays (shared memory, no pickling);
    2. in the training process (:meth:`cut`): the carried remainder plus these tokens are cut into
       ``(k, seq_len)`` rows; what is left (< ``seq_len`` tokens) is carried to the next batch.

    The carry lives in the training process, in plan order, so it does not depend on which worker
    decoded which batch, and the Loader's ``state_dict()`` holds it: resume is exact. At the end of
    an epoch the remainder is emitted as one last row padded with ``pad_id`` (so every token of the
    epoch is delivered exactly once and no document crosses an epoch).
    """

    def __init__(self, seq_len: int, eos_id: int, pad_id: int | None = None, key=None):
        if int(seq_len) < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        self.seq_len, self.eos_id, self.key = int(seq_len), int(eos_id), key
        self.pad_id = self.eos_id if pad_id is None else int(pad_id)

    def __repr__(self) -> str:
        return f"pack_tokens(seq_len={self.seq_len}, eos_id={self.eos_id}, pad_id={self.pad_id}, key={self.key!r})"

    def __call__(self, samples: list) -> dict:
        """Worker side: see the class docstring.

        Raises:
            CollateError: a document is not a 1-D integer array (or lacks ``key``).
        """
        docs = [_field(s, self.key, j) for j, s in enumerate(samples)]
        for j, d in enumerate(docs):
            if d.dtype.kind not in "iu":
                raise CollateError(j, f"tokens have dtype {d.dtype}, expected integers")
        dtype = np.result_type(*[d.dtype for d in docs]) if docs else np.int64
        parts = []
        for d in docs:
            parts += [d, np.array([self.eos_id], dtype=dtype)]
        tokens = np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype)
        return {"tokens": tokens, "lengths": np.array([len(d) + 1 for d in docs], dtype=np.int64)}

    def cut(self, carry: np.ndarray | None, batch: dict, last: bool) -> tuple[dict | None, np.ndarray]:
        """Training-process side: ``(rows, new carry)``.

        ``rows`` is ``{"input_ids": (k, seq_len) tensor, "lengths": (k,) int64 tensor}``
        (``lengths``: real tokens per row; ``seq_len`` except the padded last row of an epoch), or
        None when fewer than ``seq_len`` tokens are at hand (all carried). ``batch``: what
        ``__call__`` returned (arrays or tensors); ``last``: the epoch's last batch (flush).
        """
        import torch

        tokens = np.asarray(batch["tokens"])
        if carry is not None and len(carry):
            tokens = np.concatenate([np.asarray(carry, dtype=tokens.dtype), tokens])
        L = self.seq_len
        k = len(tokens) // L
        lengths = [L] * k
        rest = tokens[k * L :]
        rows = tokens[: k * L].reshape(k, L)
        if last and len(rest):
            tail = np.full((1, L), self.pad_id, dtype=tokens.dtype)
            tail[0, : len(rest)] = rest
            rows, lengths, rest = np.concatenate([rows, tail]), lengths + [len(rest)], rest[:0]
        if not len(rows):
            return None, rest.copy()
        return (
            {
                "input_ids": torch.from_numpy(np.ascontiguousarray(rows)),
                "lengths": torch.tensor(lengths, dtype=torch.int64),
            },
            rest.copy(),
        )


def pack_tokens(seq_len: int, eos_id: int, pad_id: int | None = None, key=None) -> PackTokens:
    """A collate that packs token sequences into rows of exactly ``seq_len`` tokens.

    Args:
        seq_len: tokens per row.
        eos_id: the separator token appended to every document.
        pad_id: fills the last row of an epoch (default ``eos_id``).
        key: the field of each (dict) sample holding its tokens, or None when the sample is the
            1-D integer array itself.

    Returns a :class:`PackTokens`. With it the Loader yields ``{"input_ids": (k, seq_len),
    "lengths": (k,)}`` batches (k varies with the documents' lengths; a batch whose tokens all
    go to the carry is not yielded). Raises ValueError for ``seq_len < 1``.
    """
    return PackTokens(seq_len, eos_id, pad_id, key)


class RawBatch(NamedTuple):
    """A batch of raw samples (:func:`raw_bytes`): every sample's payload bytes as stored.

    Attributes:
        data: torch ``uint8`` tensor: the payloads one after another, shape ``(total_bytes,)``;
            shape ``(N, sample_bytes)`` when every sample of the batch has ``sample_bytes`` bytes
            (a dataset of fixed-size records always gives that).
        offsets: torch ``int64`` tensor ``(N + 1,)``: sample ``j`` is bytes
            ``[offsets[j], offsets[j + 1])`` of ``data`` flattened (:meth:`sample`).
        ids: torch ``int64`` tensor ``(N,)``: the sample ids, in batch order.
        labels: torch ``int64`` tensor ``(N,)``: the samples' labels (-1 for a sample without one).
    """

    data: Any
    offsets: Any
    ids: Any
    labels: Any

    def sample(self, j: int):
        """The payload of the batch's sample ``j``: a 1-D ``uint8`` view of :attr:`data` (no copy)."""
        return self.data.reshape(-1)[int(self.offsets[j]) : int(self.offsets[j + 1])]


def one_size(lengths: np.ndarray) -> bool:
    """Whether samples of ``lengths`` bytes (int (N,)) all have one size ``L > 0`` (the
    :class:`RawBatch` of such samples is ``(N, L)``)."""
    return bool(len(lengths) and lengths[0] > 0 and (lengths == lengths[0]).all())


def raw_layout(lengths: np.ndarray, fixed: bool | None = None) -> tuple[np.ndarray, tuple[int, ...]]:
    """``(offsets, data shape)`` of a :class:`RawBatch` of samples of ``lengths`` bytes (int64 (N,)):
    offsets (N + 1,) int64 from 0; shape ``(N, L)`` or ``(total,)``. ``fixed``: the form, decided
    once for the samples a loader reads (:func:`one_size` of them all: a ragged dataset's batch
    whose samples happen to share a size stays flat); None: ``(N, L)`` when this batch's lengths
    are one ``L > 0``."""
    offsets = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    n = len(lengths)
    if fixed if fixed is not None else one_size(lengths):
        return offsets, (n, int(lengths[0]) if n else 0)
    return offsets, (int(offsets[-1]),)


def raw_bytes(samples: list) -> RawBatch:
    """Collate samples that no ``decode`` touched (a Loader with ``decode=None``: each sample is
    the dict of :meth:`stoker.store.dataset.Dataset.read_fields` with ``meta=True``) into a
    :class:`RawBatch` of their primary payloads: one flat ``uint8`` tensor and the offsets, or
    ``(N, sample_bytes)`` when every sample has one size.

    Given as ``Loader(ds, batch_size, collate=stoker.collate.raw_bytes)`` without ``decode``, the
    workers do not run it: they read the batch's byte ranges from the node cache straight into the
    batch's shared-memory slot, each sample checked against its checksum there, and the result is
    this same batch (:mod:`stoker.loader.workers.rawbatch`); with ``num_workers=0`` the training
    process reads it the same way. With a ``decode`` it runs as written here.

    Raises:
        CollateError: a sample is not such a dict (a ``decode`` returned something else), or the
            batch is empty.
    """
    import torch

    if not samples:
        raise CollateError(0, "empty batch")
    payloads = []
    for j, s in enumerate(samples):
        if not isinstance(s, Mapping) or "__id__" not in s or not s or not isinstance(next(iter(s.values())), bytes):
            raise CollateError(
                j, f"raw_bytes takes the samples of a Loader without decode (dicts of fields), got {type(s).__name__}"
            )
        payloads.append(next(iter(s.values())))
    lengths = np.fromiter((len(p) for p in payloads), np.int64, len(payloads))
    offsets, shape = raw_layout(lengths)
    data = np.frombuffer(b"".join(payloads), np.uint8).copy().reshape(shape)
    ids = np.fromiter((s["__id__"] for s in samples), np.int64, len(samples))
    labels = np.fromiter((s.get("__label__", -1) for s in samples), np.int64, len(samples))
    return RawBatch(*(torch.from_numpy(a) for a in (data, offsets, ids, labels)))


class OnRaw:
    """The collate :func:`on_raw` returns (picklable when ``fn`` is): ``fn`` over the
    :class:`RawBatch` of the samples."""

    __slots__ = ("fn",)

    def __init__(self, fn):
        if not callable(fn):
            raise TypeError(f"on_raw takes a function of a RawBatch, got {type(fn).__name__}")
        self.fn = fn

    def __call__(self, samples: list):
        """``fn(raw_bytes(samples))``: the path of a Loader with a ``decode`` (whose samples must
        then still be dicts of raw fields). Raises what
        :func:`raw_bytes` and ``fn`` raise."""
        return self.fn(raw_bytes(samples))

    def __repr__(self) -> str:
        return f"stoker.collate.on_raw({getattr(self.fn, '__qualname__', self.fn)!r})"


def on_raw(fn) -> OnRaw:
    """A batch-level collate: ``fn`` receives a whole batch's raw samples at once, as one
    :class:`RawBatch` (``data`` uint8, ``offsets`` int64 ``(N + 1,)``, ``ids`` and ``labels``
    int64 ``(N,)``: torch tensors), and returns the batch (tensors, arrays, or a dict, tuple or
    list of them, moved through a shared-memory slot as any collate's). The batch counterpart of
    a per-sample ``decode=``: e.g. ``raw.data.view(torch.float16).reshape(n, -1)`` for fixed-size
    records, or one call of a batch decoder over every payload.

    Given as ``Loader(ds, batch_size, collate=stoker.collate.on_raw(fn))`` without ``decode``, each
    worker reads the batch's byte ranges from the node cache straight into a buffer of its own
    (one ``os.preadv`` per run of adjacent samples, each sample checked against its checksum, as
    for :func:`raw_bytes`) and calls ``fn`` once per batch (:mod:`stoker.loader.workers.rawbatch`).
    The :class:`RawBatch` is valid only during the call: the worker reuses its buffer for the next
    batch, so ``fn`` must not keep it or views of it (what it returns is copied into the slot).
    With ``num_workers=0`` the training process reads the batch the same way, into a buffer of the
    batch's own; with a ``decode`` it runs as ``fn(raw_bytes(samples))``.

    Raises:
        TypeError: ``fn`` is not callable.
    """
    return OnRaw(fn)
