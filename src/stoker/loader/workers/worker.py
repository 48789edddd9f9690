"""Decode worker processes: read a batch's samples, decode, augment, write into a slot.

Each worker owns a copy of the dataset (the in-memory index travels with it; no
re-download) and opens the node cache by path. A task is one batch, or one part of a
split batch: ``(run, seq, epoch, slot, slot path, sample ids, offset, whole)``; the reply is small
(no pixel data): the count written, ids skipped by ``on_error="skip"``, the substitutes written
for a batch whose every sample was skipped (:mod:`stoker.loader.workers.padding`) and the process's
counters.
The sample id being decoded is published in a shared array so the loader can
name it if the worker dies. With the user's ``decode``/``collate`` (``cfg.generic``) the worker
runs :class:`stoker.loader.workers.batches.GenericDecoder` instead and the reply's last element says
where the batch is (in the slot, with its layout, or pickled in the reply itself).
"""

from __future__ import annotations

import contextlib
import traceback
from time import thread_time_ns
from typing import TYPE_CHECKING

import numpy as np

from ..options import WorkerConfig
from .sharedpickle import SharedPickle

if TYPE_CHECKING:
    from .batches import GenericDecoder, SlotWriter
    from .rawbatch import RawBatchReader


def counters(ds, derived=None, decoder=None) -> dict:
    """The process's origin/cache/read (and derived-cache) counters as one flat dict of ints, with
    ``decode_cpu_us`` (the CPU microseconds inside the decode so far) of ``decoder`` where it keeps
    one (:class:`BatchDecoder`, :class:`stoker.loader.workers.batches.GenericDecoder`)."""
    out = {f"origin_{k}": v for k, v in ds.origin.counters.snapshot().items()}
    if ds.cache is not None:
        out.update({f"cache_{k}": v for k, v in ds.cache.stats.snapshot().items()})
    out.update({f"read_{k}": v for k, v in ds.read_stats.snapshot().items()})
    if derived is not None:
        out.update(derived.counters())
    if (ns := getattr(decoder, "decode_cpu_ns", None)) is not None:
        out["decode_cpu_us"] = ns // 1000
    return out


def fresh_copy(obj):
    """A copy through pickling: drops storage clients, event loops and counters that a
    forked child inherited from its parent (each class's __getstate__ says what). numpy and
    Arrow arrays are kept, not copied (pickle's persistent ids): a forked worker reads the
    index's arrays in the parent's pages, which nothing writes, so they stay shared
    (copy-on-write) instead of a private copy of the index in every worker."""
    import io
    import pickle

    import pyarrow as pa

    kept: list = []

    class _Keeper(pickle.Pickler):
        def persistent_id(self, o):  # noqa: ANN001 - pickle's hook
            if isinstance(o, (np.ndarray, pa.Array, pa.ChunkedArray)):
                kept.append(o)
                return len(kept) - 1
            return None

    class _Loader(pickle.Unpickler):
        def persistent_load(self, pid):  # noqa: ANN001 - pickle's hook
            return kept[pid]

    buf = io.BytesIO()
    _Keeper(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    buf.seek(0)
    return _Loader(buf).load()


#: The most payload bytes a built-in decoder reads ahead in one part of a batch (its scratch
#: buffer, :meth:`BatchDecoder.payloads`): a batch of larger samples is read in several parts.
SCRATCH_BYTES = 32 << 20


def scratch_parts(lengths: np.ndarray, limit: int = SCRATCH_BYTES) -> list[tuple[int, int]]:
    """A batch's positions cut into parts ``[(start, end), ...]`` of at most ``limit`` payload bytes
    each (``lengths``: the samples' payload lengths in bytes, in batch order), a sample larger than
    ``limit`` alone in its part; ``[]`` for an empty batch."""
    cum = np.concatenate(([0], np.cumsum(lengths, dtype=np.int64)))
    parts, start, n = [], 0, len(lengths)
    while start < n:
        end = max(start + 1, int(np.searchsorted(cum, cum[start] + limit, side="right")) - 1)
        parts.append((start, end))
        start = end
    return parts


class BatchDecoder:
    """Decode+augment a list of sample ids into (images, labels) arrays; used by workers
    and by the loader itself when ``num_workers == 0``."""

    def __init__(self, ds, cfg: WorkerConfig):
        from ...decode import decode_transform  # noqa: F401 - import cost paid once per worker

        self.ds, self.cfg = ds, cfg
        self._decode_transform = decode_transform
        self.derived = cfg.derived  # a DerivedCache (see stoker.loader.derived) or None
        self._scratch = np.empty(0, np.uint8)  # a batch's payloads (payloads()), reused batch to batch
        #: CPU nanoseconds of this thread inside decode+transform (``decode_sample``), so far
        self.decode_cpu_ns = 0

    def payloads(self, ids: np.ndarray, current=None) -> list[memoryview]:
        """The verified payloads of the samples ``ids`` (int (N,)), in order, as views of this
        decoder's scratch buffer, read as a batch (:func:`stoker.loader.workers.batchread.read_batch`:
        one ``os.preadv`` per run of a cached block's samples, each checked in place). Valid until
        the next call. Raises ChecksumError / OriginError naming the sample, as :meth:`Dataset.read`."""
        from .batchread import read_batch

        sids = np.asarray(ids, dtype=np.int64).reshape(-1)
        lengths = self.ds.index.length[sids].astype(np.int64)
        offsets = np.zeros(len(sids), np.int64)
        np.cumsum(lengths[:-1], out=offsets[1:])
        total = int(lengths.sum())
        if len(self._scratch) < total:  # a new buffer: views of the old one stay valid
            self._scratch = np.empty(total + total // 4, np.uint8)
        view = self._scratch.data
        read_batch(self.ds, sids, lengths, offsets, view, current)
        return [view[o : o + n] for o, n in zip(offsets.tolist(), lengths.tolist(), strict=True)]

    def decode_sample(self, sid: int, key: str, mode: str, rng, size: int, out, data=None) -> None:
        """Decode+transform sample ``sid`` into ``out``: from its derived entry when there is one,
        else from the raw bytes (writing the derived entry as a side effect). ``data``: the
        sample's verified payload when the caller read it already (:meth:`payloads`)."""
        der = self.derived
        if der is None:
            if data is None:
                data = self.ds.read(sid)
            self._decode_transform(data, key, mode, rng, size=size, out=out, exif_orientation=self.cfg.exif_orientation)
            return
        from ...decode import decode_image
        from ..derived import SAME, transform_image

        got = der.get(sid, key)
        if got is not None and got[0] != SAME:
            transform_image(got[2], got[1], mode, rng, size, out)
            return
        img = decode_image(self.ds.read(sid), key, exif_orientation=self.cfg.exif_orientation)
        transform_image(img, img.shape[:2], mode, rng, size, out)
        if got is None:
            der.put(sid, key, img)

    def run(
        self, epoch: int, ids: np.ndarray, images: np.ndarray, labels: np.ndarray, current=None, whole: bool = True
    ):
        """Fill ``images[j]``/``labels[j]``; returns (n written, skipped ids, skipped keys,
        payloads, padded). ``payloads`` is None, except when the training process decodes on the
        device (``cfg.decode_on == "device"``): then no image is written and it is the list of
        ``(sample id, verified bytes)`` of the batch, in the order of ``labels``. ``padded``: the
        ``(sample id, key)`` of the substitutes written when every sample of the batch was
        skipped (:mod:`stoker.loader.workers.padding`; only for a ``whole`` batch, not a part of a split
        one), else empty.

        Raises:
            DecodeError: a sample no decoder reads, with ``on_error="raise"``.
            WorkerError: every sample was skipped and no substitute decoded (the dataset looks
                unreadable).
        """
        from ...decode import DecodeError
        from .samplerng import BatchRngs

        cfg, ds = self.cfg, self.ds
        if cfg.decode_on == "device":
            payloads = []
            for j, sid in enumerate(ids):
                sid = int(sid)
                if current is not None:
                    current.value = sid
                payloads.append((sid, ds.read(sid)))
                labels[j] = ds.index.labels[sid]
            return len(payloads), [], [], payloads, []
        mode, seed, size = cfg.transform, cfg.seed, cfg.image_size
        skip = cfg.on_error == "skip"
        j, skipped, skipped_keys = 0, [], []
        sids = [int(sid) for sid in ids]
        # the batch read as a batch, in parts of up to SCRATCH_BYTES (no derived cache: each sample's
        # raw bytes are wanted), and its generators made together, before any decode (the same
        # draws as default_rng(sample_seed(...)))
        lengths = ds.index.length[np.asarray(ids, dtype=np.int64)]
        parts = scratch_parts(lengths, SCRATCH_BYTES) if self.derived is None else []
        datas: list = []
        base = 0  # the batch position of datas[0]
        rngs = BatchRngs(seed, epoch, sids) if mode == "train" else None
        for k, sid in enumerate(sids):
            if parts and k == parts[0][0]:
                base, end = parts.pop(0)
                datas = self.payloads(ids[base:end], current)
            if current is not None:
                current.value = sid
            key = ds.key(sid)
            t0 = thread_time_ns()
            try:
                self.decode_sample(
                    sid,
                    key,
                    mode,
                    rngs[k] if rngs is not None else None,
                    size,
                    images[j],
                    datas[k - base] if datas else None,
                )
            except DecodeError as exc:
                if not skip:
                    raise
                skipped.append(sid)  # logged when (if) its batch is delivered (epoch_stats.account)
                skipped_keys.append((key, str(exc)))
                continue
            finally:
                self.decode_cpu_ns += thread_time_ns() - t0
            labels[j] = ds.index.labels[sid]
            j += 1
        padded: list = []
        if j == 0 and skipped and whole and cfg.substitutes:  # substitutes, so every rank yields this batch
            padded = self._pad(epoch, sids, images, labels, current, skipped_keys)
            j = len(padded)
        return j, skipped, skipped_keys, None, padded

    def _pad(self, epoch: int, sids: list, images, labels, current, skipped_keys: list) -> list:
        """Decode substitutes for the batch of ``sids``, every one of them skipped, into
        ``images``/``labels`` from row 0 (:mod:`stoker.loader.workers.padding`); their ``(id, key)``.

        Raises:
            WorkerError: none of the samples tried decoded.
        """
        from ...decode import DecodeError
        from ...order import sample_seed
        from .padding import probe_limit, probe_order, unreadable

        cfg, ds = self.cfg, self.ds
        padded: list = []
        tried, last = 0, None
        for sid in probe_order(cfg.seed, epoch, sids, len(ds), cfg.sample_ids):
            if len(padded) == len(sids) or tried == probe_limit(len(sids)):
                break
            tried += 1
            if current is not None:
                current.value = sid
            key = ds.key(sid)
            rng = np.random.default_rng(sample_seed(cfg.seed, epoch, sid)) if cfg.transform == "train" else None
            try:
                self.decode_sample(sid, key, cfg.transform, rng, cfg.image_size, images[len(padded)])
            except DecodeError as exc:
                last = str(exc)
                continue
            labels[len(padded)] = ds.index.labels[sid]
            padded.append((sid, key))
        if not padded:
            raise unreadable(epoch, [k[0] if isinstance(k, tuple) else k for k in skipped_keys], tried, last)
        return padded


def _cause(exc: BaseException):
    """``exc`` itself when the training process can re-create it (a stoker error that pickles):
    the :class:`stoker.WorkerError` raised there has it as ``__cause__``, so a ChecksumError or
    an OriginError from a worker can be told apart from a decode failure; else None."""
    import pickle

    from ...errors import StokerError

    if not isinstance(exc, StokerError):
        return None
    try:
        pickle.dumps(exc)
    except Exception:  # noqa: BLE001 - whatever fails to pickle: the text still goes
        return None
    return exc


#: The ``current`` cell of a worker that has not finished its own start (set by the pool before
#: the start; the worker sets -1, idle, once it is set up).
STARTING = -2


def _setup(ds, cfg: WorkerConfig):
    """A worker's own copy of the dataset and its decoder: ``(decoder, slot writer or None,
    derived cache or None)``."""
    ds = fresh_copy(ds)
    if not ds.origin.use_native():  # a worker never forks: obstore's runtime is safe here
        ds.origin.warm()  # s3fs: build the client now (~0.25 s), not at the first read
    with contextlib.suppress(ImportError):
        import cv2

        cv2.setNumThreads(1)
    import torch

    torch.set_num_threads(1)  # one worker per core: the resize kernel must not spawn a pool each
    dec: BatchDecoder | GenericDecoder | RawBatchReader
    writer: SlotWriter | None = None
    if cfg.generic:  # the user's decode/collate (batches.py), or raw batches read as batches (rawbatch.py)
        from .batches import GenericDecoder, SlotWriter
        from .rawbatch import RawBatchReader, reads_raw

        dec, writer = (RawBatchReader(ds, cfg) if reads_raw(cfg) else GenericDecoder(ds, cfg)), SlotWriter()
    else:
        dec = BatchDecoder(ds, cfg)
    return dec, writer, getattr(dec, "derived", None)


def worker_main(wid: int, ds, cfg, tasks, results, current, stop, ready=None) -> None:
    """Worker loop: take tasks until ``None`` or the ``stop`` event; post ('ok'|'error', ...) replies.
    ``cfg``: the :class:`WorkerConfig`, or it pickled (spawn/forkserver: then a user function
    that cannot be found here fails this worker's start with its own error, not the bootstrap).
    ``current``: the shared cell of the sample being decoded (-1 idle), :data:`STARTING` until
    the worker is set up. ``ready``: a shared counter (``multiprocessing.Value``) incremented then.
    A failure while setting up is posted as ``("start-error", wid, text)`` and the process exits
    with code 1; SIGINT is ignored (:mod:`stoker.loader.workers.interrupts`)."""
    from .interrupts import ignore_in_child

    ignore_in_child()
    import pickle
    import queue as _queue

    from ..._procs import exit_with_parent, parent_gone, parent_identity

    parent = parent_identity()  # the training process (under forkserver not the OS parent)
    exit_with_parent()
    try:
        if isinstance(cfg, bytes):
            cfg = pickle.loads(cfg)
        if isinstance(ds, SharedPickle):
            ds = ds.load()
        dec, writer, derived = _setup(ds, cfg)
    except BaseException as exc:  # noqa: BLE001 - the training process names it (launch.start_failure)
        results.put(("start-error", wid, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        raise SystemExit(1) from None
    ds = dec.ds
    maps: dict[str, tuple] = {}
    current.value = -1
    if ready is not None:
        with ready.get_lock():
            ready.value += 1
    while True:
        try:
            task = tasks.get(timeout=1.0)
        except _queue.Empty:
            if parent_gone(parent):
                break
            continue
        if task is None or stop.is_set():
            break
        try:
            results.put(_decode_task(wid, task, dec, writer, derived, cfg, maps, current))
        except BaseException as exc:  # noqa: BLE001 - every failure must reach the trainer
            results.put(_error_reply(wid, task, exc, dec, derived, int(current.value)))
        finally:
            current.value = -1
    if writer is not None:
        writer.close()
    for mm, _, _ in maps.values():
        with contextlib.suppress(BufferError):
            mm.close()


def _decode_task(wid: int, task: tuple, dec, writer, derived, cfg: WorkerConfig, maps: dict, current) -> tuple:
    """Decode one task ``(run, seq, epoch, slot, path, ids, offset, whole)`` into its slot (the
    built-in decode: slot files mapped once, kept in ``maps``) or into a packed batch (the user's
    decode/collate, with ``writer``); returns the ``"ok"`` reply. ``offset``: where a part of a
    split batch goes in its slot; ``whole``: False for such a part (loader/pipeline/split.py),
    whose worker never pads it (loader/workers/padding.py). Raises what the decode raises."""
    from ..shm import map_slot
    from .batches import GenericDecoder, pack_reply
    from .rawbatch import RawBatchReader

    run, seq, epoch, slot, path, ids, offset, whole = task
    if isinstance(dec, RawBatchReader):  # raw bytes read straight into the slot: nothing skipped, no substitutes
        assert writer is not None
        n, raw = dec.run(ids, path, writer, current)
        return ("ok", wid, run, seq, slot, n, [], [], counters(dec.ds), None, raw, [], offset)
    if writer is not None:
        assert isinstance(dec, GenericDecoder)  # the writer comes with it (cfg.generic)
        n, skipped, skipped_keys, batch, padded = dec.run(epoch, ids, current, whole)
        counts, payloads, packed = counters(dec.ds, None, dec), None, pack_reply(writer, path, batch)
    else:
        if path not in maps:
            maps[path] = map_slot(path, cfg.batch_size, cfg.image_size)
        _, images, labels = maps[path]
        assert isinstance(dec, BatchDecoder)
        n, skipped, skipped_keys, payloads, padded = dec.run(
            epoch, ids, images[offset:], labels[offset:], current, whole
        )
        counts, packed = counters(dec.ds, derived, dec), None
    # the one reply of a done task: built-in decode sends payloads, a user decode its packed batch
    return ("ok", wid, run, seq, slot, n, skipped, skipped_keys, counts, payloads, packed, padded, offset)


def _error_reply(wid: int, task: tuple, exc: BaseException, dec, derived, sid: int) -> tuple:
    """The ``"error"`` reply of a task that raised ``exc`` on sample ``sid`` (the ``current`` cell)
    in the worker's decoder ``dec``."""
    ds = dec.ds
    run, seq, _, slot = task[:4]
    key = getattr(exc, "key", None)  # the sample at fault (a corrupt one sharing the block)
    if key is None:
        key = ds.key(sid) if 0 <= sid < len(ds) else None
    err, tb = f"{type(exc).__name__}: {exc}", traceback.format_exc()
    return ("error", wid, run, seq, slot, key, err, tb, counters(ds, derived, dec), _cause(exc), task[6])
