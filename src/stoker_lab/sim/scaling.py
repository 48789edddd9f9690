"""Scaling curves of the TDCS model: over node counts, cache per node and jobs sharing a dataset,
and which resource stops the scaling (the busiest of :func:`stoker_lab.sim.tdcs.bottleneck`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from .decide import SETUPS
from .tdcs import TdcsConfig, run_setup, summarize, workload

NODES = (1, 2, 4, 8, 16, 32, 64)
CACHE_FRACTIONS = (0.1, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5)
JOBS = (1, 4, 16)


#: Epochs per scaling point: the cold one and one warm one (later warm epochs repeat it: at 16
#: nodes epochs 1 and 2 differ by under 0.1%, docs/simulation_tdcs.json).
SCALING_EPOCHS = 2


def _point(c: TdcsConfig, setup: str, memo: dict, on_point: Callable[[dict], None] | None = None) -> dict:
    key = (setup, c.nodes, c.jobs, c.cache_fraction)
    if key in memo:
        return memo[key]
    if "workload" not in memo:  # every point reads the same dataset
        memo["workload"] = workload(c)
    mine = run_setup(c, setup, memo["workload"])
    v = summarize(mine)[setup]
    warm = [r for r in mine if r["epoch"] >= 1] or mine
    # jobs run together: each job's row of an epoch carries the bytes of all of them in it
    per_epoch = {r["epoch"]: r["bytes"] for r in mine}
    warm_epochs = [e for e in per_epoch if e >= 1] or list(per_epoch)
    memo[key] = {
        "setup": setup,
        "nodes": c.nodes,
        "gpus": c.nodes * c.gpus_per_node,
        "jobs": c.jobs,
        "cache_fraction": c.cache_fraction,
        "total_s": v["total_s"],
        "warm_epoch_s": v["warm_epoch_s"],
        "warm_gpu_utilization": sum(r["gpu_utilization"] for r in warm) / len(warm),
        "bytes_per_epoch": {k: sum(b[k] for b in per_epoch.values()) / len(per_epoch) for k in mine[0]["bytes"]},
        "warm_bytes_per_epoch": {
            k: sum(per_epoch[e][k] for e in warm_epochs) / len(warm_epochs) for k in mine[0]["bytes"]
        },
        "cold_epoch_s": max(r["epoch_s"] for r in mine if r["epoch"] == 0),
        "warm_bottleneck": max(warm, key=lambda r: r["epoch_s"])["bottleneck"],
        "cold_bottleneck": max((r for r in mine if r["epoch"] == 0), key=lambda r: r["epoch_s"])["bottleneck"],
    }
    if on_point:
        on_point(memo[key])
    return memo[key]


def _points(
    cfg: TdcsConfig, setups: tuple[str, ...], memo: dict, on_point: Callable[[dict], None] | None, **change
) -> list[dict]:
    c = replace(cfg, epochs=SCALING_EPOCHS, **change)
    return [_point(c, s, memo, on_point) for s in setups]


def scaling(
    cfg: TdcsConfig, sources: dict | None = None, quick: bool = False, on_point: Callable[[dict], None] | None = None
) -> dict:
    """The curves: ``nodes`` (every setup at :data:`NODES`, cache fraction and jobs of ``cfg``),
    ``cache`` (cache fractions :data:`CACHE_FRACTIONS` at ``cfg.nodes``, the cached setups) and
    ``jobs`` (:data:`JOBS` jobs splitting the GPUs, at 4, 16 and 64 nodes), each point over
    :data:`SCALING_EPOCHS` epochs (a point met twice is run once). ``quick``: every other point.
    Each point: setup, nodes, gpus, jobs, cache_fraction, total_s, cold_epoch_s, warm_epoch_s
    (seconds), warm_gpu_utilization, bytes_per_epoch and warm_bytes_per_epoch (bytes per kind of
    link, all of the point's jobs together), and the busiest resource of the warm and the cold epoch (``name`` and each
    resource's utilisation, :func:`stoker_lab.sim.tdcs.bottleneck`). ``on_point`` is called with each
    point as it is done (a progress report: the whole grid takes minutes)."""
    pick = (lambda xs: xs[::2]) if quick else (lambda xs: xs)
    memo: dict = {}
    nodes = [p for n in pick(NODES) for p in _points(cfg, SETUPS, memo, on_point, nodes=n)]
    cache = [p for f in pick(CACHE_FRACTIONS) for p in _points(cfg, SETUPS[1:], memo, on_point, cache_fraction=f)]
    jobs = [
        p
        for n in pick((4, 16, 64))
        for j in JOBS
        if (n * cfg.gpus_per_node) % j == 0
        for p in _points(cfg, ("random", "colocated"), memo, on_point, nodes=n, jobs=j)
    ]
    return {"nodes": nodes, "cache": cache, "jobs": jobs, "epochs": SCALING_EPOCHS, "sources": sources or {}}


def plot(report: dict, path: str) -> None:
    """A PNG at ``path`` of the scaling curves: warm epoch seconds and GPU utilisation against
    nodes, origin and host-to-host bytes per epoch against nodes, total seconds against cache
    per node, and bytes against jobs sharing the dataset."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sc = report["scaling"]
    fig, ax = plt.subplots(2, 3, figsize=(15, 8))
    for s in SETUPS:
        pts = [p for p in sc["nodes"] if p["setup"] == s]
        if pts:
            x = [p["nodes"] for p in pts]
            ax[0, 0].plot(x, [p["total_s"] for p in pts], "o-", label=s)
            ax[0, 1].plot(x, [p["warm_gpu_utilization"] for p in pts], "o-", label=s)
            ax[0, 2].plot(x, [p["bytes_per_epoch"]["origin"] / 1e9 for p in pts], "o-", label=f"{s} origin")
            if s != "direct":
                ax[0, 2].plot(
                    x, [p["bytes_per_epoch"]["host_to_host"] / 1e9 for p in pts], "x--", label=f"{s} host-to-host"
                )
        cp = [p for p in sc["cache"] if p["setup"] == s]
        if cp:
            ax[1, 0].plot([p["cache_fraction"] for p in cp], [p["total_s"] for p in cp], "o-", label=s)
            ax[1, 1].plot(
                [p["cache_fraction"] for p in cp], [p["bytes_per_epoch"]["origin"] / 1e9 for p in cp], "o-", label=s
            )
    for s in ("random", "colocated"):
        for n in sorted({p["nodes"] for p in sc["jobs"]}):
            jp = [p for p in sc["jobs"] if p["setup"] == s and p["nodes"] == n]
            if jp:
                ax[1, 2].plot(
                    [p["jobs"] for p in jp],
                    [p["bytes_per_epoch"]["host_to_host"] / 1e9 for p in jp],
                    "o-",
                    label=f"{s}, {n} nodes",
                )
    titles = [
        ("nodes", "seconds, all epochs", "Time vs nodes"),
        ("nodes", "GPU utilisation (warm)", "GPU utilisation"),
        ("nodes", "GB per epoch", "Bytes per epoch vs nodes"),
        (
            "cache per node / (dataset / nodes)",
            "seconds, all epochs",
            f"Time vs cache ({report['assumptions']['nodes']['value']} nodes)",
        ),
        ("cache per node / (dataset / nodes)", "origin GB per epoch", "Origin bytes vs cache"),
        ("jobs sharing the dataset", "host-to-host GB per epoch", "Host-to-host bytes vs jobs"),
    ]
    for a, (xl, yl, t) in zip(ax.flat, titles, strict=True):
        a.set_xlabel(xl)
        a.set_ylabel(yl)
        a.set_title(t, fontsize=9)
        a.legend(fontsize=6)
    for a in (ax[0, 0], ax[0, 1], ax[0, 2]):
        a.set_xscale("log", base=2)
    fig.suptitle("stoker simulate tdcs: model of ResNet-50 / ImageNet-1k (assumptions in the JSON)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
