"""``stoker simulate --validate``: the model against measured runs.

For every epoch of every placement of each ``stoker bench cluster --netns`` report, and of the
``stoker demo`` report, the model runs the exact configuration (hosts, link rates, origin
latency, cache bytes, the driver's jobs and seeds; the demo's workers, consumer rate and origin)
and the row gives measured against predicted epoch seconds and bytes per kind of link.

Measured bytes are stoker's own counts (payload bytes, what the model predicts); the kernel's
link counts (headers and control traffic included) are given beside them for the namespace runs.
"""

from __future__ import annotations

import os

from .calibrate import (
    Calibrated,
    cold_direct_row,
    demo_params,
    demo_workload,
    fit_link_factor,
    fit_probe_cpu,
    fit_starting,
    local_latency,
    measure_cache_read_Bps,
    netns_params,
    netns_setup,
)
from .model import Job, simulate
from .reports import load_decode, load_demo, load_netns

#: Done when each epoch is within this fraction of its measured seconds ...
TIME_TOLERANCE = 0.15
#: ... and each byte count within this fraction.
BYTES_TOLERANCE = 0.05
#: Epochs shorter than this (seconds) are judged by their absolute error, apart: a few Ray task
#: starts and one scheduler tick on the shared 2 cores decide them, and a ratio of two
#: near-zero times says little.
TINY_S = 0.5


def _err(pred: float, meas: float) -> float | None:
    return None if meas <= 0 else pred / meas - 1


def _same(a: str, b: str) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


def check_inputs(netns_paths: list[str], demo_path: str | None, calibration_path: str | None) -> str | None:
    """The calibration report as it is named in ``netns_paths`` (None without namespace reports).
    Raises ValueError when there is nothing to validate, when a report is in ``netns_paths`` twice
    (as one file under two names too), or when ``calibration_path`` is not one of them."""
    if not netns_paths and not demo_path:
        raise ValueError("nothing to validate: no --netns report and no --demo report")
    for i, p in enumerate(netns_paths):
        for q in netns_paths[:i]:
            if _same(p, q):
                raise ValueError(f"--netns {p}: given twice" + (f" (as {q} too)" if p != q else ""))
    if calibration_path is None:
        return netns_paths[0] if netns_paths else None
    for p in netns_paths:
        if _same(p, calibration_path):
            return p
    if not os.path.exists(calibration_path):
        raise ValueError(f"--calibration {calibration_path}: no such file")
    raise ValueError(
        f"--calibration {calibration_path}: not one of the --netns reports "
        f"({', '.join(netns_paths) or 'none'}): the calibration run must be one of those validated"
    )


def check_own_datasets(reports: dict[str, dict]) -> None:
    """Raises ValueError naming the report and why when a ``--netns`` report's dataset cannot be
    made again exactly as reported (:func:`stoker_lab.sim.measured.netns_dataset`): the model could
    not place blocks and ranks as the run did, and a made-up layout must be asked for."""
    from .measured import netns_dataset

    for path, rep in reports.items():
        wl, why = netns_dataset(rep, path)
        if wl is None:
            raise ValueError(
                f"{path}: its dataset cannot be made again exactly as reported "
                f"({why.removeprefix(path + ': ')}), so the model cannot place blocks and ranks as "
                "the run did; --made-up-layout models it on a made-up layout instead"
            )


def netns_label(report: dict) -> str:
    """A short name of a namespace configuration: hosts and link rates."""
    links = report["links"]
    host = min(v["mbit"] for k, v in links.items() if k != "origin")
    return f"netns {report['hosts']} hosts, host {host:g} / origin {links['origin']['mbit']:g} Mbit/s"


def validate(
    netns_paths: list[str],
    demo_path: str | None,
    decode_path: str | None,
    calibration_path: str | None = None,
    measured: bool = True,
) -> dict:
    """Run the model on every measured configuration; returns ``{parameters, rows, summary}``.

    ``netns_paths``: ``stoker bench cluster --netns`` reports; ``calibration_path``: the one
    the local read time is taken from (default: the first); each report with a peer probe
    (``peer_probe``) gets its own peer request time from it
    (:func:`stoker_lab.sim.calibrate.fit_probe_cpu`), the others the calibration run's
    (:func:`stoker_lab.sim.calibrate.fit_starting`); ``demo_path``:
    a ``stoker demo`` report (None: skipped); ``decode_path``: a ``stoker bench decode``
    report for the decode pipeline's efficiency. Each row: ``config``, ``placement``,
    ``job``, ``epoch``, ``measured_s``, ``predicted_s``, ``measured_bytes``,
    ``predicted_bytes`` (``{"origin", "host_to_host"}``, bytes), ``kernel_bytes`` (namespace
    runs), ``time_error``/``bytes_error`` (predicted / measured - 1) and ``in_sample`` (the row
    is of the calibration run); namespace rows also ``rank_start_s``, ``measured_rank_s`` and
    ``predicted_rank_s`` (each rank's start offset and own seconds; None where the report has
    none). ``measured``: the namespace runs' own datasets, node keys, rank hosts and rank starts
    (:func:`stoker_lab.sim.calibrate.netns_setup`; False: made-up ones, ranks started together).
    Every report is read and checked (:mod:`stoker_lab.sim.reports`, :func:`check_inputs`, and with
    ``measured`` :func:`check_own_datasets`) before the model runs. Raises ValueError naming the
    report for one that is missing, unreadable, of another kind or inconsistent.
    """
    reps = {path: load_netns(path) for path in netns_paths}
    cal_path = check_inputs(netns_paths, demo_path, calibration_path)
    demo = load_demo(demo_path) if demo_path else None
    bench = load_decode(decode_path) if decode_path else None
    if measured:
        check_own_datasets(reps)
    params: dict[str, Calibrated] = {"cache_read_Bps": measure_cache_read_Bps()}
    rows: list[dict] = []
    factors: dict[str, Calibrated] = {}
    peak = params["cache_read_Bps"].value if measured else 0.0  # a veth copies packets in memory
    setups = {path: netns_setup(reps[path], path, measured, peak) for path in netns_paths}
    for path, st in setups.items():
        params.update({f"{k} of {path}": v for k, v in st.sources.items()})
    if cal_path is not None:
        cal = reps[cal_path]
        params["local_latency_s"] = local_latency(cal, cal_path)
        for path in netns_paths:
            factors[path] = params[f"link delivered fraction of {path}"] = fit_link_factor(
                reps[path], path, params["local_latency_s"].value, setups[path]
            )
        probed = {path for path in netns_paths if reps[path].get("peer_probe") and setups[path].node_keys}
        if len(probed) < len(netns_paths):  # a run without its own probe takes the calibration run's fit
            params["starting_processes"], params["peer_cpu_s"] = fit_starting(
                cal, cal_path, params["local_latency_s"].value, factors[cal_path].value, setups[cal_path]
            )
        for path in sorted(probed, key=netns_paths.index):
            peer = params[f"peer_cpu_s of {path}"] = fit_probe_cpu(
                reps[path], path, params["local_latency_s"].value, factors[path].value, setups[path]
            )
            if reps[path].get("local_probe"):
                params[f"local_cpu_s of {path}"] = fit_probe_cpu(
                    reps[path],
                    path,
                    params["local_latency_s"].value,
                    factors[path].value,
                    setups[path],
                    kind="local",
                    peer_cpu_s=peer.value,
                )
    for path in netns_paths:
        rep = reps[path]
        own = params.get(f"peer_cpu_s of {path}")
        cpu, starting = (
            (own.value, 0) if own is not None else (params["peer_cpu_s"].value, int(params["starting_processes"].value))
        )
        local_cpu = params.get(f"local_cpu_s of {path}")
        p = netns_params(
            rep,
            params["local_latency_s"].value,
            cpu,
            factors[path].value,
            setups[path].node_keys,
            setups[path].peak_Bps,
            starting,
            local_cpu_s=local_cpu.value if local_cpu is not None else 0.0,
        )
        p.cache_read_Bps = params["cache_read_Bps"].value
        params[f"links of {path}"] = Calibrated(
            p.nic_Bps,
            f"{path}: host links (tbf Mbit/s) x its delivered "
            f"fraction, bytes/s; origin latency "
            f"{rep['origin']['latency_ms']} ms",
        )
        fitted = cold_direct_row(rep, path)
        wl = setups[path].workload
        for placement in dict.fromkeys(r["placement"] for r in rep["runs"]):
            res = simulate(p, wl, placement, setups[path].jobs(rep, placement), rep["config"]["epochs"], together=False)
            pred = {(r.job, r.epoch): r for r in res}
            for m in (r for r in rep["runs"] if r["placement"] == placement):
                s = pred[(m["job"], m["epoch"])]
                mb = {"origin": m["stoker"]["origin_bytes"], "host_to_host": m["stoker"]["peer_bytes"]}
                pb = {k: int(s.bytes[k]) for k in mb}
                rows.append(
                    {
                        "config": netns_label(rep),
                        "source": path,
                        "placement": placement,
                        "job": m["job"],
                        "epoch": m["epoch"],
                        "measured_s": m["seconds"],
                        "predicted_s": s.seconds,
                        "measured_bytes": mb,
                        "predicted_bytes": pb,
                        "kernel_bytes": {
                            "origin": m["kernel"]["origin_link_bytes"],
                            "host_to_host": m["kernel"]["host_link_bytes"],
                        },
                        "dataset_bytes": rep["dataset"]["bytes"],
                        "rank_start_s": m.get("rank_start_s"),
                        "measured_rank_s": m.get("rank_seconds"),
                        "predicted_rank_s": s.rank_seconds,
                        "in_sample": m is fitted
                        or (
                            path == cal_path
                            and (own is None or (placement == "direct" and m["stoker"]["origin_bytes"] == 0))
                        ),
                    }
                )
    if demo is not None and demo_path:
        wl = demo_workload(demo)
        for rate in dict.fromkeys(r["consumer_rate"] for r in demo["runs"] if r["loader"] == "stoker"):
            p, extra = demo_params(demo, bench, decode_path or "", demo_path, rate)
            params.update(extra)
            res = simulate(p, wl, "direct", [Job("demo", 1)], demo["config"]["epochs"])
            for m in (r for r in demo["runs"] if r["loader"] == "stoker" and r["consumer_rate"] == rate):
                s = res[m["epoch"]]
                rows.append(
                    {
                        "config": f"demo, consumer {rate:g} samples/s",
                        "source": demo_path,
                        "placement": "direct",
                        "job": "demo",
                        "epoch": m["epoch"],
                        "measured_s": m["seconds"],
                        "predicted_s": s.seconds,
                        "measured_bytes": {"origin": m["origin_bytes"], "host_to_host": 0},
                        "predicted_bytes": {"origin": int(s.bytes["origin"]), "host_to_host": 0},
                        "dataset_bytes": demo["dataset"]["bytes"],
                        "in_sample": False,
                    }
                )
    for r in rows:
        r["time_error"] = _err(r["predicted_s"], r["measured_s"])
        r["bytes_error"] = {k: _err(r["predicted_bytes"][k], r["measured_bytes"][k]) for k in r["measured_bytes"]}
    return {
        "parameters": {k: {"value": v.value, "source": v.source} for k, v in params.items()},
        "rows": rows,
        "summary": summary(rows),
    }


def summary(rows: list[dict]) -> dict:
    """Rows within :data:`TIME_TOLERANCE` / :data:`BYTES_TOLERANCE`, overall and out of sample.
    Epochs under :data:`TINY_S` measured seconds are not in ``time_rows``/``time_within``; ``tiny``
    gives their count and their median and largest absolute error (seconds).
    A byte count under 1% of the dataset (e.g. a co-located job's few peer reads) is compared
    by its difference as a fraction of the dataset instead (a ratio of two near-zero counts
    says nothing)."""

    def ok_bytes(r: dict) -> bool:
        for k, m in r["measured_bytes"].items():
            pred, floor = r["predicted_bytes"][k], 0.01 * r["dataset_bytes"]
            if max(m, pred) < floor:
                continue
            if abs(pred - m) > BYTES_TOLERANCE * max(m, floor):
                return False
        return True

    def count(sel: list[dict]) -> dict:
        t = [r for r in sel if r["time_error"] is not None and r["measured_s"] >= TINY_S]
        tiny = sorted(abs(r["predicted_s"] - r["measured_s"]) for r in sel if r["measured_s"] < TINY_S)
        return {
            "rows": len(sel),
            "time_rows": len(t),
            "time_within": sum(abs(r["time_error"]) <= TIME_TOLERANCE for r in t),
            "bytes_within": sum(ok_bytes(r) for r in sel),
            "tiny": {
                "rows": len(tiny),
                "median_abs_error_s": tiny[len(tiny) // 2] if tiny else None,
                "max_abs_error_s": tiny[-1] if tiny else None,
            },
        }

    for r in rows:
        r["bytes_ok"] = ok_bytes(r)
        r["tiny"] = r["measured_s"] < TINY_S
        r["time_ok"] = r["time_error"] is not None and abs(r["time_error"]) <= TIME_TOLERANCE
    return {
        "all": count(rows),
        "out_of_sample": count([r for r in rows if not r["in_sample"]]),
        "time_tolerance": TIME_TOLERANCE,
        "bytes_tolerance": BYTES_TOLERANCE,
        "tiny_s": TINY_S,
        "repeats": repeats(rows),
    }


def repeats(rows: list[dict]) -> list[dict]:
    """The measured runs' own repeats: per config, placement and job, its warm epochs (no origin
    bytes measured) of :data:`TINY_S` or more, which do the same reads of the same cached blocks.
    Each group: ``config``, ``placement``, ``job``, ``epochs``, ``measured_s`` and ``predicted_s``
    (lists), ``measured_spread`` and ``predicted_spread`` (largest / smallest) and
    ``one_prediction_fits`` (whether any single time is within :data:`TIME_TOLERANCE` of every
    measured one: false when the largest exceeds the smallest by more than
    (1 + tolerance) / (1 - tolerance)). Groups of one epoch are left out."""
    groups: dict = {}
    for r in rows:
        if r["measured_bytes"].get("origin", 0) == 0 and r["measured_s"] >= TINY_S:
            groups.setdefault((r.get("config"), r.get("placement"), r.get("job")), []).append(r)
    out = []
    for (config, placement, job), rs in groups.items():
        if len(rs) < 2:
            continue
        m, p = [r["measured_s"] for r in rs], [r["predicted_s"] for r in rs]
        out.append(
            {
                "config": config,
                "placement": placement,
                "job": job,
                "epochs": [r.get("epoch") for r in rs],
                "measured_s": m,
                "predicted_s": p,
                "measured_spread": max(m) / min(m),
                "predicted_spread": max(p) / min(p),
                "one_prediction_fits": max(m) * (1 - TIME_TOLERANCE) <= min(m) * (1 + TIME_TOLERANCE),
            }
        )
    return out


def table(report: dict) -> str:
    """The validation rows as a Markdown table (MB = 1e6 bytes; error = predicted / measured - 1, or
    predicted - measured seconds for an epoch under :data:`TINY_S`)."""
    lines = [
        "| config | placement | job | epoch | measured s | predicted s | error | origin MB meas / pred "
        "| host-to-host MB meas / pred | in sample |",
        "|---" * 10 + "|",
    ]
    for r in report["rows"]:
        m, p = r["measured_bytes"], r["predicted_bytes"]
        err = (
            f"{r['predicted_s'] - r['measured_s']:+.2f} s (tiny)"
            if r["measured_s"] < TINY_S
            else f"{r['time_error']:+.0%}"
        )
        lines.append(
            f"| {r['config']} | {r['placement']} | {r['job']} | {r['epoch']} | {r['measured_s']:.2f} | "
            f"{r['predicted_s']:.2f} | {err} | {m['origin'] / 1e6:.1f} / "
            f"{p['origin'] / 1e6:.1f} | {m['host_to_host'] / 1e6:.1f} / {p['host_to_host'] / 1e6:.1f} | "
            f"{'yes' if r['in_sample'] else 'no'} |"
        )
    return "\n".join(lines)
