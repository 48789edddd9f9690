"""``cache_form="auto"``: choose the sample form from measured rates (Cachew, ATC'22).

Cachew caches a pipeline's data at the point that gives the highest throughput.  Here the
points are the sample forms of :mod:`.forms`: the raw JPEG, a re-encoded JPEG with a capped
shorter side, decoded pixels.  For each candidate, on a small seeded sample of the dataset:

* ``decode_per_core``: samples/s of one process turning the form into the loader's output
  (read_entry + transform, or decode + transform for raw), from memory;
* ``bytes_per_sample``: mean stored bytes (an entry that says "same as raw" costs both);
* ``storage``: samples/s the node can read the form at: the derived store's directory read
  with ``O_DIRECT`` (page cache bypassed; buffered where the file system refuses it, e.g. tmpfs,
  reported as ``direct_io: false``), one file per sample as the cache keeps them. The raw form
  is read from the node cache when the cache can hold the dataset (the same probe), else from
  the origin at the rate measured while reading the sample (sequential reads: a lower bound);
* ``fit``: the fraction of the dataset the derived budget holds; the rest is read raw.

Per core with ``W`` workers (decode bound vs storage bound, benchmarks/README.md):
``r_raw = min(decode_raw, storage_raw / W)`` and
``r_f = 1 / (fit / min(decode_f, storage_f / W) + (1 - fit) / r_raw)``.
The choice is the most faithful form whose modelled rate is within a factor ``min_gain``
(default 1.1) of the fastest: raw first, then uncapped decoded pixels (exact), then larger caps
before smaller (a capped form loses some detail, so a near-tie goes to the more faithful form).  Steady-state epochs are modelled; the first epoch also pays
``fill_s_per_sample`` to write the entries (reported, not part of the choice).
"""

from __future__ import annotations

import logging
import mmap
import os
import shutil
import tempfile
import time
from dataclasses import dataclass

import numpy as np

from .forms import SAME, Form, make_entry, parse_form, read_entry
from .image import DecodeError, decode_image
from .resample import one_intra_op_thread
from .transforms import decode_transform, eval_resize_for, eval_transform_reduced, train_transform_reduced

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_CANDIDATES", "measure_forms", "choose_form"]

#: Forms ``auto`` compares with raw: a JPEG capped at :func:`resolution_cap` (320 px for 224),
#: one capped at 256 px, and decoded pixels capped at 256 px.
DEFAULT_CANDIDATES = ("jpeg", "jpeg256", "rgb256")


def _read_rate(paths: list[str]) -> tuple[float, bool]:
    """(bytes/s, direct) reading each file whole, with O_DIRECT where the file system allows."""
    direct = hasattr(os, "O_DIRECT")
    total, start = 0, time.perf_counter()
    for p in paths:
        size = os.path.getsize(p)
        fd = None
        if direct:
            try:
                fd = os.open(p, os.O_RDONLY | os.O_DIRECT)
                buf = mmap.mmap(-1, max(4096, -(-size // 4096) * 4096))  # page-aligned, as O_DIRECT needs
                got = os.preadv(fd, [buf], 0)
                buf.close()
            except OSError:
                direct = False
                got = None
            finally:
                if fd is not None:
                    os.close(fd)
            if got is not None:
                total += got
                continue
        with open(p, "rb") as f:
            total += len(f.read())
    return total / max(time.perf_counter() - start, 1e-9), direct


def _probe_storage(root: str | None, blobs: list[bytes]) -> dict:
    """``{"storage_Bps", "direct_io"}``: the read rate (bytes/s) of ``blobs`` written as one file
    each under ``root`` (then removed); ``{}`` for no ``root``."""
    if not root:
        return {}
    os.makedirs(root, exist_ok=True)
    d = tempfile.mkdtemp(prefix=".probe-", dir=root)
    try:
        paths = []
        for i, b in enumerate(blobs):
            p = os.path.join(d, str(i))
            with open(p, "wb") as f:
                f.write(b)
                f.flush()
                os.fsync(f.fileno())
            paths.append(p)
        return dict(zip(("storage_Bps", "direct_io"), _read_rate(paths)))
    finally:
        shutil.rmtree(d, ignore_errors=True)


@dataclass(frozen=True)
class _Probe:
    """What every form is measured on (:func:`measure_forms`' arguments): ``items``, the decodable
    samples as ``(raw bytes, decoded image)``, and ``resize``, the eval transform's shorter side."""

    items: list
    mode: str
    size: int
    resize: int
    seed: int
    min_seconds: float
    probe_root: str | None

    def rng(self, j: int) -> np.random.Generator | None:
        """The crop RNG of sample ``j``, the same for every form (None in eval mode)."""
        return np.random.default_rng((self.seed, j)) if self.mode == "train" else None

    def raw(self, j: int, out: np.ndarray | None = None) -> np.ndarray:
        """The loader's ``(3, size, size)`` output of sample ``j`` from its raw bytes."""
        data = self.items[j][0]
        return decode_transform(data, "probe", self.mode, self.rng(j), size=self.size, out=out, resize=self.resize)

    def derived(self, j: int, entry: tuple, out: np.ndarray | None = None) -> np.ndarray:
        """The same output from sample ``j``'s derived entry, as :func:`read_entry` returns it."""
        kind, hw, img = entry
        if kind == SAME:
            return self.raw(j, out)
        if self.mode == "train":
            return train_transform_reduced(img, hw, np.random.default_rng((self.seed, j)), self.size, out)
        return eval_transform_reduced(img, hw, self.size, self.resize, out)

    def rate(self, step) -> float:
        """Samples/s of one core running ``step(j)`` over the samples (at least one pass and ``min_seconds`` of wall time, on one torch thread)."""
        n, count = 0, len(self.items)
        with one_intra_op_thread():  # one core's rate: torch's resize kernel on one thread
            start = time.perf_counter()
            while n < count or time.perf_counter() - start < self.min_seconds:
                step(n % count)
                n += 1
        return n / (time.perf_counter() - start)


def measure_forms(
    payloads: list[bytes],
    candidates=DEFAULT_CANDIDATES,
    *,
    mode: str = "train",
    size: int = 224,
    min_seconds: float = 0.25,
    probe_root: str | None = None,
    pixel_diff: bool = True,
    seed: int = 0,
) -> dict:
    """Per-form bytes, per-core rates, fill cost and pixel difference on ``payloads``.

    Args:
        payloads: raw encoded samples (undecodable ones are left out).
        candidates: form names or :class:`Form` s (``raw`` is always measured).
        mode, size: the loader's transform and output side.
        min_seconds: measuring time per form (wall seconds; at least one pass).
        probe_root: directory for the storage probe (None: no probe).
        pixel_diff: also compare each form's output with the raw path's (same crops).
        seed: RNG seed of the crops.

    Returns:
        ``{"samples": n, "forms": {name: {"bytes_per_sample", "decode_per_core" (samples/s),
        "fill_s_per_sample", "same_fraction", "storage_Bps", "direct_io", "pixel_mad",
        "pixel_p99", "pixel_max"}}}``; the ``raw`` entry has no fill cost or pixel fields.

    Raises:
        ValueError: no payload decodes.
    """
    items = []
    for i, data in enumerate(payloads):
        try:
            items.append((bytes(data), decode_image(data, f"probe-{i}")))
        except DecodeError:
            continue
    if not items:
        raise ValueError("none of the sampled payloads decodes")
    probe = _Probe(items, mode, size, eval_resize_for(size), seed, min_seconds, probe_root)
    out = np.empty((3, size, size), np.uint8)
    raw = {
        "bytes_per_sample": float(np.mean([len(d) for d, _ in items])),
        "decode_per_core": probe.rate(lambda j: probe.raw(j, out)),
        **_probe_storage(probe_root, [d for d, _ in items]),
    }
    forms = {"raw": raw}
    reference = [probe.raw(j) for j in range(len(items))] if pixel_diff else None
    for cand in candidates:
        form = parse_form(cand, size)
        if form.kind != "raw":
            forms[form.name] = _measure_form(probe, form, reference)
    return {"samples": len(items), "mode": mode, "size": size, "forms": forms}


def _measure_form(probe: _Probe, form: Form, reference: list[np.ndarray] | None) -> dict:
    """:func:`measure_forms`' row of one derived ``form`` (``reference``: the raw path's outputs,
    for the pixel difference; an entry that says "same as raw" costs the raw bytes too)."""
    t = time.perf_counter()
    entries = [make_entry(form, img) for _, img in probe.items]
    fill = (time.perf_counter() - t) / len(entries)
    decoded = [read_entry(form, e) for e in entries]
    stored = [e + (d if k == SAME else b"") for e, (d, _), (k, _, _) in zip(entries, probe.items, decoded)]
    out = np.empty((3, probe.size, probe.size), np.uint8)
    row = {
        "bytes_per_sample": float(np.mean([len(b) for b in stored])),
        "decode_per_core": probe.rate(lambda j: probe.derived(j, read_entry(form, entries[j]), out)),
        "fill_s_per_sample": fill,
        "same_fraction": sum(k == SAME for k, _, _ in decoded) / len(entries),
        "cap": form.side,
        **_probe_storage(probe.probe_root, stored),
    }
    if reference is not None:
        diffs = []
        for j, entry in enumerate(decoded):
            got = reference[j] if entry[0] == SAME else probe.derived(j, entry)
            diffs.append(np.abs(got.astype(np.int16) - reference[j]).ravel())
        d = np.concatenate(diffs)
        row.update(pixel_mad=float(d.mean()), pixel_p99=float(np.percentile(d, 99)), pixel_max=int(d.max()))
    return row


def _fidelity_rank(name: str) -> tuple:
    form = parse_form(name)
    exact = form.kind == "raw" or (form.kind == "rgb" and not form.side)
    return (not exact, form.kind != "raw", -(form.side or 1 << 30), form.kind == "jpeg")


def choose_form(
    ds,
    *,
    workers: int,
    capacity_bytes: int,
    root: str,
    candidates=DEFAULT_CANDIDATES,
    mode: str = "train",
    size: int = 224,
    samples: int = 48,
    min_seconds: float = 0.25,
    min_gain: float = 1.10,
    seed: int = 0,
) -> dict:
    """Measure the candidates on ``samples`` seeded samples of ``ds`` and pick a form.

    Args:
        ds: the :class:`~stoker.store.dataset.Dataset`.
        workers: decode worker processes (``W`` above; 0 counts as 1).
        capacity_bytes: the derived store's budget (bytes).
        root: the derived store's directory (the storage probe runs there).
        candidates, mode, size, min_seconds, seed: see :func:`measure_forms`.
        samples: how many samples to measure on.
        min_gain: a less faithful form must beat every more faithful one by this factor.

    Returns:
        ``{"choice": form name, "rate_per_core": samples/s, "raw_source": "cache"|"origin",
        "raw_read_Bps", "workers", "samples", "forms": {name: {... "fit", "storage_per_core",
        "rate_per_core"}}}`` (see the module docstring for the model).

    Raises:
        ValueError: no sampled payload decodes; OriginError/ChecksumError from reading them.
    """
    w = max(1, int(workers))
    n = len(ds)
    ids = np.sort(np.random.default_rng(seed).choice(n, size=min(samples, n), replace=False))
    t = time.perf_counter()
    payloads = [ds.read(int(i)) for i in ids]
    raw_read_bps = sum(map(len, payloads)) / max(time.perf_counter() - t, 1e-9)
    rep = measure_forms(
        payloads,
        candidates,
        mode=mode,
        size=size,
        min_seconds=min_seconds,
        probe_root=root,
        pixel_diff=False,
        seed=seed,
    )
    total_raw = float(np.sum(ds.index.length))
    cache_cap = getattr(ds.cache, "capacity_bytes", 0) if ds.cache is not None else 0
    raw_source = "cache" if cache_cap >= total_raw else "origin"
    forms = rep["forms"]
    raw_bps = forms["raw"]["storage_Bps"] if raw_source == "cache" else raw_read_bps
    _model_rates(forms, raw_bps, w, capacity_bytes, n)
    top = max(row["rate_per_core"] for row in forms.values())
    # The most faithful form within a factor min_gain of the fastest: raw, then uncapped pixels
    # (exact), then larger caps before smaller, decoded pixels before a re-encoded JPEG.
    best = min((k for k, v in forms.items() if v["rate_per_core"] * min_gain >= top), key=_fidelity_rank)
    _log_choice(best, forms)
    return {
        "choice": best,
        "rate_per_core": forms[best]["rate_per_core"],
        "raw_source": raw_source,
        "raw_read_Bps": raw_read_bps,
        "workers": w,
        "samples": rep["samples"],
        "min_gain": min_gain,
        "forms": forms,
    }


def _log_choice(best: str, forms: dict) -> None:
    """Log the choice with each form's per-core decode and storage rates, bytes and fit."""
    summary = {
        k: {
            "decode": round(v["decode_per_core"]),
            "storage": round(v["storage_per_core"]),
            "bytes": round(v["bytes_per_sample"]),
            "fit": round(v["fit"], 2),
        }
        for k, v in forms.items()
    }
    log.info(
        "cache_form=auto chose %s (%.0f samples/s per core modelled; raw %.0f): %s",
        best,
        forms[best]["rate_per_core"],
        forms["raw"]["rate_per_core"],
        summary,
    )


def _model_rates(forms: dict, raw_bps: float, workers: int, capacity_bytes: int, n: int) -> None:
    """Add ``storage_per_core``, ``fit`` and the modelled ``rate_per_core`` (samples/s; the module
    docstring's model) to each row of ``forms``, for ``n`` samples and a raw read rate ``raw_bps``."""
    raw = forms["raw"]
    raw["storage_per_core"] = raw_bps / raw["bytes_per_sample"] / workers
    raw["fit"] = 1.0
    r_raw = raw["rate_per_core"] = min(raw["decode_per_core"], raw["storage_per_core"])
    for name, row in forms.items():
        if name == "raw":
            continue
        row["fit"] = min(1.0, capacity_bytes / (n * row["bytes_per_sample"])) if n else 1.0
        row["storage_per_core"] = row["storage_Bps"] / row["bytes_per_sample"] / workers
        r_f = min(row["decode_per_core"], row["storage_per_core"])
        row["rate_per_core"] = 1.0 / (row["fit"] / r_f + (1.0 - row["fit"]) / r_raw)
