"""User ``decode`` and ``collate`` in the workers, and how their batches reach the training process.

With ``Loader(ds, batch_size, decode=fn, collate=fn2)`` a worker turns each sample id of a batch
into ``fn(ds.read_fields(i, meta=True), rng)`` (every member by name, then the sample's ``__key__``,
``__id__`` and, where it has one, ``__label__``; a substitute decoded for a batch whose every sample
was skipped also has ``__padding__`` set to True, :mod:`stoker.loader.workers.padding`; ``rng``: a numpy
Generator seeded by (seed, epoch, sample id), :func:`stoker.order.sample_seed`) and the list of
samples into ``fn2(samples)`` (default :func:`stoker.collate.default`; without ``fn`` the samples
are those dicts). The batch then travels one of two ways:

- **shared memory**, for every numpy array and CPU torch tensor of the batch, whether it is one
  array or arrays in dicts, tuples, lists and namedtuples (nested): :func:`flatten` splits it into
  a small tree description, its arrays and its other leaves (strings, numbers, Python objects,
  tensors numpy cannot view such as bfloat16; a sub-tree with no array in it counts as one such
  leaf). The worker writes the arrays one after another (64-byte aligned) into the batch's slot
  file, growing the file when the batch is larger than the slot (slots start at one page, so each
  is sized by the first batch it carries), and replies with the tree, each array's dtype, shape
  and offset, and the other leaves pickled together (nothing when there are none). The training
  process maps the slot again if it grew and rebuilds the batch, same structure and types, with
  its arrays as views over the slot (no copy); the slot is reused once every view is dropped.
- **pickled through the worker's result pipe**, for a batch with no array in it at all (a list
  of strings), or one whose slot cannot grow (``/dev/shm`` full): a copy in the worker, the
  pipe, and a copy in the training process.

``EpochStats.shm_batches`` / ``pickled_batches`` count the batches of each way; ``pickled_bytes``
the bytes pickled: whole batches, plus the other leaves of the batches through shared memory.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import logging
import math
import mmap
import os
import pickle
from time import thread_time_ns

import numpy as np

from ...errors import SampleFnError  # noqa: F401 - re-exported

log = logging.getLogger(__name__)

__all__ = ["SampleFnError", "GenericDecoder", "flatten", "rebuild", "SlotWriter", "ALIGN_BYTES"]

#: Alignment of each array in a slot (a cache line; also what numpy/torch SIMD code prefers).
ALIGN_BYTES = 64
_PAGE = mmap.PAGESIZE


def fn_name(fn) -> str:
    """A readable name of a function or callable object (for error messages)."""
    mod = getattr(fn, "__module__", None) or "?"
    name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    return f"{mod}.{name}"


def _array(x) -> np.ndarray | None:
    """The array a leaf puts in the slot (a numpy view of a CPU tensor), or None when it is not
    one that can go there (object arrays, subclasses such as masked arrays, CUDA tensors, tensors
    that need grad, bfloat16)."""
    if type(x) is np.ndarray:
        if x.dtype.hasobject:
            return None
        return x if x.flags.c_contiguous else np.ascontiguousarray(x)  # (this one makes a 0-d array 1-d)
    if type(x).__module__ == "torch" and type(x).__name__ == "Tensor":
        if x.device.type != "cpu" or x.requires_grad:
            return None
        try:
            return x.contiguous().numpy()
        except (TypeError, RuntimeError):  # a dtype numpy has no equal for (bfloat16)
            return None
    return None


def _dict_shell(x: dict) -> dict | None:
    """An empty copy of a dict subclass (its type and attributes, e.g. a defaultdict's factory),
    to be filled in the training process; None when it cannot be made."""
    try:
        shell = copy.copy(x)
        shell.clear()
    except Exception:  # noqa: BLE001 - the user's class: then it is pickled whole
        return None
    return shell


def _leaf(x, leaves: list, rest: list):
    """The tree node of ``x``; its arrays appended to ``leaves``, its other leaves to ``rest``."""
    arr = _array(x)
    if arr is not None:
        leaves.append(arr)
        return ("np" if type(x) is np.ndarray else "pt", len(leaves) - 1)
    marks = len(leaves), len(rest)
    node: tuple  # (kind, children) or (kind, index in rest, children)
    if type(x) is dict:
        node = ("dict", [(k, _leaf(v, leaves, rest)) for k, v in x.items()])
    elif isinstance(x, dict) and (shell := _dict_shell(x)) is not None:
        rest.append(shell)
        node = ("dictof", len(rest) - 1, [(k, _leaf(v, leaves, rest)) for k, v in x.items()])
    elif type(x) in (tuple, list):
        node = (type(x).__name__, [_leaf(v, leaves, rest) for v in x])
    elif isinstance(x, tuple) and hasattr(type(x), "_make") and hasattr(type(x), "_fields"):  # a namedtuple
        rest.append(type(x))
        node = ("named", len(rest) - 1, [_leaf(v, leaves, rest) for v in x])
    else:
        rest.append(x)
        return ("obj", len(rest) - 1)
    if len(leaves) == marks[0]:  # no array below: the container is one pickled leaf
        del rest[marks[1] :]
        rest.append(x)
        return ("obj", len(rest) - 1)
    return node


def flatten(batch) -> tuple | None:
    """``(tree, arrays, rest)`` of a batch: ``arrays`` every numpy array / CPU tensor in it (as
    contiguous numpy arrays, in tree order), ``rest`` its other leaves (and what rebuilding its
    containers needs: a namedtuple's class, an empty copy of a dict subclass), ``tree`` the
    structure referring to both by index. None when the batch holds no array (it is pickled
    whole)."""
    leaves: list = []
    rest: list = []
    tree = _leaf(batch, leaves, rest)
    if not leaves:
        return None
    return tree, leaves, rest


def _layout(leaves: list) -> tuple[list, int]:
    """Per array ``(dtype, shape, offset)`` and the total bytes in a slot; the dtype as its string,
    or for a structured dtype its field list (the string of one is ``|V<n>``, without its fields)."""
    specs, off = [], 0
    for a in leaves:
        specs.append((a.dtype.descr if a.dtype.names else a.dtype.str, a.shape, off))
        off += -(-a.nbytes // ALIGN_BYTES) * ALIGN_BYTES
    return specs, off


def rebuild(tree, specs, buf: np.ndarray, rest=()):
    """The batch described by ``tree``/``specs``/``rest`` (:func:`flatten`) with its arrays as
    views over ``buf`` (uint8, the slot): numpy arrays, and torch tensors where the worker's were
    tensors; ``rest``: the batch's other leaves, unpickled (filled into, not copied).

    Plain recursion, no closure: a nested function that calls itself is a reference cycle, and
    one holding ``buf`` kept the slot from its release (:meth:`stoker.loader.shm.SlotRing.hold`)
    until Python's cycle collector ran, never with ``gc.disable()``."""
    return _build(tree, specs, buf, rest)


def _build(node, specs, buf: np.ndarray, rest):
    kind = node[0]
    if kind in ("np", "pt"):
        dt, shape, off = specs[node[1]]
        dt = np.dtype(dt)
        n = math.prod(shape) * dt.itemsize  # Python ints: numpy's prod costs ~5 us a call
        arr = buf[off : off + n].view(dt).reshape(shape) if n else np.empty(shape, dt)
        if kind == "pt":
            import torch

            return torch.from_numpy(arr)
        return arr
    if kind == "obj":
        return rest[node[1]]
    if kind == "dict":
        return {k: _build(v, specs, buf, rest) for k, v in node[1]}
    if kind == "dictof":  # a dict subclass: its empty copy, filled
        d = rest[node[1]]
        for k, v in node[2]:
            d[k] = _build(v, specs, buf, rest)
        return d
    if kind == "named":
        return rest[node[1]]._make([_build(v, specs, buf, rest) for v in node[2]])
    items = [_build(v, specs, buf, rest) for v in node[1]]
    return tuple(items) if kind == "tuple" else items


class SlotWriter:
    """A worker's mappings of the slot files; writes a flattened batch into one, growing it.

    The file is grown with ``posix_fallocate`` (pages reserved, so a full ``/dev/shm`` answers
    ENOSPC instead of a SIGBUS later); on no room the batch is pickled instead (``None``)."""

    def __init__(self):
        self.maps: dict[str, mmap.mmap] = {}
        self.warned = False  # the no-room fallback is logged once per worker

    def write(self, path: str, leaves: list) -> tuple[list, int] | None:
        """Write ``leaves`` into the slot at ``path``: ``(specs, slot bytes now)``, or None when
        the slot would have to grow and the shared-memory directory has no room."""
        specs, need = _layout(leaves)
        mm = self.reserve(path, need)
        if mm is None:
            return None
        buf = np.frombuffer(mm, dtype=np.uint8)
        for a, (_, _, off) in zip(leaves, specs, strict=True):
            buf[off : off + a.nbytes] = a.reshape(-1).view(np.uint8)
        del buf
        return specs, len(mm)

    def reserve(self, path: str, need: int) -> mmap.mmap | None:
        """This worker's mapping of the slot at ``path``, grown to at least ``need`` bytes (with 25 %
        headroom); None when it would have to grow and the shared-memory directory has no room."""
        mm = self.maps.get(path)
        size = os.path.getsize(path) if mm is None else len(mm)
        if need > size:
            want = -(-(need + need // 4) // _PAGE) * _PAGE  # 25 % headroom for the next batches
            fd = os.open(path, os.O_RDWR)
            try:
                try:
                    os.posix_fallocate(fd, 0, want)
                except OSError as exc:
                    if exc.errno not in (errno.ENOSPC, errno.ENOMEM, errno.EDQUOT):
                        raise
                    return None
                if mm is not None:
                    mm.close()
                mm = self.maps[path] = mmap.mmap(fd, want)
            finally:
                os.close(fd)
        elif mm is None:
            fd = os.open(path, os.O_RDWR)
            try:
                mm = self.maps[path] = mmap.mmap(fd, size)
            finally:
                os.close(fd)
        return mm

    def close(self) -> None:
        for mm in self.maps.values():
            with contextlib.suppress(BufferError):
                mm.close()


class GenericDecoder:
    """Runs the user's ``decode`` and ``collate`` over a batch's sample ids (in a worker, or in
    the training process when ``num_workers == 0``)."""

    def __init__(self, ds, cfg):
        from ...collate import default

        self.ds, self.cfg = ds, cfg
        self.decode = cfg.decode
        self.collate = cfg.collate if cfg.collate is not None else default
        #: CPU nanoseconds of this thread inside the user's ``decode``, so far
        self.decode_cpu_ns = 0

    def sample(self, sid: int, rng, pad: bool = False):
        """Sample ``sid``: its fields (:meth:`~stoker.store.dataset.Dataset.read_fields` with
        ``meta=True``; ``pad``: a substitute, :data:`stoker.loader.workers.padding.PAD_FIELD` set to True),
        through the user's ``decode`` with ``rng`` when there is one.

        Raises:
            SampleFnError: ``decode`` raised or returned None (names the sample's key; the user's
                exception is its ``__cause__``).
            ChecksumError, OriginError: reading the sample's bytes failed (with its key).
        """
        fields = self.ds.read_fields(sid, meta=True)
        if pad:
            from .padding import PAD_FIELD

            fields[PAD_FIELD] = True
        if self.decode is None:
            return fields
        key = self.ds.key(sid)
        t0 = thread_time_ns()
        try:
            sample = self.decode(fields, rng)
        except SampleFnError:
            raise
        except Exception as exc:  # noqa: BLE001 - the user's code: any failure names the sample
            raise SampleFnError(
                key, f"decode function {fn_name(self.decode)} failed on sample {key!r}: {type(exc).__name__}: {exc}"
            ) from exc
        finally:
            self.decode_cpu_ns += thread_time_ns() - t0
        if sample is None:
            raise SampleFnError(
                key,
                f"decode function {fn_name(self.decode)} returned None for sample {key!r} "
                f"(it must return the decoded sample)",
            )
        return sample

    def run(self, epoch: int, ids, current=None, whole: bool = True):
        """``(n samples, skipped ids, skipped keys, batch, padded)``. When every sample was
        skipped (``on_error="skip"``), the batch is made of substitutes
        (:mod:`stoker.loader.workers.padding`), whose ``(sample id, key)`` are ``padded`` (else empty);
        batch is None only when ``whole`` is False and every sample was skipped.

        Raises:
            SampleFnError: ``decode`` raised or returned None for a sample, or ``collate`` raised
                (:class:`stoker.collate.CollateError` names the sample at fault); with its key.
            ChecksumError, OriginError: reading the sample's bytes failed (with its key).
            WorkerError: every sample was skipped and no substitute decoded (the dataset looks
                unreadable).
        """
        from ...order import sample_seed

        cfg = self.cfg
        skip = cfg.on_error == "skip"
        samples, kept, skipped, skipped_keys = [], [], [], []
        sids = [int(sid) for sid in ids]
        # the generators made together, not each right after a decode (see BatchDecoder.run)
        rngs = (
            [np.random.default_rng(sample_seed(cfg.seed, epoch, sid)) for sid in sids]
            if self.decode is not None
            else [None] * len(sids)
        )
        for sid, rng in zip(sids, rngs, strict=True):
            if current is not None:
                current.value = sid
            try:
                sample = self.sample(sid, rng)
            except SampleFnError as err:
                if not skip:
                    raise
                skipped.append(sid)  # logged when (if) its batch is delivered (epoch_stats.account)
                skipped_keys.append((self.ds.key(sid), str(err)))
                continue
            samples.append(sample)
            kept.append(sid)
        padded: list = []
        if not samples and skipped and whole and cfg.substitutes:  # substitutes: every rank yields this batch
            samples, padded = self._pad(epoch, sids, current, skipped_keys)
            kept = [sid for sid, _ in padded]
        return self._collate(samples, kept, current, skipped, skipped_keys, padded)

    def _pad(self, epoch: int, sids: list, current, skipped_keys: list) -> tuple[list, list]:
        """Substitutes for the batch of ``sids``, every one of them skipped
        (:mod:`stoker.loader.workers.padding`): their samples and their ``(id, key)``.

        Raises:
            WorkerError: none of the samples tried decoded.
        """
        from ...order import sample_seed
        from .padding import probe_limit, probe_order, unreadable

        samples: list = []
        padded: list[tuple[int, str]] = []
        tried, last = 0, None
        for sid in probe_order(self.cfg.seed, epoch, sids, len(self.ds), self.cfg.sample_ids):
            if len(padded) == len(sids) or tried == probe_limit(len(sids)):
                break
            tried += 1
            if current is not None:
                current.value = sid
            rng = np.random.default_rng(sample_seed(self.cfg.seed, epoch, sid)) if self.decode is not None else None
            try:
                samples.append(self.sample(sid, rng, pad=True))
            except SampleFnError as err:
                last = str(err)
                continue
            padded.append((sid, self.ds.key(sid)))
        if not padded:
            raise unreadable(epoch, [k for k, _ in skipped_keys], tried, last)
        return samples, padded

    def _collate(self, samples: list, kept: list, current, skipped: list, skipped_keys: list, padded: list):
        """``run``'s result: the user's collate of ``samples`` (of sample ids ``kept``)."""
        from ...collate import CollateError

        ds = self.ds
        if not samples:
            return 0, skipped, skipped_keys, None, padded
        try:
            batch = self.collate(samples)
        except CollateError as exc:
            key = ds.key(kept[exc.index]) if 0 <= exc.index < len(kept) else None
            if current is not None and key is not None:
                current.value = kept[exc.index]
            raise SampleFnError(
                key, f"collate function {fn_name(self.collate)} failed on sample {key!r}: {exc.what}"
            ) from exc
        except Exception as exc:  # noqa: BLE001
            keys = [ds.key(s) for s in kept[:3]]
            raise SampleFnError(
                None,
                f"collate function {fn_name(self.collate)} failed on the batch of samples "
                f"{keys}{'...' if len(kept) > 3 else ''}: {type(exc).__name__}: {exc}",
            ) from exc
        return len(samples), skipped, skipped_keys, batch, padded


def pack_reply(writer: SlotWriter, path: str | None, batch):
    """What a worker sends for a generic ``batch``: ``("shm", tree, specs, slot bytes, rest)``
    after writing its arrays into the slot at ``path`` (``rest``: its other leaves pickled, or
    None when it has none), or ``("pickle", pickled bytes)`` for a batch with no array or one the
    slot cannot grow to hold; None for no batch."""
    if batch is None:
        return None
    if path is not None and (flat := flatten(batch)) is not None:
        tree, leaves, rest = flat
        wrote = writer.write(path, leaves)
        if wrote is not None:
            blob = pickle.dumps(rest, protocol=pickle.HIGHEST_PROTOCOL) if rest else None
            return ("shm", tree, wrote[0], wrote[1], blob)
        if not writer.warned:
            from ..shm import shm_base

            writer.warned = True
            log.warning(
                "shared memory (%s) has no room to grow a batch slot to %d bytes: batches that do not fit "
                "are pickled through the worker's pipe instead (slower; counted in pickled_batches)",
                shm_base(),
                sum(a.nbytes for a in leaves),
            )
    return ("pickle", pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL))


def receive(ring, slot: int | None, reply, stats, hold: bool = True):
    """The training process's side of :func:`pack_reply`: the batch, its arrays as views over slot
    ``slot`` (released once they are all dropped; at once, after a copy, in a ``limited`` ring;
    ``hold`` False: not released here, the caller releases the slot of an ``"shm"`` reply) and
    its other leaves unpickled, or the whole batch unpickled (the slot released at once). Counts
    the way it came in ``stats`` (``shm_batches`` or ``pickled_batches``; every pickled byte in
    ``pickled_bytes``). ``reply`` may also be ``("local", batch)`` (decoded in this process,
    ``num_workers=0``) or None (no batch)."""
    if reply is None or reply[0] == "local":
        if slot is not None:
            ring.release(slot)
        return None if reply is None else reply[1]
    if reply[0] == "pickle":
        ring.release(slot)
        stats.pickled_batches += 1
        stats.pickled_bytes += len(reply[1])
        return pickle.loads(reply[1])
    _, tree, specs, nbytes, blob = reply
    stats.shm_batches += 1
    rest = ()
    if blob is not None:
        stats.pickled_bytes += len(blob)
        try:
            rest = pickle.loads(blob)
        except BaseException:
            ring.release(slot)
            raise
    buf = ring.buffer(slot, nbytes)
    if not hold:
        return rebuild(tree, specs, buf, rest)
    if ring.limited:  # too few slots: copy out, the slot is free again at once
        used = max((off + math.prod(shape) * np.dtype(dt).itemsize for dt, shape, off in specs), default=0)
        buf = buf[:used].copy()
        ring.release(slot)
        return rebuild(tree, specs, buf, rest)
    ring.hold(slot, buf)
    return rebuild(tree, specs, buf, rest)
