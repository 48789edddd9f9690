"""`stoker bench faults`, the lifecycle cases: Ctrl-C mid-epoch, a Loader dropped without ``close()``,
the cache directory removed mid-epoch, a read-only cache directory, an ``http://`` origin, a hung
decode, and a longer run of the lifecycle property test.

Each runs a training script (:mod:`stoker_lab.bench.fault_lifecycle_child`) as a child in its own
session with a hard timeout, on a small dataset packed here whose samples carry their id. Besides
the child's own counts, the bench counts what stays after it: processes of its session
(``details["problems"]``), temporary cache files and staging (``leftover_files``) and its
``/dev/shm`` entries (``leftover_shm``).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from .fault_harness import aggregate, child_env
from .faults_child import scan_leftovers, shm_entries, shm_leftovers

N_SAMPLES = 160
_SRC_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def packed(work: str, name: str = "lc", body=None) -> str:
    """A lifecycle dataset under ``work/<name>/packed`` (made once): ``N_SAMPLES`` files
    ``s0000.bin`` ... whose bytes begin with the id (``body(i)``, by default the id padded with
    dots to 800 bytes), 64 KiB shards. Returns its path."""
    dst = os.path.join(work, name, "packed")
    if not os.path.exists(os.path.join(dst, "index.parquet")):
        from stoker.store.pack import pack

        src = os.path.join(work, name, "src")
        os.makedirs(src, exist_ok=True)
        for i in range(N_SAMPLES):
            with open(os.path.join(src, f"s{i:04d}.bin"), "wb") as f:
                f.write(body(i) if body else f"{i}".encode().ljust(800, b"."))
        pack(src, dst, source="files", shard_bytes=64 << 10, progress=False)
    return dst


def session_procs(sid: int) -> list[int]:
    """Live processes of session ``sid``."""
    out = []
    for st in os.listdir("/proc"):
        if not st.isdigit():
            continue
        try:
            with open(f"/proc/{st}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            out.append(int(st))
    return out


def launch(ctx, kind: str, tag: str, timeout_s: float, spec: dict | None = None, wrap=None, during=None) -> dict:
    """Run the child script ``kind`` on the dataset (``spec["url"]`` may override it); ``wrap(argv)``
    -> argv (a mount namespace), ``during(popen, run_dir)``: what the bench does while it runs.
    Returns ``rc`` (None on timeout), ``stderr``, ``rounds``, ``procs_left``, ``files``, ``shm``."""
    d = os.path.join(ctx.work, "lc", "runs", tag)
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    full = {
        "kind": kind,
        "url": packed(ctx.work),
        "n_samples": N_SAMPLES,
        "cache_dir": os.path.join(d, "cache"),
        "ctl": d,
        "result": os.path.join(d, "result.json"),
        **(spec or {}),
    }
    with open(os.path.join(d, "spec.json"), "w") as f:
        json.dump(full, f)
    argv = [sys.executable, "-m", "stoker_lab.bench.fault_lifecycle_child", os.path.join(d, "spec.json")]
    shm_before = shm_entries()
    with tempfile.TemporaryFile() as err:
        p = subprocess.Popen(
            wrap(argv) if wrap else argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=err,
            start_new_session=True,
            env=child_env(),
        )
        try:
            if during:
                during(p, d)
            rc = p.wait(timeout_s)
        except subprocess.TimeoutExpired:
            rc = None
        t0 = time.monotonic()  # what the child started must go with it
        while session_procs(p.pid) and time.monotonic() - t0 < 10:
            time.sleep(0.05)
        procs_left = session_procs(p.pid)
        for pid in procs_left + ([p.pid] if rc is None else []):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        p.wait()
        err.seek(0)
        stderr = err.read().decode(errors="replace")
    try:
        with open(full["result"]) as f:
            res = json.load(f)
    except (OSError, ValueError):
        res = {"rounds": []}
    pids = {p.pid, res.get("pid", p.pid)} | {q for r in res["rounds"] for q in r.get("pids", [])}
    from stoker.cache.tiered import default_memory_root

    caches = [full["cache_dir"]] + [os.path.join(full["cache_dir"], w) for w in ("w0", "w2")]
    out = {
        "rc": rc,
        "stderr": stderr,
        "rounds": res["rounds"],
        "procs_left": procs_left,
        "files": scan_leftovers([full["cache_dir"]]),
        "shm": shm_leftovers(shm_before, pids=pids, tiers=[default_memory_root(c) for c in caches]),
    }
    for c in caches:
        shutil.rmtree(default_memory_root(c), ignore_errors=True)
    return out


def run_row(name: str, expected: str, runs: list[dict], want_rc=(0,), problems: list[str] | None = None) -> dict:
    """One report row from :func:`launch` results: a timeout is a hang, an exit code outside
    ``want_rc`` a signal death (negative) or a failure."""
    rounds, problems = [], list(problems or [])
    for r in runs:
        rounds += r["rounds"]
        if r["rc"] is None:
            rounds.append({"outcome": "hang", "error": f"timed out; stderr: {r['stderr'].strip()[-200:]}"})
        elif r["rc"] not in want_rc:
            bad = {"outcome": "signal_death" if r["rc"] < 0 else "failed", "signal_deaths": int(r["rc"] < 0)}
            rounds.append({**bad, "error": f"exit code {r['rc']}; stderr: {r['stderr'].strip()[-300:]}"})
        if r["procs_left"]:
            problems.append(f"processes still running 10 s after the script ended: {r['procs_left']}")
    row = aggregate(name, expected, rounds, extra_faults=len(runs))
    row["leftover_files"] = sum(len(r["files"]) for r in runs)
    row["leftover_shm"] = sum(len(r["shm"]) for r in runs)
    paths = [p for r in runs for p in r["files"] + r["shm"]]
    if paths:
        row["details"]["leftover_paths"] = paths[:10]
    row["details"]["problems"] = problems
    return row


def ctrl_c(ctx) -> dict:
    """SIGINT to the training script's process group mid-epoch, as a terminal's Ctrl-C (2 workers
    and the prefetcher get it too): a script with no handler, and one that catches it and runs one
    more epoch. Right: the first ends with one ``KeyboardInterrupt`` traceback, the second's next
    epoch delivers every sample once; no process or /dev/shm entry stays."""

    def interrupt(p, d):
        t0 = time.monotonic()
        while not os.path.exists(os.path.join(d, "mid")) and p.poll() is None and time.monotonic() - t0 < 60:
            time.sleep(0.01)
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGINT)

    plain = launch(ctx, "sigint_plain", "ctrl_c-plain", 60, during=interrupt)
    cont = launch(ctx, "sigint_continue", "ctrl_c-continue", 60, during=interrupt)
    tracebacks = plain["stderr"].count("Traceback (most recent call last)")
    rec = {"outcome": "failed", "error": None}
    if plain["rc"] is not None and tracebacks == 1 and "KeyboardInterrupt" in plain["stderr"]:
        rec["outcome"] = "clean_error"
        rec["error"] = "KeyboardInterrupt (one traceback)"
    else:
        rec["error"] = f"exit {plain['rc']}, {tracebacks} tracebacks: {plain['stderr'].strip()[-300:]}"
    plain = {**plain, "rounds": [rec], "rc": 0 if plain["rc"] in (-signal.SIGINT, 1, 130) else plain["rc"]}
    return run_row("ctrl_c_mid_epoch", "clean_error", [plain, cont])


def dropped_loader(ctx) -> dict:
    """A new Loader per epoch bound to the same name, never closed, garbage collector off; the
    script ends without ``close()``. Right: each dropped Loader's processes gone within 10 s,
    every epoch exactly once, nothing left after the script."""
    return run_row("dropped_loader", "completed", [launch(ctx, "drop", "dropped_loader", 120)])


def cache_removed(ctx) -> dict:
    """The cache directory removed (``rm -rf``) after batch 3 of the first epoch (2 workers, then
    0). Right: the job goes on, both epochs deliver every sample once."""
    run = launch(ctx, "rmcache", "cache_removed", 120)
    removed = sum(1 for r in run["rounds"] if r.get("removed"))
    problems = [] if removed == 2 else [f"the cache directory was removed in {removed} of 2 runs"]
    row = run_row("cache_dir_removed_mid_epoch", "completed", [run], problems=problems)
    row["faults_injected"] = removed
    return row


def cache_read_only(ctx) -> dict:
    """A read-only cache directory: an empty one as ``cache_dir`` (right: one
    ``CacheUnwritableError`` naming it), and a filled one served with ``cache_read_only=True``
    (right: every sample once). As root the directories are bind-mounted read-only in a private
    mount namespace (``unshare -m``); otherwise they get mode 0o500."""
    base = os.path.join(ctx.work, "lc", "ro")
    shutil.rmtree(base, ignore_errors=True)
    empty, filled = os.path.join(base, "empty"), os.path.join(base, "filled")
    os.makedirs(empty)
    fill = launch(ctx, "epoch", "cache_ro-fill", 120, spec={"cache_dir": filled})
    if fill["rc"] != 0:
        return run_row("cache_dir_read_only", "clean_error", [fill], problems=["filling the cache failed"])
    wrap, modes = None, []
    if os.geteuid() == 0 and shutil.which("unshare"):
        q = [shlex.quote(d) for d in (empty, filled)]
        mounts = " && ".join(f"mount --bind {d} {d} && mount -o remount,ro,bind {d} {d}" for d in q)

        def wrap(argv: list[str]) -> list[str]:
            return ["unshare", "-m", "--propagation", "private", "sh", "-c", f"{mounts} && exec {shlex.join(argv)}"]

    else:
        for d in (empty, filled):
            for top, dirs, _ in os.walk(d):
                modes += [top] + [os.path.join(top, x) for x in dirs]
        for m in modes:
            os.chmod(m, 0o500)
    try:
        ro = launch(ctx, "readonly", "cache_ro", 120, spec={"ro_empty": empty, "ro_filled": filled}, wrap=wrap)
    finally:
        for m in modes:
            os.chmod(m, 0o700)
    problems = [] if set(os.listdir(empty)) == set() else [f"files were written into the read-only {empty}"]
    return run_row("cache_dir_read_only", "clean_error", [ro], problems=problems)


def http_origin(ctx) -> dict:
    """The dataset read from an ``http://`` origin (a web server on 127.0.0.1 that serves byte
    ranges, :class:`stoker_lab.bench.httporigin.RangeFileServer`), two epochs with 2 workers.
    Right: every sample once per epoch."""
    from .httporigin import RangeFileServer

    with RangeFileServer(os.path.dirname(packed(ctx.work))) as srv:
        run = launch(ctx, "epoch", "http_origin", 120, spec={"url": srv.url("packed"), "epochs": 2})
        problems = [] if srv.requests else ["the web server got no request"]
    return run_row("http_origin", "completed", [run], problems=problems)


def hung_decode(ctx) -> dict:
    """The decode of one sample (``s0017``) blocks, ``timeout_s`` 3 (2 workers, then 0). Right: the
    epoch ends in an error naming the sample, the next epoch delivers every sample once."""
    return run_row("hung_decode", "clean_error", [launch(ctx, "hang", "hung_decode", 120)])


def lifecycle_property(ctx) -> dict:
    """tests/loader/test_lifecycle_properties.py with ``STOKER_LIFECYCLE_EXAMPLES`` 40 (random
    sequences of create, iterate, break, close and drop on up to three Loaders: every finished
    epoch exactly once, nothing left). Skipped where the checkout's tests are not there."""
    test = os.path.join(os.path.dirname(_SRC_DIR), "tests", "loader", "test_lifecycle_properties.py")
    if not os.path.exists(test):
        return {**aggregate("lifecycle_property_40", "completed", []), "outcome": "skipped",
                "details": {"reason": f"{test} not found (not a checkout)"}}  # fmt: skip
    env = dict(child_env(), STOKER_LIFECYCLE_EXAMPLES="40")
    argv = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", test]
    p = subprocess.Popen(
        argv, cwd=os.path.dirname(_SRC_DIR), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL, start_new_session=True, env=env,
    )  # fmt: skip
    try:
        out = p.communicate(timeout=900)[0].decode(errors="replace")
        rc = p.returncode
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, rc = p.communicate()[0].decode(errors="replace"), None
    last = (out.strip().splitlines() or [""])[-1]
    rec = {"outcome": "completed" if rc == 0 else "hang" if rc is None else "failed", "error": None}
    if rc != 0:
        rec["error"] = f"pytest exit {rc}: {out.strip()[-400:]}"
    left = session_procs(p.pid)
    # /dev/shm and staging: the test checks them itself, per sequence (other jobs share /dev/shm)
    run = {"rc": 0, "stderr": "", "rounds": [rec], "procs_left": left, "files": [], "shm": []}
    row = run_row("lifecycle_property_40", "completed", [run])
    row["faults_injected"] = 40
    row["details"]["pytest"] = last
    return row


CASES = {  # name -> (function, part of --quick)
    "ctrl_c_mid_epoch": (ctrl_c, True),
    "dropped_loader": (dropped_loader, True),
    "cache_dir_removed_mid_epoch": (cache_removed, True),
    "cache_dir_read_only": (cache_read_only, True),
    "http_origin": (http_origin, True),
    "hung_decode": (hung_decode, True),
    "lifecycle_property_40": (lifecycle_property, False),
}
