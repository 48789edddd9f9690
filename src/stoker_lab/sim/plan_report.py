"""The ``stoker plan`` report for people: the assumptions with their sources, a table of the setups
per epoch, the smallest cache per node per setup (:func:`text`), and the plot of GPU utilisation
against cache per node (:func:`plot`). The report itself is :func:`stoker_lab.sim.plan.plan`'s."""

from __future__ import annotations

from .byte_cpu import FIELDS, PATHS
from .plan import TARGET_UTILIZATION
from .plateau import shown_utilization as _u

#: The byte paths as the report's lines name them.
_PATH_NAMES = {"fill": "fill", "peer_send": "peer send", "peer_receive": "peer receive", "warm_read": "warm read"}


def _size(n: float | None) -> str:
    return "none reaches it" if n is None else f"{n / 1e9:.2f} GB ({int(n)} bytes)"


def text(report: dict) -> str:
    """The plan as text, the answer first: the smallest cache per node per setup (where none
    reaches the target, the best utilisation, where it levels off and the assumption that bounds
    it, with its flag: :func:`short_lines`) and whether co-located scheduling changes it; then one
    table row per setup and epoch (seconds, GPU utilisation, GB per kind of link, byte-moving and
    decode cores per node, bottleneck), what the byte-moving cores are made of
    (:func:`cpu_lines`), what each setup models (and the bench placement it stands for), and last
    every assumption with its source."""
    out = [f"smallest cache per node for >= {TARGET_UTILIZATION:.0%} GPU utilisation after the first epoch:"]
    short = report.get("levels_off", {})
    for s, n in report["min_cache_per_node_bytes"].items():
        note = " (no cache: 0 when remote reads alone keep the GPUs busy)" if s == "direct" else ""
        out.append(f"  {s}: {_size(n)}{note}")
        if s in short:
            out += short_lines(s, short[s])
    ch = report["colocated_changes_min_cache"]
    if ch["changes"] is None:
        out.append(f"co-located scheduling against presence-only affinity: {ch['why']}")
    else:
        out.append(f"co-located scheduling {'changes' if ch['changes'] else 'does not change'} it: {ch['why']}")
    out += [
        "",
        "| setup | epoch | epoch s | GPU utilisation | origin GB | host-to-host GB | local GB "
        "| byte-moving cores/node | decode cores/node | bottleneck |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s, r in report["setups"].items():
        b = r["bytes"]
        for e, secs in enumerate(r["epoch_s"]):
            u = r["gpu_utilization"][e]
            out.append(
                f"| {s} | {e} | {secs:.1f} | {'n/a' if u is None else f'{u:.2f}'} | {b['origin'][e] / 1e9:.1f} | "
                f"{b['host_to_host'][e] / 1e9:.1f} | {b['local'][e] / 1e9:.1f} | {r['byte_cores_per_node'][e]:.1f} | "
                f"{r['decode_cores_per_node'][e]:.1f} | {r['bottleneck'][e]} |"
            )
    out += ["", *cpu_lines(report)]
    notes = report.get("setup_notes", {})
    if notes:
        out += ["", "setups (and the stoker bench cluster --netns placement each stands for):"]
        for s, n in notes.items():
            bench = f"the bench's {n['bench_placement']}" if n["bench_placement"] else "no bench placement"
            out.append(f"  {s}: {n['model']}; {bench} ({n['differs']})")
    out += ["", "assumptions:"]
    for k, v in report["assumptions"].items():
        val = v["value"]
        shown = f"{val:.6g}" if isinstance(val, float) else str(val)
        out.append(f"  {k} = {shown}   ({v['source']})")
    return "\n".join(out)


def short_lines(setup: str, lv: dict) -> list[str]:
    """The lines under a setup that reaches the target at no cache size (``lv``: its
    ``levels_off`` entry of the report): the best GPU utilisation and at which cache per node, the
    smallest cache per node within the tolerance of it, and the assumption that bounds it there
    with the flag that changes it (what the model gives with it relaxed)."""
    b = lv["bound"]
    if setup == "direct":
        where = f"    best {_u(lv['best_utilization'])} GPU utilisation, with no cache"
    else:
        where = (
            f"    best {_u(lv['best_utilization'])} GPU utilisation, at {lv['best_cache_per_node_bytes'] / 1e9:.2f} GB "
            f"per node; it levels off from {lv['plateau_cache_per_node_bytes'] / 1e9:.2f} GB per node "
            f"({_u(lv['plateau_utilization'])}, within {lv['tolerance']:.0%} of the best): more cache does not help"
        )
    lines = [where, _bound_line("    bound by", b)]
    g = lv.get("at_given")
    if g is not None:
        lower = g["cache_per_node_bytes"] > lv["best_cache_per_node_bytes"]
        lines.append(
            f"    at your {g['cache_per_node_bytes'] / 1e9:.2f} GB per node: {_u(g['utilization'])}"
            + (" (more cache lowers it here: its reads are slower than what they replace)" if lower else "")
        )
        lines.append(_bound_line("      bound by", g["bound"]))
    return lines


def _bound_line(head: str, b: dict) -> str:
    if b["resource"] is None:
        return f"{head} none of the assumptions tried: {b['why']}"
    return f"{head} {b['why']}; change it with {b['flag']}"


def cpu_lines(report: dict) -> list[str]:
    """What the byte-moving cores are made of: the cost of each byte path (the assumptions'), the
    formula, and per setup the cores by path of its epoch that moves bytes on the most cores,
    against the node's cores."""
    a = report["assumptions"]
    costs = {p: a[FIELDS[p]]["value"] for p in PATHS}
    cores = a["cores_per_node"]["value"]
    out = [
        "byte-moving cores per node = bytes per node and second on each path x its CPU-s/GB "
        f"(fill {costs['fill']:g}, peer send {costs['peer_send']:g}, peer receive {costs['peer_receive']:g}, "
        f"warm read {costs['warm_read']:g}; sources above); CPU is the bottleneck where they and the decode "
        f"cores need more than the node's {cores} cores. Per setup, its epoch with the most:"
    ]
    for s, r in report["setups"].items():
        if not r["epoch_s"]:
            continue
        e = max(range(len(r["epoch_s"])), key=lambda i: r["byte_cores_per_node"][i])
        parts = ", ".join(f"{_PATH_NAMES[p]} {r['byte_cores_by_path'][p][e]:.2f}" for p in PATHS)
        used = r["byte_cores_per_node"][e] + r["decode_cores_per_node"][e]
        out.append(
            f"  {s}, epoch {e}: {r['byte_cores_per_node'][e]:.2f} cores moving bytes ({parts}) + "
            f"{r['decode_cores_per_node'][e]:.2f} decoding = {used:.2f} of {cores}"
            + (" (CPU short)" if r["bottleneck"][e] == "CPU" else "")
        )
    return out


def plot(report: dict, path: str) -> None:
    """A figure at ``path``, in the format its extension names (``.png``, ``.pdf``, ``.svg``): GPU
    utilisation after the first epoch against cache per node (GB), one line per setup (``direct``,
    which has no cache, as a flat line), the target dotted; points over twice ``dataset / nodes``
    (a large cache given by the user) are left out, saying so."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    most = 2 * report["dataset_per_node_bytes"]
    curves = {s: [p for p in pts if p[0] <= most] for s, pts in report["curves"].items()}
    beyond = any(p[0] > most for pts in report["curves"].values() for p in pts)
    cached = [c for s, pts in curves.items() if s != "direct" for c, _ in pts]
    right = max(cached, default=1) / 1e9
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for s, pts in curves.items():
        pts = [p for p in pts if p[1] is not None]
        if not pts:
            continue
        if s == "direct":
            ax.plot([0, right], [pts[0][1]] * 2, "--", label="direct (no cache)")
        else:
            ax.plot([c / 1e9 for c, _ in pts], [u for _, u in pts], "o-", label=s)
    ax.axhline(TARGET_UTILIZATION, color="grey", lw=0.8, ls=":", label=f"{TARGET_UTILIZATION:.0%}")
    ax.set_xlabel("cache per node, GB")
    ax.set_ylabel("GPU utilisation after the first epoch")
    ax.set_ylim(0, 1.05)
    note = f"\npoints over {most / 1e9:.1f} GB (2 x dataset / nodes) not shown" if beyond else ""
    ax.set_title(f"stoker plan: model of the setups (assumptions in the JSON){note}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
