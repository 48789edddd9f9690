"""The peer stage of ``stoker bench io``: a peer's cache service serving a rank, beside bare TCP.

Two Ray nodes: node A runs the dataset's cache service (:class:`stoker.cluster.service.cache_service.CacheService`),
warmed with its own :meth:`~stoker.cluster.service.cache_service.CacheService.fill` from the origin; node B
runs a rank (:class:`stoker_lab.bench.peer_rank.PeerRank`, a Ray actor) that owns no block
(``me = -1``) and fetches every block of the dataset, whole, as a cluster-mode Loader fetches a
peer's block (``BlockReader.fetch_block``: :class:`stoker.cluster.service.reader.BlockRouter`'s
``read(..., block=True)`` over the data plane, then the index check), ``concurrency`` blocks at a
time (a Loader's fill threads), ``rounds`` times over so that a pass moves about ``pass_bytes``.
The bytes travel over the service's data endpoint (:mod:`stoker.cluster.service.endpoint`:
``sendfile`` from the cache file), on the reading process's own connection; Ray only says where
the endpoint listens. Two ways of reading (:data:`stoker_lab.bench.peer_report.VIAS`): in the
rank's Ray worker (``direct``), and in a child process of the rank with a copy of the router
(``worker``: a Loader's prefetcher and decode workers).

The CPU counted is each thread's time on a CPU (``/proc/<pid>/task/*/schedstat``:
:mod:`stoker_lab.bench.peer_profile`) of every process on the path, over one pass, split into the
sender and the receiver (:func:`stoker_lab.bench.peer_report.ends`: the service; the reading
processes; each node's raylet by its increment over its rest). The GCS and the driver (which only
calls the rank once per pass) are reported apart (``apart_cpu_s``). The pass is repeated ``reps``
times and the pass with the least CPU is kept, as the other stages do; GB/s is that pass's bytes
over its wall time inside the reading process.

The floor (:mod:`stoker_lab.bench.peer_floor`) moves the same block files, from the service's cache
directory, between the same two places (loopback, or two network namespaces), as many times, with
as many requests in flight: ``os.sendfile`` out, ``recv_into`` one buffer in. The ratio is stoker's
CPU-s/GB (both ends) over the floor's. Over 2x, the row's ``exception``
(:mod:`stoker_lab.bench.peer_report`) says where the CPU went (per process) with the top frames of a
profile of more passes (:func:`stoker_lab.bench.peer_profile.profile`: py-spy of the Python
processes, ``perf`` of all), or why no profile could be taken.

:func:`loopback` runs it on a 2-node ``ray.cluster_utils.Cluster`` on this machine's address;
:mod:`stoker_lab.bench.peer_netns` on two network namespaces with a shaped link.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import subprocess
import tempfile
import time
from typing import Any

from .peer_profile import PROFILE_S, cpu_between, cpu_marks
from .peer_rank import PeerRank
from .peer_report import GB, VIAS, counted_roles, ends, not_measured, peer_rows

__all__ = ["PASS_BYTES", "loopback", "loopback_process", "measure", "not_measured", "rounds_for", "stop"]

#: Seconds the counted processes are watched with no pass running (their CPU at rest).
IDLE_S = 2.0
#: Bytes a pass moves over loopback by default (the dataset read as many times as it takes): about
#: a second of CPU behind each pass's figures at this stage's 0.3-0.6 CPU-s/GB, where a 1 GB pass
#: moved 20-30% between runs on the shared 2-core machine.
PASS_BYTES = 3_000_000_000


#: How the floor moves the bytes (the rows' ``floor.what``, after where).
FLOOR_WHAT = (
    "{rounds} times over with {concurrency} requests in flight on one connection: the sender os.sendfile of "
    "each block from its cache file, the receiver socket.recv_into its place in one preallocated buffer; CPU "
    "of both ends"
)


def block_files(cache_dir: str, ds) -> list[str]:
    """Paths of the block files of ``ds`` in the node cache at ``cache_dir`` (disk tier), in block order."""
    from stoker.cache.layout import ns_dir

    root = ns_dir(cache_dir, ds.version)
    return [os.path.join(root, ds.blocks.name(b)) for b in range(len(ds.blocks))]


def rounds_for(pass_bytes: int, dataset_bytes: int) -> int:
    """How many times a pass reads the dataset (``dataset_bytes``) to move at least ``pass_bytes`` (>= 1)."""
    return max(1, math.ceil(pass_bytes / max(1, dataset_bytes)))


def measure(
    url: str,
    storage_options: dict,
    block_bytes: int,
    node_a: str,
    node_b: str,
    cache_root: str,
    pids: dict,
    concurrency: int,
    reps: int,
    pass_bytes: int = PASS_BYTES,
    vias: tuple[str, ...] = tuple(VIAS),
    holder: dict | None = None,
) -> dict:
    """The stoker side of the stage, on a Ray cluster this process has joined: start node A's
    cache service (budget: twice the dataset), fill it from the origin, start :class:`PeerRank`
    on node B, then for each of ``vias`` (:data:`VIAS`) one untimed pass and ``reps`` timed ones.

    ``pids``: ``{role: pid}`` of the raylets (``"raylet A"``, ``"raylet B"``) and of processes to
    report apart (``"gcs"``, ...); the rank's, the service's and the worker's are added.
    ``holder``: a dict that gets ``rank`` (the actor) at once, so the caller can stop it with
    :func:`stop` even when this raises. Returns ``{"files", "fill", "blocks", "bytes" (the
    dataset's), "rounds", "concurrency", "pids", "idle_cpu_s_per_s" (each process's CPU-s per
    second over :data:`IDLE_S` seconds with no pass running), "verify_cpu_s_per_GB", "calls", via:
    {bytes, cpu_s, wall_s, cpu_s_per_GB, GBps, sender, receiver, by_process, apart_cpu_s, passes,
    digest, counters}}``. RuntimeError when the fill or a read fails or a byte came from elsewhere
    than the peer's cache."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from stoker.cluster.service.cache_service import dataset_ref, find_services, get_service, start_services
    from stoker.store.dataset import open_dataset

    holder = {} if holder is None else holder
    ds = open_dataset(url, storage_options=storage_options, cache=False, check=False, block_bytes=block_bytes)
    nbytes = int(sum(int(ds.blocks.end[b]) - int(ds.blocks.start[b]) for b in range(len(ds.blocks))))
    rounds = rounds_for(pass_bytes, nbytes)
    start_services(cache_root, {node_a: 2 * nbytes + (64 << 20)})
    service = get_service(node_a)
    info = find_services()[node_a]
    t0 = time.perf_counter()
    dref = dataset_ref(ds, storage_options)
    fill = ray.get(service.fill.remote(dref, list(range(len(ds.blocks))), concurrency), timeout=600)
    fill["seconds"] = time.perf_counter() - t0
    if fill["failed"] or fill["refused"] or fill["filled"] + fill["cached"] != len(ds.blocks):
        raise RuntimeError(f"the cache service of node {node_a} did not take every block: {fill}")
    remote_rank: Any = ray.remote(num_cpus=0)(PeerRank)
    rank = holder["rank"] = remote_rank.options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_b, soft=False), max_restarts=0
    ).remote(url, storage_options, block_bytes, node_a, concurrency, rounds)
    if "worker" in vias:
        ray.get(rank.start_worker.remote(), timeout=180)
    pids = dict(pids, service=int(info["pid"]), **ray.get(rank.pids.remote(), timeout=120))
    out: dict = {
        "files": block_files(info["cache_dir"], ds),
        "fill": fill,
        "blocks": len(ds.blocks),
        "bytes": nbytes,
        "rounds": rounds,
        "concurrency": concurrency,
        "pids": pids,
    }
    idle = {k: pids[k] for k in ("rank", "worker", "service", "raylet A", "raylet B") if k in pids}
    i0, t0 = cpu_marks(idle), time.perf_counter()
    time.sleep(IDLE_S)
    out["idle_cpu_s_per_s"] = {k: v / (time.perf_counter() - t0) for k, v in cpu_between(i0, cpu_marks(idle)).items()}
    for via in vias:
        out[via] = _passes(rank, via, pids, reps, nbytes * rounds, out["idle_cpu_s_per_s"])
        if via == "direct":
            out["calls"] = _calls(rank, {k: pids[k] for k in counted_roles(via)}, reps, len(ds.blocks))
            v = ray.get(rank.verify_cpu_s.remote(), timeout=600)
            out["verify_cpu_s_per_GB"] = v["cpu_s"] / (v["bytes"] / GB)
    return out


def _passes(rank, via: str, pids: dict, reps: int, moved: int, idle_per_s: dict) -> dict:
    """One untimed pass ``via`` on ``rank``, then ``reps`` timed ones (each moving ``moved``
    bytes); the one with the least CPU of both ends (:func:`stoker_lab.bench.peer_report.ends`)."""
    import ray

    counted = {k: pids[k] for k in counted_roles(via)}
    apart = {k: p for k, p in pids.items() if k not in counted}
    method = getattr(rank, VIAS[via])
    ray.get(method.remote(), timeout=600)  # connections, first buffers, thread start: not measured
    passes = []
    for _ in range(max(1, reps)):
        c0, a0, t0 = cpu_marks(counted), cpu_marks(apart), time.perf_counter()
        r = ray.get(method.remote(), timeout=600)
        c1, a1, span = cpu_marks(counted), cpu_marks(apart), time.perf_counter() - t0
        if r["bytes"] != moved or r["counters"]["fetch_peer"] != moved:
            raise RuntimeError(
                f"a pass ({via}) moved {r['bytes']} bytes, {r['counters']['fetch_peer']} from the peer's "
                f"cache, expected {moved} (counters {r['counters']})"
            )
        by = cpu_between(c0, c1)
        sender, receiver = ends(via, by, idle_per_s, span, moved)
        passes.append(
            {
                "cpu_s": sender["cpu_s"] + receiver["cpu_s"],
                "wall_s": r["wall_s"],
                "sender": sender,
                "receiver": receiver,
                "by_process": by,
                "apart_cpu_s": cpu_between(a0, a1),
                "digest": r["digest"],
                "counters": r["counters"],
            }
        )
    best = min(passes, key=lambda p: p["cpu_s"])
    return dict(
        best,
        bytes=moved,
        cpu_s_per_GB=best["cpu_s"] / (moved / GB),
        GBps=moved / GB / best["wall_s"] if best["wall_s"] > 0 else 0.0,
        passes=[{"cpu_s": p["cpu_s"], "wall_s": p["wall_s"]} for p in passes],
    )


def _calls(rank, counted: dict, reps: int, blocks: int) -> dict:
    """What a request costs apart from its bytes: ``reps`` passes of :meth:`PeerRank.read_heads`
    (1 KiB of each block); ``{bytes, cpu_s_per_call, by_process (CPU-s per call), wall_s}`` of
    the pass with the least CPU (raylets whole: no increment taken)."""
    import ray

    ray.get(rank.read_heads.remote(), timeout=600)
    best = None
    for _ in range(max(1, reps)):
        c0 = cpu_marks(counted)
        r = ray.get(rank.read_heads.remote(), timeout=600)
        by = cpu_between(c0, cpu_marks(counted))
        if best is None or sum(by.values()) < sum(best[0].values()):
            best = (by, r)
    assert best is not None
    by, r = best
    return {
        "bytes": r["bytes"],
        "head_bytes": 1024,
        "cpu_s_per_call": sum(by.values()) / blocks,
        "by_process": {k: v / blocks for k, v in by.items()},
        "wall_s": r["wall_s"],
    }


def stop(holder: dict | None) -> None:
    """Stop what :func:`measure` started: the rank (``holder["rank"]``: its worker child too)
    and every cache service. Never raises."""
    import ray

    from stoker.cluster.service.cache_service import stop_services

    rank = (holder or {}).get("rank")
    if rank is not None:
        try:
            ray.get(rank.close.remote(), timeout=30)
        except Exception:  # noqa: BLE001 - killed next
            pass
        try:
            ray.kill(rank, no_restart=True)
        except Exception:  # noqa: BLE001 - gone already
            pass
    try:
        stop_services()
    except Exception:  # noqa: BLE001 - tear-down: the cluster goes next anyway
        pass


# -- loopback -------------------------------------------------------------------
def loopback(
    url: str,
    storage_options: dict,
    block_bytes: int,
    workdir: str,
    concurrency: int = 8,
    reps: int = 3,
    object_store_bytes: int = 200 << 20,
    profile_s: float = PROFILE_S,
    pass_bytes: int = PASS_BYTES,
) -> list:
    """The stage over loopback: a 2-node ``ray.cluster_utils.Cluster`` on this machine (node A the
    head, node B added; one CPU each), joined by this process, :func:`measure` (passes of about
    ``pass_bytes``), the floor between two processes on the address the data endpoint listens on,
    and over 2x a profile of ``profile_s`` seconds of passes (0: none). Everything started is
    stopped on every exit path (the rank and its worker child, the services, the cluster and its
    session files, the node cache under ``workdir``); if this process is killed, Ray's processes
    end with it (they share its fate). Returns the rows
    (:func:`peer_rows`). RuntimeError when this process has joined a Ray cluster already."""
    import ray
    from ray.cluster_utils import Cluster

    from stoker.store.dataset import open_dataset

    from . import peer_floor

    if ray.is_initialized():
        raise RuntimeError("the loopback peer stage starts its own Ray cluster; this process has joined one")
    open_dataset(url, storage_options=storage_options, cache=False, check=False, block_bytes=block_bytes)  # fail fast
    cache_root = os.path.join(workdir, "peer-cache-loopback")
    shutil.rmtree(cache_root, ignore_errors=True)
    # Ray's session files (logs, sockets) in a directory of this run, removed with it; a short
    # path under the system's temporary directory keeps the sockets' paths under 108 bytes
    ray_tmp = tempfile.mkdtemp(prefix="stoker-ray-")
    node_args: dict[str, Any] = {"num_cpus": 1, "object_store_memory": object_store_bytes, "temp_dir": ray_tmp}
    holder: dict = {}
    cluster = None
    try:
        cluster = Cluster(initialize_head=True, head_node_args=dict(node_args, include_dashboard=False))
        node_b = cluster.add_node(**node_args)
        ray.init(address=cluster.address, include_dashboard=False, logging_level=logging.ERROR, log_to_driver=False)
        cluster.wait_for_nodes()
        node_ip = _local_address({n["NodeManagerAddress"] for n in ray.nodes()})
        head = cluster.head_node
        assert head is not None
        pids = {
            "raylet A": _pid(head, "raylet"),
            "raylet B": _pid(node_b, "raylet"),
            "gcs": _pid(head, "gcs_server"),
            "driver": os.getpid(),
        }
        m = measure(
            url,
            storage_options,
            block_bytes,
            head.node_id,
            node_b.node_id,
            cache_root,
            pids,
            concurrency,
            reps,
            pass_bytes,
            holder=holder,
        )
        floor = peer_floor.transfer(m["files"], node_ip, reps, m["rounds"], concurrency)
        return peer_rows(
            "loopback",
            m,
            floor,
            f"a bare TCP transfer of the same block files over {node_ip} (the data endpoint's address), "
            + FLOOR_WHAT.format(rounds=m["rounds"], concurrency=concurrency),
            holder.get("rank"),
            profile_s,
            network={
                "kind": "loopback",
                "ray_node_ip": node_ip,
                "floor_host": node_ip,
                "note": "Ray's nodes, their data endpoints and the floor use this machine's own address, which "
                "the kernel routes through the loopback device",
            },
        )
    finally:
        stop(holder)
        if ray.is_initialized():
            ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
        shutil.rmtree(cache_root, ignore_errors=True)
        shutil.rmtree(ray_tmp, ignore_errors=True)


def loopback_process(
    url: str,
    storage_options: dict,
    block_bytes: int,
    workdir: str,
    concurrency: int = 8,
    reps: int = 3,
    profile_s: float = PROFILE_S,
    timeout_s: float = 600.0,
    pass_bytes: int = PASS_BYTES,
) -> list:
    """:func:`loopback` in a new Python process (``python -m stoker_lab.bench.peer_stage``), for a
    caller that must not start Ray itself: one that has read through obstore (Ray forks its daemons
    with a ``preexec_fn``, which a tokio runtime does not survive) or has joined another cluster.
    Returns its rows; RuntimeError with the process's error output when it fails or runs past
    ``timeout_s`` seconds (it is killed, and Ray's processes with it)."""
    import json
    import sys

    os.makedirs(workdir, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="stoker-peer-", dir=workdir) as d:
        spec, out = os.path.join(d, "spec.json"), os.path.join(d, "rows.json")
        with open(spec, "w") as f:
            json.dump(
                {
                    "url": url,
                    "storage_options": storage_options,
                    "block_bytes": block_bytes,
                    "workdir": workdir,
                    "concurrency": concurrency,
                    "reps": reps,
                    "profile_s": profile_s,
                    "pass_bytes": pass_bytes,
                },
                f,
            )
        env = dict(os.environ)
        src = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [src, env.get("PYTHONPATH")]))
        with open(os.path.join(d, "log"), "wb") as log:
            p = subprocess.Popen(
                [sys.executable, "-m", __name__, spec, out], stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env
            )
            try:
                p.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                pass
            finally:  # also on Ctrl-C or an error here: Ray's processes end with it
                if p.poll() is None:
                    p.kill()
                    p.wait()
        if p.returncode != 0 or not os.path.exists(out):
            with open(os.path.join(d, "log"), errors="replace") as f:
                tail = f.read()[-3000:]
            why = f"ran past {timeout_s} s" if p.returncode == -9 else f"exited with code {p.returncode}"
            raise RuntimeError(f"the loopback peer stage {why}:\n{tail}")
        with open(out) as f:
            return json.load(f)


def main(spec_path: str, out_path: str) -> int:
    """:func:`loopback` with the arguments in the JSON file ``spec_path``; writes its rows to ``out_path``."""
    import json

    with open(spec_path) as f:
        spec = json.load(f)
    rows = loopback(
        spec["url"],
        spec["storage_options"],
        spec["block_bytes"],
        spec["workdir"],
        spec["concurrency"],
        spec["reps"],
        profile_s=spec["profile_s"],
        pass_bytes=spec["pass_bytes"],
    )
    with open(out_path, "w") as f:
        json.dump(rows, f)
    return 0


def _local_address(ips: set) -> str:
    """The one address of the loopback cluster's nodes, checked to be this machine's own (it can
    be bound here), so that no byte of the stage leaves the machine. RuntimeError otherwise."""
    import socket

    if len(ips) != 1:
        raise RuntimeError(f"the loopback cluster's nodes have several addresses: {sorted(ips)}")
    (ip,) = ips
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((ip, 0))
    except OSError as exc:
        raise RuntimeError(f"the loopback cluster's address {ip} is not one of this machine's: {exc}") from exc
    return ip


def _pid(node, kind: str) -> int:
    """The pid of the ``kind`` process (``"raylet"``, ``"gcs_server"``) of a ``cluster_utils`` node."""
    return int(node.all_processes[kind][0].process.pid)


if __name__ == "__main__":
    import sys

    # through the module's own name: Ray and multiprocessing pickle PeerRank and worker_main by it
    from stoker_lab.bench.peer_stage import main as _main

    sys.exit(_main(*sys.argv[1:]))
