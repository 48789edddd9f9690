"""`stoker bench peers`: one run, one dataset, one origin, one transform, every loader.

Steps: make the demo's real-photo ImageFolder set; convert it once into each loader's own
format with the loader's own tool (stoker pack, the raw tree for torch and Ray Data, WebDataset
``ShardWriter`` tars, Streaming ``MDSWriter`` shards, LitData ``optimize`` chunks, DALI
``wds2idx`` indexes over WebDataset tars, the same tars for SPDL), after installing the system
packages a peer needs that pip cannot (SPDL's FFmpeg libraries: :mod:`stoker_lab.bench.sysdeps`,
``scripts/system_deps.sh spdl``); start the emulated remote origin (moto S3 behind
the throttling proxy, :class:`stoker_lab.bench.origin.LocalS3Origin`) and upload every format to it
(unthrottled); then run each loader in a subprocess of its own Python for ``epochs`` epochs
from an empty cache, with the same workers, batch size and emulated accelerator, collecting
one JSON line per epoch. A loader that cannot be installed, converted or run is recorded in
``skipped`` with the reason (the tail of its stderr), never dropped. Each loader's versions,
settings, recipe and what it has of a cache and of resume are recorded under ``peers``.

``device="cuda"`` runs the accelerator comparison instead: stoker with
``ImageOptions(decode_device="cuda")`` against DALI's GPU pipeline (``decoders.image(device=
"mixed")``) on the same files; :func:`cuda_missing` says why it cannot run on a machine without a
CUDA GPU.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

from ..sysdeps import ensure_system_packages
from ..venvs import run_json_lines, stderr_tail

LOADERS = ("stoker", "torch", "webdataset", "streaming", "litdata", "dali", "spdl", "ray_data", "ray_data+stoker")
GPU_LOADERS = ("stoker", "dali")  # the loaders of device="cuda"
_VENV = {"streaming": "streaming", "litdata": "litdata", "dali": "dali", "spdl": "spdl"}
_ON_WDS_TARS = ("dali", "spdl")  # loaders that read the WebDataset tars (made by webdataset's conversion)
_IMPORTS = {
    "webdataset": "webdataset",
    "ray_data": "ray.data",
    "ray_data+stoker": "ray.data",
}  # modules a main-Python loader needs beyond stoker
_HERE = os.path.dirname(os.path.abspath(__file__))


@dataclass
class PeersConfig:
    """Benchmark parameters. Bytes in bytes, rates in samples/s, latency in ms, bandwidth in
    MB/s (1e6 B/s), timeouts in seconds. ``consumer_rate``: the emulated accelerator (a sleep of
    batch/rate per batch; above every loader's decode bound here, so samples/s measures the
    loader and ``stall_fraction`` the accelerator time it loses). ``make_venvs``: create missing
    peer environments and, as root with apt-get, install the system packages a peer needs
    (:func:`stoker_lab.bench.sysdeps.ensure_system_packages`; False: skip those peers, with the
    reason and the command that would install them). ``device``: "cpu", or "cuda"
    for the accelerator comparison (``loaders`` then defaults to :data:`GPU_LOADERS`). ``retries``:
    a loader whose run fails is run again from an empty cache up to this many times; each failure
    is kept in the report's ``failures`` (and the table), only the last attempt's rows in ``runs``."""

    images: int = 5000
    classes: int = 20
    epochs: int = 3
    loaders: tuple = LOADERS
    workers: int = 2
    batch_size: int = 64
    consumer_rate: float = 2000.0
    latency_ms: float = 20.0
    bandwidth_MBps: float = 100.0
    seed: int = 0
    shard_bytes: int = 64 << 20
    wds_shard_bytes: int = 20_000_000
    dali_source: str = "local"
    device: str = "cpu"
    retries: int = 1
    make_venvs: bool = True
    run_timeout_s: float = 1800.0
    workdir: str | None = None
    json_path: str | None = None
    plot_path: str | None = None


def cuda_missing() -> str | None:
    """Why ``device="cuda"`` cannot run on this machine, in one line; None when torch sees a CUDA GPU."""
    try:
        import torch
    except ImportError as exc:
        return f"torch is not importable here ({exc})"
    if not torch.cuda.is_available():
        return f"no CUDA GPU is visible to torch {torch.__version__} (torch.cuda.is_available() is False)"
    return None


def _log(msg: str) -> None:
    print(f"[peers {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def slug(loader: str) -> str:
    """``loader`` as a file name and an origin prefix: ``ray_data+stoker`` -> ``ray_data_stoker``."""
    return loader.replace("+", "_")


def _runner(loader: str) -> str:
    return os.path.join(_HERE, f"run_{slug(loader)}.py")


def _python_for(loader: str, cfg: PeersConfig) -> str:
    """The Python that runs ``loader``; raises RuntimeError (the reason) if there is none."""
    from ..venvs import VenvError, ensure_venv, ready_venv, venv_root

    if loader not in _VENV:
        mod = _IMPORTS.get(loader)
        if mod:
            r = subprocess.run([sys.executable, "-c", f"import {mod}"], capture_output=True, text=True, timeout=120)
            if r.returncode:
                raise RuntimeError(
                    f"cannot import {mod} in stoker's Python: {stderr_tail(r.stderr, 2)} "
                    f"(pip install -e '.[dev]' in the stoker checkout, or {mod.split('.')[0]})"
                )
        return sys.executable
    name = _VENV[loader]
    if not cfg.make_venvs:
        py = ready_venv(name)
        if py is None:
            raise RuntimeError(
                f"its virtual environment {os.path.join(venv_root(), name)} is not present "
                "and making environments is off"
            )
        return py
    try:
        return ensure_venv(name, log=_log)
    except VenvError as exc:
        raise RuntimeError(f"could not install: {exc}") from None


def _dir_bytes(path: str) -> tuple[int, int]:
    files = [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]
    return len(files), sum(os.path.getsize(f) for f in files)


def _env(origin) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    so = origin.storage_options(throttled=True) if origin else {}
    env.update(
        AWS_ACCESS_KEY_ID=so.get("key", "testing"),
        AWS_SECRET_ACCESS_KEY=so.get("secret", "testing"),
        AWS_DEFAULT_REGION="us-east-1",
        AWS_REGION="us-east-1",
        AWS_CONFIG_FILE=os.devnull,
        AWS_SHARED_CREDENTIALS_FILE=os.devnull,
        PYTHONUNBUFFERED="1",
    )
    return env


def _convert(loader: str, py: str, src: str, out: str, cfg: PeersConfig, work: str, env: dict) -> dict:
    """Convert ``src`` into ``loader``'s format at ``out``; returns {convert_seconds, files, bytes}."""
    shutil.rmtree(out, ignore_errors=True)
    conf = os.path.join(work, f"convert-{loader}.json")
    with open(conf, "w") as f:
        json.dump({"shard_bytes": cfg.shard_bytes, "wds_shard_bytes": cfg.wds_shard_bytes, "workers": cfg.workers}, f)
    rows, why = run_json_lines(
        [py, _runner(loader), "convert", src, out, conf],
        env,
        cfg.run_timeout_s,
        os.path.join(work, f"convert-{loader}.log"),
    )
    if why:
        raise RuntimeError(f"conversion failed: {why}")
    seconds = sum(r["seconds"] for r in rows if r.get("kind") == "convert")
    if loader == "dali":  # DALI's format: WebDataset tars plus its own index files
        for name in os.listdir(src):
            os.link(os.path.join(src, name), os.path.join(out, name))
    files, nbytes = _dir_bytes(out)
    return {"convert_seconds": seconds, "files": files, "bytes": nbytes}


def _presign(origin, keys: list[str], expires_s: int = 86400) -> list[str]:
    import boto3

    so = origin.storage_options(throttled=True)
    client = boto3.client(
        "s3",
        endpoint_url=so["endpoint_url"],
        aws_access_key_id=so["key"],
        aws_secret_access_key=so["secret"],
        region_name="us-east-1",
    )
    return [
        client.generate_presigned_url("get_object", Params={"Bucket": origin.bucket, "Key": k}, ExpiresIn=expires_s)
        for k in keys
    ]


def _read_config(loader: str, cfg: PeersConfig, origin, fmt_dir: str, cache_dir: str) -> dict:
    names = sorted(os.listdir(fmt_dir))
    c = {
        "loader": loader,
        "epochs": cfg.epochs,
        "batch_size": cfg.batch_size,
        "workers": cfg.workers,
        "seed": cfg.seed,
        "consumer_rate": cfg.consumer_rate,
        "cache_dir": cache_dir,
        "url": origin.url(slug(loader)),
        "storage_options": origin.storage_options(throttled=True),
        "control_url": origin.direct_url,
        "origin_pid": origin.pid,
        "dali_source": cfg.dali_source,
        "device": cfg.device,
    }
    if loader in ("stoker", "ray_data+stoker"):  # a node cache that holds the dataset
        c["cache_bytes"] = 2 * _dir_bytes(fmt_dir)[1] + (64 << 20)
    if loader == "webdataset":
        c["urls"] = _presign(origin, [f"{loader}/{n}" for n in names if n.endswith(".tar")])
    if loader in _ON_WDS_TARS:
        c["fetch"] = list(zip(_presign(origin, [f"{loader}/{n}" for n in names]), names))
    if loader == "dali":
        c["s3_tars"] = [origin.url(f"{loader}/{n}") for n in names if n.endswith(".tar")]
        c["s3_indexes"] = [t[:-4] + ".idx" for t in c["s3_tars"]]
    return c


def read_with_retries(read_once, epochs: int, retries: int) -> tuple[list[dict], str | None, list[dict]]:
    """Call ``read_once() -> (rows, why)`` until a run delivers ``epochs`` epoch rows without an
    error, at most ``1 + retries`` times. Returns (the last run's rows, why it failed or None, the
    failures before it: ``[{"attempt": n, "reason": ...}]``)."""
    failed: list[dict] = []
    for attempt in range(1 + max(0, retries)):
        rows, why = read_once()
        got = sum(1 for r in rows if r.get("kind") == "epoch")
        if not why and got == epochs:
            return rows, None, failed
        why = f"ran {got} of {epochs} epochs; " + (why or "no error reported")
        if attempt < retries:
            failed.append({"attempt": attempt, "reason": why})
    return rows, why, failed


def _read(loader: str, py: str, cfg: PeersConfig, origin, fmt_dir: str, work: str, env: dict, report: dict):
    """One read run of ``loader`` from an empty cache; returns (its JSON rows, why it failed or None)
    and appends the load averages around it to ``report["load"]``."""
    cache_dir = os.path.join(work, "cache", loader)
    shutil.rmtree(cache_dir, ignore_errors=True)
    conf = os.path.join(work, f"read-{loader}.json")
    with open(conf, "w") as f:
        json.dump(_read_config(loader, cfg, origin, fmt_dir, cache_dir), f)
    load = {"loader": loader, "before": list(os.getloadavg())}
    _log(f"{loader}: {cfg.epochs} epochs")
    rows, why = run_json_lines(
        [py, _runner(loader), "read", conf], env, cfg.run_timeout_s, os.path.join(work, f"read-{loader}.log")
    )
    load["after"] = list(os.getloadavg())
    report["load"].append(load)
    shutil.rmtree(cache_dir, ignore_errors=True)
    return rows, why


def run_peers(cfg: PeersConfig) -> dict:
    """Run the benchmark; returns the report (also written to ``cfg.json_path``):
    ``{runs: [{loader, epoch, samples_per_s, stall_fraction, cpu_s_per_1000, origin_bytes, ...}],
    formats: [{loader, convert_seconds, bytes, ...}], skipped: [{loader, reason}], ...}``."""
    from ...sample_data import make_sample_data
    from ..origin import ORIGIN_NICE, LocalS3Origin, upload_tree
    from ..report import save_report
    from .report import check_targets, print_table, write_plot

    unknown = set(cfg.loaders) - set(LOADERS)
    if unknown:
        raise ValueError(f"unknown loaders {sorted(unknown)}; choose from {', '.join(LOADERS)}")
    if cfg.device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {cfg.device!r}")
    if cfg.device == "cuda" and set(cfg.loaders) - set(GPU_LOADERS):
        raise ValueError(f"device='cuda' compares {' and '.join(GPU_LOADERS)} only, got {', '.join(cfg.loaders)}")
    work = cfg.workdir or os.path.join(tempfile.gettempdir(), "stoker-bench-peers")
    os.makedirs(work, exist_ok=True)
    report: dict = {
        "machine": {
            "cores": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
            "loadavg_start": list(os.getloadavg()),
        },
        "origin": {
            "latency_ms": cfg.latency_ms,
            "bandwidth_MBps": cfg.bandwidth_MBps,
            "server": "moto S3 on 127.0.0.1 behind a throttling TCP proxy (same machine)",
            "server_nice": ORIGIN_NICE,
        },
        "config": {k: v for k, v in asdict(cfg).items() if k not in ("json_path", "plot_path", "workdir")},
        "runs": [],
        "setup": [],
        "formats": [],
        "skipped": [],
        "load": [],
        "peers": {},
        "failures": [],
    }
    report["config"]["loaders"] = list(cfg.loaders)
    sd = make_sample_data(os.path.join(work, "data"), images=cfg.images, classes=cfg.classes, seed=cfg.seed)
    src = os.path.join(work, "data", "train")
    report["dataset"] = {
        "images": sd["images"],
        "classes": sd["classes"],
        "bytes": sd["bytes"],
        "mean_sample_bytes": sd["bytes"] / max(1, sd["images"]),
    }
    _log(f"sample data: {sd['images']} images, {sd['bytes'] / 1e6:.1f} MB")

    def skip(loader: str, reason: str) -> None:
        report["skipped"].append({"loader": loader, "reason": reason})
        _log(f"skipped {loader}: {reason}")

    env = _env(None)
    pythons, fmt_dirs, formats_by = {}, {}, {}
    wds_tars = None  # (folder, seconds) of the WebDataset tars made for DALI and SPDL
    wanted = list(cfg.loaders)
    for loader in wanted:
        try:
            ensure_system_packages(loader, cfg.make_venvs, log=_log)
            pythons[loader] = _python_for(loader, cfg)
        except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
            skip(loader, str(exc))
    for loader in [lo for lo in wanted if lo in pythons]:
        out = os.path.join(work, "formats", loader)
        try:
            source = src
            if loader in _ON_WDS_TARS:  # DALI and SPDL read WebDataset tars; made here if webdataset did not run
                if "webdataset" in fmt_dirs:
                    wds_tars = (fmt_dirs["webdataset"], formats_by["webdataset"]["convert_seconds"])
                elif wds_tars is None:
                    wds_dir = os.path.join(work, "formats", "wds-tars")
                    made = _convert("webdataset", _python_for("webdataset", cfg), src, wds_dir, cfg, work, env)
                    wds_tars = (wds_dir, made["convert_seconds"])
                source = wds_tars[0]
            fmt = _convert(loader, pythons[loader], source, out, cfg, work, env)
            if loader in _ON_WDS_TARS:
                fmt["convert_seconds"] += wds_tars[1]
        except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
            skip(loader, str(exc))
            continue
        fmt_dirs[loader] = out
        formats_by[loader] = fmt
        report["formats"].append({"loader": loader, **fmt})
        _log(
            f"{loader}: converted in {fmt['convert_seconds']:.1f} s, {fmt['files']} files, {fmt['bytes'] / 1e6:.1f} MB"
        )

    with LocalS3Origin(latency_ms=cfg.latency_ms, bandwidth_MBps=cfg.bandwidth_MBps) as origin:
        env = _env(origin)
        _log(f"origin {origin.endpoint_url} (latency {cfg.latency_ms} ms, {cfg.bandwidth_MBps} MB/s)")
        for fmt in report["formats"]:
            up = upload_tree(
                fmt_dirs[fmt["loader"]], origin.url(slug(fmt["loader"])), origin.storage_options(throttled=False)
            )
            fmt["upload_seconds"] = up["seconds"]
        for loader in [lo for lo in wanted if lo in fmt_dirs]:
            rows, why, failed = read_with_retries(
                lambda lo=loader: _read(lo, pythons[lo], cfg, origin, fmt_dirs[lo], work, env, report),
                cfg.epochs,
                cfg.retries,
            )
            for f in failed:
                report["failures"].append({"loader": loader, **f})
                _log(f"{loader} failed (run again from an empty cache): {f['reason']}")
            for r in rows:
                kind = r.pop("kind", None)
                if kind == "epoch":
                    report["runs"].append({"loader": loader, **r})
                    _log(
                        f"  epoch {r['epoch']}: {r['samples_per_s']:.0f} samples/s, stall {r['stall_fraction']:.2f}, "
                        f"CPU {r['cpu_s_per_1000']:.2f} s/1000, origin {r['origin_bytes'] / 1e6:.1f} MB"
                    )
                elif kind == "setup":
                    report["peers"][loader] = r.pop("peer", {})
                    report["setup"].append({"loader": loader, **r})
            if why:
                skip(loader, why)
    report["machine"]["loadavg_end"] = list(os.getloadavg())
    report["checks"] = check_targets(report)
    print_table(report)
    save_report(report, cfg.json_path, cfg.plot_path, write_plot, _log)
    return report
