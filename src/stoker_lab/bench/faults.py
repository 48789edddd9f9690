"""`stoker bench faults`: every fault scenario, measured the same way, in bounded time.

Setup: a dataset whose labels are the sample indexes (packed from a file list of the bundled
photographs, small shards) is uploaded to the emulated S3 origin
(:class:`stoker_lab.bench.origin.LocalS3Origin`); the loaders read it through stoker's own
fault-injecting proxy (:class:`stoker_lab.bench.faultproxy.FaultProxy`). Each scenario runs its
training process as a child (:mod:`stoker_lab.bench.faults_child`) in its own session with a hard
timeout, so a hang is reported as ``"hang"`` and never hangs the bench. Exhaustion cases mount
a small tmpfs in a private mount namespace (``unshare -m``; root only, otherwise
``"skipped"`` with the reason). The non-loader cases (cache ownership, concurrent pack, stray
ImageFolder folders, warm-up) are in :mod:`stoker_lab.bench.fault_cases`, the lifecycle cases in
:mod:`stoker_lab.bench.fault_lifecycle`, an ``http://`` origin that compresses or stalls and a
packer whose clock runs ahead in :mod:`stoker_lab.bench.fault_origins`, and a cluster job's
checkpoint resumed at another world size or placement in :mod:`stoker_lab.bench.fault_resume`.

Per scenario (JSON list ``scenarios``): ``scenario``, ``faults_injected`` (faults the proxy or
the bench really injected), ``outcome`` (``completed``, ``clean_error``, ``failed``, ``hang``,
``signal_death`` or ``skipped``; over several rounds the worst), ``outcomes`` (count per
outcome), ``expected`` (``|`` separates acceptable outcomes), ``samples_lost``,
``samples_duplicated``, ``signal_deaths``, ``leftover_files``, ``leftover_shm`` (counts),
``overhead_s`` (mean seconds of the rounds that completed minus the clean run's, None when none
completed; the issue's "overhead"),
``seconds`` (wall, whole scenario), ``ok`` and ``details`` (errors, leftover paths, ...).
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import sys
import tempfile
import time

from .fault_harness import LoaderRunner, Scenario, finish
from .faultproxy import Fault, FaultProxy


def loader_scenarios(quick: bool) -> list[Scenario]:
    """The loader scenarios, in run order (``clean`` first: every overhead is against it)."""
    kills = 5 if quick else 20
    w0 = {"loader_kw": {"num_workers": 0}}
    return [
        Scenario("clean"),
        Scenario("origin_503_burst_1.5s", fault=Fault("status", 503, burst_s=1.5)),
        Scenario("origin_500_burst_1s", fault=Fault("status", 500, burst_s=1.0)),
        Scenario("origin_500_burst_5s", fault=Fault("status", 500, burst_s=5.0), quick=False),
        Scenario("origin_503_sustained", "clean_error", fault=Fault("status", 503), timeout_s=180, quick=False),
        Scenario("conn_reset_mid_body", fault=Fault("reset", every=3, count=8)),
        Scenario("truncated_body", fault=Fault("truncate", every=3, count=8), quick=False),
        Scenario(
            "stalled_get_20s",
            fault=Fault("stall", count=1, stall_s=20.0),
            spec={"loader_kw": {"timeout_s": 15.0}},
            timeout_s=120,
        ),
        Scenario(
            "sigkill_prefetcher",
            "completed",
            spec={"kill": {"target": "prefetcher", "rounds": kills}, "must_name": ["prefetch"]},
            timeout_s=60 + 15 * kills,
        ),
        Scenario(
            "sigkill_worker",
            "completed",
            spec={"kill": {"target": "worker", "rounds": kills}, "must_name": ["worker"]},
            timeout_s=60 + 15 * kills,
        ),
        Scenario(
            "fork_after_async",
            "completed|clean_error",
            repeat=1 if quick else 2,
            timeout_s=90,
            spec={
                "pre": "obstore_busy_thread",
                "must_name": ["fork", "spawn", "forkserver"],
                "loader_kw": {"timeout_s": 20.0},
            },
        ),
        Scenario(
            "cache_disk_smaller_than_budget",
            mount=("3m", "cache"),
            spec={"open_kw": {"cache_bytes": 1 << 30}, "epochs": 2},
        ),
        Scenario(
            "cache_disk_smaller_than_budget_w0",
            mount=("3m", "cache"),
            spec={"open_kw": {"cache_bytes": 1 << 30}, "epochs": 2, **w0},
            quick=False,
        ),
        Scenario(
            "small_dev_shm",
            "completed|clean_error",
            mount=("4m", "shm"),
            spec={"loader_kw": {"batch_size": 16, "image_size": 224}, "must_name": ["/dev/shm"]},
        ),
        Scenario(
            "small_dev_shm_w0",
            "completed|clean_error",
            mount=("4m", "shm"),
            quick=False,
            spec={"loader_kw": {"batch_size": 16, "image_size": 224, "num_workers": 0}, "must_name": ["/dev/shm"]},
        ),
        Scenario(
            "small_dev_shm_memory_tier",
            mount=("4m", "shm"),
            quick=False,
            spec={"open_kw": {"memory_bytes": 64 << 20}, "loader_kw": {"batch_size": 8}},
        ),
    ]


def make_dataset(work: str, images: int) -> tuple[str, int]:
    """Pack ``images`` bundled photographs, label = sample index, into ``work/packed``
    (256 KiB shards, so several shards and cache blocks). Returns (local path, samples)."""
    from stoker.store.pack import pack

    from ..sample_data import make_sample_data

    raw = os.path.join(work, "raw")
    make_sample_data(raw, images=images, classes=4, seed=0, workers=1)
    files = sorted(os.path.join(d, f) for d, _, fs in os.walk(os.path.join(raw, "train")) for f in fs)
    listing = os.path.join(work, "list.csv")
    with open(listing, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["path", "label", "key"])
        for i, p in enumerate(files):
            w.writerow([p, i, f"s{i:05d}"])
    dst = os.path.join(work, "packed")
    shutil.rmtree(dst, ignore_errors=True)
    pack(listing, dst, shard_bytes=256 << 10, progress=False, source="filelist")
    return dst, len(files)


def run(
    json_path: str | None = None,
    quick: bool = False,
    only: list[str] | None = None,
    images: int | None = None,
    workdir: str | None = None,
    ray: bool = True,
    log=None,
) -> dict:
    """Run the scenarios (all, or those named in ``only``; ``quick``: the short list, fewer
    SIGKILL rounds) and return ``{"scenarios": [rows], "config", "cores", "seconds"}``; also
    written to ``json_path``. ``images``: dataset samples (default 96, 64 with ``quick``);
    ``ray``: include the warm-up scenario (starts a local Ray). Raises ValueError for an
    unknown name in ``only``."""
    from . import fault_cases, fault_lifecycle, fault_origins, fault_resume
    from .origin import LocalS3Origin, upload_tree

    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    t_all = time.perf_counter()
    loader_sc = loader_scenarios(quick)
    cases = {**fault_cases.CASES, **fault_lifecycle.CASES, **fault_origins.CASES, **fault_resume.CASES}
    names = [s.name for s in loader_sc] + list(cases)
    unknown = sorted(set(only or []) - set(names))
    if unknown:
        raise ValueError(f"unknown scenario(s) {unknown}; known: {names}")
    want = lambda name, in_quick: (name in only) if only else (in_quick or not quick)  # noqa: E731
    images = images or (64 if quick else 96)
    work = workdir or tempfile.mkdtemp(prefix="stoker-bench-faults-")
    os.makedirs(work, exist_ok=True)
    rows: list[dict] = []
    report = {
        "scenarios": rows,
        "cores": os.cpu_count(),
        "config": {"images": images, "quick": quick, "only": only, "workdir": work},
    }
    local, n = make_dataset(work, images)
    with LocalS3Origin(latency_ms=2.0, bandwidth_MBps=0) as origin, FaultProxy(origin.endpoint_url) as proxy:
        upload_tree(local, origin.url("ds"), origin.storage_options(throttled=False))
        opts = dict(origin.storage_options(), endpoint_url=proxy.endpoint_url)
        runner = LoaderRunner(work, origin.url("ds"), opts, n, proxy)
        report["config"].update(
            samples=n, dataset_bytes=sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(local) for f in fs)
        )
        clean_s = None
        for sc in loader_sc:
            if not (want(sc.name, sc.quick) or sc.name == "clean"):
                continue
            log(f"bench faults: {sc.name} ...")
            row = runner.run(sc)
            if sc.name == "clean":
                secs = row.get("_round_s") or []
                clean_s = sum(secs) / len(secs) if secs else None
            rows.append(finish(row, clean_s))
            log(f"bench faults: {sc.name}: {row['outcome']} (expected {row['expected']}) in {row['seconds']} s")
        ctx = fault_cases.Context(
            work=work,
            local=local,
            n_samples=n,
            origin=origin,
            proxy=proxy,
            url=origin.url("ds"),
            storage_options=opts,
            quick=quick,
            ray=ray,
        )
        for name, (fn, in_quick) in cases.items():
            if not want(name, in_quick):
                continue
            log(f"bench faults: {name} ...")
            t0 = time.perf_counter()
            row = fn(ctx)
            row["seconds"] = round(time.perf_counter() - t0, 2)
            rows.append(finish(row, clean_s))
            log(f"bench faults: {name}: {row['outcome']} (expected {row['expected']}) in {row['seconds']} s")
    report["seconds"] = round(time.perf_counter() - t_all, 1)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(report, f, indent=2)
    if not workdir:
        shutil.rmtree(work, ignore_errors=True)
    return report


def table(report: dict) -> str:
    """The report as a Markdown table (the "Faults" table of benchmarks/README.md)."""
    cols = (
        "scenario",
        "faults_injected",
        "outcome",
        "expected",
        "samples_lost",
        "samples_duplicated",
        "signal_deaths",
        "leftover_files",
        "leftover_shm",
        "overhead_s",
    )
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in report["scenarios"]:
        lines.append("| " + " | ".join("" if r.get(c) is None else str(r.get(c)) for c in cols) + " |")
    return "\n".join(lines)
