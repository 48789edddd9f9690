"""The readers of ``bytes_only`` (:mod:`stoker_lab.bench.bytes_only`), each in a process of its own.

``python -m stoker_lab.bench.byte_readers CFG_JSON`` runs one reader (``cfg["reader"]``) over the
same samples and prints its boundary marks (:func:`stoker_lab.bench.steady_state.mark`), one JSON
line each, for :func:`stoker_lab.bench.steady_state.figures`:

* ``stoker_per_sample``: a Loader over the packed files with the user's per-sample ``decode=``
  (the sample's bytes as ``np.frombuffer`` uint8, no copy) and ``collate=np.stack``: one
  ``(batch, sample_bytes)`` array through the shared-memory slots;
* ``stoker_raw``: ``collate=stoker.collate.raw_bytes`` without decode: each batch read straight
  into its slot (:mod:`stoker.loader.workers.rawbatch`); fixed-size samples give ``data`` of shape
  ``(N, sample_bytes)``, samples of several sizes a flat ragged ``data`` with ``offsets``;
* ``torch``: a plain ``torch.utils.data.DataLoader`` over the ``.npy`` files (``np.load`` per file,
  torch's default collate), ``num_workers`` persistent workers, ``shuffle=True``, the rest its
  defaults;
* ``floor``: one process, no workers: every file opened once, then each epoch (a permutation)
  ``os.preadv`` of each whole file into one reused buffer.

Every reader's training process has imported torch before its first epoch (a training job has).
The consumer takes no time: it counts samples and bytes (the samples' stored bytes: a whole
``.npy`` file, header included, for the torch DataLoader and the floor).
"""

from __future__ import annotations

import json
import os
import resource
import sys

import numpy as np

from . import steady_state as ss
from .peers import _runner


def raw_array(fields, rng):
    """The per-sample decode: the sample's file bytes as a numpy uint8 array (a view, no copy)."""
    return np.frombuffer(next(iter(fields.values())), np.uint8)


def stack(samples):
    """The per-sample row's collate: one ``(batch, sample_bytes)`` uint8 array."""
    return np.stack(samples)


class _NpyFiles:
    """torch Dataset of the ``.npy`` files: ``np.load`` of file ``i`` (what DLIO's NPYReader does)."""

    def __init__(self, paths: list[str]):
        self.paths = paths

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int):
        return np.load(self.paths[i])


def _stoker_epochs(cfg: dict):
    """(one-epoch function, closer) of a stoker Loader per ``cfg`` (``reader``, ``packed``, ``cache_dir``)."""
    from stoker.collate import raw_bytes
    from stoker.loader import Loader
    from stoker.store.dataset import open_dataset

    ds = open_dataset(cfg["packed"], cfg["cache_dir"], cfg["cache_bytes"])
    if cfg["reader"] == "stoker_per_sample":
        kw: dict = {"decode": raw_array, "collate": stack}
    else:
        kw = {"collate": raw_bytes}
    loader = Loader(ds, cfg["batch_size"], num_workers=cfg["workers"], seed=cfg["seed"], drop_last=True, **kw)

    def epoch() -> tuple[int, int]:
        n = b = 0
        for batch in loader:
            if isinstance(batch, np.ndarray):
                n, b = n + batch.shape[0], b + batch.nbytes
            else:
                n, b = n + len(batch.ids), b + int(batch.offsets[-1])
        return n, b

    return epoch, loader.close


def _torch_epochs(cfg: dict):
    """(one-epoch function, closer) of a plain torch DataLoader over the ``.npy`` files."""
    from torch.utils.data import DataLoader

    dl = DataLoader(
        _NpyFiles(cfg["paths"]),
        batch_size=cfg["batch_size"],
        shuffle=True,
        num_workers=cfg["workers"],
        persistent_workers=True,
    )

    file_bytes = os.path.getsize(cfg["paths"][0])  # every file has one size: bytes read, the .npy header too

    def epoch() -> tuple[int, int]:
        n = 0
        for batch in dl:
            n += batch.shape[0]
        return n, n * file_bytes

    return epoch, lambda: None


def _floor_epochs(cfg: dict):
    """(one-epoch function, closer) of bare ``os.preadv`` of each whole file into one reused buffer."""
    paths = cfg["paths"]
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < len(paths) + 64:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, len(paths) + 64), hard))
    fds = [os.open(p, os.O_RDONLY) for p in paths]
    sizes = [os.fstat(fd).st_size for fd in fds]
    buf = memoryview(bytearray(max(sizes)))
    rng = np.random.default_rng(cfg["seed"])

    def epoch() -> tuple[int, int]:
        n = b = 0
        for k in rng.permutation(len(fds)).tolist():
            got = os.preadv(fds[k], [buf[: sizes[k]]], 0)
            if got != sizes[k]:
                raise RuntimeError(f"{paths[k]}: read {got} of {sizes[k]} bytes")
            n, b = n + 1, b + got
        return n, b

    def close() -> None:
        for fd in fds:
            os.close(fd)

    return epoch, close


READERS = {
    "stoker_per_sample": _stoker_epochs,
    "stoker_raw": _stoker_epochs,
    "torch": _torch_epochs,
    "floor": _floor_epochs,
}


def run(cfg: dict) -> None:
    """Run ``cfg["reader"]``: the first epoch, ``first_warm`` warm ones, then the short and long
    runs sized by :func:`stoker_lab.bench.steady_state.window`; a mark printed at each boundary.
    Raises KeyError naming an unknown reader."""
    _runner.subreaper()
    import torch  # noqa: F401 - a training process has it imported before its first epoch

    make = READERS[cfg["reader"]]
    epoch, close = make(cfg)
    n = b = 0

    def emit(at: int) -> dict:
        m = ss.mark(at, n, b, _runner.tree_cpu_s)
        print(json.dumps(m), flush=True)
        return m

    try:
        marks = [emit(0)]
        for k in range(cfg["first_warm"] + 1):
            dn, db = epoch()
            n, b = n + dn, b + db
            marks.append(emit(k + 1))
        short, extra = ss.window(
            marks[-1]["cpu_s"] - marks[-2]["cpu_s"], cfg["min_epochs"], cfg["min_cpu_s"], cfg["max_epochs"]
        )
        at = marks[-1]["at"]
        for run_epochs in (short, short + extra):
            for _ in range(run_epochs):
                dn, db = epoch()
                n, b = n + dn, b + db
            at += run_epochs
            emit(at)
    finally:
        close()


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        run(json.load(f))
