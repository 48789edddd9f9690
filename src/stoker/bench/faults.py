"""`stoker bench faults`: every fault scenario, measured the same way, in bounded time.

Setup: a dataset whose labels are the sample indexes (packed from a file list of the bundled
photographs, small shards) is uploaded to the emulated S3 origin
(:class:`stoker.bench.origin.LocalS3Origin`); the loaders read it through stoker's own
fault-injecting proxy (:class:`stoker.bench.faultproxy.FaultProxy`). Each scenario runs its
training process as a child (:mod:`stoker.bench.faults_child`) in its own session with a hard
timeout, so a hang is reported as ``"hang"`` and never hangs the bench. Exhaustion cases mount
a small tmpfs in a private mount namespace (``unshare -m``; root only, otherwise
``"skipped"`` with the reason). The non-loader cases (cache ownership, concurrent pack, stray
ImageFolder folders, warm-up) are in :mod:`stoker.bench.fault_cases`.

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
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

from .faultproxy import Fault, FaultProxy
from .faults_child import scan_leftovers, shm_entries, shm_leftovers

_SRC_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_WORST = ("signal_death", "hang", "failed", "skipped", "clean_error", "completed")


@dataclass
class Scenario:
    """One loader scenario: the proxy's ``fault``, overrides of the child's spec, a tmpfs
    (``mount``: (size, where); where is ``"shm"`` or ``"cache"``), ``timeout_s`` (hard limit for
    the child, seconds), ``repeat`` (separate child runs)."""

    name: str
    expected: str = "completed"
    fault: Fault | None = None
    spec: dict = field(default_factory=dict)
    mount: tuple[str, str] | None = None
    timeout_s: float = 120.0
    repeat: int = 1
    quick: bool = True  # part of --quick


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
        Scenario("stalled_get_20s", fault=Fault("stall", count=1, stall_s=20.0),
                 spec={"loader_kw": {"timeout_s": 15.0}}, timeout_s=120),
        Scenario("sigkill_prefetcher", "completed|clean_error",
                 spec={"kill": {"target": "prefetcher", "rounds": kills}, "must_name": ["prefetch"]}, timeout_s=60 + 15 * kills),
        Scenario("sigkill_worker", "completed|clean_error",
                 spec={"kill": {"target": "worker", "rounds": kills}, "must_name": ["worker"]}, timeout_s=60 + 15 * kills),
        Scenario("fork_after_async", "completed|clean_error", repeat=1 if quick else 2, timeout_s=90,
                 spec={"pre": "obstore_busy_thread", "must_name": ["fork", "spawn", "forkserver"],
                       "loader_kw": {"timeout_s": 20.0}}),
        Scenario("cache_disk_smaller_than_budget", mount=("3m", "cache"),
                 spec={"open_kw": {"cache_bytes": 1 << 30}, "epochs": 2}),
        Scenario("cache_disk_smaller_than_budget_w0", mount=("3m", "cache"),
                 spec={"open_kw": {"cache_bytes": 1 << 30}, "epochs": 2, **w0}, quick=False),
        Scenario("small_dev_shm", "completed|clean_error", mount=("4m", "shm"),
                 spec={"loader_kw": {"batch_size": 16, "image_size": 224}, "must_name": ["/dev/shm"]}),
        Scenario("small_dev_shm_w0", "completed|clean_error", mount=("4m", "shm"), quick=False,
                 spec={"loader_kw": {"batch_size": 16, "image_size": 224, "num_workers": 0},
                       "must_name": ["/dev/shm"]}),
        Scenario("small_dev_shm_memory_tier", mount=("4m", "shm"), quick=False,
                 spec={"open_kw": {"memory_bytes": 64 << 20}, "loader_kw": {"batch_size": 8}}),
    ]


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def run_child(argv: list[str], timeout_s: float, env: dict | None = None) -> tuple[int | None, str]:
    """Run ``argv`` in its own session; on timeout SIGKILL its process group. Returns
    (return code, or None on timeout; last 2000 characters of stderr)."""
    with tempfile.TemporaryFile() as err:
        p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                             start_new_session=True, env=env)
        try:
            rc = p.wait(timeout_s)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
            rc = None
        err.seek(0)
        text = err.read().decode(errors="replace")
        fatal = [ln for ln in text.splitlines() if ln.startswith("Fatal Python error")][:1]
        return rc, "\n".join(fatal + [text[-2000:]])


def child_env() -> dict:
    """The environment for children: this checkout's ``src`` first on PYTHONPATH."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [_SRC_DIR, env.get("PYTHONPATH")]))
    return env


def aggregate(name: str, expected: str, rounds: list[dict], extra_faults: int = 0) -> dict:
    """One report row from per-round records (see the module docstring); ``extra_faults``: faults
    injected outside the rounds (by the proxy)."""
    outcomes: dict[str, int] = {}
    for r in rounds:
        outcomes[r["outcome"]] = outcomes.get(r["outcome"], 0) + 1
    outcome = next((o for o in _WORST if o in outcomes), "failed")
    row = {"scenario": name, "faults_injected": extra_faults + sum(r.get("faults_injected", 0) for r in rounds),
           "outcome": outcome, "outcomes": outcomes, "expected": expected,
           "samples_lost": sum(r.get("lost", 0) for r in rounds),
           "samples_duplicated": sum(r.get("duplicated", 0) for r in rounds),
           "signal_deaths": sum(r.get("signal_deaths", 0) for r in rounds),
           "leftover_files": 0, "leftover_shm": 0, "overhead_s": None, "seconds": 0.0, "details": {}}
    errors = sorted({r["error"] for r in rounds if r.get("error")})
    if errors:
        row["details"]["errors"] = errors[:5]
    # overhead is the cost of riding a fault out: only rounds that completed are comparable with the clean run
    row["_round_s"] = [r["seconds"] for r in rounds if "seconds" in r and r["outcome"] == "completed"]
    return row


def finish(row: dict, clean_s: float | None) -> dict:
    """Fill ``overhead_s`` and ``ok`` of a row."""
    secs = row.pop("_round_s", [])
    if secs and clean_s is not None:
        row["overhead_s"] = round(sum(secs) / len(secs) - clean_s, 3)
    row["ok"] = (row["outcome"] in row["expected"].split("|") and not row["samples_lost"]
                 and not row["samples_duplicated"] and not row["signal_deaths"]
                 and not row["leftover_files"] and not row["leftover_shm"]
                 and not row["details"].get("problems"))
    return row


class LoaderRunner:
    """Runs :class:`Scenario` s against one dataset behind one fault proxy."""

    def __init__(self, work: str, url: str, storage_options: dict, n_samples: int, proxy: FaultProxy):
        self.work, self.url, self.opts, self.n, self.proxy = work, url, storage_options, n_samples, proxy
        self.base = {"url": url, "storage_options": storage_options, "n_samples": n_samples, "epochs": 1,
                     "open_kw": {"cache_bytes": 256 << 20},
                     "loader_kw": {"batch_size": 16, "num_workers": 2, "transform": "eval", "image_size": 32,
                                   "timeout_s": 30.0, "seed": 0},
                     "must_name": [url, "shards/", "/dev/shm"]}  # + the cache directory: what a cause names

    def run(self, sc: Scenario) -> dict:
        """Run ``sc``; returns its report row (before :func:`finish`)."""
        if sc.mount and os.geteuid() != 0:
            return {**aggregate(sc.name, sc.expected, []), "outcome": "skipped",
                    "details": {"reason": "needs root for unshare -m and a tmpfs mount"}}
        if sc.mount and shutil.which("unshare") is None:
            return {**aggregate(sc.name, sc.expected, []), "outcome": "skipped",
                    "details": {"reason": "unshare(1) not found"}}
        t0 = time.perf_counter()
        rounds, faults, extra = [], 0, {}
        for rep in range(sc.repeat):
            rec, f, more = self._once(sc, rep)
            rounds += rec
            faults += f
            for k, v in more.items():
                extra[k] = extra.get(k, 0) + v if isinstance(v, int) else v
        row = aggregate(sc.name, sc.expected, rounds, faults)
        row["leftover_files"] = extra.pop("leftover_files", 0)
        row["leftover_shm"] = extra.pop("leftover_shm", 0)
        row["details"].update(extra)
        row["seconds"] = round(time.perf_counter() - t0, 2)
        return row

    def _once(self, sc: Scenario, rep: int) -> tuple[list[dict], int, dict]:
        d = os.path.join(self.work, "runs", f"{sc.name}-{rep}")
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(d)
        cache_dir = sc.spec.get("cache_dir") or (
            os.path.join(d, "disk", "cache") if sc.mount and sc.mount[1] == "cache" else os.path.join(d, "cache"))
        spec = _merge(self.base, sc.spec)
        spec.update(cache_dir=cache_dir, result=os.path.join(d, "result.json"), seed=rep,
                    scan_in_child=bool(sc.mount), scan_dirs=[cache_dir])
        spec["must_name"] = list(spec["must_name"]) + [cache_dir]
        with open(os.path.join(d, "spec.json"), "w") as f:
            json.dump(spec, f)
        argv = [sys.executable, "-m", "stoker.bench.faults_child", os.path.join(d, "spec.json")]
        if sc.mount:
            size, where = sc.mount
            target = "/dev/shm" if where == "shm" else os.path.join(d, "disk")
            os.makedirs(target, exist_ok=True)
            script = f"mount -t tmpfs -o size={size} tmpfs {target} && exec " + " ".join(argv)
            argv = ["unshare", "-m", "sh", "-c", script]
        shm_before = shm_entries()
        before = self.proxy.stats()["faults_injected"]
        self.proxy.set_fault(sc.fault)
        try:
            rc, err = run_child(argv, sc.timeout_s, child_env())
        finally:
            self.proxy.set_fault(None)
        faults = (self.proxy.stats()["faults_injected"] - before  # + the small tmpfs, the runtime started first
                  + (1 if sc.mount else 0) + (1 if spec.get("pre") else 0))
        try:
            with open(spec["result"]) as f:
                res = json.load(f)
        except (OSError, ValueError):
            res = {"rounds": []}
        rounds = res["rounds"]
        extra: dict = {}
        if rc is None or rc < 0 or not res.get("done"):
            how = ("hang" if rc is None else "signal_death" if rc < 0 else "failed")
            fatal = [ln for ln in err.splitlines() if "Fatal Python error" in ln or "Bus error" in ln]
            rounds.append({"outcome": how, "signal_deaths": int(rc is not None and rc < 0),
                           "error": f"training process: {'timed out after %ss' % sc.timeout_s if rc is None else 'exit code %s' % rc}"
                                    f"; stderr: {(fatal[0] if fatal else err.strip()[-300:])[:300]}"})
        pids = {p for r in rounds for p in r.get("pids", [])} | ({res["pid"]} if "pid" in res else set())
        if sc.mount:
            files, shm = res.get("leftover_files", []), res.get("leftover_shm", [])
            if not res.get("done"):
                extra["leftovers_unmeasured"] = "the training process did not finish inside its namespace"
        else:
            from ..cache.tiered import default_memory_root
            files = scan_leftovers([cache_dir])
            shm = shm_leftovers(shm_before, pids=pids,
                                tiers=[default_memory_root(c) for c in _cache_roots(cache_dir, spec)])
        extra["leftover_files"], extra["leftover_shm"] = len(files), len(shm)
        if files or shm:
            extra["leftover_paths"] = (files + shm)[:10]
        from ..cache.tiered import default_memory_root
        for root in _cache_roots(cache_dir, spec):  # this run's caches are temporary: so are their memory tiers
            shutil.rmtree(default_memory_root(root), ignore_errors=True)
        return rounds, faults, extra


def _cache_roots(cache_dir: str, spec: dict) -> list[str]:
    """The cache directories a child uses: ``cache_dir``, or one per SIGKILL round under it."""
    rounds = (spec.get("kill") or {}).get("rounds", 1)
    return [cache_dir] + [os.path.join(cache_dir, f"round-{i}") for i in range(rounds if rounds > 1 else 0)]


def make_dataset(work: str, images: int) -> tuple[str, int]:
    """Pack ``images`` bundled photographs, label = sample index, into ``work/packed``
    (256 KiB shards, so several shards and cache blocks). Returns (local path, samples)."""
    from .sample_data import make_sample_data
    from ..store.pack import pack
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


def run(json_path: str | None = None, quick: bool = False, only: list[str] | None = None,
        images: int | None = None, workdir: str | None = None, ray: bool = True, log=None) -> dict:
    """Run the scenarios (all, or those named in ``only``; ``quick``: the short list, fewer
    SIGKILL rounds) and return ``{"scenarios": [rows], "config", "cores", "seconds"}``; also
    written to ``json_path``. ``images``: dataset samples (default 96, 64 with ``quick``);
    ``ray``: include the warm-up scenario (starts a local Ray). Raises ValueError for an
    unknown name in ``only``."""
    from . import fault_cases
    from .origin import LocalS3Origin, upload_tree
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    t_all = time.perf_counter()
    loader_sc = loader_scenarios(quick)
    cases = fault_cases.CASES
    names = [s.name for s in loader_sc] + list(cases)
    unknown = sorted(set(only or []) - set(names))
    if unknown:
        raise ValueError(f"unknown scenario(s) {unknown}; known: {names}")
    want = lambda name, in_quick: (name in only) if only else (in_quick or not quick)  # noqa: E731
    images = images or (64 if quick else 96)
    work = workdir or tempfile.mkdtemp(prefix="stoker-bench-faults-")
    os.makedirs(work, exist_ok=True)
    rows: list[dict] = []
    report = {"scenarios": rows, "cores": os.cpu_count(),
              "config": {"images": images, "quick": quick, "only": only, "workdir": work}}
    local, n = make_dataset(work, images)
    with LocalS3Origin(latency_ms=2.0, bandwidth_MBps=0) as origin, FaultProxy(origin.endpoint_url) as proxy:
        upload_tree(local, origin.url("ds"), origin.storage_options(throttled=False))
        opts = dict(origin.storage_options(), endpoint_url=proxy.endpoint_url)
        runner = LoaderRunner(work, origin.url("ds"), opts, n, proxy)
        report["config"].update(samples=n, dataset_bytes=sum(
            os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(local) for f in fs))
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
        ctx = fault_cases.Context(work=work, local=local, n_samples=n, origin=origin, proxy=proxy,
                                  url=origin.url("ds"), storage_options=opts, quick=quick, ray=ray)
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
    """The report as a Markdown table (the README's "Faults" table)."""
    cols = ("scenario", "faults_injected", "outcome", "expected", "samples_lost", "samples_duplicated",
            "signal_deaths", "leftover_files", "leftover_shm", "overhead_s")
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in report["scenarios"]:
        lines.append("| " + " | ".join("" if r.get(c) is None else str(r.get(c)) for c in cols) + " |")
    return "\n".join(lines)
