"""``bytes_only`` of ``stoker bench io``: stoker's bytes-only Loader against DLIO's PyTorch reader, same files.

DLIO (``dlio-benchmark``, the emulator behind MLPerf Storage) is the benchmark people use for
storage. Its PyTorch data loader (``reader.data_loader: pytorch``) reads one file per sample with a
``torch.utils.data.DataLoader`` whose worker processes open each file with the format's reader
(``np.load`` for ``format: npy``), and hands back a fixed emulated tensor of about the record size.
Here both readers get the same files and the same workers and batch size:

* **files**: ``files`` random-byte ``.npy`` files of ``sample_bytes`` bytes each (default 114,660 B:
  MLPerf Storage's ResNet-50 ``record_length``), a uint8 array of shape ``(sample_bytes - 128, 1)``
  behind numpy's 128-byte header, in ``<workdir>/files/train/`` (DLIO's layout: ``data_folder/train``);
* **stoker**: the same files packed on local disk (``stoker.pack(dir, dst, source="files")``),
  opened with a fresh node cache; ``Loader(ds, batch_size, num_workers=workers, decode=<the file's
  bytes as a numpy uint8 array, no copy>, collate=<np.stack: one (batch, sample_bytes) uint8 array>,
  drop_last=True)``, shuffle on; run in a subprocess of stoker's Python;
* **DLIO**: ``python -m dlio_benchmark.main workload=default`` with hydra overrides
  (:func:`dlio_overrides`): ``framework=pytorch``, ``reader.data_loader=pytorch``, ``format=npy``,
  ``read_threads=workers``, ``batch_size``, ``record_length=sample_bytes`` (so its emulated tensor,
  sqrt(record_length)^2 bytes, is about one sample), ``sample_shuffle=seed``,
  ``workflow.generate_data=False`` (our files), ``train.computation_time=0`` (no emulated compute),
  no evaluation, no checkpoints, ``keep_files=True``; run in its own virtual environment
  (:mod:`stoker_lab.bench.venvs`, ``dlio``) by :mod:`stoker_lab.bench.dlio_runner`, which times each of
  DLIO's epochs (``DLIOBenchmark._train``) from outside.

torch is imported in both processes before the first epoch (DLIO imports it at start-up; stoker's
child does, as a training job would have): stoker's Loader would otherwise import it inside its
first ``iter()`` (through ``stoker.decode``), even with a ``decode=`` of the user's.

Sources (the keys of the report):

* ``local``: the first epoch. stoker reads the packed shards from the local origin (a directory on
  local disk) through its empty cache, filling it; DLIO reads the directory of files. Both start
  their worker processes in this epoch. The files were just written, so the page cache holds them
  for both readers (dropping it would need the whole machine).
* ``warm_cache``: epochs 2 and later, summed. stoker serves every sample from its node cache; DLIO,
  which has no cache of its own, reads the same directory again (warm in the page cache).

CPU is counted over each run's whole process tree (the training process, its workers, their
children; :func:`stoker_lab.bench.peers._runner.tree_cpu_s`) around each epoch's iteration, by the
same code for both. ``samples_per_s_per_core`` is samples per CPU-second: samples/s divided by the
CPU-seconds per second that all processes of the run used (``samples / cpu_s``), so that it does
not depend on how many cores a shared machine happened to give the run.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

from .venvs import run_json_lines

GB = 1e9
NPY_HEADER = 128  # numpy's .npy v1.0 header for a small uint8 array, padded to 64-byte alignment
DLIO_REQUIREMENT = "dlio-benchmark==2.0.0"
_HERE = os.path.dirname(os.path.abspath(__file__))
PER_CORE = (
    "samples per CPU-second: samples/s divided by the CPU-seconds per second used by every process "
    "of that run (training process, workers and their children), i.e. samples / cpu_s over the epochs"
)


@dataclass
class BytesOnlyConfig:
    """``files`` of ``sample_bytes`` each (default 1,024 x 114,660 B = 117 MB: the run takes about a
    minute, DLIO's start-up included); ``workers`` / ``batch_size``: both readers'; ``epochs``: the
    first is ``local``, the rest ``warm_cache`` (>= 2); ``dlio``: run DLIO's half; ``make_venv``: make
    DLIO's environment if it is missing (False: use it only if it is there, else skip with the
    reason); ``timeout_s``: per run."""

    files: int = 1024
    sample_bytes: int = 114_660
    workers: int = 2
    batch_size: int = 64
    epochs: int = 3
    seed: int = 0
    dlio: bool = True
    make_venv: bool = True
    timeout_s: float = 900.0
    workdir: str | None = None


def _log(msg: str) -> None:
    print(f"[bench io bytes_only {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# -- the files ------------------------------------------------------------------
def make_files(root: str, files: int, sample_bytes: int, seed: int = 0) -> str:
    """``files`` random-byte .npy files of exactly ``sample_bytes`` bytes in ``root/train``
    (``img_00000.npy``, ...) and an empty ``root/valid``; reused when ``root`` already holds the same
    set. Returns ``root``."""
    import numpy as np

    if sample_bytes <= NPY_HEADER:
        raise ValueError(f"sample_bytes must be above the .npy header ({NPY_HEADER} B), got {sample_bytes}")
    spec = {"files": files, "sample_bytes": sample_bytes, "seed": seed}
    marker = os.path.join(root, "files.json")
    try:
        with open(marker) as f:
            if json.load(f) == spec:
                return root
    except (OSError, ValueError):
        pass
    shutil.rmtree(root, ignore_errors=True)
    train = os.path.join(root, "train")
    os.makedirs(train)
    os.makedirs(os.path.join(root, "valid"))  # DLIO lists it even with evaluation off; left empty
    rng = np.random.default_rng(seed)
    n = sample_bytes - NPY_HEADER
    for i in range(files):
        path = os.path.join(train, f"img_{i:05d}.npy")
        np.save(path, rng.integers(0, 256, size=(n, 1), dtype=np.uint8))
        if i == 0 and os.path.getsize(path) != sample_bytes:
            raise RuntimeError(
                f"{path} is {os.path.getsize(path)} bytes, not {sample_bytes}: the .npy header "
                f"is not {NPY_HEADER} bytes with this numpy"
            )
    with open(marker, "w") as f:
        json.dump(spec, f)
    return root


# -- stoker's half (its own process) ---------------------------------------------
def raw_array(fields, rng):
    """Decode off: the sample's file bytes as a numpy uint8 array (a view, no copy)."""
    import numpy as np

    return np.frombuffer(next(iter(fields.values())), np.uint8)


def stack(samples):
    """Collate: one (batch, sample_bytes) uint8 array (it goes through the shared-memory slots)."""
    import numpy as np

    return np.stack(samples)


def _stoker_child(cfg: dict) -> None:
    """Run in a subprocess: ``cfg['epochs']`` epochs of the bytes-only Loader over a fresh cache;
    one JSON line per epoch (samples, bytes, seconds, cpu_s of the process tree)."""
    from stoker.loader import Loader
    from stoker.store.dataset import open_dataset

    from .peers import _runner

    _runner.subreaper()
    # a training process has imported torch before its first epoch, and so has DLIO's (at start-up); the
    # Loader's first iter() imports it (through stoker.decode) even with decode=, about 1.3 CPU-s here
    import torch  # noqa: F401

    shutil.rmtree(cfg["cache_dir"], ignore_errors=True)
    ds = open_dataset(cfg["packed"], cfg["cache_dir"], cfg["cache_bytes"])
    with Loader(
        ds,
        cfg["batch_size"],
        num_workers=cfg["workers"],
        seed=cfg["seed"],
        drop_last=True,
        decode=raw_array,
        collate=stack,
    ) as loader:
        for e in range(cfg["epochs"]):
            c0, t0 = _runner.tree_cpu_s(), time.perf_counter()
            n = nbytes = 0
            for batch in loader:
                n += batch.shape[0]
                nbytes += batch.nbytes
            t, c = time.perf_counter() - t0, _runner.tree_cpu_s() - c0
            s = loader.stats
            _runner.emit(
                {
                    "kind": "epoch",
                    "epoch": e,
                    "samples": n,
                    "bytes": nbytes,
                    "seconds": t,
                    "cpu_s": c,
                    "origin_bytes": int(s.origin_bytes),
                    "cache_hit_ratio": s.cache_hit_ratio,
                    "first_batch_s": s.first_batch_s,
                    "start_method": loader.start_method,
                    "loader_cpu_s": {k: float(v) for k, v in s.cpu_s.items()},
                }
            )
    shutil.rmtree(cfg["cache_dir"], ignore_errors=True)


# -- DLIO's half ----------------------------------------------------------------
def dlio_python(make: bool) -> str:
    """The Python of DLIO's environment (made when ``make`` and missing); RuntimeError with the reason."""
    from .venvs import VenvError, ensure_venv, ready_venv, venv_root

    if not make:
        py = ready_venv("dlio")
        if py is None:
            raise RuntimeError(
                f"DLIO's virtual environment {os.path.join(venv_root(), 'dlio')} is not present "
                "and making it is off (stoker bench io --dlio makes it: about 2.6 GB installed, "
                "from the package index)"
            )
        return py
    try:
        return ensure_venv("dlio", log=_log)
    except VenvError as exc:
        raise RuntimeError(f"could not install DLIO: {exc}") from None


def dlio_overrides(
    data_folder: str, out: str, files: int, sample_bytes: int, workers: int, batch_size: int, epochs: int, seed: int
) -> list[str]:
    """DLIO's command line (hydra overrides of its ``default`` workload): its PyTorch reader over our
    ``.npy`` files in ``data_folder/train``, no data generation, no emulated compute, no evaluation."""
    w = "++workload."
    return [
        "workload=default",
        f"hydra.run.dir={out}/hydra",
        f"{w}framework=pytorch",
        f"{w}reader.data_loader=pytorch",
        f"{w}workflow.generate_data=False",
        f"{w}workflow.train=True",
        f"{w}workflow.evaluation=False",
        f"{w}workflow.checkpoint=False",
        f"{w}workflow.profiling=False",
        f"{w}dataset.data_folder={data_folder}",
        f"{w}dataset.format=npy",
        f"{w}dataset.num_files_train={files}",
        f"{w}dataset.num_files_eval=0",
        f"{w}dataset.num_samples_per_file=1",
        f"{w}dataset.record_length={sample_bytes}",
        f"{w}dataset.num_subfolders_train=0",
        f"{w}dataset.num_subfolders_eval=0",
        f"{w}dataset.keep_files=True",
        f"{w}reader.read_threads={workers}",
        f"{w}reader.batch_size={batch_size}",
        f"{w}reader.sample_shuffle=seed",
        f"{w}reader.multiprocessing_context=fork",
        f"{w}train.epochs={epochs}",
        f"{w}train.computation_time=0",
        f"{w}train.seed={seed}",
        f"{w}output.folder={out}",
    ]


# -- the report -----------------------------------------------------------------
def index_map_note(fmt: dict | None, dlio_rows: list[dict]) -> dict | None:
    """What DLIO's per-sample debug string costs (see :func:`stoker_lab.bench.dlio_runner.index_map_format_s`)
    and DLIO's warm samples per CPU-second without it: an estimate (its CPU less that cost per sample),
    given beside the measured figure, never instead of it."""
    if not fmt or "cpu_s" not in fmt:
        return fmt
    warm = figures(dlio_rows[1:])
    est = None
    if warm and warm["cpu_s"]:
        left = warm["cpu_s"] - warm["samples"] * fmt["cpu_s"]
        est = warm["samples"] / left if left > 0 else None
    return {
        "entries": fmt["entries"],
        "cpu_s_per_sample": fmt["cpu_s"],
        "what": "DLIO 2.0.0's FormatReader.read_index evaluates f'{self.global_index_map}' for a logging.debug "
        "call on every sample (debug off too): a cost that grows with the number of files; measured "
        "in DLIO's process on its own map",
        "warm_cache_dlio_samples_per_s_per_core_without_it_estimate": est,
    }


def figures(rows: list[dict]) -> dict | None:
    """Summed figures of epoch rows: samples, bytes, seconds, cpu_s, samples/s, samples per CPU-s, CPU-s/GB."""
    if not rows:
        return None
    n, b = sum(r["samples"] for r in rows), sum(r["bytes"] for r in rows)
    t, c = sum(r["seconds"] for r in rows), sum(r["cpu_s"] for r in rows)
    return {
        "epochs": len(rows),
        "samples": n,
        "bytes": b,
        "seconds": t,
        "cpu_s": c,
        "samples_per_s": n / t if t > 0 else 0.0,
        "samples_per_s_per_core": n / c if c > 0 else None,
        "cpu_s_per_GB": c / (b / GB) if b else None,
    }


def source_row(what: str, sample_bytes: int, stoker: dict | None, dlio: dict | None) -> dict:
    """One source of the report: both readers' samples per CPU-second and CPU-s/GB, and their ratio."""
    get = lambda f, k: f[k] if f else None  # noqa: E731
    s, d = get(stoker, "samples_per_s_per_core"), get(dlio, "samples_per_s_per_core")
    return {
        "what": what,
        "sample_bytes": sample_bytes,
        "stoker_samples_per_s_per_core": s,
        "dlio_samples_per_s_per_core": d,
        "stoker_cpu_s_per_GB": get(stoker, "cpu_s_per_GB"),
        "dlio_cpu_s_per_GB": get(dlio, "cpu_s_per_GB"),
        "stoker_samples_per_s": get(stoker, "samples_per_s"),
        "dlio_samples_per_s": get(dlio, "samples_per_s"),
        "stoker_over_dlio": s / d if s and d else None,
        "stoker": stoker,
        "dlio": dlio,
    }


def _dlio_version(py: str) -> str | None:
    r = subprocess.run(
        [py, "-c", "import importlib.metadata as m; print(m.version('dlio-benchmark'))"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return r.stdout.strip() or None if r.returncode == 0 else None


def run(cfg: BytesOnlyConfig | None = None) -> dict:
    """Measure; returns the ``bytes_only`` report (see the module docstring)."""
    from stoker.store.pack import pack

    cfg = cfg or BytesOnlyConfig()
    if cfg.epochs < 2:
        raise ValueError(f"epochs must be >= 2 (the first is 'local', the rest 'warm_cache'), got {cfg.epochs}")
    files = cfg.files - cfg.files % cfg.batch_size  # whole batches: both readers drop the last partial one
    if files < cfg.batch_size:
        raise ValueError(f"files ({cfg.files}) must hold at least one batch of {cfg.batch_size}")
    work = cfg.workdir or os.path.join(os.environ.get("TMPDIR", "/tmp"), "stoker-bench-bytes-only")
    os.makedirs(work, exist_ok=True)
    t_start = time.perf_counter()
    data = make_files(os.path.join(work, "files"), files, cfg.sample_bytes, cfg.seed)
    packed = os.path.join(work, "packed")
    pack(os.path.join(data, "train"), packed, source="files", overwrite=True, progress=False)
    total = files * cfg.sample_bytes
    _log(f"{files} files of {cfg.sample_bytes} B ({total / 1e6:.1f} MB), packed into {packed}")
    report: dict = {
        "config": {**asdict(cfg), "files": files},
        "files": {
            "count": files,
            "sample_bytes": cfg.sample_bytes,
            "bytes": total,
            "format": f"random bytes in .npy files (uint8 ({cfg.sample_bytes - NPY_HEADER}, 1) behind "
            f"the {NPY_HEADER}-byte header), DLIO's layout data_folder/train/",
            "where": data,
        },
        "per_core_definition": PER_CORE,
        "cpu_accounting": "the whole process tree of each run (tree_cpu_s: /proc utime+stime, children included), "
        "around each epoch's iteration; worker start-up falls in the first epoch for both",
        "stoker": {
            "what": "stoker.pack(dir, dst, source='files') on local disk, open_dataset(dst, <fresh cache "
            "dir>), Loader(num_workers, batch_size, shuffle, drop_last=True, decode=file bytes as "
            "np.frombuffer uint8, collate=np.stack)"
        },
    }
    env = dict(os.environ)
    src_root = os.path.dirname(os.path.dirname(_HERE))  # the folder holding stoker_lab
    env["PYTHONPATH"] = os.pathsep.join([src_root] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    common = {"workers": cfg.workers, "batch_size": cfg.batch_size, "epochs": cfg.epochs, "seed": cfg.seed}

    _log(f"stoker: {cfg.epochs} epochs, {cfg.workers} workers, batch {cfg.batch_size}")
    scfg = {**common, "packed": packed, "cache_dir": os.path.join(work, "cache"), "cache_bytes": 4 * total + (64 << 20)}
    cfg_path = os.path.join(work, "stoker.json")
    with open(cfg_path, "w") as f:
        json.dump(scfg, f)
    rows, why = run_json_lines(
        [sys.executable, "-m", "stoker_lab.bench.bytes_only", "stoker", cfg_path],
        env,
        cfg.timeout_s,
        os.path.join(work, "stoker.log"),
    )
    if why:
        raise RuntimeError(f"stoker's bytes-only run failed: {why}")
    stoker_rows = [r for r in rows if r.get("kind") == "epoch"]

    dlio_rows: list[dict] = []
    report["dlio_version"] = None
    report["exception"] = None
    if not cfg.dlio:
        report["exception"] = "DLIO not run (--no-dlio)"
    else:
        try:
            py = dlio_python(cfg.make_venv)
            report["dlio_version"] = _dlio_version(py)
            out = os.path.join(work, "dlio-out")
            shutil.rmtree(out, ignore_errors=True)
            overrides = dlio_overrides(
                data, out, files, cfg.sample_bytes, cfg.workers, cfg.batch_size, cfg.epochs, cfg.seed
            )
            report["dlio"] = {
                "python": py,
                "requirement": DLIO_REQUIREMENT,
                "command": "python -m dlio_benchmark.main " + " ".join(overrides),
                "what": "DLIO's PyTorch data loader (torch DataLoader, read_threads workers, "
                "persistent, fork, its NPYReader: np.load per file) over the same files",
            }
            _log(f"DLIO {report['dlio_version']}: {cfg.epochs} epochs")
            dcfg = {"batch_size": cfg.batch_size, "overrides": overrides}
            dcfg_path = os.path.join(work, "dlio.json")
            with open(dcfg_path, "w") as f:
                json.dump(dcfg, f)
            denv = {k: v for k, v in env.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
            rows, why = run_json_lines(
                [py, os.path.join(_HERE, "dlio_runner.py"), dcfg_path],
                denv,
                cfg.timeout_s,
                os.path.join(work, "dlio.log"),
            )
            dlio_rows = [r for r in rows if r.get("kind") == "epoch"]
            if why:
                raise RuntimeError(f"DLIO's run failed: {why}")
            report["dlio"]["own_summary"] = next((r["summary"] for r in rows if r.get("kind") == "summary"), None)
            fmt = next((r for r in rows if r.get("kind") == "index_map_format"), None)
            report["dlio"]["index_map_format"] = index_map_note(fmt, dlio_rows)
        except RuntimeError as exc:
            report["exception"] = str(exc)
            dlio_rows = []
    report["local"] = source_row(
        "first epoch: stoker from the packed shards on local disk through its empty cache "
        "(filling it); DLIO over the directory of files; both start their workers here",
        cfg.sample_bytes,
        figures(stoker_rows[:1]),
        figures(dlio_rows[:1]),
    )
    report["warm_cache"] = source_row(
        "epochs 2+: stoker from its warm node cache; DLIO (no cache of its own) "
        "over the same directory, warm in the page cache",
        cfg.sample_bytes,
        figures(stoker_rows[1:]),
        figures(dlio_rows[1:]),
    )
    report["epochs"] = {"stoker": stoker_rows, "dlio": dlio_rows}
    report["seconds"] = time.perf_counter() - t_start
    return report


def table(r: dict) -> str:
    """The report as a few lines of text."""

    def num(x, fmt):
        return format(x, fmt) if isinstance(x, (int, float)) else "-"

    c = r["config"]
    lines = [
        f"bytes only: {r['files']['count']} files of {r['files']['sample_bytes']} B "
        f"({r['files']['bytes'] / 1e6:.1f} MB), {c['workers']} workers, batch {c['batch_size']}; "
        f"DLIO {r.get('dlio_version') or '-'}; samples/s per core = samples per CPU-second",
        f"{'source':12} {'stoker smp/CPU-s':>16} {'DLIO smp/CPU-s':>15} {'ratio':>6} "
        f"{'stoker CPU-s/GB':>15} {'DLIO CPU-s/GB':>13} {'stoker smp/s':>12} {'DLIO smp/s':>10}",
    ]
    for src in ("local", "warm_cache"):
        s = r[src]
        lines.append(
            f"{src:12} {num(s['stoker_samples_per_s_per_core'], '16.0f')} "
            f"{num(s['dlio_samples_per_s_per_core'], '15.0f')} {num(s['stoker_over_dlio'], '6.2f')} "
            f"{num(s['stoker_cpu_s_per_GB'], '15.2f')} {num(s['dlio_cpu_s_per_GB'], '13.2f')} "
            f"{num(s['stoker_samples_per_s'], '12.0f')} {num(s['dlio_samples_per_s'], '10.0f')}"
        )
    fmt = (r.get("dlio") or {}).get("index_map_format") or {}
    if "cpu_s_per_sample" in fmt:
        lines.append(
            f"DLIO's per-sample debug string of its {fmt['entries']}-entry index map: "
            f"{1e3 * fmt['cpu_s_per_sample']:.2f} ms CPU; DLIO warm without it (estimate): "
            f"{num(fmt['warm_cache_dlio_samples_per_s_per_core_without_it_estimate'], '.0f')} "
            f"samples per CPU-s"
        )
    if r.get("exception"):
        lines.append(f"DLIO: {r['exception']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """``python -m stoker_lab.bench.bytes_only stoker CFG_JSON`` (the stoker half's subprocess), or
    ``python -m stoker_lab.bench.bytes_only [--files N] [--json PATH] [--no-dlio]`` (the measurement alone)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["stoker"] and len(argv) == 2:
        with open(argv[1]) as f:
            _stoker_child(json.load(f))
        return
    import argparse

    p = argparse.ArgumentParser(prog="python -m stoker_lab.bench.bytes_only")
    p.add_argument("--files", type=int, default=BytesOnlyConfig.files)
    p.add_argument("--workers", type=int, default=BytesOnlyConfig.workers)
    p.add_argument("--batch-size", type=int, default=BytesOnlyConfig.batch_size)
    p.add_argument("--epochs", type=int, default=BytesOnlyConfig.epochs)
    p.add_argument("--dlio", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--workdir")
    p.add_argument("--json")
    a = p.parse_args(argv)
    r = run(
        BytesOnlyConfig(
            files=a.files, workers=a.workers, batch_size=a.batch_size, epochs=a.epochs, dlio=a.dlio, workdir=a.workdir
        )
    )
    print(table(r))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(r, f, indent=1)


if __name__ == "__main__":
    main()
