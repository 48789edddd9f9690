"""`stoker bench peers` report: its targets, a Markdown table, a PNG plot."""

from __future__ import annotations


def _by_loader(report: dict) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in report["runs"]:
        out.setdefault(r["loader"], []).append(r)
    return out


def _cold_warm(rows: list[dict], key: str) -> dict:
    cold = [r[key] for r in rows if r["epoch"] == 0 and key in r]
    warm = [r[key] for r in rows if r["epoch"] > 0 and key in r]
    return {"cold": cold[0] if cold else None, "warm": sum(warm) / len(warm) if warm else None}


def epoch_rates(report: dict, key: str = "samples_per_s") -> dict[str, dict]:
    """Per loader: ``{"cold": epoch 0's ``key`` (default samples/s), "warm": the mean of the later
    epochs' (None with one epoch)}``."""
    return {loader: _cold_warm(rows, key) for loader, rows in _by_loader(report).items()}


WARM_TARGET, COLD_TARGET = 2.0, 2.5  # stoker's samples/s over the best peer's, warm and cold
#: The rows that read through stoker's cache: not peers of the stoker row in its targets.
OWN = ("stoker", "ray_data+stoker")


def ray_data_check(report: dict, rates: dict) -> dict:
    """``ray_data+stoker`` against plain ``ray_data`` in the same run: ``value`` its warm samples/s
    over ray_data's (None unless both ran more than one epoch), ``ok`` when that is >= 1 and its
    warm epochs read 0 bytes from the origin; ``origin_bytes_warm``: those bytes (None: no warm
    epoch)."""
    mine, plain = rates.get("ray_data+stoker", {}), rates.get("ray_data", {})
    value = mine["warm"] / plain["warm"] if mine.get("warm") and plain.get("warm") else None
    warm = [r["origin_bytes"] for r in report["runs"] if r["loader"] == "ray_data+stoker" and r["epoch"] > 0]
    origin = sum(warm) if warm else None
    return {
        "value": value,
        "target": ">= 1, 0 origin bytes warm",
        "best_peer": "ray_data",
        "origin_bytes_warm": origin,
        "ok": value is not None and value >= 1 and origin == 0,
    }


def check_targets(report: dict) -> dict:
    """The targets: stoker's warm-epoch throughput >= 2x the best peer's, its cold epoch >= 2.5x
    the best peer's (peers that ran, not the rows of :data:`OWN`; warm = mean of epochs after the
    first), its warm CPU seconds per 1,000 samples the lowest of all; and ``ray_data+stoker`` at
    least plain Ray Data's warm samples/s with 0 origin bytes warm (:func:`ray_data_check`).

    Returns ``{name: {"value": ratio or None, "target", "best_peer", "ok"}}`` (for the CPU check
    ``value`` is the best peer's warm CPU-s per 1,000 over stoker's: above 1 when stoker's is lower).
    """
    rates = epoch_rates(report)
    mine = rates.get("stoker", {})
    out = {"ray_data_stoker_vs_ray_data": ray_data_check(report, rates)}
    cpu = {lo: r["warm"] for lo, r in epoch_rates(report, "cpu_s_per_1000").items() if r["warm"]}
    others = {lo: v for lo, v in cpu.items() if lo not in OWN}
    lowest = min(others, key=others.get) if others else None
    value = others[lowest] / cpu["stoker"] if lowest and cpu.get("stoker") else None
    out["warm_cpu_lowest"] = {
        "value": value,
        "target": "> 1",
        "best_peer": lowest,
        "ok": value is not None and value > 1,
    }
    for name, key, factor in (("warm_vs_best_peer", "warm", WARM_TARGET), ("cold_vs_best_peer", "cold", COLD_TARGET)):
        peers = {lo: r[key] for lo, r in rates.items() if lo not in OWN and r[key]}
        best = max(peers, key=peers.get) if peers else None
        value = mine[key] / peers[best] if best and mine.get(key) else None
        out[name] = {
            "value": value,
            "target": f">= {factor}",
            "best_peer": best,
            "ok": value is not None and value >= factor,
        }
    return out


def markdown(report: dict) -> str:
    """The run as Markdown tables: which loaders ran (:func:`ran_line`), epochs, formats, skipped
    loaders with their reasons, targets."""
    ds, org, cfg = report["dataset"], report["origin"], report["config"]
    lines = [
        f"{report['machine']['cores']} cores; {ds['images']:,} photos, {ds['bytes'] / 1e6:.1f} MB "
        f"(mean {ds['mean_sample_bytes'] / 1e3:.0f} KB); origin {org['latency_ms']:g} ms, "
        f"{org['bandwidth_MBps']:g} MB/s; {cfg['workers']} workers, batch {cfg['batch_size']}, "
        f"emulated accelerator {cfg['consumer_rate']:g} samples/s; load average at start "
        f"{report['machine']['loadavg_start'][0]:.2f}",
        "",
        ran_line(report),
        "",
        "| loader | epoch | samples/s | first batch s | data stall | CPU s / 1,000 samples | origin CPU s / 1,000 "
        "| origin MB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    lower = False
    for r in report["runs"]:
        first = f"{r['first_batch_s']:.2f}" if "first_batch_s" in r else "–"
        bound = r.get("cpu_unaccounted_s", 0.0) > 0  # a process ended unreaped: a lower bound (peers/_runner.py)
        lower |= bound
        lines.append(
            f"| {r['loader']} | {r['epoch']}{' (cold)' if r['epoch'] == 0 else ''} | "
            f"{r['samples_per_s']:,.0f} | {first} | {r['stall_fraction']:.2f} | "
            f"{'≥ ' if bound else ''}{r['cpu_s_per_1000']:.2f} | "
            f"{r.get('origin_cpu_s_per_1000', 0.0):.2f} | {r['origin_bytes'] / 1e6:,.1f} |"
        )
    if lower:
        lines += [
            "",
            "≥: a process of the loader's tree ended without being reaped inside it (Ray's raylet lets the "
            "kernel reap its workers): its CPU after the epoch's start is not counted, so the figure is a lower bound.",
        ]
    lines += ["", "| format | tool | convert s | upload s | files | MB on origin |", "|---|---|---|---|---|---|"]
    tools = {
        "stoker": "stoker pack",
        "torch": "(raw ImageFolder)",
        "webdataset": "webdataset.ShardWriter",
        "streaming": "streaming.MDSWriter",
        "litdata": "litdata.optimize",
        "dali": "ShardWriter + DALI wds2idx",
        "spdl": "ShardWriter (the same tars)",
        "ray_data": "(raw ImageFolder)",
        "ray_data+stoker": "stoker pack",
    }
    for f in report["formats"]:
        lines.append(
            f"| {f['loader']} | {tools.get(f['loader'], '')} | {f['convert_seconds']:.1f} | "
            f"{f.get('upload_seconds', 0.0):.1f} | {f['files']} | {f['bytes'] / 1e6:,.1f} |"
        )
    peers = report.get("peers") or {}
    if peers:
        lines += ["", "| loader | versions | cache | resume |", "|---|---|---|---|"]
        for lo, p in peers.items():
            vers = ", ".join(f"{k} {v}" for k, v in (p.get("versions") or {}).items() if v)
            lines.append(f"| {lo} | {vers} | {p.get('cache', '')} | {p.get('resume', '')} |")
    if report.get("failures"):
        lines += ["", "Failed, then run again from an empty cache:"] + [
            f"- {f['loader']} (attempt {f['attempt'] + 1}): {f['reason']}" for f in report["failures"]
        ]
    if report["skipped"]:
        lines += ["", "Skipped:"] + [f"- {s['loader']}: {s['reason']}" for s in report["skipped"]]
    checks = report.get("checks") or {}
    if checks:
        lines.append("")
        for name, c in checks.items():
            v = f"{c['value']:.2f}x" if c["value"] is not None else "n/a"
            lines.append(
                f"- {name}: {v} (best peer {c['best_peer']}; target {c['target']}): {'met' if c['ok'] else 'NOT met'}"
            )
    return "\n".join(lines)


def ran_line(report: dict) -> str:
    """Which loaders ran (every epoch measured) of those asked for, and which did not (their reasons
    under "Skipped")."""
    asked = list(report["config"].get("loaders") or [])
    ran = [lo for lo in asked if any(r["loader"] == lo for r in report["runs"])]
    missed = [s["loader"] for s in report["skipped"]]
    line = f"Ran {len(ran)} of {len(asked)} loaders: {', '.join(ran) or 'none'}"
    return line + (f"; skipped: {', '.join(missed)} (reasons below)" if missed else "")


def print_table(report: dict) -> None:
    """Print :func:`markdown` to stdout."""
    print(markdown(report), flush=True)


def write_plot(report: dict, path: str) -> None:
    """Four panels per loader and epoch: samples/s, data stall, loader CPU s per 1,000 samples,
    origin MB. Needs matplotlib (the ``demo`` extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = _by_loader(report)
    loaders = list(rows)
    epochs = sorted({r["epoch"] for r in report["runs"]})
    panels = [
        ("samples_per_s", "samples/s"),
        ("stall_fraction", "data stall (fraction of wall time)"),
        ("cpu_s_per_1000", "loader CPU s / 1,000 samples"),
        ("origin_bytes", "origin MB"),
    ]
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    width = 0.8 / max(1, len(epochs))
    for ax, (key, label) in zip(axes.flat, panels):
        for j, e in enumerate(epochs):
            vals = []
            for lo in loaders:
                r = next((x for x in rows[lo] if x["epoch"] == e), None)
                v = r[key] if r else 0.0
                vals.append(v / 1e6 if key == "origin_bytes" else v)
            xs = [i + (j - (len(epochs) - 1) / 2) * width for i in range(len(loaders))]
            ax.bar(xs, vals, width, label=f"epoch {e}" + (" (cold)" if e == 0 else ""))
        ax.set_xticks(range(len(loaders)), loaders)
        ax.set_title(label)
        ax.grid(axis="y", alpha=0.3)
    axes.flat[0].legend()
    ds, org = report["dataset"], report["origin"]
    fig.suptitle(
        f"{ds['images']:,} photos, origin {org['latency_ms']:g} ms / {org['bandwidth_MBps']:g} MB/s, "
        f"{report['config']['workers']} workers, {report['machine']['cores']} cores"
        + (f"; skipped: {', '.join(x['loader'] for x in report['skipped'])}" if report["skipped"] else "")
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
