"""The CPU each host of a namespace cluster spends per GB its link carries (``stoker bench cluster --netns``).

For each job's epoch (:func:`stoker_lab.bench.netcluster_driver.run_placements`) and each host
``h<i>``, :func:`host_rows` adds up the CPU seconds of the processes that move its bytes:

- ``ranks_s``: the host's ranks, their own processes over their epoch (each rank's
  ``process_cpu_s`` marks, :func:`stoker_lab.bench.netcluster.cpu_marks`);
- ``service_s``: the host's cache service over the job (its process's CPU time, asked of the
  actor before and after; 0 without one: the ``direct`` placement);
- ``raylet_s``: the host's raylet over the job (every thread's ``schedstat``, found by name among
  the namespace's processes, :func:`pids_named`);

and divides their sum by the bytes its link carried both ways (the kernel's ``rx_bytes +
tx_bytes`` of its ``eth0`` over the job): ``cpu_s_per_GB``, None where the link carried under
:data:`MIN_LINK_BYTES` (a co-located warm epoch reads its own node: CPU spent on no link bytes).
The rank's figure covers its epoch, the service's and the raylet's the whole job around it (start-up
and teardown included), so the sum leans high.
"""

from __future__ import annotations

import subprocess

from .peer_profile import threads_cpu_ns

GB = 1e9
#: Below this many bytes on a host's link its CPU per GB means nothing (the link carried control only).
MIN_LINK_BYTES = 1 << 20


def pids_named(ns: str, comm: str) -> list[int]:
    """Ids of the processes in network namespace ``ns`` whose command name is ``comm``."""
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=30).stdout
    found = []
    for p in out.split():
        try:
            with open(f"/proc/{p}/comm") as f:
                if f.read().strip() == comm:
                    found.append(int(p))
        except (OSError, ValueError):
            continue
    return found


def host_names(links: dict) -> list[str]:
    """The host links' names (``h0``, ``h1``, ...) of a cluster's ``links``, in host order."""
    return sorted((n for n in links if n != "origin"), key=lambda n: int(n[1:]))


def raylets_cpu_s(links: dict) -> dict[str, float]:
    """``{host: CPU seconds of its raylet so far}`` (0 for a host without one: killed, not started)."""
    out = {}
    for name in host_names(links):
        pids = pids_named(links[name]["ns"], "raylet")
        out[name] = sum(sum(threads_cpu_ns(p).values()) for p in pids) / 1e9
    return out


def marks(links: dict, services: dict[str, float], host_of: dict[str, int]) -> dict[str, dict[str, float]]:
    """Now, per host: ``{host: {"raylet_s", "service_s"}}`` from :func:`raylets_cpu_s` and
    ``services`` (``{node id: its cache service's CPU seconds so far}``, the node's host by
    ``host_of``)."""
    raylets = raylets_cpu_s(links)
    out = {name: {"raylet_s": raylets[name], "service_s": 0.0} for name in host_names(links)}
    for node, cpu in services.items():
        h = host_of.get(node)
        if h is not None and f"h{h}" in out:
            out[f"h{h}"]["service_s"] = float(cpu)
    return out


def host_rows(before: dict, after: dict, recs: list[dict], rank_hosts: list[int], kernel_links: dict) -> list[dict]:
    """One entry per host (module doc): ``{host, ranks, ranks_s, service_s, raylet_s, cpu_s,
    link_bytes, cpu_s_per_GB}``. ``before``/``after``: :func:`marks` around the job; ``recs``: the
    job's rank records (each with ``cpu``: its start and end marks), ``rank_hosts``: each rank's
    host index; ``kernel_links``: ``{link: {rx_bytes, tx_bytes}}`` over the job."""
    out = []
    for name in host_names(kernel_links):
        i = int(name[1:])
        mine = [r for r, h in zip(recs, rank_hosts, strict=True) if h == i]
        ranks = sum(r["cpu"][1]["process_cpu_s"] - r["cpu"][0]["process_cpu_s"] for r in mine)
        b, a = before.get(name, {}), after.get(name, {})
        service = max(0.0, a.get("service_s", 0.0) - b.get("service_s", 0.0))
        raylet = max(0.0, a.get("raylet_s", 0.0) - b.get("raylet_s", 0.0))
        link = kernel_links[name]["rx_bytes"] + kernel_links[name]["tx_bytes"]
        cpu = ranks + service + raylet
        out.append(
            {
                "host": name,
                "ranks": len(mine),
                "ranks_s": ranks,
                "service_s": service,
                "raylet_s": raylet,
                "cpu_s": cpu,
                "link_bytes": int(link),
                "cpu_s_per_GB": cpu / (link / GB) if link >= MIN_LINK_BYTES else None,
            }
        )
    return out


def placement_summary(runs: list[dict]) -> dict[str, dict]:
    """Per placement, over its warm epochs (epoch >= 1) with ``host_cpu``: each host's CPU seconds
    and link bytes added up, and their quotient (``cpu_s_per_GB``, None under
    :data:`MIN_LINK_BYTES`): ``{placement: {host: {cpu_s, link_bytes, cpu_s_per_GB}}}``."""
    out: dict[str, dict] = {}
    for r in runs:
        if r.get("epoch", 0) < 1 or not r.get("host_cpu"):
            continue
        per = out.setdefault(r["placement"], {})
        for h in r["host_cpu"]:
            acc = per.setdefault(h["host"], {"cpu_s": 0.0, "link_bytes": 0})
            acc["cpu_s"] += h["cpu_s"]
            acc["link_bytes"] += h["link_bytes"]
    for per in out.values():
        for acc in per.values():
            n = acc["link_bytes"]
            acc["cpu_s_per_GB"] = acc["cpu_s"] / (n / GB) if n >= MIN_LINK_BYTES else None
    return out
