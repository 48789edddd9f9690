"""The training process of the lifecycle scenarios of `stoker bench faults`
(:mod:`stoker_lab.bench.fault_lifecycle`): ``python -m stoker_lab.bench.fault_lifecycle_child SPEC``.

The dataset holds ``n`` small samples whose bytes begin with the sample id (key ``s0017`` holds
``b"17...."``); the decode returns the id, so each epoch's delivered ids are checked against
``range(n)``. ``spec["kind"]`` says what the script does:

* ``epoch``: ``epochs`` whole epochs with 2 workers (an HTTP origin; the fill of a cache);
* ``sigint_plain`` / ``sigint_continue``: epochs with a short sleep per batch; the file ``mid``
  in ``ctl`` is made after batch 1 of epoch 1, where the bench sends SIGINT to the process group.
  ``plain`` has no handler; ``continue`` catches ``KeyboardInterrupt`` and runs one more epoch;
* ``drop``: a new Loader per epoch bound to the same name, never closed, with the garbage
  collector off; after each re-binding the old Loader's processes must be gone within 10 s;
* ``rmcache``: the cache directory is removed after batch 3 of the first epoch (2 and 0 workers);
* ``readonly``: ``open_dataset`` on an empty read-only ``cache_dir`` (must raise
  ``CacheUnwritableError`` naming it), then a filled read-only cache with ``cache_read_only=True``;
* ``origin_error``: one epoch with 2 workers, then one with 0, each of which must end in an error
  whose message holds every string of ``spec["must_name"]`` (an origin that fails at once);
* ``hang``: the decode of sample 17 blocks (once; until the file ``release`` appears, at most
  120 s) with ``timeout_s`` 3: the first epoch must end in an error naming ``s0017``, the next
  must deliver every sample once (2 and 0 workers).

Each round's record (``outcome``, ``error``, ``lost``, ``duplicated``, ``pids``) goes to
``spec["result"]`` (JSON, rewritten after every round).
"""

from __future__ import annotations

import gc
import glob
import json
import os
import shutil
import sys
import time

import numpy as np

_SPEC: dict = {}


def sample_id(fields, rng):
    """The decode: the sample's id (its bytes begin with it)."""
    return np.int64(int(fields["bin"].split(b".")[0]))


def slow_id(fields, rng):
    """:func:`sample_id` after 5 ms, so an epoch lasts long enough to be interrupted."""
    time.sleep(0.005)
    return sample_id(fields, rng)


def stuck_once(fields, rng):
    """:func:`sample_id`, except that the first decode of sample 17 blocks until ``release``."""
    i = sample_id(fields, rng)
    ctl = os.environ["STOKER_BENCH_CTL"]
    if i == 17 and not os.path.exists(os.path.join(ctl, "stuck")):
        open(os.path.join(ctl, "stuck"), "w").close()
        t0 = time.monotonic()
        while not os.path.exists(os.path.join(ctl, "release")) and time.monotonic() - t0 < 120:
            time.sleep(0.05)
    return i


def _live_stats():
    """(pid, fields after the command name) of every live process: zombies (Z) and dead (X)
    left out; a process gone while read is skipped."""
    for st_path in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(st_path) as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] not in ("Z", "X"):
            yield int(st_path.split("/")[2]), fields


def children(pid: int) -> list[int]:
    """Live children of ``pid`` (from /proc: field 4 of /proc/<pid>/stat, proc(5))."""
    return [p for p, fields in _live_stats() if int(fields[1]) == pid]


def session_members(sid: int) -> list[int]:
    """Live processes of session ``sid`` (field 6 of /proc/<pid>/stat, proc(5))."""
    return [p for p, fields in _live_stats() if int(fields[3]) == sid]


def _record(outcome: str = "completed", error: str | None = None) -> dict:
    return {"outcome": outcome, "error": error, "lost": 0, "duplicated": 0, "signal_deaths": 0, "pids": []}


def _count(rec: dict, ids: list[int], n: int) -> None:
    """Add one epoch's lost and duplicated ids to ``rec``."""
    seen: dict[int, int] = {}
    for i in ids:
        seen[i] = seen.get(i, 0) + 1
    rec["lost"] += sum(1 for i in range(n) if i not in seen)
    rec["duplicated"] += sum(c - 1 for c in seen.values()) + sum(c for i, c in seen.items() if not 0 <= i < n)


def _epoch(ld, rec: dict, n: int, on_batch=None) -> None:
    ids: list[int] = []
    for k, b in enumerate(ld):
        ids += [int(v) for v in np.asarray(b).reshape(-1)]
        if on_batch:
            on_batch(k)
    _count(rec, ids, n)


def _open(cache_dir: str, **kw):
    from stoker.store.dataset import open_dataset

    return open_dataset(_SPEC["url"], cache_dir=cache_dir, cache_bytes=64 << 20, **kw)


def _loader(ds, workers: int = 2, decode=sample_id, **kw):
    from stoker.loader import Loader

    return Loader(ds, 8, num_workers=workers, decode=decode, timeout_s=kw.pop("timeout_s", 60.0), **kw)


def _err(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc)[:400]}"


def kind_epoch(n: int) -> list[dict]:
    rec = _record()
    with _loader(_open(_SPEC["cache_dir"])) as ld:
        rec["pids"] = ld.processes.pids() if hasattr(ld, "processes") else []
        for _ in range(_SPEC.get("epochs", 1)):
            _epoch(ld, rec, n)
    return [rec]


def kind_sigint(n: int, catch: bool) -> list[dict]:
    rec = _record()
    ctl = _SPEC["ctl"]
    ld = _loader(_open(_SPEC["cache_dir"]), decode=slow_id)

    def mark(k: int) -> None:
        if k == 1:
            rec["pids"] = ld.processes.pids()
            _write([rec])  # the pids, before the interrupt
            open(os.path.join(ctl, "mid"), "w").close()
        time.sleep(0.05)

    _epoch(ld, rec, n)
    if not catch:
        for _ in range(2):
            _epoch(ld, rec, n, mark)
        return [rec]
    try:
        _epoch(ld, _record(), n, mark)
        rec["outcome"], rec["error"] = "failed", "no KeyboardInterrupt came"
    except KeyboardInterrupt:
        ld.state_dict()  # what a script that saves a checkpoint does
    _epoch(ld, rec, n)  # the next cell: one more whole epoch on the same Loader
    ld.close()
    return [rec]


def kind_drop(n: int) -> list[dict]:
    gc.disable()
    rec = _record()
    ld = None
    for epoch in range(3):
        old: list = ld.processes.pids() if ld is not None else []
        ld = _loader(_open(_SPEC["cache_dir"]), seed=epoch)  # the old Loader is dropped here, never closed
        t0 = time.monotonic()
        while set(old) & set(children(os.getpid())) and time.monotonic() - t0 < 10:
            time.sleep(0.02)
        left = sorted(set(old) & set(children(os.getpid())))
        if left:
            rec["outcome"] = "failed"
            rec["error"] = f"epoch {epoch}: processes {left} of the dropped Loader still running after 10 s"
        rec["drop_s"] = max(rec.get("drop_s", 0.0), round(time.monotonic() - t0, 3))
        _epoch(ld, rec, n)
        rec["pids"] += ld.processes.pids()
    return [rec]  # the script ends without close(): the bench checks that nothing stays


def _remove(cache: str, rec: dict) -> None:
    """``rm -rf cache`` while the job's processes write into it: again until it is gone once."""
    for _ in range(20):
        shutil.rmtree(cache, ignore_errors=True)
        if not os.path.exists(cache):
            rec["removed"] = True
            return
    rec["outcome"], rec["error"] = "failed", f"the bench could not remove {cache}"


def kind_rmcache(n: int) -> list[dict]:
    recs = []
    for workers in (2, 0):
        cache = os.path.join(_SPEC["cache_dir"], f"w{workers}")
        rec = _record()
        try:
            ds = _open(cache, block_bytes=32 << 10)
            with _loader(ds, workers, prefetch_bytes=96 << 10) as ld:
                rec["pids"] = ld.processes.pids()
                for epoch in range(2):
                    _epoch(
                        ld,
                        rec,
                        n,
                        (lambda k, c=cache, r=rec: _remove(c, r) if k == 3 else None) if epoch == 0 else None,
                    )
        except Exception as exc:  # noqa: BLE001 - classified by the bench
            from stoker.errors import StokerError

            rec["outcome"], rec["error"], rec["lost"] = "failed", _err(exc), 0
            if isinstance(exc, StokerError) and cache in str(exc):
                rec["outcome"] = "clean_error"
        recs.append(rec)
    return recs


def kind_readonly(n: int) -> list[dict]:
    from stoker.cache.spec import CacheOptions
    from stoker.errors import CacheUnwritableError

    empty, filled = _SPEC["ro_empty"], _SPEC["ro_filled"]
    rec = _record("failed")
    try:
        _open(empty)
        rec["error"] = f"open_dataset on the read-only {empty} raised nothing"
    except CacheUnwritableError as exc:
        if empty in str(exc):
            rec["outcome"], rec["error"] = "clean_error", _err(exc)
        else:
            rec["error"] = f"the error does not name {empty}: {_err(exc)}"
    except Exception as exc:  # noqa: BLE001
        rec["error"] = _err(exc)
    served = _record()
    try:
        with _loader(_open(filled, cache=CacheOptions(cache_read_only=True))) as ld:
            _epoch(ld, served, n)
            served["cache_hits"] = ld.stats.cache_hits
    except Exception as exc:  # noqa: BLE001
        served["outcome"], served["error"] = "failed", f"a read-only pre-filled cache: {_err(exc)}"
    return [rec, served]


def kind_origin_error(n: int) -> list[dict]:
    recs = []
    for workers in (2, 0):
        rec = _record("failed")
        try:
            with _loader(_open(os.path.join(_SPEC["cache_dir"], f"w{workers}")), workers) as ld:
                rec["pids"] = ld.processes.pids()
                _epoch(ld, _record(), n)
            rec["error"] = f"{workers} workers: the epoch completed"
        except Exception as exc:  # noqa: BLE001 - classified here
            rec["error"] = f"{workers} workers: {_err(exc)}"
            missing = [s for s in _SPEC.get("must_name", []) if s not in str(exc)]
            if missing:
                rec["error"] += f" (does not name {missing})"
            else:
                rec["outcome"] = "clean_error"
        recs.append(rec)
    return recs


def kind_hang(n: int) -> list[dict]:
    recs = []
    for workers in (2, 0):
        ctl = os.path.join(_SPEC["ctl"], f"w{workers}")
        os.makedirs(ctl, exist_ok=True)
        os.environ["STOKER_BENCH_CTL"] = ctl
        rec = _record("failed")
        ld = _loader(_open(os.path.join(_SPEC["cache_dir"], f"w{workers}")), workers, stuck_once, timeout_s=3.0)
        try:
            t0 = time.monotonic()
            try:
                _epoch(ld, _record(), n)
                rec["error"] = "the epoch with a stuck decode completed"
            except Exception as exc:  # noqa: BLE001
                rec["stall_s"] = round(time.monotonic() - t0, 2)
                rec["error"] = _err(exc)
                if "s0017" in str(exc):
                    rec["outcome"] = "clean_error"
            try:
                _epoch(ld, rec, n)  # the user caught it: the next epoch runs
            except Exception as exc:  # noqa: BLE001
                rec["outcome"], rec["error"] = "failed", f"the next epoch: {_err(exc)}"
        finally:
            open(os.path.join(ctl, "release"), "w").close()
            ld.close()
        recs.append(rec)
    return recs


def _write(rounds: list[dict]) -> None:
    from stoker._atomic import umask_mode, write_atomic

    write_atomic(_SPEC["result"], json.dumps({"rounds": rounds, "pid": os.getpid()}).encode(), mode=umask_mode())


def main(spec_path: str) -> None:
    """Run the script ``spec["kind"]`` of the JSON file ``spec_path``; see the module docstring."""
    with open(spec_path) as f:
        _SPEC.update(json.load(f))
    n, kind = _SPEC["n_samples"], _SPEC["kind"]
    _write([])
    if kind.startswith("sigint"):
        rounds = kind_sigint(n, kind == "sigint_continue")
    else:
        kinds = {"epoch": kind_epoch, "drop": kind_drop, "rmcache": kind_rmcache, "readonly": kind_readonly}
        rounds = {**kinds, "origin_error": kind_origin_error}.get(kind, kind_hang)(n)
    _write(rounds)


if __name__ == "__main__":
    main(sys.argv[1])
