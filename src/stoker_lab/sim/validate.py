"""``stoker simulate --validate``: the model against measured runs.

For every epoch of every placement of each ``stoker bench cluster --netns`` report, and of the
``stoker demo`` report, the model runs the exact configuration (hosts, link rates, origin
latency, cache bytes, the driver's jobs and seeds; the demo's workers, consumer rate and origin)
and the row gives measured against predicted epoch seconds and bytes per kind of link.

Measured bytes are stoker's own counts (payload bytes, what the model predicts); the kernel's
link counts (headers and control traffic included) are given beside them for the namespace runs.

A report of ``stoker bench cluster --netns --repeats N`` holds N repeats of every placement; the
model runs each repeat as a run of its own (its own rank hosts, start offsets, link fit and
probes; :func:`stoker_lab.sim.reports.netns_repeats`) and every row says its ``repeat`` (0 for a
report made before repeats). ``summary.repeats`` gives each configuration's spread over its
repeats (:func:`repeats`), and each row says whether its predicted time is within
:data:`TIME_TOLERANCE` of the measured one (``within: "15%"``), else within the spread of that
epoch's own repeats where the spread is wider (``"spread"``), else neither (``null``).
"""

from __future__ import annotations

import os

from .calibrate import (
    Calibrated,
    cold_direct_row,
    decode_cpu,
    demo_params,
    demo_workload,
    fit_link_factor,
    fit_probe_cpu,
    fit_starting,
    local_latency,
    measure_cache_read_Bps,
    netns_params,
    netns_setup,
    probe_local_latency,
)
from .model import Job, simulate
from .reports import load_decode, load_demo, load_netns, netns_repeats

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
    """A short name of a namespace configuration: hosts and link rates; for a run that looks like
    training, also its dataset (MB = 1e6 bytes), its accelerator rate and whether it decodes
    (reports without either keep their old name)."""
    links, cfg = report["links"], report["config"]
    host = min(v["mbit"] for k, v in links.items() if k != "origin")
    label = f"netns {report['hosts']} hosts, host {host:g} / origin {links['origin']['mbit']:g} Mbit/s"
    rate = float(cfg.get("consumer_rate", 0.0))
    if rate > 0 or cfg.get("decode"):
        label += f", {report['dataset']['bytes'] / 1e6:.0f} MB"
        label += f", consumer {rate:g}/s" if rate > 0 else ""
        label += ", decode" if cfg.get("decode") else ""
    return label


def unit_name(path: str, repeat: int, repeats: int) -> str:
    """How the parameters name one repeat of a report: the path alone for a report of one repeat."""
    return path if repeats == 1 else f"{path} repeat {repeat}"


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
    peak = params["cache_read_Bps"].value if measured else 0.0  # a veth copies packets in memory
    # every repeat of every report is a run of its own: (path, repeat, its report, its name)
    units = []
    for path in netns_paths:
        cut = netns_repeats(reps[path])
        units += [(path, k, sub, unit_name(path, k, len(cut))) for k, sub in cut]
    setups = {name: netns_setup(sub, path, measured, peak) for path, _, sub, name in units}
    for name, st in setups.items():
        params.update({f"{k} of {name}": v for k, v in st.sources.items()})
    factors: dict[str, Calibrated] = {}
    decode: dict[str, float] = {}
    local_of: dict[str, float] = {}
    if cal_path is not None:
        cal_unit = next(u for u in units if u[0] == cal_path)  # the calibration run: its first repeat
        cal, cal_name = cal_unit[2], cal_unit[3]
        cal_decode = decode_cpu(reps[cal_path], cal_path)
        if cal_decode is not None:
            params["decode_cpu_s"] = cal_decode
        for path in netns_paths:  # a decode run's decode CPU: the calibration run's probe, else its own
            if reps[path]["config"].get("decode"):
                own_decode = cal_decode or decode_cpu(reps[path], path)
                if own_decode is not None and cal_decode is None:
                    params[f"decode_cpu_s of {path}"] = Calibrated(
                        own_decode.value, own_decode.source + "; the calibration run has no decode probe"
                    )
                decode[path] = own_decode.value if own_decode is not None else 0.0
        # a run that looks like training reads its node cache as fast as its own local probe did
        # (its warm epochs are mostly the accelerator's steps); the others as the calibration run's
        # warm direct epochs did
        own_local = {name: probe_local_latency(sub, name) for _, _, sub, name in units}
        if any(v is None for v in own_local.values()):
            params["local_latency_s"] = local_latency(cal, cal_path, decode.get(cal_path, 0.0))
        for name, got in own_local.items():
            if got is not None:
                params[f"local_latency_s of {name}"] = got
            local_of[name] = (got or params["local_latency_s"]).value
        for path, _, sub, name in units:
            factors[name] = params[f"link delivered fraction of {name}"] = fit_link_factor(
                sub, name, local_of[name], setups[name], decode.get(path, 0.0)
            )
        probed = {name for _, _, sub, name in units if sub.get("peer_probe") and setups[name].node_keys}
        if len(probed) < len(units):  # a run without its own probe takes the calibration run's fit
            params["starting_processes"], params["peer_cpu_s"] = fit_starting(
                cal, cal_name, local_of[cal_name], factors[cal_name].value, setups[cal_name]
            )
        for _, _, sub, name in units:
            if name not in probed:
                continue
            peer = params[f"peer_cpu_s of {name}"] = fit_probe_cpu(
                sub, name, local_of[name], factors[name].value, setups[name]
            )
            if sub.get("local_probe"):
                params[f"local_cpu_s of {name}"] = fit_probe_cpu(
                    sub, name, local_of[name], factors[name].value, setups[name], kind="local", peer_cpu_s=peer.value
                )
    for path, k, rep, name in units:
        own = params.get(f"peer_cpu_s of {name}")
        cpu, starting = (
            (own.value, 0) if own is not None else (params["peer_cpu_s"].value, int(params["starting_processes"].value))
        )
        local_cpu = params.get(f"local_cpu_s of {name}")
        p = netns_params(
            rep,
            local_of[name],
            cpu,
            factors[name].value,
            setups[name].node_keys,
            setups[name].peak_Bps,
            starting,
            local_cpu_s=local_cpu.value if local_cpu is not None else 0.0,
            decode_cpu_s=decode.get(path, 0.0),
        )
        p.cache_read_Bps = params["cache_read_Bps"].value
        params[f"links of {name}"] = Calibrated(
            p.nic_Bps,
            f"{name}: host links (tbf Mbit/s) x its delivered "
            f"fraction, bytes/s; origin latency "
            f"{rep['origin']['latency_ms']} ms",
        )
        fitted = cold_direct_row(rep, name)
        wl = setups[name].workload
        for placement in dict.fromkeys(r["placement"] for r in rep["runs"]):
            res = simulate(p, wl, placement, setups[name].jobs(rep, placement), rep["config"]["epochs"], together=False)
            pred = {(r.job, r.epoch): r for r in res}
            for m in (r for r in rep["runs"] if r["placement"] == placement):
                s = pred[(m["job"], m["epoch"])]
                mb = {"origin": m["stoker"]["origin_bytes"], "host_to_host": m["stoker"]["peer_bytes"]}
                pb = {kind: int(s.bytes[kind]) for kind in mb}
                rows.append(
                    {
                        "config": netns_label(rep),
                        "source": path,
                        "repeat": k,
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
                            and k == 0
                            and (
                                own is None
                                or (
                                    placement == "direct"
                                    and m["stoker"]["origin_bytes"] == 0
                                    and f"local_latency_s of {name}" not in params
                                )
                            )
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
                        "repeat": 0,
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
    says nothing). Each row gains ``within`` (:func:`within`; ``time_within_or_spread`` counts
    the rows with either), ``repeats``: :func:`repeats`; ``configs``: the counts per config
    (:func:`by_config`); ``warm_epochs``: :func:`warm_epochs`."""

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
            "time_within_or_spread": sum(r["within"] is not None for r in t),
            "bytes_within": sum(ok_bytes(r) for r in sel),
            "tiny": {
                "rows": len(tiny),
                "median_abs_error_s": tiny[len(tiny) // 2] if tiny else None,
                "max_abs_error_s": tiny[-1] if tiny else None,
            },
        }

    groups = repeats(rows)
    spread = {(g["config"], g["placement"], g["job"], g["epoch"]): g["spread"] for g in groups}
    for r in rows:
        r["bytes_ok"] = ok_bytes(r)
        r["tiny"] = r["measured_s"] < TINY_S
        r["time_ok"] = r["time_error"] is not None and abs(r["time_error"]) <= TIME_TOLERANCE
        r["repeat_spread"] = spread.get((r.get("config"), r.get("placement"), r.get("job"), r.get("epoch")))
        r["within"] = within(r["time_error"], r["repeat_spread"])
    return {
        "all": count(rows),
        "out_of_sample": count([r for r in rows if not r["in_sample"]]),
        "configs": {
            c: count([r for r in rows if r.get("config") == c]) for c in dict.fromkeys(r.get("config") for r in rows)
        },
        "time_tolerance": TIME_TOLERANCE,
        "bytes_tolerance": BYTES_TOLERANCE,
        "tiny_s": TINY_S,
        "repeats": groups,
        "warm_epochs": warm_epochs(rows),
    }


def within(time_error: float | None, spread: float | None) -> str | None:
    """Which criterion an epoch's predicted time meets: ``"15%"`` (:data:`TIME_TOLERANCE`) when
    ``|predicted / measured - 1|`` is at most that, else ``"spread"`` when the epoch's own
    repeats are spread wider than that (``spread``: their largest / smallest - 1, :func:`repeats`)
    and the error is at most the spread, else None (neither, or no measured time)."""
    if time_error is None:
        return None
    if abs(time_error) <= TIME_TOLERANCE:
        return "15%"
    if spread is not None and spread > TIME_TOLERANCE and abs(time_error) <= spread:
        return "spread"
    return None


def repeats(rows: list[dict]) -> list[dict]:
    """Each configuration's spread over its repeats: per ``config``, ``placement``, ``job`` and
    ``epoch`` with rows of at least two repeats (``repeat``; rows without it are repeat 0, and
    rows of two reports of one configuration are repeats of it too), the repeats' ``repeats``
    and ``measured_s``, their ``min_s``, ``max_s`` and ``median_s`` (seconds) and ``spread``
    (``max_s / min_s - 1``; None where ``min_s`` is 0). Groups of one repeat are left out."""
    groups: dict = {}
    for r in rows:
        groups.setdefault((r.get("config"), r.get("placement"), r.get("job"), r.get("epoch")), []).append(r)
    out = []
    for (config, placement, job, epoch), rs in groups.items():
        if len(rs) < 2:
            continue
        m = sorted(r["measured_s"] for r in rs)
        half = len(m) // 2
        out.append(
            {
                "config": config,
                "placement": placement,
                "job": job,
                "epoch": epoch,
                "repeats": [r.get("repeat", 0) for r in rs],
                "measured_s": [r["measured_s"] for r in rs],
                "min_s": m[0],
                "max_s": m[-1],
                "median_s": m[half] if len(m) % 2 else (m[half - 1] + m[half]) / 2,
                "spread": m[-1] / m[0] - 1 if m[0] > 0 else None,
            }
        )
    return out


def warm_epochs(rows: list[dict]) -> list[dict]:
    """The measured runs' own warm epochs: per config, repeat, placement and job, its warm epochs (no origin
    bytes measured) of :data:`TINY_S` or more, which do the same reads of the same cached blocks.
    Each group: ``config``, ``placement``, ``job``, ``epochs``, ``measured_s`` and ``predicted_s``
    (lists), ``measured_spread`` and ``predicted_spread`` (largest / smallest) and
    ``one_prediction_fits`` (whether any single time is within :data:`TIME_TOLERANCE` of every
    measured one: false when the largest exceeds the smallest by more than
    (1 + tolerance) / (1 - tolerance)). Groups of one epoch are left out."""
    groups: dict = {}
    for r in rows:
        if r["measured_bytes"].get("origin", 0) == 0 and r["measured_s"] >= TINY_S:
            groups.setdefault((r.get("config"), r.get("repeat", 0), r.get("placement"), r.get("job")), []).append(r)
    out = []
    for (config, repeat, placement, job), rs in groups.items():
        if len(rs) < 2:
            continue
        m, p = [r["measured_s"] for r in rs], [r["predicted_s"] for r in rs]
        out.append(
            {
                "config": config,
                "repeat": repeat,
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
        "| config | repeat | placement | job | epoch | measured s | predicted s | error | within "
        "| origin MB meas / pred | host-to-host MB meas / pred | in sample |",
        "|---" * 12 + "|",
    ]
    for r in report["rows"]:
        m, p = r["measured_bytes"], r["predicted_bytes"]
        err = (
            f"{r['predicted_s'] - r['measured_s']:+.2f} s (tiny)"
            if r["measured_s"] < TINY_S
            else f"{r['time_error']:+.0%}"
        )
        lines.append(
            f"| {r['config']} | {r.get('repeat', 0)} | {r['placement']} | {r['job']} | {r['epoch']} | "
            f"{r['measured_s']:.2f} | {r['predicted_s']:.2f} | {err} | {r.get('within') or '-'} | "
            f"{m['origin'] / 1e6:.1f} / "
            f"{p['origin'] / 1e6:.1f} | {m['host_to_host'] / 1e6:.1f} / {p['host_to_host'] / 1e6:.1f} | "
            f"{'yes' if r['in_sample'] else 'no'} |"
        )
    return "\n".join(lines)
