"""The machinery of `stoker bench faults` (:mod:`stoker_lab.bench.faults`): a scenario's description,
its training process run as a child with a hard timeout (:mod:`stoker_lab.bench.faults_child`), and one
report row aggregated from its rounds. The loader scenarios and the other cases
(:mod:`stoker_lab.bench.fault_cases`) are built on it.
"""

from __future__ import annotations

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


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def run_child(argv: list[str], timeout_s: float, env: dict | None = None) -> tuple[int | None, str]:
    """Run ``argv`` in its own session; on timeout SIGKILL its process group. Returns
    (return code, or None on timeout; last 2000 characters of stderr)."""
    with tempfile.TemporaryFile() as err:
        p = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True, env=env
        )
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
    row = {
        "scenario": name,
        "faults_injected": extra_faults + sum(r.get("faults_injected", 0) for r in rounds),
        "outcome": outcome,
        "outcomes": outcomes,
        "expected": expected,
        "samples_lost": sum(r.get("lost", 0) for r in rounds),
        "samples_duplicated": sum(r.get("duplicated", 0) for r in rounds),
        "signal_deaths": sum(r.get("signal_deaths", 0) for r in rounds),
        "leftover_files": 0,
        "leftover_shm": 0,
        "overhead_s": None,
        "seconds": 0.0,
        "details": {},
    }
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
    row["ok"] = (
        row["outcome"] in row["expected"].split("|")
        and not row["samples_lost"]
        and not row["samples_duplicated"]
        and not row["signal_deaths"]
        and not row["leftover_files"]
        and not row["leftover_shm"]
        and not row["details"].get("problems")
    )
    return row


class LoaderRunner:
    """Runs :class:`Scenario` s against one dataset behind one fault proxy."""

    def __init__(self, work: str, url: str, storage_options: dict, n_samples: int, proxy: FaultProxy):
        self.work, self.url, self.opts, self.n, self.proxy = work, url, storage_options, n_samples, proxy
        self.base = {
            "url": url,
            "storage_options": storage_options,
            "n_samples": n_samples,
            "epochs": 1,
            "open_kw": {"cache_bytes": 256 << 20},
            "loader_kw": {
                "batch_size": 16,
                "num_workers": 2,
                "transform": "eval",
                "image_size": 32,
                "timeout_s": 30.0,
                "seed": 0,
            },
            "must_name": [url, "shards/", "/dev/shm"],
        }  # + the cache directory: what a cause names

    def run(self, sc: Scenario) -> dict:
        """Run ``sc``; returns its report row (before :func:`finish`)."""
        if sc.mount and os.geteuid() != 0:
            return {
                **aggregate(sc.name, sc.expected, []),
                "outcome": "skipped",
                "details": {"reason": "needs root for unshare -m and a tmpfs mount"},
            }
        if sc.mount and shutil.which("unshare") is None:
            return {
                **aggregate(sc.name, sc.expected, []),
                "outcome": "skipped",
                "details": {"reason": "unshare(1) not found"},
            }
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
            os.path.join(d, "disk", "cache") if sc.mount and sc.mount[1] == "cache" else os.path.join(d, "cache")
        )
        spec = _merge(self.base, sc.spec)
        spec.update(
            cache_dir=cache_dir,
            result=os.path.join(d, "result.json"),
            seed=rep,
            scan_in_child=bool(sc.mount),
            scan_dirs=[cache_dir],
        )
        spec["must_name"] = list(spec["must_name"]) + [cache_dir]
        with open(os.path.join(d, "spec.json"), "w") as f:
            json.dump(spec, f)
        argv = [sys.executable, "-m", "stoker_lab.bench.faults_child", os.path.join(d, "spec.json")]
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
        faults = (
            self.proxy.stats()["faults_injected"]
            - before  # + the small tmpfs, the runtime started first
            + (1 if sc.mount else 0)
            + (1 if spec.get("pre") else 0)
        )
        try:
            with open(spec["result"]) as f:
                res = json.load(f)
        except (OSError, ValueError):
            res = {"rounds": []}
        rounds = res["rounds"]
        extra: dict = {}
        if rc is None or rc < 0 or not res.get("done"):
            how = "hang" if rc is None else "signal_death" if rc < 0 else "failed"
            fatal = [ln for ln in err.splitlines() if "Fatal Python error" in ln or "Bus error" in ln]
            ended = f"timed out after {sc.timeout_s}s" if rc is None else f"exit code {rc}"
            rounds.append(
                {
                    "outcome": how,
                    "signal_deaths": int(rc is not None and rc < 0),
                    "error": f"training process: {ended}; stderr: {(fatal[0] if fatal else err.strip()[-300:])[:300]}",
                }
            )
        pids = {p for r in rounds for p in r.get("pids", [])} | ({res["pid"]} if "pid" in res else set())
        if sc.mount:
            files, shm = res.get("leftover_files", []), res.get("leftover_shm", [])
            if not res.get("done"):
                extra["leftovers_unmeasured"] = "the training process did not finish inside its namespace"
        else:
            from stoker.cache.tiered import default_memory_root

            files = scan_leftovers([cache_dir])
            shm = shm_leftovers(
                shm_before, pids=pids, tiers=[default_memory_root(c) for c in _cache_roots(cache_dir, spec)]
            )
        extra["leftover_files"], extra["leftover_shm"] = len(files), len(shm)
        if files or shm:
            extra["leftover_paths"] = (files + shm)[:10]
        from stoker.cache.tiered import default_memory_root

        for root in _cache_roots(cache_dir, spec):  # this run's caches are temporary: so are their memory tiers
            shutil.rmtree(default_memory_root(root), ignore_errors=True)
        return rounds, faults, extra


def _cache_roots(cache_dir: str, spec: dict) -> list[str]:
    """The cache directories a child uses: ``cache_dir``, or one per SIGKILL round under it."""
    rounds = (spec.get("kill") or {}).get("rounds", 1)
    return [cache_dir] + [os.path.join(cache_dir, f"round-{i}") for i in range(rounds if rounds > 1 else 0)]
