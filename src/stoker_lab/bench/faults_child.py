"""The training process of one `stoker bench faults` scenario: ``python -m stoker_lab.bench.faults_child SPEC``.

It opens the dataset, runs ``epochs`` epochs of a :class:`stoker.loader.Loader` per round and
counts the sample ids it receives. The bench packs its datasets with label = sample index, so
the labels of the delivered batches are the sample ids; an epoch of a dataset of ``n``
samples (world size 1, no ``drop_last``) must deliver each id in ``range(n)`` exactly once.

Each round's outcome goes to the result file (JSON, rewritten atomically after every round,
so the parent keeps what happened before a hang or a signal death):

* ``completed``: every epoch ran to its end; ``lost`` / ``duplicated`` count the ids missing /
  received more than once;
* ``clean_error``: the loader raised an error whose message names what failed (one of the
  spec's ``must_name`` strings: the dataset URL, a shard, ``/dev/shm``, a worker ...);
  ids received before it still count towards ``duplicated``;
* ``hang``: the loader's own watchdog gave up ("no batch from the workers for N s"): a stall
  turned into an error that names no cause;
* ``signal_death``: a stoker process died by a signal the bench did not send (the error says so);
* ``failed``: any other exception.

With ``kill`` in the spec, a timer thread SIGKILLs one worker or the prefetch process at a
random point of each round (after a random batch, plus 0-50 ms), ``rounds`` times; the pids
come from the Loader's own process handles (``loader.processes``). A worker that dies by a
signal the bench did not send is counted in ``signal_deaths``.
"""

from __future__ import annotations

import collections
import json
import os
import random
import re
import signal
import sys
import threading
import time

_WATCHDOG = "no batch from the workers"


def _write(path: str, result: dict) -> None:
    from stoker._atomic import umask_mode, write_atomic

    write_atomic(path, json.dumps(result).encode(), mode=umask_mode())


def classify(exc: BaseException, must_name: list[str]) -> str:
    """``hang``, ``clean_error`` or ``failed`` for an exception a loader raised (see the module doc)."""
    msg = f"{exc}"
    if _WATCHDOG in msg:
        return "hang"
    return "clean_error" if any(s and s in msg for s in must_name) else "failed"


def _foreign_signal_deaths(msg: str, our_pids: set[int]) -> int:
    """1 if ``msg`` reports a stoker process dead by a signal (negative exit code) we did not send."""
    for pid, _code in re.findall(r"pid (\d+)\)? died with exit code (-\d+)", msg):
        if int(pid) not in our_pids:
            return 1
    return 0


def _pre(kind: str | None, spec: dict) -> None:
    """What the training script did before making the Loader (fork-after-async scenarios)."""
    if not kind:
        return
    opts = spec["storage_options"]
    if kind.startswith("obstore"):
        import obstore
        from obstore.store import S3Store

        bucket, _, prefix = spec["url"][len("s3://") :].partition("/")
        store = S3Store(
            bucket,
            endpoint=opts["endpoint_url"],
            access_key_id=opts["key"],
            secret_access_key=opts["secret"],
            region="us-east-1",
            client_options={"allow_http": True},
        )
        key = f"{prefix.strip('/')}/index.parquet"
        bytes(obstore.get_range(store, key, start=0, end=100))
        if kind == "obstore_busy_thread":

            def pump():
                while True:
                    bytes(obstore.get_range(store, key, start=0, end=1000))

            threading.Thread(target=pump, daemon=True).start()
            time.sleep(0.3)


def _killer(loader, target: str, delay_s: float, killed: list) -> None:
    time.sleep(delay_s)
    running = loader.processes
    procs = list(running.workers) if target == "worker" else [p for p in [running.prefetcher] if p is not None]
    procs = [p for p in procs if p.pid and p.exitcode is None]
    if not procs:
        return
    p = random.choice(procs)
    try:
        os.kill(p.pid, signal.SIGKILL)
        killed.append(p.pid)
    except ProcessLookupError:
        pass


def run_round(spec: dict, cache_dir: str, rnd: int, rng: random.Random) -> dict:
    """One round: open, load ``epochs`` epochs, close. Returns the round's record."""
    from stoker.cache.spec import MOVED, CacheOptions
    from stoker.loader import Loader
    from stoker.loader.options import loader_kwargs
    from stoker.store.dataset import open_dataset

    n, epochs, kill = spec["n_samples"], spec.get("epochs", 1), spec.get("kill")
    rec = {
        "round": rnd,
        "outcome": "completed",
        "error": None,
        "lost": 0,
        "duplicated": 0,
        "signal_deaths": 0,
        "faults_injected": 0,
        "seconds": 0.0,
        "pids": [os.getpid()],
    }
    killed: list[int] = []
    t0 = time.perf_counter()
    loader = None
    try:
        open_kw = dict(spec.get("open_kw", {}))  # flat, as JSON holds it: the cache fields go in their group
        cache = CacheOptions(**{k: open_kw.pop(k) for k in MOVED if k in open_kw})
        ds = open_dataset(
            spec["url"], cache_dir=cache_dir, cache=cache, storage_options=spec.get("storage_options"), **open_kw
        )
        loader = Loader(ds, **loader_kwargs(spec.get("loader_kw", {})))
        nb = max(1, -(-n // loader.batch_size))
        kill_after = rng.randrange(max(1, nb - 1)) if kill else -1
        armed = False  # one kill per round, in the first epoch
        for _ in range(epochs):
            seen: collections.Counter = collections.Counter()
            try:
                for b, (_, labels) in enumerate(loader):
                    seen.update(int(x) for x in labels)
                    if b == kill_after and not armed:
                        armed = True
                        rec["pids"] += loader.processes.pids()
                        threading.Thread(
                            target=_killer, args=(loader, kill["target"], rng.uniform(0, 0.05), killed), daemon=True
                        ).start()
            finally:
                rec["duplicated"] += sum(c - 1 for c in seen.values() if c > 1)
                extra = [i for i in seen if not 0 <= i < n]
                rec["duplicated"] += sum(seen[i] for i in extra)  # ids that are not the dataset's
            rec["lost"] += sum(1 for i in range(n) if i not in seen)
    except Exception as exc:  # noqa: BLE001 - every failure is classified and reported
        time.sleep(0.06 if kill else 0)  # a kill timer still in flight lands before we classify
        rec["outcome"] = classify(exc, spec.get("must_name", []))
        rec["error"] = f"{type(exc).__name__}: {str(exc)[:400]}"
        rec["lost"] = 0  # an epoch that ends in an error promises nothing about the rest
        rec["signal_deaths"] += _foreign_signal_deaths(str(exc), set(killed))
        if rec["signal_deaths"]:
            rec["outcome"] = "signal_death"
    finally:
        time.sleep(0.06 if kill else 0)
        if loader is not None:
            rec["pids"] += [p.pid for p in loader.processes.workers]
            loader.close()
    rec["faults_injected"] = len(killed)
    rec["seconds"] = time.perf_counter() - t0
    return rec


def scan_leftovers(dirs: list[str]) -> list[str]:
    """Temporary block files (``.tmp-*``, see :mod:`stoker.cache.files`) and staging
    directories (``.staging/<pid>-<id>``) still under ``dirs`` once every loader is closed."""
    from stoker.cache.files import TMP_MARK

    out = []
    for top in dirs:
        for d, subdirs, files in os.walk(top):
            out += [os.path.join(d, f) for f in files if f.startswith(TMP_MARK)]
            if os.path.basename(d) == ".staging":
                out += [os.path.join(d, s) for s in subdirs]
                subdirs[:] = []
    return out


def shm_entries(base: str = "/dev/shm") -> list[str]:
    """Names in ``base`` that stoker creates (``stoker-*``)."""
    try:
        return sorted(n for n in os.listdir(base) if n.startswith("stoker-"))
    except OSError:
        return []


def shm_leftovers(
    before: list[str], base: str = "/dev/shm", pids: set[int] | None = None, tiers: list[str] = ()
) -> list[str]:
    """stoker's entries in ``base`` that were not there ``before``: slot files and the like (only
    those named ``stoker-<pid>-...`` after one of ``pids``, when given: other jobs share /dev/shm),
    plus temporary files left inside memory-tier directories (``stoker-cache-*``: caches, which
    stay by design): the new ones when ``pids`` is None, else those named in ``tiers``."""
    out, new = [], sorted(set(shm_entries(base)) - set(before))
    for name in new:
        if name.startswith("stoker-cache-"):
            continue
        part = name.split("-")[1] if "-" in name else ""
        if pids is None or (part.isdigit() and int(part) in pids):
            out.append(os.path.join(base, name))
    tier_dirs = [os.path.join(base, n) for n in new if n.startswith("stoker-cache-")] if pids is None else tiers
    return out + scan_leftovers([d for d in tier_dirs if os.path.isdir(d)])


def main(spec_path: str) -> None:
    """Run the scenario described by the JSON file ``spec_path``; see the module docstring."""
    import faulthandler

    faulthandler.enable()
    with open(spec_path) as f:
        spec = json.load(f)
    result = {"rounds": [], "leftover_files": [], "leftover_shm": [], "shm_before": shm_entries(), "pid": os.getpid()}
    _write(spec["result"], result)  # the pid names this process's shared-memory files, even after a hang
    from stoker import _torch as torch_adapter
    from stoker import decode, loader  # noqa: F401 - imports paid before any round is timed

    torch_adapter.load()
    _pre(spec.get("pre"), spec)
    rng = random.Random(spec.get("seed", 0))
    rounds = (spec.get("kill") or {}).get("rounds", 1)
    for rnd in range(rounds):
        cache_dir = spec["cache_dir"] if rounds == 1 else os.path.join(spec["cache_dir"], f"round-{rnd}")
        result["rounds"].append(run_round(spec, cache_dir, rnd, rng))
        _write(spec["result"], result)
    if spec.get("scan_in_child"):  # a private mount namespace: the parent cannot see these files
        result["leftover_files"] = scan_leftovers(spec.get("scan_dirs", []))
        from stoker.cache.tiered import default_memory_root

        pids = {os.getpid()} | {p for r in result["rounds"] for p in r["pids"]}
        caches = [spec["cache_dir"]] + [os.path.join(spec["cache_dir"], f"round-{i}") for i in range(rounds)]
        result["leftover_shm"] = shm_leftovers(
            result["shm_before"], pids=pids, tiers=[default_memory_root(c) for c in caches]
        )
    result["done"] = True
    _write(spec["result"], result)


if __name__ == "__main__":
    main(sys.argv[1])
