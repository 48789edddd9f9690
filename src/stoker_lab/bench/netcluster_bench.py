"""``stoker bench cluster --netns``: direct, random and co-located placement on a cluster of
network namespaces, with the bytes on every link counted by the kernel.

:func:`run` makes a :class:`stoker_lab.bench.netcluster.NetCluster` (3 hosts and an origin on one
bridge, ``tbf``-shaped links), starts the origin server and Ray inside it
(:class:`stoker_lab.bench.netcluster_ray.NetRay`), runs :mod:`stoker_lab.bench.netcluster_driver` in the
first host and removes everything (namespaces, processes, caches) on the way out, also on an
error or Ctrl-C. :func:`summary` compares the kernel's counts with stoker's; :func:`table` and
:func:`plot` show the report.

Protocol overhead: a full 1448-byte TCP segment travels as a 1514-byte Ethernet frame (66 bytes
of Ethernet, IP and TCP headers with timestamps, 4.6%), plus HTTP headers per request and Ray's
own messages; the kernel's count is expected to exceed stoker's by up to that much (less where
veth carries GSO segments of up to 64 KiB with one set of headers), and the report says by how
much it does (``excess_pct``).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time

from .netcluster_hostcpu import placement_summary

#: Ethernet + IPv4 + TCP (with timestamps) headers per full 1448-byte segment: 66 / 1448.
TCP_OVERHEAD = 66 / 1448
#: Below this many stoker bytes an agreement ratio means nothing (the Ray control traffic dominates).
MIN_COMPARED_BYTES = 1 << 20


def run(
    images: int = 900,
    epochs: int = 3,
    hosts: int = 3,
    host_mbit: float = 400.0,
    origin_mbit: float = 200.0,
    latency_ms: float = 20.0,
    block_bytes: int = 1 << 20,
    shard_bytes: int = 16 << 20,
    cache_bytes: int = 256 << 20,
    decode: bool = False,
    seed: int = 0,
    placements: tuple[str, ...] = ("direct", "random", "colocated"),
    workdir: str | None = None,
    job_timeout_s: float = 300.0,
    faults: tuple[str, ...] = ("kill", "link_down"),
    link_down_s: float = 5.0,
    fault_pause_s: float = 0.02,
    state_check: bool = True,
    repeats: int = 1,
    consumer_rate: float = 0.0,
    short_side: tuple[int, int] | None = None,
) -> dict:
    """Run the benchmark; returns the report ``{machine, hosts, links, origin, config, dataset,
    runs, faults, state, control, idle_busy_cores, peer_probe, local_probe, summary, phases_s, seconds}`` (``control``:
    each placement's
    probe, :func:`stoker_lab.bench.netcluster_driver.probe_control`; ``phases_s``: seconds of each phase, in
    order: ``sample_data``, ``namespaces``, ``origin_start``, ``ray_start``, ``driver`` (of which
    ``driver.upload_pack``, one ``driver.<placement>`` each, ``driver.fault_<kind>``,
    ``driver.state_check``) and ``teardown``; ``runs``: one row per placement, job and epoch; bytes in bytes,
    rates in Mbit/s = 1e6 bits/s, seconds in seconds).

    ``workdir``: where the run's files go (default: the system's temporary directory); the
    sample images are made once under ``<workdir or $TMPDIR/stoker-bench-netns>/data`` and reused
    by later runs with the same ``images`` and ``seed``; everything else is removed at the end.
    ``images``: sample images (a multiple of ``hosts`` keeps every rank's share equal, so that
    exactly-once needs no padding). ``faults``: fault runs after the placements
    (:mod:`stoker_lab.bench.netcluster_faults`: ``"kill"``, ``"link_down"`` for ``link_down_s``
    seconds; ``fault_pause_s``: seconds between a fault epoch's reads, so the fault lands in the
    middle); ``state_check``: ``stoker warm``, ``stoker cluster-state`` and the extender's
    prioritize on the cluster (``netcluster_driver.state_check``).
    ``repeats``: every placement run that many times over, each time on empty caches, in the same
    cluster (each row's ``repeat``; each repeat's control and peer probes in ``repeat_probes``,
    the first's also where a report of one repeat has them). ``consumer_rate``: samples/s each
    rank's accelerator takes (``netcluster_driver.Consumer``: ``1 / rate`` s per sample, after
    the read, no read-ahead; 0: none). ``short_side``: the sample photos' shorter side in pixels
    (min, max; default :data:`stoker_lab.sample_data.SHORT_SIDE`, about 65 KB a photo; (400, 600)
    gives about 90 KB, near ImageNet's mean). ``decode``: every rank decodes every sample it
    reads (:func:`stoker.decode.image.decode_image`); ``decode_probe`` in the report: the
    driver's own CPU seconds per decoded sample, apart from every epoch.
    Raises ValueError for ``repeats`` < 1, a negative ``consumer_rate`` or a bad ``short_side``
    (before anything is made); :class:`stoker_lab.bench.netcluster.NetnsUnavailable`
    without CAP_NET_ADMIN (before anything is made), RuntimeError when a process fails (with its
    log), ``subprocess.TimeoutExpired`` when the driver runs past its limit.
    """
    from ..sample_data import SHORT_SIDE, make_sample_data
    from .netcluster import NetCluster, check_capability
    from .netcluster_faults import FAULTS, FaultHandler
    from .netcluster_ray import NetRay

    for f in faults:
        if f not in FAULTS:
            raise ValueError(f"unknown fault {f!r}; choose from {FAULTS}")
    if faults and hosts < 2:
        raise ValueError("fault runs need at least 2 hosts (the Ray head is never the victim)")
    check_options(repeats, consumer_rate, short_side)
    side = tuple(short_side) if short_side is not None else SHORT_SIDE
    check_capability()
    t0 = time.perf_counter()
    if workdir:
        os.makedirs(workdir, exist_ok=True)
    work = tempfile.mkdtemp(prefix="stoknc-", dir=workdir)  # removed at the end, with the caches
    # the sample images (inputs, not caches) stay for the next run, as the other benchmarks' do
    data = os.path.join(workdir or os.path.join(tempfile.gettempdir(), "stoker-bench-netns"), "data")
    phases: dict[str, float] = {}
    t_phase = t0

    def lap(name: str) -> None:
        nonlocal t_phase
        now = time.perf_counter()
        phases[name], t_phase = now - t_phase, now

    try:
        make_sample_data(data, images=images, classes=10, seed=seed, short_side=side)
        lap("sample_data")
        with NetCluster(hosts, host_mbit, origin_mbit) as net:
            lap("namespaces")
            procs = NetRay(net, os.path.join(work, "run"))
            procs.start_origin(latency_ms)
            lap("origin_start")
            procs.start_ray()
            lap("ray_start")
            spec = {
                "address": procs.address,
                "endpoint_url": procs.endpoint_url,
                "direct_url": procs.direct_url,
                "links": net.links(),
                "host_ips": net.host_ip,
                "data_dir": os.path.join(data, "train"),
                "workdir": os.path.join(work, "caches"),
                "epochs": epochs,
                "block_bytes": block_bytes,
                "shard_bytes": shard_bytes,
                "cache_bytes": cache_bytes,
                "seed": seed,
                "decode": decode,
                "placements": list(placements),
                "job_timeout_s": job_timeout_s,
                "faults": list(faults),
                "link_down_s": link_down_s,
                "fault_pause_s": fault_pause_s,
                "fault_peer_timeout_s": 2.0,
                "request_dir": os.path.join(work, "requests"),
                "state_check": state_check,
                "repeats": repeats,
                "consumer_rate": consumer_rate,
            }
            spec_path, out_path = os.path.join(work, "spec.json"), os.path.join(work, "rows.json")
            with open(spec_path, "w") as f:
                json.dump(spec, f)
            budget_s = 120 + job_timeout_s * (repeats * len(placements) * (epochs * 2 + 1) + 3 * len(faults) + 2)
            handler = FaultHandler(net, procs, spec["request_dir"])
            try:
                procs.driver(
                    "stoker_lab.bench.netcluster_driver", spec_path, out_path, timeout_s=budget_s, poll=handler.poll
                )
            finally:
                handler.close()
            lap("driver")
            with open(out_path) as f:
                rows = json.load(f)
            links = net.links()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    lap("teardown")
    phases.update({f"driver.{k}": v for k, v in rows.get("phases_s", {}).items()})
    report = {
        "machine": {"cores": os.cpu_count()},
        "hosts": hosts,
        "links": links,
        "origin": {"latency_ms": latency_ms, "bandwidth": "the origin link's tbf"},
        "config": {
            "jobs": 2,
            "ranks_per_job": hosts,
            "epochs": epochs,
            "block_bytes": block_bytes,
            "seed": seed,
            "shard_bytes": shard_bytes,
            "cache_bytes_per_node": cache_bytes,
            "decode": decode,
            "repeats": repeats,
            "consumer_rate": consumer_rate,
            "image_short_side": list(side),
            "jobs_run": "one after the other, so each job's kernel counts are its own",
            "rank_start": "together: a job's ranks start their clocks at one gate (bench/start_gate.py)",
        },
        "dataset": rows["dataset"],
        "setup_s": rows["setup_s"],
        "runs": rows["runs"],
        "faults": rows.get("faults", []),
        "state": rows.get("state"),
        "control": rows.get("control"),
        "idle_busy_cores": rows.get("idle_busy_cores"),
        "peer_probe": rows.get("peer_probe"),
        "local_probe": rows.get("local_probe"),
        "decode_probe": rows.get("decode_probe"),
        "repeat_probes": rows.get("repeat_probes"),
        "phases_s": phases,
    }
    report["config"].update(
        faults=list(faults), link_down_s=link_down_s, fault_pause_s=fault_pause_s, fault_peer_timeout_s=2.0
    )
    report["summary"] = summary(report)
    report["seconds"] = time.perf_counter() - t0
    return report


def check_options(repeats: int, consumer_rate: float, short_side: tuple[int, int] | None) -> None:
    """Raises ValueError naming the option for ``repeats`` < 1 (or not an integer), a negative or
    non-finite ``consumer_rate`` (samples/s), or a ``short_side`` that is not two pixel counts
    16 <= min <= max."""
    import math

    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an integer >= 1, got {repeats!r}")
    if not isinstance(consumer_rate, (int, float)) or not math.isfinite(consumer_rate) or consumer_rate < 0:
        raise ValueError(f"consumer rate must be a number >= 0 samples/s per rank, got {consumer_rate!r}")
    if short_side is not None:
        ok = len(short_side) == 2 and all(isinstance(x, int) and not isinstance(x, bool) for x in short_side)
        if not ok or not 16 <= short_side[0] <= short_side[1]:
            raise ValueError(f"image short side must be MIN,MAX pixels with 16 <= MIN <= MAX, got {short_side!r}")


def _excess(kernel: int, stoker: int) -> float | None:
    return None if stoker < MIN_COMPARED_BYTES else (kernel / stoker - 1) * 100


def summary(report: dict) -> dict:
    """The done-criteria figures.

    Per row, ``agreement``: the kernel's excess over stoker's count in percent (origin link vs
    stoker's origin bytes, host links vs stoker's peer bytes; None where stoker counted under
    1 MiB) and ``agree``: whether each kernel count is within 5% of stoker's count plus the TCP/IP
    headers (:data:`TCP_OVERHEAD`) plus the control bytes of the row's placement.

    Control bytes: what a job sends that is not data (Ray's messages, rank start-up, the driver's
    task submissions, index reads and the origin's stats). Where the report has ``control`` (one
    probe per placement: a job of that placement that reads nothing, run first on its own counter
    window, :func:`stoker_lab.bench.netcluster_driver.probe_control`), a placement's control bytes are
    its probe's host-link and origin-link bytes, measured. For reports without probes, the
    older estimate: the most host-link bytes of a ``direct`` job and the most origin-link bytes of
    a job that stoker says read nothing from the origin, or 0 without such rows. Either way a job
    without data on a link agrees by definition; the check that matters is on the jobs with data.
    ``control_bytes`` in the summary: ``{placement: {host, origin}}``.
    Per placement: the warm epochs' (epoch >= 1) most origin-link bytes as a fraction of the
    dataset, their host-link bytes in total and mean samples/s; ``colocated_vs_random_host``:
    co-located host-link bytes over the random ones'."""
    size = report["dataset"]["bytes"]
    runs = report["runs"]
    probes = report.get("control") or {}
    direct = [r["kernel"]["host_link_bytes"] for r in runs if r["placement"] == "direct"]
    warm = [r["kernel"]["origin_link_bytes"] for r in runs if r["stoker"]["origin_bytes"] == 0]
    fallback = {"host": max(direct, default=0), "origin": max(warm, default=0)}
    control = {
        p: (
            {"host": probes[p]["host_link_bytes"], "origin": probes[p]["origin_link_bytes"]}
            if p in probes
            else fallback
        )
        for p in dict.fromkeys(r["placement"] for r in runs)
    }

    def agrees(kernel: int, stoker: int, extra: int) -> bool:
        return abs(kernel - stoker * (1 + TCP_OVERHEAD)) <= 0.05 * stoker + extra

    for r in runs:
        k, s = r["kernel"], r["stoker"]
        r["agreement"] = {
            "origin_excess_pct": _excess(k["origin_link_bytes"], s["origin_bytes"]),
            "host_excess_pct": _excess(k["host_link_bytes"], s["peer_bytes"]),
            "agree": agrees(k["origin_link_bytes"], s["origin_bytes"], control[r["placement"]]["origin"])
            and agrees(k["host_link_bytes"], s["peer_bytes"], control[r["placement"]]["host"]),
        }
    out = {
        "all_exactly_once": all(r["exactly_once"] for r in runs),
        "control_bytes": control,
        "all_agree": all(r["agreement"]["agree"] for r in runs),
        "placements": {},
    }
    for p in dict.fromkeys(r["placement"] for r in runs):
        rows = [r for r in runs if r["placement"] == p and r["epoch"] >= 1]
        if rows:
            out["placements"][p] = {
                "warm_origin_link_fraction": max(r["kernel"]["origin_link_bytes"] for r in rows) / size,
                "warm_host_link_bytes": sum(r["kernel"]["host_link_bytes"] for r in rows),
                "warm_samples_per_s": sum(r["samples_per_s"] for r in rows) / len(rows),
            }
    pl = out["placements"]
    if "colocated" in pl and "random" in pl and pl["random"]["warm_host_link_bytes"]:
        out["colocated_vs_random_host"] = pl["colocated"]["warm_host_link_bytes"] / pl["random"]["warm_host_link_bytes"]
    ex = [v for r in runs for k, v in r["agreement"].items() if k != "agree" and v is not None]
    out["excess_pct_range"] = [min(ex), max(ex)] if ex else None
    faults = report.get("faults") or []
    out["faults_finished_exactly_once"] = all(f["finished"] and f["exactly_once"] for f in faults) if faults else None
    out["faults_rejoined"] = all(f["rejoin"].get("served") for f in faults) if faults else None
    if report.get("state"):
        out["state_holder_first"] = report["state"]["holder_first"]
    out["tcp_overhead_pct"] = TCP_OVERHEAD * 100
    out["warm_host_cpu"] = placement_summary(runs)
    return out


def host_cpu_table(report: dict) -> str:
    """Each host's CPU per GB its link carried in the warm epochs, per placement (the summary's
    ``warm_host_cpu``, :func:`stoker_lab.bench.netcluster_hostcpu.placement_summary`), as Markdown."""
    per = (report.get("summary") or {}).get("warm_host_cpu") or placement_summary(report.get("runs", []))
    if not per:
        return ""
    hosts = sorted({h for p in per.values() for h in p}, key=lambda n: int(n[1:]))
    lines = [
        "CPU-s per GB on each host's link, warm epochs (the host's ranks, cache service and raylet; link: both ways):",
        "| placement | " + " | ".join(hosts) + " |",
        "|---" * (len(hosts) + 1) + "|",
    ]
    for p, by in per.items():
        cells = []
        for h in hosts:
            v = by.get(h) or {}
            n = v.get("link_bytes", 0) / 1e6
            x = v.get("cpu_s_per_GB")
            cells.append(f"{x:.2f} ({v.get('cpu_s', 0.0):.2f} s / {n:.0f} MB)" if x is not None else f"- ({n:.1f} MB)")
        lines.append(f"| {p} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def table(report: dict) -> str:
    """The report as a Markdown table (MB = 1e6 bytes)."""
    lines = [
        "| placement | job | epoch | samples/s | exactly once | origin link MB (kernel) | origin MB (stoker) "
        "| host-to-host MB (kernel) | peer MB (stoker) | local MB (stoker) |",
        "|---" * 10 + "|",
    ]
    for r in report["runs"]:
        k, s = r["kernel"], r["stoker"]
        lines.append(
            f"| {r['placement']} | {r['job']} | {r['epoch']} | {r['samples_per_s']:,.0f} | "
            f"{'yes' if r['exactly_once'] else 'NO'} | {k['origin_link_bytes'] / 1e6:.1f} | "
            f"{s['origin_bytes'] / 1e6:.1f} | {k['host_link_bytes'] / 1e6:.1f} | "
            f"{s['peer_bytes'] / 1e6:.1f} | {s['local_bytes'] / 1e6:.1f} |"
        )
    return "\n".join(lines)


def fault_table(report: dict) -> str:
    """The fault rows as a Markdown table: where the victim's blocks were read from (MB = 1e6
    bytes) before and after the fault, and whether the host served again once back."""
    lines = [
        "| fault | host | finished | exactly once | seconds | victim's blocks before: peer / origin MB "
        "| after: peer / origin MB (fallbacks) | back: served MB from it |",
        "|---" * 8 + "|",
    ]
    for f in report.get("faults") or []:
        b, a = f["dead_host_blocks"]["before"], f["dead_host_blocks"]["after"]
        back = (f["rejoin"].get("dead_host_blocks") or {}).get("peer_bytes", 0)
        lines.append(
            f"| {f['fault']} | {f['host']} | {'yes' if f['finished'] else 'NO'} | "
            f"{'yes' if f['exactly_once'] else 'NO'} | {f['seconds']:.1f} | {b['peer_bytes'] / 1e6:.1f} / "
            f"{b['origin_bytes'] / 1e6:.1f} | {a['peer_bytes'] / 1e6:.1f} / {a['origin_bytes'] / 1e6:.1f} "
            f"({a['fallbacks']}) | {back / 1e6:.1f} |"
        )
    return "\n".join(lines)


def plot(report: dict, path: str) -> None:
    """A PNG at ``path``: kernel bytes per link (each host's and the origin's, rx + tx) per
    placement, job and epoch, as stacked bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = report["runs"]
    names = list(runs[0]["kernel"]["links"]) if runs else []
    labels = [f"{r['placement'][:3]} {r['job'][-1]}/e{r['epoch']}" for r in runs]
    fig, ax = plt.subplots(figsize=(max(8, len(runs) * 0.5), 4.5))
    bottom = [0.0] * len(runs)
    for name in names:
        vals = [(r["kernel"]["links"][name]["rx_bytes"] + r["kernel"]["links"][name]["tx_bytes"]) / 1e6 for r in runs]
        ax.bar(range(len(runs)), vals, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax.set_xticks(range(len(runs)), labels, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("MB on the link (kernel, rx + tx)")
    links = report.get("links", {})
    ax.set_title(
        "Bytes per link per epoch; links: " + ", ".join(f"{n} {v['mbit']:g} Mbit/s" for n, v in links.items()),
        fontsize=8,
    )
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
