"""The derived-sample cache: each sample's cheaper form (:mod:`.forms`), node-local, shared.

Decode workers consult it before the raw read. On a hit the sample is transformed from its
derived form (a reduced JPEG or decoded pixels) in the original image's coordinates; on a miss
the raw sample is read, decoded and transformed as usual, and its derived entry is written as a
side effect (filled during the first epoch, used from the second).

Storage is a :class:`stoker.cache.DiskCache` of its own (own byte budget, policy ``noevict``; its
writes, shared by every worker process and loader, as the node cache's: cache/README.md), by
default in ``<node cache>/.derived``:

* one file per sample, ``<root>/<dataset content version>-<form>[-exif]/<sample id>``: a dataset
  re-packed under the same URL gets a new version, so it is never served stale entries;
* a worker SIGKILLed mid-write leaves a temporary file, removed (and the usage recounted) by
  :meth:`DerivedCache.recover`, which the loader runs when it starts;
* every read is checked (header, length, xxh3-64 of the payload); a damaged or truncated entry is
  logged with the sample key, deleted, counted in ``corrupt`` and the sample is read raw.

Pixels: a sample's output is computed from its derived form when its entry exists, else from
the full-size raw image; the two differ by the detail the cap removes (measured by
``stoker bench decode``, section ``cache_forms``), so with a derived form the pixels of an
epoch depend on which entries the cache held when the epoch ran.
"""

from __future__ import annotations

import errno
import logging
import os
from dataclasses import dataclass

import numpy as np

from .._atomic import open_file
from ..decode.forms import SAME, EntryError, Form, make_entry, parse_form, read_entry
from ..decode.transforms import eval_resize_for, eval_transform_reduced, train_transform_reduced

log = logging.getLogger(__name__)

__all__ = ["DerivedCache", "DerivedStats", "default_root", "transform_image"]

_MAX_ENTRY = 1 << 30  # an entry larger than this is damaged (a 16k x 16k RGB image is 0.75 GiB)
_RETRY_AFTER_REFUSAL = 1024  # samples to skip fill attempts after the budget refused one


def default_root(ds) -> str:
    """``<node cache root>/.derived`` (the block cache skips dot-directories), or
    ``<default cache dir>/.derived`` for a dataset opened without a cache."""
    if ds.cache is not None:
        return os.path.join(ds.cache.root, ".derived")
    from ..store.dataset import default_cache_dir

    return os.path.join(default_cache_dir(), ".derived")


@dataclass
class DerivedStats:
    """Per-process counters (samples): ``hits`` served from a derived entry, ``same`` entries
    that say "use the raw sample" (already within the cap), ``misses``, ``fills`` entries
    written (``fill_bytes``), ``refused`` by the budget, ``corrupt`` entries dropped,
    ``write_errors`` (OSError while writing; the sample itself is unaffected)."""

    hits: int = 0
    same: int = 0
    misses: int = 0
    fills: int = 0
    fill_bytes: int = 0
    refused: int = 0
    corrupt: int = 0
    write_errors: int = 0

    def snapshot(self) -> dict:
        return dict(self.__dict__)


def transform_image(img: np.ndarray, orig_hw, mode: str, rng, size: int, out=None) -> np.ndarray:
    """The loader's train/eval transform of ``img``, a copy of an ``orig_hw`` image (same
    or reduced size); see :func:`~stoker.decode.transforms.train_transform_reduced`."""
    if mode == "train":
        if rng is None:
            raise ValueError("mode='train' needs an rng")
        return train_transform_reduced(img, orig_hw, rng, size, out)
    if mode == "eval":
        return eval_transform_reduced(img, orig_hw, size, eval_resize_for(size), out)
    raise ValueError(f"mode must be 'train' or 'eval', got {mode!r}")


class DerivedCache:
    """Derived entries of one dataset version in one form, under ``root`` with its own budget.

    Args:
        root: directory of the store (shared by every process on the node).
        capacity_bytes: byte budget of the store (entry bytes; never exceeded).
        form: a :class:`~stoker.decode.forms.Form` or its name (not ``raw``).
        version: the dataset's content version (``ds.version``).
        exif_orientation: whether images were decoded with EXIF orientation (part of the key).
        size: output side, used to resolve a bare ``"jpeg"`` to its default cap.
        mode: file mode of the entries (:mod:`stoker.cache.perms`; default
            ``$STOKER_CACHE_MODE`` or 0600, directories 0700): the node cache's mode.

    Picklable (each process reopens the store by path; counters start at zero).

    Raises:
        ValueError: a ``raw`` or unknown form, a negative budget, a bad mode.
        stoker.CacheModeError, stoker.UnsafePathError: see :class:`stoker.cache.DiskCache`.
    """

    def __init__(
        self,
        root: str,
        capacity_bytes: int,
        form,
        version: str,
        *,
        exif_orientation: bool = False,
        size: int = 224,
        mode: int | str | None = None,
    ):
        from ..cache import DiskCache

        self.form: Form = parse_form(form, size)
        if self.form.kind == "raw":
            raise ValueError("the raw form has no derived cache")
        self.store = DiskCache(root, int(capacity_bytes), policy="noevict", mode=mode)
        self.namespace = f"{version}-{self.form.name}" + ("-exif" if exif_orientation else "")
        self.stats = DerivedStats()
        self._skip_fills = 0

    def __getstate__(self):
        state = dict(self.__dict__)
        state["stats"] = DerivedStats()
        state["_skip_fills"] = 0
        return state

    @property
    def root(self) -> str:
        return self.store.root

    def path(self, sid: int) -> str:
        """File of sample ``sid``'s entry."""
        return self.store.path(self.namespace, str(int(sid)))

    def recover(self) -> dict:
        """Remove temporary files of dead writers and recount usage (see DiskCache.recover)."""
        return self.store.recover()

    def used_bytes(self) -> int:
        return self.store.used_bytes()

    # -- read ---------------------------------------------------------------
    def get(self, sid: int, key: str):
        """Sample ``sid``'s entry as ``(kind, (H, W) original, image or None)``, or None on a miss.

        A damaged entry is logged (naming ``key`` and the file), deleted and counted in
        ``stats.corrupt``; None is returned so the caller reads the raw sample.
        """
        path = self.path(sid)
        try:
            fd = open_file(path, os.O_RDONLY)  # a symlink planted at the name is not followed
        except OSError as exc:
            if not isinstance(exc, FileNotFoundError) and exc.errno != errno.ELOOP:
                raise
            self.stats.misses += 1
            return None
        try:
            n = os.fstat(fd).st_size
            data = os.pread(fd, n, 0) if n <= _MAX_ENTRY else b""
        finally:
            os.close(fd)
        try:
            got = read_entry(self.form, data)
        except EntryError as exc:
            log.warning("derived entry of sample %r (%s) is damaged, reading the raw sample: %s", key, path, exc)
            self.stats.corrupt += 1
            self.store.remove(self.namespace, str(int(sid)))
            return None
        if got[0] == SAME:
            self.stats.same += 1
        else:
            self.stats.hits += 1
        return got

    # -- write --------------------------------------------------------------
    def put(self, sid: int, key: str, img: np.ndarray) -> bool:
        """Write sample ``sid``'s entry made from its decoded image ``img`` ((H, W, 3) uint8).

        Returns True when the entry is stored (or already was), False when the budget refused
        it or the write failed (logged with ``key``; the sample itself is unaffected). After a
        refusal this process skips the next 1,024 fill attempts (the budget is full).
        """
        if self._skip_fills > 0:
            self._skip_fills -= 1
            return False
        entry = make_entry(self.form, img)
        try:
            ok = self.store.put(self.namespace, str(int(sid)), entry)
        except OSError as exc:
            log.warning("cannot write the derived entry of sample %r (%s): %s", key, self.path(sid), exc)
            self.stats.write_errors += 1
            return False
        if ok:
            self.stats.fills += 1
            self.stats.fill_bytes += len(entry)
        else:
            self.stats.refused += 1
            self._skip_fills = _RETRY_AFTER_REFUSAL
        return ok

    def counters(self) -> dict:
        """``{"derived_<counter>": int}`` for the loader's statistics."""
        return {f"derived_{k}": v for k, v in self.stats.snapshot().items()}


def setup(ds, image, *, workers: int, mode: str):
    """The loader's derived cache for ``image.cache_form`` (a name or ``"auto"``; ``image``: the
    loader's :class:`~stoker.loader.options.ImageOptions`, whose ``cache_form_bytes``,
    ``cache_form_dir``, ``image_size`` and ``exif_orientation`` it reads; ``workers``: decode
    processes; ``mode``: the transform): ``(DerivedCache or None, report)``. ``auto`` measures the
    candidates (:func:`stoker.decode.choose.choose_form`) and returns None when raw wins; the
    report is its measurement (``{"choice": name}`` for a fixed form). Temporary files of dead
    writers are removed and usage recounted (``recover``).

    Raises:
        ValueError: unknown form name, or no ``root`` over a read-only node cache; see
            :func:`~stoker.decode.choose.choose_form`.
        stoker.CacheUnwritableError: ``root`` cannot be created or written.
    """
    from ..cache.paths import UNWRITABLE_ERRNOS, unwritable_root
    from ..cache.perms import ensure_dir, parse_mode
    from ..errors import StokerError

    form, root, size, capacity_bytes = image.cache_form, image.cache_form_dir, image.image_size, image.cache_form_bytes
    if root is None and getattr(ds.cache, "read_only", False):
        raise ValueError(
            f"cache_form keeps derived samples in a directory it writes, and the node cache {ds.cache.root} "
            "is read-only: give it one (ImageOptions(cache_form_dir=...)), or leave cache_form off"
        )
    root = root or default_root(ds)
    cache_mode = parse_mode(getattr(ds.cache, "mode", None))
    try:
        ensure_dir(root, cache_mode)  # before the storage probe of "auto" writes there: the cache's mode
    except OSError as exc:
        if exc.errno in UNWRITABLE_ERRNOS and not isinstance(exc, StokerError):  # not UnsafePathError
            raise unwritable_root(root, exc) from exc
        raise
    if form == "auto":
        from ..decode.choose import choose_form

        report = choose_form(ds, workers=workers, capacity_bytes=capacity_bytes, root=root, mode=mode, size=size)
        name = report["choice"]
    else:
        name = parse_form(form, size).name
        report = {"choice": name}
    if name == "raw":
        return None, report
    cache = DerivedCache(
        root, capacity_bytes, name, ds.version, exif_orientation=image.exif_orientation, size=size, mode=cache_mode
    )
    report["root"], report["recovered"] = cache.root, cache.recover()
    return cache, report
