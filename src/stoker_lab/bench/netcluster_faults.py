"""Fault runs of ``stoker bench cluster --netns``: a host killed, a link down, in mid-epoch.

Two sides, one file each way:

- the driver (in the first host namespace, :mod:`stoker_lab.bench.netcluster_driver`) runs the jobs
  and, at the right moment, asks for a fault with :func:`request` (a JSON file in a directory
  both sides see; the answer comes back beside it);
- the benchmark process, which made the namespaces, carries it out with :class:`FaultHandler`
  (it alone holds the :class:`stoker_lab.bench.netcluster.NetCluster`): ``kill`` (SIGKILL of every
  process of a host: its raylet and cache service die at once), ``restart`` (``ray start`` on
  that host again), ``link_down`` (the host's link down for ``seconds``, then up again:
  :meth:`NetCluster.set_link`).

A fault run (:func:`fault_run`): on empty caches, a warm epoch with one rank per host fills each
host's share; then a fault epoch with ranks on every host but the victim (the last host, never
the Ray head: the ranks ask for the ``steady`` resource, which the victim lacks) that read slowly,
so the fault lands in the middle; then, once the host is back, a rejoin epoch. Each read is
tallied by the node that owns its block and by whether it came before or after the fault, so the
row says where the victim's blocks were read from. Every wait has a timeout, named in its error.
"""

from __future__ import annotations

import json
import os
import threading
import time
from functools import partial

import numpy as np

#: The Ray resource every host but the fault victim offers (fault-epoch ranks ask for it).
STEADY = "stoker_steady"
#: The fault kinds, in the order they run.
FAULTS = ("kill", "link_down")


# -- the benchmark process's side ---------------------------------------------------------


class FaultHandler:
    """Carries out the driver's requests on ``net`` (a started NetCluster) and ``procs`` (its
    :class:`stoker_lab.bench.netcluster_ray.NetRay`). :meth:`poll` answers every request waiting in
    ``request_dir``; links taken down come back up by a timer thread (and in :meth:`close`)."""

    def __init__(self, net, procs, request_dir: str):
        self.net, self.procs, self.dir = net, procs, request_dir
        self._timers: list[threading.Timer] = []
        os.makedirs(request_dir, exist_ok=True)

    def poll(self) -> None:
        for name in sorted(os.listdir(self.dir)):
            if not name.endswith(".req"):
                continue
            path = os.path.join(self.dir, name)
            with open(path) as f:
                req = json.load(f)
            os.remove(path)
            try:
                out = {"ok": True, **self.handle(req)}
            except Exception as exc:  # noqa: BLE001 - sent back to the driver, which names it
                out = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            _write_json(path[:-4] + ".done", out)

    def handle(self, req: dict) -> dict:
        """One request ``{action, host, seconds?}``; returns what was done (``t``: time.time())."""
        i, action = int(req["host"]), req["action"]
        if not 0 < i < self.net.hosts:
            raise ValueError(f"fault host must be 1..{self.net.hosts - 1} (not the Ray head), got {i}")
        if action == "kill":
            return {"killed": self.net.kill_host(i), "t": time.time()}
        if action == "restart":
            self.procs.restart_node(i)
            return {"t": time.time()}
        if action == "link_down":
            link = f"h{i}"
            self.net.set_link(link, False)
            timer = threading.Timer(float(req["seconds"]), self.net.set_link, (link, True))
            timer.daemon = True
            timer.start()
            self._timers.append(timer)
            return {"t": time.time()}
        raise ValueError(f"unknown fault action {action!r}")

    def close(self) -> None:
        """Bring every link taken down back up now (cancelled timers)."""
        for t in self._timers:
            if t.is_alive():
                t.cancel()
                t.function(*t.args)
        self._timers = []


def _write_json(path: str, obj) -> None:
    from stoker._atomic import umask_mode, write_atomic

    write_atomic(path, json.dumps(obj).encode(), mode=umask_mode())


# -- the driver's side -----------------------------------------------------------------------


def request(request_dir: str, action: str, host: int, timeout_s: float = 120.0, **extra) -> dict:
    """Ask the benchmark process for fault ``action`` on host ``host``; returns its answer.
    Raises TimeoutError (naming the action and ``timeout_s``) when no answer comes, RuntimeError
    with the handler's error when it failed."""
    base = os.path.join(request_dir, f"{time.time_ns()}-{action}")
    _write_json(base + ".req", {"action": action, "host": host, **extra})
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(base + ".done"):
        if time.monotonic() > deadline:
            raise TimeoutError(f"fault request {action!r} on host {host}: no answer in {timeout_s} s (request timeout)")
        time.sleep(0.05)
    with open(base + ".done") as f:
        out = json.load(f)
    if not out.get("ok"):
        raise RuntimeError(f"fault request {action!r} on host {host} failed: {out.get('error')}")
    return out


def slow_reader(ctx, epoch: int, pause_s: float, flag: str, started: str) -> dict:
    """Cluster ``train_fn`` of a fault epoch: read (and verify) the rank's plan with ``pause_s``
    seconds between samples; tally each read's bytes by its block's owner node and by whether
    file ``flag`` (the fault happened) existed. Writes file ``started`` once a tenth is read.
    Returns ``{ids, seconds, by_owner: {"before"|"after": {node id: {local, peer, origin,
    fallbacks}}}}``."""
    ids = ctx.plan(epoch, 0)
    router = ctx.dataset.reader.router
    by: dict = {"before": {}, "after": {}}
    t0 = time.perf_counter()
    for k, i in enumerate(ids):
        when = "after" if os.path.exists(flag) else "before"
        b = int(ctx.dataset.blocks.sample_block[int(i)])
        node = router.nodes[int(router.owner[b])]
        c0 = ctx.counters.read()
        ctx.dataset.read(int(i))
        c1 = ctx.counters.read()
        t = by[when].setdefault(node, {"local": 0, "peer": 0, "origin": 0, "fallbacks": 0})
        t["local"] += c1["local"] - c0["local"]
        t["peer"] += c1["peer"] - c0["peer"] + c1["peer_origin"] - c0["peer_origin"]
        t["origin"] += c1["origin"] - c0["origin"]
        t["fallbacks"] += c1["fallbacks"] - c0["fallbacks"]
        if k == len(ids) // 10:
            open(started, "w").close()
        time.sleep(pause_s)
    return {"ids": ids.tolist(), "seconds": time.perf_counter() - t0, "by_owner": by}


def _host_of(ips: list[str]) -> dict[str, int]:
    """Node id -> host index, for every node Ray has known (dead ones too)."""
    import ray

    return {n["NodeID"]: ips.index(n["NodeManagerAddress"]) for n in ray.nodes() if n.get("NodeManagerAddress") in ips}


def _sum(results: list[dict], when: str, host: int, host_of: dict) -> dict:
    out = {"local_bytes": 0, "peer_bytes": 0, "origin_bytes": 0, "fallbacks": 0}
    for r in results:
        for node, t in r["by_owner"][when].items():
            if host_of.get(node) == host:
                for k in ("local", "peer", "origin"):
                    out[f"{k}_bytes"] += t[k]
                out["fallbacks"] += t["fallbacks"]
    return out


def _wait_host(ip: str, timeout_s: float) -> None:
    import ray

    deadline = time.monotonic() + timeout_s
    while not any(n.get("Alive") and n["NodeManagerAddress"] == ip for n in ray.nodes()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"host {ip} did not rejoin the Ray cluster in {timeout_s} s (rejoin timeout)")
        time.sleep(0.5)


def fault_run(kind: str, spec: dict, url: str, opts: dict, n: int) -> dict:
    """One fault run (see the module doc) on the cluster the driver joined; returns its row:
    ``{fault, host, finished, exactly_once, seconds, error, dead_host_blocks: {before, after},
    rejoin: {finished, served_bytes, dead_host_blocks}}`` (bytes; ``dead_host_blocks``: where the
    victim's blocks were read from by the fault epoch's ranks, before and after the fault)."""
    from stoker.cluster.jobs.gang import gather
    from stoker.cluster.jobs.job import read_epochs
    from stoker.cluster.jobs.job import run as cluster_run
    from stoker.cluster.service.cache_service import stop_services
    from stoker.cluster.settings import ClusterOptions

    hosts, ips = len(spec["host_ips"]), spec["host_ips"]
    victim = hosts - 1
    work = os.path.join(spec["workdir"], f"fault-{kind}")
    os.makedirs(work, exist_ok=True)
    common = dict(
        storage_options=opts,
        cache_dir=os.path.join(work, "cache"),
        cache_bytes=spec["cache_bytes"],
        block_bytes=spec["block_bytes"],
    )
    limits = dict(timeout_s=spec["job_timeout_s"], peer_timeout_s=spec["fault_peer_timeout_s"], retry_s=0.5)
    steady = {"CPU": 0.5, STEADY: 1}
    stop_services()
    cluster_run(
        partial(read_epochs, epochs=1),
        url,
        hosts,
        {"CPU": 0.5},
        cluster=ClusterOptions(job=f"{kind}-warm", **limits),
        **common,
    )
    flag, started = os.path.join(work, "fault-done"), os.path.join(work, "started")
    row: dict = {"fault": kind, "host": f"h{victim}", "finished": False, "exactly_once": False, "error": None}
    fn = partial(slow_reader, epoch=1, pause_s=spec["fault_pause_s"], flag=flag, started=started)
    t0 = time.monotonic()
    refs = cluster_run(
        fn, url, hosts - 1, steady, cluster=ClusterOptions(job=f"{kind}-fault", wait=False, **limits), **common
    )
    deadline = time.monotonic() + spec["job_timeout_s"]
    while not os.path.exists(started) and time.monotonic() < deadline:
        time.sleep(0.05)
    act = {"kill": {}, "link_down": {"seconds": spec["link_down_s"]}}[kind]
    row["fault_at"] = request(spec["request_dir"], kind, victim, **act)["t"]
    open(flag, "w").close()
    try:
        res = gather(refs, timeout_s=spec["job_timeout_s"])
        results = [r["result"] for r in res]
        ids = np.concatenate([np.asarray(r["ids"], dtype=np.int64) for r in results])
        row.update(finished=True, exactly_once=bool(len(ids) == n and np.array_equal(np.sort(ids), np.arange(n))))
    except Exception as exc:  # noqa: BLE001 - the row says why
        results, row["error"] = [], f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
    row["seconds"] = time.monotonic() - t0
    host_of = _host_of(ips)
    row["dead_host_blocks"] = {w: _sum(results, w, victim, host_of) for w in ("before", "after")}
    # the host comes back and serves again
    if kind == "kill":
        request(spec["request_dir"], "restart", victim, timeout_s=spec["job_timeout_s"])
        _wait_host(ips[victim], spec["job_timeout_s"])
    else:
        time.sleep(max(0.0, row["fault_at"] + spec["link_down_s"] + 1.0 - time.time()))
    os.remove(flag)
    rejoin: dict = {"finished": False}
    try:
        fn = partial(slow_reader, epoch=2, pause_s=0.0, flag=flag, started=os.path.join(work, "started2"))
        res = cluster_run(fn, url, hosts - 1, steady, cluster=ClusterOptions(job=f"{kind}-rejoin", **limits), **common)
        blocks = _sum([r["result"] for r in res], "before", victim, _host_of(ips))
        rejoin.update(finished=True, dead_host_blocks=blocks, served=blocks["peer_bytes"] > 0)
    except Exception as exc:  # noqa: BLE001
        rejoin["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
    row["rejoin"] = rejoin
    stop_services()
    return row
