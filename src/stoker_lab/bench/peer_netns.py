"""The peer stage of ``stoker bench io`` over a shaped link: two network namespaces, ``--peer netns``.

:func:`run` makes a :class:`stoker_lab.bench.netcluster.NetCluster` of two hosts (and its origin
namespace), each host link shaped by ``tbf`` to ``mbit`` Mbit/s in each direction; starts the
emulated S3 origin in the origin namespace and a Ray node in each host
(:class:`stoker_lab.bench.netcluster_ray.NetRay`: node A the head on host 0, node B on host 1);
then runs :func:`main` as the Ray driver inside host 0. The driver packs the sample photos into
that origin, measures the stage (:func:`stoker_lab.bench.peer_stage.measure`: node A's cache
service, filled from the origin, serving a rank on node B), runs the floor between the two
hosts (:func:`stoker_lab.bench.peer_floor.transfer`: the server in host 0, the client in host 1,
over the same shaped link, as many times over with as many requests in flight), profiles a pass
when over 2x, and writes the rows as JSON. A pass moves about :data:`PASS_LINK_S` seconds of the
link's bytes.
Every namespace made and every process in it is removed on the way out, on every exit path
(:meth:`stoker_lab.bench.netcluster.NetCluster.close`), with the run's files.

Without CAP_NET_ADMIN or iproute2, :func:`run` raises
:class:`stoker_lab.bench.netcluster.NetnsUnavailable` before anything is made.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import tempfile
import time

#: Default link rate of the two host links, Mbit/s per direction.
DEFAULT_MBIT = 1000.0
#: Seconds of the link a pass fills (the dataset read as many times as it takes): at 1 Gbit/s about
#: 750 MB a pass, about half a CPU-second behind each pass's figures; the stage takes about 2 minutes.
PASS_LINK_S = 6.0


def run(
    data_dir: str,
    block_bytes: int = 1 << 20,
    shard_bytes: int = 16 << 20,
    concurrency: int = 8,
    reps: int = 3,
    mbit: float = DEFAULT_MBIT,
    profile_s: float = 4.0,
    timeout_s: float = 600.0,
) -> list:
    """The stage over a ``tbf`` link of ``mbit`` Mbit/s between two namespaces (module doc);
    ``data_dir``: the sample photos' ``train`` tree; the run's files (Ray's, the node caches) go in
    a new directory under the system's temporary directory, removed at the end. Returns the rows
    (:func:`stoker_lab.bench.peer_stage.peer_rows`). Raises NetnsUnavailable (nothing made),
    RuntimeError with the driver's log when it fails, ``subprocess.TimeoutExpired`` after
    ``timeout_s`` seconds."""
    from .netcluster import NetCluster, check_capability
    from .netcluster_hostcpu import pids_named
    from .netcluster_ray import NetRay

    check_capability()
    # under the system's temporary directory, not ``workdir``: Ray's socket paths under it
    # (``run/r0/session_<date>_<pid>/sockets/plasma_store``) must stay under 108 bytes
    work = tempfile.mkdtemp(prefix="stoknc-peer-")
    phases: dict[str, float] = {}
    t0 = time.perf_counter()
    try:
        with NetCluster(hosts=2, host_mbit=mbit, origin_mbit=max(mbit, 1000.0)) as net:
            procs = NetRay(net, os.path.join(work, "run"), cpus_per_host=1, object_store_bytes=200 << 20)
            procs.start_origin(latency_ms=0.0)
            phases["namespaces_origin_s"] = time.perf_counter() - t0
            procs.start_ray()
            phases["ray_start_s"] = time.perf_counter() - t0 - sum(phases.values())
            pids = {
                "raylet A": pids_named(net.host_ns[0], "raylet"),
                "raylet B": pids_named(net.host_ns[1], "raylet"),
                "gcs": pids_named(net.host_ns[0], "gcs_server"),
            }
            for role, found in pids.items():
                if len(found) != 1:
                    raise RuntimeError(f"expected one {role} process in its namespace, found {found}")
            spec = {
                "address": procs.address,
                "endpoint_url": procs.endpoint_url,
                "data_dir": data_dir,
                "cache_root": os.path.join(work, "caches"),
                "block_bytes": block_bytes,
                "shard_bytes": shard_bytes,
                "concurrency": concurrency,
                "reps": reps,
                "mbit": mbit,
                "profile_s": profile_s,
                "host_ns": net.host_ns,
                "host_ips": net.host_ip,
                "pids": {k: v[0] for k, v in pids.items()},
            }
            spec_path, out_path = os.path.join(work, "spec.json"), os.path.join(work, "rows.json")
            with open(spec_path, "w") as f:
                json.dump(spec, f)
            procs.driver(__name__, spec_path, out_path, timeout_s=timeout_s)
            phases["driver_s"] = time.perf_counter() - t0 - sum(phases.values())
            with open(out_path) as f:
                out = json.load(f)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    phases["teardown_s"] = time.perf_counter() - t0 - sum(phases.values())
    for r in out["rows"]:
        r["network"]["phases_s"] = dict(phases, **out["driver_phases_s"])
    return out["rows"]


def main(spec_path: str, out_path: str) -> int:
    """The driver, in host 0's namespace (see the module doc); writes ``{"rows": [...]}`` to ``out_path``."""
    import ray

    from stoker.store.pack import pack
    from stoker.store.pack_options import PackOptions

    from . import peer_floor
    from .origin import endpoint_options
    from .peer_report import peer_rows
    from .peer_stage import FLOOR_WHAT, measure, stop

    with open(spec_path) as f:
        spec = json.load(f)
    opts = endpoint_options(spec["endpoint_url"])
    ray.init(address=spec["address"], logging_level=logging.ERROR, log_to_driver=False)
    holder: dict = {}
    phases = {}
    t0 = time.perf_counter()
    try:
        url = "s3://stoker/peer"
        dst = PackOptions(dst_storage_options=opts)
        pack(spec["data_dir"], url, options=dst, shard_bytes=spec["shard_bytes"], progress=False)
        phases["driver.pack_s"] = time.perf_counter() - t0
        by_ip = {n["NodeManagerAddress"]: n["NodeID"] for n in ray.nodes() if n.get("Alive")}
        node_a, node_b = (by_ip[ip] for ip in spec["host_ips"])
        pids = dict(spec["pids"], driver=os.getpid())
        m = measure(
            url,
            opts,
            spec["block_bytes"],
            node_a,
            node_b,
            spec["cache_root"],
            pids,
            spec["concurrency"],
            spec["reps"],
            int(PASS_LINK_S * spec["mbit"] * 1e6 / 8),
            holder=holder,
        )
        phases["driver.measure_s"] = time.perf_counter() - t0 - sum(phases.values())
        ns_a, ns_b = spec["host_ns"]
        floor = peer_floor.transfer(
            m["files"],
            spec["host_ips"][0],
            spec["reps"],
            m["rounds"],
            spec["concurrency"],
            server_prefix=("ip", "netns", "exec", ns_a),
            client_prefix=("ip", "netns", "exec", ns_b),
        )
        phases["driver.floor_s"] = time.perf_counter() - t0 - sum(phases.values())
        mbit = spec["mbit"]
        rows = peer_rows(
            f"netns, {mbit:g} Mbit/s",
            m,
            floor,
            f"a bare TCP transfer of the same block files from host A's namespace to host B's over the same "
            f"shaped link (tbf {mbit:g} Mbit/s each way), "
            + FLOOR_WHAT.format(rounds=m["rounds"], concurrency=spec["concurrency"]),
            holder.get("rank"),
            spec["profile_s"],
            network={"kind": "netns", "tbf_mbit": mbit, "hosts": spec["host_ips"], "link_GBps": mbit * 1e6 / 8 / 1e9},
        )
        phases["driver.rows_and_profile_s"] = time.perf_counter() - t0 - sum(phases.values())
        with open(out_path, "w") as f:
            json.dump({"rows": rows, "driver_phases_s": phases}, f)
    finally:
        stop(holder)
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
