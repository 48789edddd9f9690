"""The CPU that moving bytes costs on a node, for ``stoker plan`` and ``stoker simulate tdcs``.

Four byte paths, each with a cost in CPU-seconds per GB (10^9 bytes) moved, counting every process
on its side of the path (:data:`PATHS`):

- ``fill``: origin -> node cache, a block fetched and written (GETs, checksum, cache write); in the
  ``direct`` setup, which has no cache, a sample's range from the origin into the rank;
- ``peer_send``: the sender's side of a block between nodes (the node's cache service and what it
  sends through);
- ``peer_receive``: the receiver's side (the reading rank's processes and what they receive through);
- ``warm_read``: node cache -> a worker, a hit.

The model counts each byte a rank reads once, on the kind of link it came by (``origin``,
``host_to_host``, ``local``: :data:`stoker_lab.sim.model.LINK_KINDS`), and a fill's block once
more as ``origin`` bytes. So an epoch's byte-moving cores per node are (:func:`byte_cores`)::

    (origin x fill + host_to_host x (peer_send + peer_receive) + local x warm_read) / nodes / epoch s / 1e9

the cluster's bytes spread evenly over its nodes (every host-to-host byte is sent by one node and
received by another), at the epoch's modelled throughput (its bytes over its modelled seconds).
The model gives no link a CPU cost; this is counted after each epoch, and :func:`cpu_utilization`
sets it and the decode cores the epoch kept busy against the node's cores.

The defaults (:data:`DEFAULTS`) are measured figures, each with its source; replace one by editing
its entry, or hand in a ``stoker bench io --json`` report (:func:`from_bench_io`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .reports import load_json

__all__ = [
    "DEFAULTS",
    "DEFAULT_NODE_CORES",
    "FIELDS",
    "PATHS",
    "PEER_ROLES",
    "PathCost",
    "byte_cores",
    "cpu_utilization",
    "from_bench_io",
    "node_cores",
]

GB = 1e9


@dataclass(frozen=True)
class PathCost:
    """One byte path's cost: ``cpu_s_per_GB`` (CPU-seconds per 10^9 bytes moved, >= 0) and where
    the figure comes from (``source``, one line)."""

    cpu_s_per_GB: float
    source: str


#: The byte paths, in the order reports show them.
PATHS = ("fill", "peer_send", "peer_receive", "warm_read")
#: Each path's field of :class:`stoker_lab.sim.tdcs_config.TdcsConfig` (and of the plan's assumptions).
FIELDS = {p: f"{p}_cpu_s_per_GB" for p in PATHS}

#: The peer path over the cache service's data endpoint (``sendfile`` out of the cache file, one
#: connection per process, ``recv_into``; the reader checks each block against the index), ``stoker
#: bench io --peer loopback,netns`` on a 2-core machine at a load of 3-5: each end of
#: benchmarks/bench_io_peer.json's costliest row (the planner's own rule for a report,
#: :func:`from_bench_io`: the rank reading over a namespace link shaped to 1 Gbit/s; over loopback
#: 0.36-0.43 CPU-s/GB both ends). The Ray path it replaced cost 11.5 (3.78 sending, 7.72 receiving).
PEER_SEND_CPU_S_PER_GB = 0.17
PEER_RECEIVE_CPU_S_PER_GB = 0.67
PEER_SUM_CPU_S_PER_GB = PEER_SEND_CPU_S_PER_GB + PEER_RECEIVE_CPU_S_PER_GB
#: The sender's share of the sum: how a report's peer row with only the sum is split.
PEER_SEND_SHARE = PEER_SEND_CPU_S_PER_GB / PEER_SUM_CPU_S_PER_GB
_PEER_SOURCE = (
    "stoker bench io --peer loopback,netns on a 2-core machine: a block from a peer's cache service over its "
    "data endpoint to a rank, over a network-namespace link shaped to 1 Gbit/s, {both:.2f} CPU-s/GB both ends; "
    "{end} (benchmarks/bench_io_peer.json, stage 'peer cache service->rank (netns, 1000 Mbit/s)' {key}.cpu_s_per_GB)"
)

#: The default cost of each byte path. Each figure is one measured run's; hand in a newer one with
#: ``--cpu-costs`` (:func:`from_bench_io`), or edit the entry.
DEFAULTS: dict[str, PathCost] = {
    "fill": PathCost(
        2.55,
        "stoker bench io on a 2-core machine: origin -> cache, the prefetch process in a cold epoch "
        "(benchmarks/bench_io.json origin_to_cache_cpu_s_per_GB; benchmarks/README.md, the byte path "
        "beside its floors)",
    ),
    "peer_send": PathCost(
        PEER_SEND_CPU_S_PER_GB,
        _PEER_SOURCE.format(
            both=PEER_SUM_CPU_S_PER_GB, end="the sender's: the cache service + its raylet's increment", key="sender"
        ),
    ),
    "peer_receive": PathCost(
        PEER_RECEIVE_CPU_S_PER_GB,
        _PEER_SOURCE.format(
            both=PEER_SUM_CPU_S_PER_GB, end="the receiver's: the rank + its raylet's increment", key="receiver"
        ),
    ),
    "warm_read": PathCost(
        0.20,
        "stoker bench io on a 2-core machine: cache (disk tier) -> worker, a worker's reads of the "
        "samples from the node cache (benchmarks/bench_io.json; benchmarks/README.md)",
    ),
}

#: A node's CPU cores when neither ``--cores-per-node`` nor ``--decode-cores`` says otherwise.
DEFAULT_NODE_CORES = (40, "assumption: a DGX-1's 40 CPU cores (2x Xeon E5-2698 v4), decode_cores' default too")

#: The processes of ``stoker bench io``'s peer rows (``cpu_s_by_process``) on each end (``relay
#: child``: the reports of the Ray peer path, before the data endpoint).
PEER_ROLES = {"peer_send": ("service", "raylet A"), "peer_receive": ("rank", "raylet B", "worker", "relay child")}
#: Stage names in a ``stoker bench io --json`` report: the fill (its prefix) and the warm read.
FILL_STAGE = "origin->cache"
WARM_STAGE = "cache (disk tier)->worker"
PEER_STAGE = "peer"
SIDES = {"peer_send": "sender", "peer_receive": "receiver"}


def byte_cores(costs: dict[str, float], link_bytes: dict[str, float], nodes: int, seconds: float) -> dict:
    """Cores per node moving bytes in one epoch: ``{path: cores for each of PATHS, "total"}``.

    ``costs``: CPU-s/GB per path (:data:`PATHS`); ``link_bytes``: the cluster's bytes of the
    epoch by kind of link (``origin``, ``host_to_host``, ``local``); ``nodes`` >= 1; ``seconds``:
    the epoch's. Formula in the module docstring; all 0 for an epoch of 0 seconds."""
    moved = {
        "fill": link_bytes.get("origin", 0.0),
        "peer_send": link_bytes.get("host_to_host", 0.0),
        "peer_receive": link_bytes.get("host_to_host", 0.0),
        "warm_read": link_bytes.get("local", 0.0),
    }
    out = {p: float(moved[p]) / nodes / seconds * costs[p] / GB if seconds > 0 else 0.0 for p in PATHS}
    out["total"] = sum(out[p] for p in PATHS)
    return out


def cpu_utilization(byte_cores_per_node: float, decode_cores_per_node: float, cores: int) -> float:
    """The node's cores kept busy, as a fraction of them: (byte-moving cores + decode cores busy) /
    ``cores``. Over 1: the node's cores are short (the model's epoch is faster than they allow).
    0 with no cores given (0)."""
    return (byte_cores_per_node + decode_cores_per_node) / cores if cores > 0 else 0.0


def node_cores(given: int | None, decode_cores: int, decode_given: bool) -> tuple[int, int, dict[str, str]]:
    """``(cores per node, decode cores per node, sources)`` of ``--cores-per-node`` (``given``; None:
    not given) and the decode cores (``decode_cores``, given as ``--decode-cores`` or the default).
    Decoding runs on the node's cores and, by default, has every one of them (the default's 40
    are a DGX-1's), so the one given sets the other: ``--decode-cores`` alone sets the node's cores
    to it (0, decoding costs nothing: the default node's), ``--cores-per-node`` alone sets the decode
    cores to it; neither: :data:`DEFAULT_NODE_CORES` and ``decode_cores``. ``sources`` has the
    source of each figure set here (none for a default). Raises ValueError for fewer than 1 core,
    or ``--decode-cores`` over ``--cores-per-node``."""
    if given is None:
        if decode_given and decode_cores > 0:
            why = f"--decode-cores {decode_cores}: no --cores-per-node given, so decoding has every core of the node"
            return decode_cores, decode_cores, {"cores_per_node": why}
        return DEFAULT_NODE_CORES[0], decode_cores, {}
    if given < 1:
        raise ValueError(f"--cores-per-node must be >= 1, got {given}")
    src = {"cores_per_node": "given (--cores-per-node)"}
    if not decode_given:
        why = f"--cores-per-node {given}: no --decode-cores given, so decoding has every core of the node"
        return given, given, src | {"decode_cores": why}
    if decode_cores > given:
        raise ValueError(
            f"--decode-cores {decode_cores} is more than the node's cores (--cores-per-node {given}): decoding "
            "runs on the node's cores"
        )
    return given, decode_cores, src


def _number(value, path: str, where: str) -> float | None:
    """A cost read from a report: None when absent (None), else a finite number >= 0. Raises
    ValueError naming the report and the key for anything else."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"--cpu-costs {path}: {where} is {value!r}, not a cost in CPU-s/GB (a number >= 0)")
    return float(value)


def _stages(rep: dict, path: str) -> list[dict]:
    stages = rep.get("stages")
    if not isinstance(stages, list) or not all(isinstance(s, dict) and isinstance(s.get("stage"), str) for s in stages):
        raise ValueError(f"--cpu-costs {path}: no 'stages' list of named stages: not a stoker bench io --json report")
    return stages


def _fill(rep: dict, stages: list[dict], path: str) -> tuple[float, str] | None:
    for s in stages:
        if s["stage"].startswith(FILL_STAGE):
            v = _number(s.get("cpu_s_per_GB"), path, f"stage {s['stage']!r} cpu_s_per_GB")
            if v is not None:
                return v, f"stage {s['stage']!r} cpu_s_per_GB"
    v = _number(rep.get("origin_to_cache_cpu_s_per_GB"), path, "origin_to_cache_cpu_s_per_GB")
    return (v, "origin_to_cache_cpu_s_per_GB") if v is not None else None


def _warm(stages: list[dict], path: str) -> tuple[float, str] | None:
    for s in stages:
        if s["stage"] == WARM_STAGE:
            v = _number(s.get("cpu_s_per_GB"), path, f"stage {WARM_STAGE!r} cpu_s_per_GB")
            if v is not None:
                return v, f"stage {WARM_STAGE!r} cpu_s_per_GB"
    return None


def _side(row: dict, path: str, which: str) -> tuple[float, str] | None:
    """One end of a peer row (``which``: peer_send or peer_receive): its own figure (``sender``/
    ``receiver`` ``.cpu_s_per_GB``, or ``sender_cpu_s_per_GB``), else the CPU of its processes in
    ``cpu_s_by_process`` over ``bytes`` (when every process there is a known role); None without."""
    side, name = SIDES[which], row["stage"]
    nested = row.get(side)
    for key, value in (
        (f"{side}.cpu_s_per_GB", nested.get("cpu_s_per_GB") if isinstance(nested, dict) else None),
        (f"{side}_cpu_s_per_GB", row.get(f"{side}_cpu_s_per_GB")),
    ):
        v = _number(value, path, f"stage {name!r} {key}")
        if v is not None:
            return v, f"stage {name!r} {key}"
    by, nbytes = row.get("cpu_s_by_process"), row.get("bytes")
    known = {r for roles in PEER_ROLES.values() for r in roles}
    if isinstance(by, dict) and by and set(by) <= known and isinstance(nbytes, (int, float)) and nbytes > 0:
        roles = [r for r in PEER_ROLES[which] if r in by]
        cpu = sum(_number(by[r], path, f"stage {name!r} cpu_s_by_process.{r}") or 0.0 for r in roles)
        return cpu / (nbytes / GB), f"stage {name!r} cpu_s_by_process ({' + '.join(roles)}) / bytes"
    return None


def _peer_row(row: dict, path: str) -> dict[str, tuple[float, str]]:
    """``{path: (cost, where in the report)}`` of one measured peer row: each end's own figure
    (:func:`_side`), else the summed ``cpu_s_per_GB`` split as the defaults split it."""
    out = {}
    total = _number(row.get("cpu_s_per_GB"), path, f"stage {row['stage']!r} cpu_s_per_GB")
    for which in SIDES:
        got = _side(row, path, which)
        if got is None and total is not None:
            share = PEER_SEND_SHARE if which == "peer_send" else 1 - PEER_SEND_SHARE
            got = (
                total * share,
                (
                    f"stage {row['stage']!r} cpu_s_per_GB (both ends) x {share:.1%}, the defaults' split (no "
                    f"{SIDES[which]} figure in the row)"
                ),
            )
        if got is not None:
            out[which] = got
    return out


def _peers(stages: list[dict], path: str) -> dict[str, tuple[float, str]]:
    """The peer figures of the costliest measured peer row (the most CPU-s/GB over both ends):
    the planner plans for the dearest way a rank was measured reading a peer."""
    rows = [_peer_row(s, path) for s in stages if s["stage"].startswith(PEER_STAGE)]
    rows = [r for r in rows if r]
    if not rows:
        return {}
    return max(rows, key=lambda r: sum(v for v, _ in r.values()))


def from_bench_io(path: str) -> dict[str, PathCost]:
    """The cost of each of :data:`PATHS` from a ``stoker bench io --json`` report at ``path``.

    - ``fill``: the ``origin->cache ...`` stage's ``cpu_s_per_GB`` (else ``origin_to_cache_cpu_s_per_GB``);
    - ``peer_send``/``peer_receive``: of the measured ``peer ...`` stages (those with figures), the
      one with the most CPU-s/GB over both ends; in it each end's ``sender.cpu_s_per_GB`` /
      ``receiver.cpu_s_per_GB`` (or ``sender_cpu_s_per_GB`` / ``receiver_cpu_s_per_GB``), else that
      end's processes in ``cpu_s_by_process`` (:data:`PEER_ROLES`) over ``bytes``, else the row's
      ``cpu_s_per_GB`` (both ends) split as :data:`DEFAULTS` split it;
    - ``warm_read``: the ``cache (disk tier)->worker`` stage's ``cpu_s_per_GB``.

    A figure the report lacks (or holds as null: a stage not measured) is the default's, its source
    saying so. Every source names the report, the machine's cores where it gives them, and the key.
    Raises ValueError naming ``--cpu-costs`` and the report for a missing or unreadable file, one
    that is not JSON or has no ``stages`` list, and a figure that is not a number >= 0."""
    rep = load_json(path, "--cpu-costs")
    stages = _stages(rep, path)
    machine = rep.get("machine")
    cores = machine.get("cores") if isinstance(machine, dict) else None
    where = f"{path} (stoker bench io{f', {cores} cores' if cores else ''})"
    found: dict[str, tuple[float, str] | None] = {"fill": _fill(rep, stages, path), "warm_read": _warm(stages, path)}
    found |= _peers(stages, path)
    out = {}
    for p in PATHS:
        got = found.get(p)
        if got is None:
            d = DEFAULTS[p]
            out[p] = PathCost(d.cpu_s_per_GB, f"default, {path} has no figure for it: {d.source}")
        else:
            out[p] = PathCost(got[0], f"{where}: {got[1]}")
    return out
