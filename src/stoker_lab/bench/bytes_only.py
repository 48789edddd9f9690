"""``bytes_only`` of ``stoker bench io``: what a bytes-only training job gets, in the steady state.

Every reader gets the same samples, 2 workers and batch 64 by default, and a consumer that takes
no time; each runs in a process of its own (:mod:`stoker_lab.bench.byte_readers`, DLIO's in its own
virtual environment: :mod:`stoker_lab.bench.dlio_runner`) and is measured by the method of
:mod:`stoker_lab.bench.steady_state`: the CPU of every process of the run (the training process,
its workers and their children, from ``/proc``) and the wall time, as the difference between a
short and a long run of warm epochs on the same workers, so that start-up and warm-up cancel. The
first epoch and the first warm epochs are reported apart (``first``, ``first_warm``).

The samples (:func:`make_files`): ``files`` random-byte ``.npy`` files of ``sample_bytes`` each
(default 1,024 x 114,660 B: MLPerf Storage's ResNet-50 ``record_length``), a uint8 array of shape
``(sample_bytes - 128, 1)`` behind numpy's 128-byte header, in ``<workdir>/files/train/`` (DLIO's
layout), in the page cache (just written); and for the ragged row (:func:`make_ragged_files`) as
many random-byte files of 0.5x to 1.5x ``sample_bytes``, the same mean.

The rows (:data:`ROWS`): stoker with a per-sample ``decode=`` (``np.frombuffer``, ``np.stack``),
stoker's ragged and fixed-shape raw batches (``collate=stoker.collate.raw_bytes``), each from a
fresh node cache over the files packed on local disk (``stoker.pack(dir, dst, source="files")``)
that the first epoch fills; a plain torch DataLoader over the ``.npy`` files; DLIO's PyTorch reader
as released and with its per-sample debug string taken out (:data:`DLIO_DEBUG_LINE`); the floor:
bare ``os.preadv`` of each file into one reused buffer. A row that cannot run says why in
``skipped`` (DLIO not installed: how to install it), never a figure it did not measure.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

from . import steady_state as ss
from .venvs import run_json_lines

NPY_HEADER = 128  # numpy's .npy v1.0 header for a small uint8 array, padded to 64-byte alignment
DLIO_REQUIREMENT = "dlio-benchmark==2.0.0"
_HERE = os.path.dirname(os.path.abspath(__file__))

#: The rows, in report order: name -> what it measures.
ROWS = {
    "stoker_per_sample": "stoker, per-sample decode: Loader(decode=np.frombuffer of the sample's bytes, "
    "collate=np.stack) from its warm node cache",
    "stoker_ragged": "stoker, ragged raw batches: Loader(collate=stoker.collate.raw_bytes), no decode, from its "
    "warm node cache; samples of 0.5x-1.5x sample_bytes, one flat uint8 tensor + offsets per batch",
    "stoker_fixed": "stoker, fixed-shape raw batches: Loader(collate=stoker.collate.raw_bytes), no decode, from "
    "its warm node cache; (batch, sample_bytes) uint8 per batch",
    "torch": "plain torch.utils.data.DataLoader over the same bytes as .npy files in the page cache: np.load "
    "per file, default collate, shuffle=True, persistent_workers=True",
    "dlio": "DLIO's PyTorch reader (dlio-benchmark 2.0.0, reader.data_loader=pytorch, format=npy) over the "
    "same .npy files, as released",
    "dlio_without_debug": "DLIO's PyTorch reader as above, its per-sample debug string taken out",
    "floor": "floor: one process, each file opened once, then os.preadv of the whole file into one reused "
    "buffer, in a new permutation each epoch",
}

#: The line of dlio-benchmark 2.0.0 that costs DLIO its per-sample debug string (the PyPI release;
#: the repository's tag v2.0.1, whose setup.py still says 2.0.0, has it at this line; the tag
#: v2.0.0 predates it). The runner reports where it finds it in the installed copy.
DLIO_DEBUG_LINE = (
    "dlio_benchmark/reader/reader_handler.py:109, FormatReader.read_index: "
    'self.logger.debug(f"{self.global_index_map}")'
)
DLIO_DEBUG_HOW = (
    "the line formats the whole sample -> file map on every sample (debug logging off too), so its cost "
    "grows with the number of files; taken out by giving DLIO's index map (ConfigArguments.get_global_map_index's "
    "result) a type whose str() is a constant: a dict subclass, lookups unchanged, DLIO's code not edited"
)


@dataclass
class BytesOnlyConfig:
    """``files`` of ``sample_bytes`` each; ``workers`` / ``batch_size``: every reader's;
    ``first_warm``: warm epochs reported apart; the steady figures over at least ``min_epochs``
    warm epochs and, where ``max_epochs`` allows, ``min_cpu_s`` CPU-seconds (DLIO: ``min_epochs``,
    its epochs are fixed before it starts); ``dlio``: run DLIO's rows; ``make_venv``: make DLIO's
    environment when missing (about 2.6 GB from the package index; off: its rows are skipped with
    how to install it); ``timeout_s``: per reader."""

    files: int = 1024
    sample_bytes: int = 114_660
    workers: int = 2
    batch_size: int = 64
    seed: int = 0
    first_warm: int = 2
    min_epochs: int = 10
    min_cpu_s: float = 3.0
    max_epochs: int = 400
    dlio: bool = True
    make_venv: bool = False
    timeout_s: float = 900.0
    workdir: str | None = None


def _log(msg: str) -> None:
    print(f"[bench io bytes_only {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# -- the files ------------------------------------------------------------------
def _reuse(root: str, spec: dict) -> bool:
    try:
        with open(os.path.join(root, "files.json")) as f:
            return json.load(f) == spec
    except (OSError, ValueError):
        return False


def make_files(root: str, files: int, sample_bytes: int, seed: int = 0) -> str:
    """``files`` random-byte .npy files of exactly ``sample_bytes`` bytes in ``root/train``
    (``img_00000.npy``, ...) and an empty ``root/valid``; reused when ``root`` already holds the same
    set. Returns ``root``. Raises ValueError when ``sample_bytes`` does not exceed the .npy header."""
    import numpy as np

    if sample_bytes <= NPY_HEADER:
        raise ValueError(f"sample_bytes must be above the .npy header ({NPY_HEADER} B), got {sample_bytes}")
    spec = {"files": files, "sample_bytes": sample_bytes, "seed": seed}
    if _reuse(root, spec):
        return root
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
    with open(os.path.join(root, "files.json"), "w") as f:
        json.dump(spec, f)
    return root


def ragged_lengths(files: int, sample_bytes: int, seed: int = 0) -> list[int]:
    """``files`` lengths spread evenly over 0.5x-1.5x ``sample_bytes`` (in a shuffled order), whose
    mean is ``sample_bytes`` to within a byte."""
    import numpy as np

    k = np.arange(files)
    half = sample_bytes // 2
    lengths = sample_bytes - half + (2 * half * k) // max(1, files - 1)
    return np.random.default_rng(seed).permutation(lengths).astype(int).tolist()


def make_ragged_files(root: str, files: int, sample_bytes: int, seed: int = 0) -> str:
    """``files`` random-byte files (``smp_00000.bin``, ...) of :func:`ragged_lengths` in ``root/train``;
    reused when ``root`` already holds the same set. Returns ``root``."""
    import numpy as np

    spec = {"files": files, "sample_bytes": sample_bytes, "seed": seed, "ragged": True}
    if _reuse(root, spec):
        return root
    shutil.rmtree(root, ignore_errors=True)
    train = os.path.join(root, "train")
    os.makedirs(train)
    rng = np.random.default_rng(seed + 1)
    for i, n in enumerate(ragged_lengths(files, sample_bytes, seed)):
        with open(os.path.join(train, f"smp_{i:05d}.bin"), "wb") as f:
            f.write(rng.integers(0, 256, size=n, dtype=np.uint8).tobytes())
    with open(os.path.join(root, "files.json"), "w") as f:
        json.dump(spec, f)
    return root


# -- DLIO -----------------------------------------------------------------------
def dlio_python(make: bool) -> str:
    """The Python of DLIO's environment (made when ``make`` and missing); RuntimeError saying how to
    install it otherwise, or why the install failed."""
    from .venvs import VenvError, ensure_venv, ready_venv, venv_root

    if not make:
        py = ready_venv("dlio")
        if py is None:
            raise RuntimeError(
                f"not measured: DLIO is not installed ({os.path.join(venv_root(), 'dlio')} is not present); "
                f"`stoker bench io --make-dlio-venv` installs {DLIO_REQUIREMENT} there (about 2.6 GB from the "
                "package index, 3-4 minutes) and measures it"
            )
        return py
    try:
        return ensure_venv("dlio", log=_log)
    except VenvError as exc:
        raise RuntimeError(f"not measured: could not install DLIO: {exc}") from None


def dlio_overrides(data_folder: str, out: str, files: int, cfg: BytesOnlyConfig, epochs: int) -> list[str]:
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
        f"{w}dataset.record_length={cfg.sample_bytes}",
        f"{w}dataset.num_subfolders_train=0",
        f"{w}dataset.num_subfolders_eval=0",
        f"{w}dataset.keep_files=True",
        f"{w}reader.read_threads={cfg.workers}",
        f"{w}reader.batch_size={cfg.batch_size}",
        f"{w}reader.sample_shuffle=seed",
        f"{w}reader.multiprocessing_context=fork",
        f"{w}train.epochs={epochs}",
        f"{w}train.computation_time=0",
        f"{w}train.seed={cfg.seed}",
        f"{w}output.folder={out}",
    ]


def _dlio_version(py: str) -> str | None:
    r = subprocess.run(
        [py, "-c", "import importlib.metadata as m; print(m.version('dlio-benchmark'))"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return r.stdout.strip() or None if r.returncode == 0 else None


def dlio_rows(cfg: BytesOnlyConfig, data: str, files: int, work: str, env: dict) -> dict:
    """The two DLIO rows (as released; without its debug string): name -> row (:func:`row`)."""
    try:
        py = dlio_python(cfg.make_venv)
    except RuntimeError as exc:
        return {name: skipped(name, str(exc)) for name in ("dlio", "dlio_without_debug")}
    version = _dlio_version(py)
    short, extra = ss.window(1.0, cfg.min_epochs, 0.0, cfg.min_epochs)
    marks_at = ss.boundaries(cfg.first_warm, short, extra)
    denv = {k: v for k, v in env.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    out_rows = {}
    for name, quiet in (("dlio", False), ("dlio_without_debug", True)):
        out = os.path.join(work, f"{name}-out")
        shutil.rmtree(out, ignore_errors=True)
        overrides = dlio_overrides(data, out, files, cfg, marks_at[-1])
        dcfg = {"batch_size": cfg.batch_size, "overrides": overrides, "marks": marks_at, "quiet_index_map": quiet}
        path = os.path.join(work, f"{name}.json")
        with open(path, "w") as f:
            json.dump(dcfg, f)
        _log(f"{name}: DLIO {version}, {marks_at[-1]} epochs")
        lines, why = run_json_lines(
            [py, os.path.join(_HERE, "dlio_runner.py"), path], denv, cfg.timeout_s, os.path.join(work, f"{name}.log")
        )
        r = row(name, lines, why, cfg.first_warm)
        r["dlio"] = {
            "version": version,
            "python": py,
            "command": "python -m dlio_benchmark.main " + " ".join(overrides),
            "debug_line": next((x for x in lines if x.get("kind") == "debug_line"), None),
            "index_map_format": next((x for x in lines if x.get("kind") == "index_map_format"), None),
            "own_summary": next((x["summary"] for x in lines if x.get("kind") == "summary"), None),
        }
        if quiet:
            r["debug_cost_taken_out"] = {"line": DLIO_DEBUG_LINE, "how": DLIO_DEBUG_HOW}
        out_rows[name] = r
    return out_rows


# -- the report -----------------------------------------------------------------
def skipped(name: str, why: str) -> dict:
    """A row that was not measured: its name, what it would measure, and why not."""
    return {"name": name, "what": ROWS[name], "skipped": why, "steady": None}


def row(name: str, lines: list[dict], why: str | None, first_warm: int) -> dict:
    """A reader's row from its printed lines (:func:`stoker_lab.bench.steady_state.figures` of its
    marks); a reader that failed gives a skipped row with the reason."""
    marks = [x for x in lines if x.get("kind") == "mark"]
    if why:
        return skipped(name, f"failed: {why}")
    try:
        figs = ss.figures(marks, first_warm)
    except ValueError as exc:
        return skipped(name, f"failed: {exc}")
    return {"name": name, "what": ROWS[name], "skipped": None, **figs}


def _ratios(rows: list[dict]) -> None:
    """Each measured row's steady samples per CPU-second over the torch DataLoader's and the floor's."""
    by = {r["name"]: (r["steady"] or {}).get("samples_per_cpu_s") for r in rows}
    for r in rows:
        mine = (r["steady"] or {}).get("samples_per_cpu_s")
        for ref in ("torch", "floor"):
            r[f"per_cpu_s_vs_{ref}"] = mine / by[ref] if mine and by.get(ref) else None


def _reader(name: str, reader_cfg: dict, work: str, env: dict, cfg: BytesOnlyConfig) -> dict:
    path = os.path.join(work, f"{name}.json")
    with open(path, "w") as f:
        json.dump(reader_cfg, f)
    _log(f"{name}")
    lines, why = run_json_lines(
        [sys.executable, "-m", "stoker_lab.bench.byte_readers", path],
        env,
        cfg.timeout_s,
        os.path.join(work, f"{name}.log"),
    )
    return row(name, lines, why, cfg.first_warm)


def run(cfg: BytesOnlyConfig | None = None) -> dict:
    """Measure every row; returns the ``bytes_only`` report (see the module docstring).
    Raises ValueError when ``files`` holds no whole batch."""
    from stoker.store.pack import pack

    cfg = cfg or BytesOnlyConfig()
    files = cfg.files - cfg.files % cfg.batch_size  # whole batches: every reader drops the last partial one
    if files < cfg.batch_size:
        raise ValueError(f"files ({cfg.files}) must hold at least one batch of {cfg.batch_size}")
    work = cfg.workdir or os.path.join(os.environ.get("TMPDIR", "/tmp"), "stoker-bench-bytes-only")
    os.makedirs(work, exist_ok=True)
    t_start = time.perf_counter()
    data = make_files(os.path.join(work, "files"), files, cfg.sample_bytes, cfg.seed)
    ragged = make_ragged_files(os.path.join(work, "ragged"), files, cfg.sample_bytes, cfg.seed)
    packed = {"fixed": os.path.join(work, "packed"), "ragged": os.path.join(work, "packed-ragged")}
    pack(os.path.join(data, "train"), packed["fixed"], source="files", overwrite=True, progress=False)
    pack(os.path.join(ragged, "train"), packed["ragged"], source="files", overwrite=True, progress=False)
    total = files * cfg.sample_bytes
    _log(f"{files} files of {cfg.sample_bytes} B ({total / 1e6:.1f} MB), packed")
    env = dict(os.environ)
    src_root = os.path.dirname(os.path.dirname(_HERE))  # the folder holding stoker_lab
    env["PYTHONPATH"] = os.pathsep.join([src_root] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    paths = [os.path.join(data, "train", f"img_{i:05d}.npy") for i in range(files)]
    common = {k: getattr(cfg, k) for k in ("workers", "batch_size", "seed", "first_warm", "min_epochs")}
    common |= {"min_cpu_s": cfg.min_cpu_s, "max_epochs": cfg.max_epochs, "cache_bytes": 4 * total + (64 << 20)}
    readers: dict[str, dict] = {
        "stoker_per_sample": {"reader": "stoker_per_sample", "packed": packed["fixed"]},
        "stoker_ragged": {"reader": "stoker_raw", "packed": packed["ragged"]},
        "stoker_fixed": {"reader": "stoker_raw", "packed": packed["fixed"]},
        "torch": {"reader": "torch", "paths": paths},
    }
    rows = []
    for name, rc in readers.items():
        cache = os.path.join(work, f"cache-{name}")
        shutil.rmtree(cache, ignore_errors=True)
        rows.append(_reader(name, {**common, **rc, "cache_dir": cache}, work, env, cfg))
        shutil.rmtree(cache, ignore_errors=True)
    if cfg.dlio:
        rows += list(dlio_rows(cfg, data, files, work, env).values())
    else:
        rows += [skipped(n, "not measured: --no-dlio") for n in ("dlio", "dlio_without_debug")]
    rows.append(_reader("floor", {**common, "reader": "floor", "paths": paths}, work, env, cfg))
    _ratios(rows)
    return {
        "config": {**asdict(cfg), "files": files},
        "files": {
            "count": files,
            "sample_bytes": cfg.sample_bytes,
            "bytes": total,
            "format": f"random bytes in .npy files (uint8 ({cfg.sample_bytes - NPY_HEADER}, 1) behind the "
            f"{NPY_HEADER}-byte header), DLIO's layout data_folder/train/; the ragged row: as many random-byte "
            f"files of {min(ragged_lengths(files, cfg.sample_bytes))}-{max(ragged_lengths(files, cfg.sample_bytes))} B",
            "where": data,
        },
        "method": "steady: (long run - short run) over their difference in samples, the runs back to back on one "
        "set of workers after the first epoch and first_warm warm epochs (reported apart); CPU of every process "
        "of the run (training process, workers, their children) from /proc at the runs' boundaries only",
        "rows": rows,
        "seconds": time.perf_counter() - t_start,
    }


def _num(x, fmt: str) -> str:
    if isinstance(x, (int, float)) and math.isfinite(x):
        return format(x, fmt)
    width = fmt.split(".")[0]
    return "-".rjust(int(width) if width.isdigit() else 1)


def table(r: dict) -> str:
    """The report as text: one line per row (steady state), then the first epochs, then skipped rows."""
    c = r["config"]
    lines = [
        f"bytes only: {r['files']['count']} samples of {r['files']['sample_bytes']} B "
        f"({r['files']['bytes'] / 1e6:.1f} MB), {c['workers']} workers, batch {c['batch_size']}; steady state "
        "(difference of a short and a long run of warm epochs), CPU of every process",
        f"{'row':20} {'samples/s':>9} {'smp/CPU-s':>9} {'CPU-s/GB':>8} {'us/smp train':>12} {'us/smp workers':>14} "
        f"{'vs torch':>8} {'vs floor':>8} {'epochs':>6} {'CPU-s':>6}",
    ]
    for x in r["rows"]:
        s = x["steady"]
        if s is None:
            continue
        us = s["us_per_sample"]
        lines.append(
            f"{x['name']:20} {_num(s['samples_per_s'], '9.0f')} {_num(s['samples_per_cpu_s'], '9.0f')} "
            f"{_num(s['cpu_s_per_GB'], '8.2f')} {_num(us['training'], '12.1f')} {_num(us['workers'], '14.1f')} "
            f"{_num(x['per_cpu_s_vs_torch'], '8.2f')} {_num(x['per_cpu_s_vs_floor'], '8.3f')} "
            f"{s['warm_epochs']:6d} {_num(s['cpu_s'], '6.2f')}"
        )
    for x in r["rows"]:
        if x["steady"] is not None:
            warm = ", ".join(_num(w["samples_per_cpu_s"], ".0f") for w in x["first_warm"])
            lines.append(
                f"  {x['name']}: first epoch {_num(x['first']['samples_per_cpu_s'], '.0f')} samples per CPU-s, "
                f"{_num(x['first']['samples_per_s'], '.0f')} samples/s; first warm epochs {warm} samples per CPU-s"
            )
    lines += [f"  {x['name']}: skipped: {x['skipped']}" for x in r["rows"] if x["skipped"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """``python -m stoker_lab.bench.bytes_only [--files N] [--json PATH] [--no-dlio]``: the measurement alone."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m stoker_lab.bench.bytes_only")
    p.add_argument("--files", type=int, default=BytesOnlyConfig.files)
    p.add_argument("--dlio", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--make-dlio-venv", action="store_true")
    p.add_argument("--workdir")
    p.add_argument("--json")
    a = p.parse_args(sys.argv[1:] if argv is None else argv)
    r = run(BytesOnlyConfig(files=a.files, dlio=a.dlio, make_venv=a.make_dlio_venv, workdir=a.workdir))
    print(table(r))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(r, f, indent=1)


if __name__ == "__main__":
    main()
