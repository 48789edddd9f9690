"""`stoker.Writer`: samples made in Python written as a packed dataset, the same shards and index
as ``stoker pack``.

The writer encodes each sample (:mod:`.samplecodec`), cuts the samples into shards by
:func:`stoker.store.pack.cut`'s rule as they arrive, and writes each shard whole with its manifest
(:func:`stoker.store.manifests.write_shard`) on one background thread while the next is filled.
Closing it writes the index last, as pack does (:func:`stoker.store.publish.install_index`), so
the destination holds no dataset until then. A writer that fails inside its ``with`` removes the
shards it wrote; a killed one leaves shards but never an index, which no reader opens and the
next writer or pack at the destination replaces. Parallel writers each write a part
(:mod:`.parts`), which :meth:`Writer.merge` publishes as one dataset.
"""

from __future__ import annotations

import contextlib
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from .._units import parse_size
from ..errors import PackLeaseLostError, SourceError
from ..storage import Origin
from .lease import DEFAULT_LEASE_S, PackLease
from .manifests import ShardWriter, stream_hash, write_shard
from .pack import DEFAULT_SHARD_BYTES, PackResult
from .pack_options import PackOptions
from .parts import PartRecord, merge_parts, part_origin, part_shard_name, write_record, writer_result
from .publish import clear_destination, first_missing_dir, install_index, remove_if_empty
from .samplecodec import encode_sample, schema_mismatch
from .seenkeys import SeenKeys
from .shards import DEFAULT_SMALL_SAMPLE_BYTES, estimate_sample_bytes
from .sources import resolve_labels
from .wds import finish_sample

__all__ = ["Writer"]


class Writer:
    """Write samples made in Python as a packed dataset at ``dst`` (any fsspec URL).

    ::

        with stoker.Writer("s3://bucket/train", shard_bytes="64MiB") as w:
            for i, (jpeg, label, emb) in enumerate(items):
                w.write({"__key__": f"{i:08d}", "jpg": jpeg, "cls": label, "emb": emb})

    A sample is a dict: ``"__key__"`` (str, unique; its last ``/``-part non-empty and without a
    ``.``) and one or more fields, each bytes, str, int, float, a numpy array (dtype and shape
    kept), a dict or a list; how each is stored and read back is the table of
    :mod:`stoker.store.samplecodec`. Every sample has the fields and kinds of the first (an array
    the same dtype and number of dimensions; its shape may differ). The primary payload is the
    first image field (``jpg``, ``png``, ...), else the first field; an int or str ``cls`` field,
    or a ``json`` dict's ``label``, is the sample's label, as for a WebDataset pack.

    Args:
        dst: the dataset's URL (a path, ``file://``, ``s3://``, ...).
        shard_bytes: target shard size, an int or a string such as ``"64MiB"`` (bytes; > 0). The
            writer holds about two shards of samples in memory.
        part: None for one writer; an int >= 0 for one of several parallel writers (one per rank
            or process), each with its own part number; :meth:`merge` publishes the parts.
        overwrite: replace a dataset at ``dst`` (its index is removed when the writer starts:
            the old dataset is gone from then on, as with ``pack --overwrite``).
        storage_options: fsspec storage options (S3: ``endpoint_url``, ``key``, ``secret``, ...).
        lease_s: length in seconds of the writer's lease on ``dst`` (or on its part), renewed while
            it writes (:mod:`stoker.store.lease`; > 0).
        small_sample_bytes: samples whose fields total fewer bytes than this (int or size string,
            default 4096) are grouped, many to one tar member, at a few bytes each
            (:mod:`stoker.store.shards`); 0 writes every sample as its own members (WebDataset's
            layout), a size above every sample's groups them all. Readers read both alike.

    Atomic: until :meth:`close` (the end of the ``with`` without an exception) returns, ``dst``
    holds no index, so :func:`stoker.open_dataset` opens nothing there. An exception inside the
    ``with`` (or :meth:`abort`) removes every shard the writer wrote; a killed writer leaves its
    shards (``dst/shards/``) and lease but no index: nothing opens them, and the next writer or
    pack at ``dst`` takes the lease of a dead process over and removes them once its own index is in.

    Raises (from the constructor):
        stoker.PackLeaseError: another live pack or writer holds ``dst`` (or the part).
        stoker.DatasetExistsError: ``dst`` already holds a dataset and ``overwrite`` is false.
        ValueError, TypeError: a bad ``shard_bytes``, ``part`` or ``lease_s``.
    """

    def __init__(
        self,
        dst: str,
        *,
        shard_bytes: int | str = DEFAULT_SHARD_BYTES,
        part: int | None = None,
        overwrite: bool = False,
        storage_options: dict | None = None,
        lease_s: float = DEFAULT_LEASE_S,
        small_sample_bytes: int | str = DEFAULT_SMALL_SAMPLE_BYTES,
    ):
        self.shard_bytes = parse_size(shard_bytes, "shard_bytes")
        if self.shard_bytes < 1:
            raise ValueError(f"shard_bytes must be positive, got {self.shard_bytes}")
        self._options = PackOptions(small_sample_bytes=parse_size(small_sample_bytes, "small_sample_bytes"))
        if part is not None and (isinstance(part, bool) or not isinstance(part, int) or part < 0):
            raise ValueError(f"part must be None or an int >= 0, got {part!r}")
        self.part = part
        self.dest = Origin(os.fspath(dst), dict(storage_options or {}))
        self.url = self.dest.url
        self.result: PackResult | None = None  # set by close()
        self._made = first_missing_dir(self.dest)
        own = self.dest if part is None else part_origin(self.dest, part)
        self._lease = PackLease(own, lease_s)
        self._lease.__enter__()
        try:
            clear_destination(self.dest, overwrite)
            if part is not None:  # an earlier run's record of this part no longer stands
                with contextlib.suppress(FileNotFoundError):
                    own.fs.rm(own.path("part.json"))
        except BaseException:
            self._lease.release()
            raise
        self._shards = ShardWriter(self.dest, True, self._lease.check, self._options)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="stoker-writer")
        self._pending: Future | None = None
        self._written: list[str] = []  # shard names, for abort
        self._batch: list[tuple[str, list]] = []  # (key, [(field, bytes), ...])
        self._batch_bytes = 0
        self._count = 0
        self._seen = SeenKeys()  # the keys taken, as digests (about 20 B per key), for the duplicate check
        self._labels: list = []
        self._kinds: dict[str, str] | None = None
        self._state = "open"
        self._t0 = time.perf_counter()

    def __enter__(self) -> Writer:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def __len__(self) -> int:
        """Samples written so far."""
        return self._count

    def write(self, sample: dict[str, Any]) -> None:
        """Add one sample (see the class docstring). It is checked and encoded now; its shard is
        written once full.

        Raises:
            TypeError: not a dict, a key that is not a str, a value with no stored form (naming
                the key and field).
            stoker.SourceError: (a ValueError) a duplicate key, or fields that differ from the
                first sample's (naming the key and the field), a malformed key or field name.
            ValueError: the writer is closed.
            stoker.OriginError, stoker.PackLeaseLostError: from writing an earlier shard.
        """
        if self._state != "open":
            raise ValueError(f"Writer({self.url!r}) is {self._state}: it takes no more samples")
        try:
            key, members, kinds = encode_sample(sample)
        except TypeError as exc:
            raise TypeError(f"{self.url}: {exc}") from None
        except SourceError as exc:  # a malformed key or field name
            raise SourceError(f"{self.url}: {exc}") from None
        digest = self._seen.digest(key)
        if any(self._key_at(j) == key for j in self._seen.earlier(digest)):  # usually no candidate
            raise SourceError(f"{self.url}: duplicate key {key!r}: every sample needs its own key")
        if self._kinds is None:
            self._kinds = kinds
        elif why := schema_mismatch(kinds, self._kinds):
            raise SourceError(f"{self.url}: sample {key!r} {why}")
        s = finish_sample(key, members, self.url)
        options = self._options
        size = estimate_sample_bytes(key, [(f, len(d)) for f, d in s.members], int(options.small_sample_bytes))
        if self._batch and self._batch_bytes + size > self.shard_bytes:
            self._flush()
        self._seen.add(digest)
        self._count += 1
        self._labels.append(s.label)
        self._batch.append((key, s.members))
        self._batch_bytes += size

    def _key_at(self, j: int) -> str:
        """The key of the ``j``-th sample written (after the shard being written is recorded)."""
        self._collect()
        rows = self._shards.rows
        return rows[j] if j < len(rows) else self._batch[j - len(rows)][0]

    def _flush(self) -> None:
        """Hand the filled shard to the writing thread, after the previous one is written."""
        self._collect()
        n = len(self._shards.table)
        name = part_shard_name(self.part, n) if self.part is not None else f"shards/shard-{n:06d}.tar"
        batch, self._batch, self._batch_bytes = self._batch, [], 0
        self._written.append(name)
        self._pending = self._pool.submit(self._write_shard, name, batch)

    def _write_shard(self, name: str, batch: list[tuple[str, list]]) -> dict:
        self._lease.check()
        options = self._options
        small = int(options.small_sample_bytes)
        return write_shard(self.dest, name, stream_hash(batch, small), batch, small)

    def _collect(self) -> None:
        """Wait for the shard being written and record it (its error, if any, is raised here)."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self._shards.add(pending.result(), False)

    def close(self) -> PackResult:
        """Write the last shard and publish: the index (one writer) or the part's record (a part).
        Returns (and keeps as :attr:`result`) the :class:`stoker.store.pack.PackResult`; a second
        call returns it again. On any error the writer aborts (:meth:`abort`) and re-raises.

        Raises:
            stoker.SourceError: (a ValueError) one writer (not a part) with no sample.
            stoker.OriginError, stoker.PackLeaseLostError: writing failed or the lease was lost.
        """
        if self.result is not None:
            return self.result
        if self._state != "open":
            raise ValueError(f"Writer({self.url!r}) is {self._state}")
        try:
            if self._batch:
                self._flush()
            self._collect()
            rows = self._shards.rows
            if self.part is None:
                if not len(rows):
                    raise SourceError(f"{self.url}: no sample was written; a dataset needs at least one")
                self._seen = SeenKeys()  # no more writes: the digests' memory goes before the index's
                raw, self._labels = self._labels, []
                labels, names, classes = resolve_labels(raw, None, rows)
                del raw
                version = install_index(self.dest, self._lease, rows, labels, names, classes, self._shards.table)
            else:
                record = PartRecord(self.part, self._shards.table, list(rows.as_lists()), self._labels)
                record.kinds = self._kinds or {}
                self._lease.check()
                write_record(part_origin(self.dest, self.part), record)
                version, classes = "", []
        except BaseException:
            self.abort()
            raise
        self._finish("closed")
        self.result = writer_result(self.url, rows, self._shards.table, len(classes), version, self._t0)
        return self.result

    def abort(self) -> None:
        """Give up: stop writing, remove every shard (and manifest) this writer wrote, and its part
        folder; the destination is left as it was before (less an index ``overwrite`` removed).
        No error for a writer already closed or aborted."""
        if self._state != "open":
            return
        self._pool.shutdown(wait=True, cancel_futures=True)
        if self._lost_lease():  # another writer took the destination over: its shards, not ours
            self._written = []
        for name in self._written:
            for rel in (name, f"{name}.json"):
                with contextlib.suppress(Exception):  # best effort: never hides the writer's own error
                    self.dest.fs.rm(self.dest.path(rel))
        self._finish("aborted")
        if self.part is not None:
            own = part_origin(self.dest, self.part)
            with contextlib.suppress(Exception):
                own.fs.rm(own.root, recursive=True)
        if self._made is not None:
            remove_if_empty(self.dest, self._made)

    def _lost_lease(self) -> bool:
        try:
            self._lease.check()
        except PackLeaseLostError:
            return True
        except Exception:  # noqa: BLE001 - the origin fails: still ours as far as we know
            return False
        return False

    def _finish(self, state: str) -> None:
        self._state = state
        self._pool.shutdown(wait=True)
        self._lease.release()

    @staticmethod
    def merge(dst: str, parts: int, *, overwrite: bool = False, storage_options: dict | None = None) -> PackResult:
        """Publish parts ``0..parts-1`` written at ``dst`` by ``Writer(dst, part=i)`` as one dataset:
        one index over every part's shards (none is copied), installed atomically; the parts'
        folders are removed after. Call it once, after every part writer has closed (e.g. on rank 0
        after a barrier). Returns the dataset's :class:`stoker.store.pack.PackResult`.

        Raises:
            stoker.SourceNotFoundError: (a FileNotFoundError) a part is missing or unfinished
                (naming it: its writer never closed, failed or was killed).
            stoker.SourceError: (a ValueError) a key written by two parts, parts whose fields
                differ, a part folder numbered ``parts`` or more, no sample at all.
            stoker.DatasetExistsError: ``dst`` holds a dataset and ``overwrite`` is false.
            stoker.PackLeaseError: another pack or merge is writing ``dst``.
        """
        return merge_parts(dst, parts, overwrite=overwrite, storage_options=storage_options)
