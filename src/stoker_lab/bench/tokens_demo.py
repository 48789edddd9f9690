"""`stoker demo --kind tokens`: language-model pre-training input, stoker against the common recipe.

One run, one machine, one emulated origin (moto's S3 behind a throttling proxy, as in
:mod:`stoker_lab.bench.demo`). The corpus is real text: the Python standard library's own ``.py``
files (:mod:`stoker_lab.bench.realdata`), uploaded to the origin as files and packed there with
``stoker pack --source files``. A byte-level BPE is trained on the corpus, and both loaders do the
same work per document: read its bytes from the origin (or stoker's node cache), tokenize it,
append EOS and pack the tokens into rows of exactly ``seq_len`` (:func:`stoker.collate.pack_tokens`):

- **baseline**: ``torch.utils.data.DataLoader`` (``num_workers`` processes, shuffled) over a
  map-style dataset that reads each file through fsspec (s3fs), the usual recipe for text files
  in object storage; its ``collate_fn`` is the same packing, and the carry is kept in the
  training process in the same way.
- **stoker**: ``Loader(ds, decode=TokenizeDecode, collate=pack_tokens(seq_len))``, ``num_workers``
  processes; a cold epoch and warm epochs (node cache).

Reported per epoch: documents/s, tokens/s (real tokens, EOS included, padding excluded), tokens,
origin bytes. The check: stoker's warm-epoch tokens/s is at least 3x the baseline's.
"""

from __future__ import annotations

import os
import platform
import shutil
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from .report import print_checks

__all__ = ["TokensDemoConfig", "run_tokens_demo"]

#: Corpus sizes: files of at most ``max_file_bytes`` (small documents, as in web text, where the
#: per-file request is what a file-per-document recipe pays most for).
QUICK = {"max_files": 400, "max_file_bytes": 3000}
FULL = {"max_files": 2000, "max_file_bytes": 8000}


@dataclass
class TokensDemoConfig:
    """Parameters. Latency in ms, bandwidth in MB/s (1e6 B/s), sizes in bytes, rates in tokens/s."""

    quick: bool = False
    latency_ms: float = 20.0
    bandwidth_MBps: float = 100.0
    workers: int = 2
    batch_size: int = 32
    seq_len: int = 1024
    vocab_size: int = 4096
    epochs: int = 3
    seed: int = 0
    max_files: int | None = None
    max_file_bytes: int | None = None
    workdir: str | None = None
    json_path: str | None = None


def _log(msg: str) -> None:
    print(f"[demo tokens {time.strftime('%H:%M:%S')}] {msg}", flush=True)


class FsspecTextFiles:
    """The baseline's map-style dataset: item ``i`` = ``decode({"py": bytes of file i})``, each
    file read with one GET through fsspec; the filesystem is made in each worker process."""

    def __init__(self, base_url: str, rels: list[str], storage_options: dict, decode):
        self.base_url, self.rels, self.opts, self.decode = base_url.rstrip("/"), rels, storage_options, decode
        self._fs: Any = None

    def __len__(self) -> int:
        return len(self.rels)

    def __getstate__(self):
        return dict(self.__dict__, _fs=None)

    def __getitem__(self, i: int):
        import fsspec

        if self._fs is None:
            self._fs = fsspec.filesystem(self.base_url.split("://")[0], **self.opts)
        data = self._fs.cat_file(f"{self.base_url}/{self.rels[i]}")
        return self.decode({"py": data}, None)


def _epoch(batches, packer=None) -> dict:
    """Iterate one epoch; ``packer``: cut the carry in this process (the baseline)."""
    t0 = time.perf_counter()
    tokens = rows = 0
    carry = None
    it = iter(batches)
    pending = next(it, None)
    while pending is not None:
        nxt = next(it, None)
        out = pending
        if packer is not None:
            out, carry = packer.cut(carry, pending, last=nxt is None)
        if out is not None:
            tokens += int(out["lengths"].sum())
            rows += int(out["input_ids"].shape[0])
        pending = nxt
    return {"seconds": time.perf_counter() - t0, "tokens": tokens, "rows": rows}


def run_tokens_demo(cfg: TokensDemoConfig) -> dict:
    """Run the demo (module docstring); returns the report (also written to ``cfg.json_path``)."""
    import torch

    from stoker.collate import pack_tokens
    from stoker.loader import Loader
    from stoker.store.dataset import open_dataset
    from stoker.store.pack import pack

    from .origin import ORIGIN_NICE, LocalS3Origin, upload_tree
    from .realdata import TokenizeDecode, copy_stdlib_corpus, train_bpe
    from .report import save_report

    preset = QUICK if cfg.quick else FULL
    workdir = cfg.workdir or os.path.join(tempfile.gettempdir(), "stoker-demo-tokens")
    corpus = os.path.join(workdir, "corpus")
    shutil.rmtree(corpus, ignore_errors=True)
    rels = copy_stdlib_corpus(
        corpus, cfg.max_files or preset["max_files"], cfg.max_file_bytes or preset["max_file_bytes"]
    )
    nbytes = sum(os.path.getsize(os.path.join(corpus, r)) for r in rels)
    _log(f"corpus: {len(rels)} standard-library .py files, {nbytes / 1e6:.1f} MB")
    t = time.perf_counter()
    decode = TokenizeDecode(train_bpe([os.path.join(corpus, r) for r in rels], cfg.vocab_size))
    _log(f"byte-level BPE ({cfg.vocab_size} tokens) trained in {time.perf_counter() - t:.1f} s")
    eos = 0  # <|endoftext|>
    report: dict = {
        "kind": "tokens",
        "machine": {"cores": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "origin": {
            "latency_ms": cfg.latency_ms,
            "bandwidth_MBps": cfg.bandwidth_MBps,
            "server": "moto S3 on 127.0.0.1 behind a throttling TCP proxy",
            "server_nice": ORIGIN_NICE,
        },
        "config": {
            "workers": cfg.workers,
            "batch_size": cfg.batch_size,
            "seq_len": cfg.seq_len,
            "vocab_size": cfg.vocab_size,
            "epochs": cfg.epochs,
            "quick": cfg.quick,
        },
        "dataset": {"documents": len(rels), "bytes": nbytes, "source": "Python standard library .py files"},
        "runs": [],
    }
    with LocalS3Origin(latency_ms=cfg.latency_ms, bandwidth_MBps=cfg.bandwidth_MBps) as origin:
        raw_url, packed_url = origin.url("raw/corpus"), origin.url("packed/corpus")
        fast, opts = origin.storage_options(throttled=False), origin.storage_options(throttled=True)
        upload_tree(corpus, raw_url, fast)
        pr = pack(raw_url, packed_url, source="files", overwrite=True, storage_options=fast, progress=False)
        _log(f"packed {pr.samples} documents into {pr.shards} shard(s) in {pr.seconds:.1f} s")

        packer = pack_tokens(cfg.seq_len, eos_id=eos)
        base = FsspecTextFiles(raw_url, rels, opts, decode)
        gen = torch.Generator().manual_seed(cfg.seed)
        dl = torch.utils.data.DataLoader(
            base,
            batch_size=cfg.batch_size,
            shuffle=True,
            generator=gen,
            num_workers=cfg.workers,
            collate_fn=packer,
            persistent_workers=cfg.workers > 0,
        )
        for epoch in range(min(2, cfg.epochs)):
            before = origin.stats().get("bytes_served", 0)
            m = _epoch(dl, packer)
            report["runs"].append(_row("baseline", epoch, m, len(rels), origin.stats().get("bytes_served", 0) - before))
            _log(_line(report["runs"][-1]))
        del dl

        cache_dir = os.path.join(workdir, "cache")
        shutil.rmtree(cache_dir, ignore_errors=True)
        ds = open_dataset(
            packed_url, cache_dir=cache_dir, cache_bytes=4 * pr.shard_bytes + (64 << 20), storage_options=opts
        )
        with Loader(
            ds, cfg.batch_size, num_workers=cfg.workers, seed=cfg.seed, decode=decode, collate=packer
        ) as loader:
            for epoch in range(cfg.epochs):
                m = _epoch(loader)
                st = loader.stats
                report["runs"].append(
                    _row(
                        "stoker",
                        epoch,
                        m,
                        st.samples,
                        st.origin_bytes,
                        exactly_once=st.exactly_once,
                        shm_batches=st.shm_batches,
                        pickled_batches=st.pickled_batches,
                        cache_hit_ratio=st.cache_hit_ratio,
                    )
                )
                _log(_line(report["runs"][-1]))
        shutil.rmtree(cache_dir, ignore_errors=True)
    report["checks"] = _checks(report)
    _print_table(report)
    save_report(report, cfg.json_path, None, None, _log)
    return report


def _row(loader, epoch, m, docs, origin_bytes, **extra) -> dict:
    s = m["seconds"]
    return {
        "loader": loader,
        "epoch": epoch,
        "documents": docs,
        "tokens": m["tokens"],
        "rows": m["rows"],
        "seconds": s,
        "documents_per_s": docs / s if s else 0.0,
        "tokens_per_s": m["tokens"] / s if s else 0.0,
        "origin_bytes": int(origin_bytes),
        **extra,
    }


def _line(r: dict) -> str:
    return (
        f"{r['loader']} epoch {r['epoch']}: {r['documents_per_s']:.0f} documents/s, "
        f"{r['tokens_per_s']:.0f} tokens/s ({r['tokens']} tokens, {r['seconds']:.2f} s), "
        f"origin {r['origin_bytes'] / 1e6:.1f} MB"
    )


def _checks(report: dict) -> dict:
    base = [r for r in report["runs"] if r["loader"] == "baseline"]
    warm = [r for r in report["runs"] if r["loader"] == "stoker" and r["epoch"] >= 1]
    best_base = max((r["tokens_per_s"] for r in base), default=0.0)
    warm_rate = float(np.median([r["tokens_per_s"] for r in warm])) if warm else 0.0
    ratio = warm_rate / best_base if best_base else 0.0
    stoker = [r for r in report["runs"] if r["loader"] == "stoker"]
    same = bool(stoker) and all(r["tokens"] == base[0]["tokens"] for r in stoker + base)
    once = bool(stoker) and all(r["exactly_once"] for r in stoker)
    shm = bool(stoker) and all(r["pickled_batches"] == 0 and r["shm_batches"] > 0 for r in stoker)
    return {
        "warm_tokens_per_s_3x_baseline": {
            "ok": ratio >= 3.0,
            "value": ratio,
            "target": ">= 3x the baseline",
            "ratio": ratio,
            "stoker_warm": warm_rate,
            "baseline": best_base,
        },
        "same_work": {
            "ok": same,
            "value": same,
            "target": "every run delivers the same tokens",
            "tokens": [r["tokens"] for r in stoker + base],
        },
        "exactly_once": {"ok": once, "value": once, "target": "True"},
        "shared_memory": {"ok": shm, "value": shm, "target": "every batch through shared memory"},
    }


def _print_table(report: dict) -> None:
    print(
        f"\nmachine: {report['machine']['cores']} cores; corpus: {report['dataset']['documents']} documents, "
        f"{report['dataset']['bytes'] / 1e6:.1f} MB; origin: {report['origin']['latency_ms']} ms, "
        f"{report['origin']['bandwidth_MBps']} MB/s"
    )
    print(f"{'loader':10} {'epoch':>5} {'docs/s':>9} {'tokens/s':>11} {'tokens':>10} {'origin MB':>10}")
    for r in report["runs"]:
        print(
            f"{r['loader']:10} {r['epoch']:>5} {r['documents_per_s']:>9.0f} {r['tokens_per_s']:>11.0f} "
            f"{r['tokens']:>10} {r['origin_bytes'] / 1e6:>10.1f}"
        )
    print_checks(report["checks"])
