"""``stoker plan``: a capacity planner on the TDCS model (:mod:`stoker_lab.sim.tdcs`).

The user's figures (dataset, nodes, accelerators, cache, links) become a
:class:`~stoker_lab.sim.tdcs_config.TdcsConfig`, and the three setups a user chooses between run
on it through :func:`stoker_lab.sim.tdcs.run_setup` (no second model): ``direct`` (remote reads,
no cache), ``presence`` (presence-only affinity) and ``colocated`` (stoker's co-located
scheduling). Each epoch gets its time, GPU utilisation, bytes per kind of link, the cores per node
that moving those bytes takes (:mod:`stoker_lab.sim.byte_cpu`) and bottleneck
(:func:`stoker_lab.sim.tdcs.bottleneck`: ``CPU`` where moving bytes and decoding need more cores
than a node has).

The smallest cache per node that keeps the GPUs at least :data:`TARGET_UTILIZATION` busy after the
first epoch is found by bisection on the model (:func:`min_cache`), each point a cold epoch and one
warm one (:data:`stoker_lab.sim.scaling.SCALING_EPOCHS`: later warm epochs repeat it). Its lower end
needs no run: a warm epoch reads at least ``dataset - nodes x cache`` bytes from the origin (blocks
are never evicted and hold no more payload than their bytes), so below
``(dataset - T x origin_Bps / target) / nodes`` the origin link alone keeps the GPUs under the
target (``T``: an epoch's GPU seconds, taken 5% long to allow for uneven plans).

The model walks every sample, so its time and memory grow with the sample count. A dataset of more
than :data:`MAX_SAMPLES` samples is planned on an equivalent one of fewer samples
(:func:`scaled`): each modelled sample stands for ``r`` of the user's, with ``r`` times the bytes,
and every other per-sample or per-request figure follows (GPU and decode rates / ``r``; block,
shard and prefetch bytes and request latencies x ``r``), so a modelled chunk is ``r`` of the
user's chunks back to back: the same bytes, rates and bounds, coarser in time (fewer, longer chunks
per rank: the first chunk's wait and the last one's GPU time weigh ``r`` times more).

Where no cache size searched reaches the target, :func:`levels_off` says how close a setup gets:
its best utilisation, the smallest cache per node within
:data:`stoker_lab.sim.plateau.PLATEAU_TOLERANCE` of it (the same bisection, that level as its
target), and the assumption that bounds it there, found by what-if runs
(:func:`stoker_lab.sim.plateau.bound`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

from .byte_cpu import PATHS
from .plateau import AT_GIVEN_GAP, PLATEAU_TOLERANCE, bound, knobs, relaxed
from .scaling import SCALING_EPOCHS
from .tdcs import TdcsConfig, assumptions, run_setup, workload
from .workload import Workload

#: The setups the planner compares by default (a subset of :data:`stoker_lab.sim.decide.SETUPS`).
PLAN_SETUPS = ("direct", "presence", "colocated")
#: Every setup ``stoker plan --setups`` can run: each one's model and the placement of
#: ``stoker bench cluster --netns`` (``direct``, ``random``, ``colocated``) it stands for, if any,
#: with where the two differ (``bench_placement`` None: no such placement in the bench).
SETUP_NOTES: dict[str, dict] = {
    "direct": {
        "model": "every rank reads the remote store, no cache at all",
        "bench_placement": None,
        "differs": "the bench's direct placement has a node cache on each host (plan's direct-cached)",
    },
    "direct-cached": {
        "model": "ranks placed as direct; each node caches the blocks its own ranks read, shares none",
        "bench_placement": "direct",
        "differs": "the same reads; the bench's hosts share one machine's cores, which plan does not model",
    },
    "random": {
        "model": "a distributed cache, ranks on random nodes, at most gpus_per_node a node",
        "bench_placement": "random",
        "differs": "the bench draws each rank's host with replacement (two ranks may share a host), plan "
        "fills at most gpus_per_node a node, so its peer reads differ",
    },
    "presence": {
        "model": "like random, on nodes that already hold the dataset (presence-only affinity)",
        "bench_placement": None,
        "differs": "no such placement in the bench",
    },
    "colocated": {
        "model": "stoker's co-located placement and read plans",
        "bench_placement": "colocated",
        "differs": "the same placement code; the bench's hosts share one machine's cores",
    },
}
#: GPU utilisation after the first epoch that the smallest cache per node must keep.
TARGET_UTILIZATION = 0.9
#: The bisection stops when its bracket is this fraction of ``dataset / nodes`` wide.
RESOLUTION = 0.02
#: The most samples the model walks: a dataset with more is planned scaled down (:func:`scaled`).
#: ImageNet-1k's train set, the TDCS example's size, measured on a 2-core development machine: its
#: plan (16 nodes x 8 GPUs) takes about 50 s; a 10 TB, 80M-sample plan of 4 nodes x 8 GPUs scaled
#: to 1.27M samples took 28 s and 270 MB (unscaled: over 11 minutes, 3.4 GB, unfinished). The time
#: and memory grow with the samples walked.
MAX_SAMPLES = 1_281_167
#: Slack on an epoch's GPU seconds in the search's lower bound (see the module docstring).
GPU_SLACK = 1.05


def share_bytes(wl: Workload, nodes: int) -> float:
    """``dataset / nodes``: the cache per node at which the cluster holds the dataset once (the
    blocks' bytes, tar headers included), the unit of ``TdcsConfig.cache_fraction``."""
    return float(wl.block_bytes.sum()) / nodes


def scaled(cfg: TdcsConfig, most: int | None = None) -> tuple[TdcsConfig, float]:
    """``(config, r)``: ``cfg`` itself and 1.0 when it has at most ``most`` samples (default
    :data:`MAX_SAMPLES`), else the equivalent config of ``ceil(samples / ceil(samples / most))``
    samples, each standing for ``r = samples / that`` of ``cfg``'s: ``r`` times the bytes (the
    same dataset bytes), GPU and decode rates / ``r`` (the same bytes/s per GPU, the same decode
    bound), block, shard and prefetch bytes x ``r`` (the same samples per block, blocks per shard,
    chunks ahead) and request latencies x ``r`` (a modelled request stands for ``r`` requests, so
    the same latency per byte)."""
    most = MAX_SAMPLES if most is None else most
    if cfg.samples <= most:
        return cfg, 1.0
    n = math.ceil(cfg.samples / math.ceil(cfg.samples / most))
    r = cfg.samples / n
    return (
        replace(
            cfg,
            samples=n,
            mean_sample_bytes=cfg.mean_sample_bytes * r,
            gpu_rate=cfg.gpu_rate / r,
            decode_rate=cfg.decode_rate / r,
            block_bytes=round(cfg.block_bytes * r),
            shard_bytes=round(cfg.shard_bytes * r),
            prefetch_bytes=round(cfg.prefetch_bytes * r),
            store_latency_ms=cfg.store_latency_ms * r,
            peer_latency_ms=cfg.peer_latency_ms * r,
        ),
        r,
    )


class _Curve:
    """GPU utilisation after the first epoch against cache per node, one setup: each point a model
    run of :data:`SCALING_EPOCHS` epochs, run once."""

    def __init__(self, cfg: TdcsConfig, setup: str, wl: Workload):
        self.cfg, self.setup, self.wl = cfg, setup, wl
        self.share = share_bytes(wl, cfg.nodes)
        self.points: dict[int, float] = {}  # cache per node, bytes -> utilisation
        self.warm: dict[int, dict] = {}  # cache per node, bytes -> the row of its least busy warm epoch

    def add(self, cache_bytes: int, rows: list[dict]) -> None:
        """Record a run made elsewhere (the plan's own, at the user's cache): the lowest GPU
        utilisation of the epochs after the first, and that epoch's row (nothing with one epoch)."""
        warm = [r for r in rows if r["epoch"] >= 1 and r["gpu_utilization"] is not None]
        if warm:
            row = min(warm, key=lambda r: r["gpu_utilization"])
            self.points[cache_bytes] = row["gpu_utilization"]
            self.warm[cache_bytes] = row

    def __call__(self, cache_bytes: int) -> float:
        if cache_bytes not in self.points:
            c = replace(self.cfg, epochs=SCALING_EPOCHS, cache_fraction=cache_bytes / self.share)
            self.add(cache_bytes, run_setup(c, self.setup, self.wl))
        return self.points[cache_bytes]


def lower_bound(cfg: TdcsConfig, wl: Workload, target: float = TARGET_UTILIZATION) -> int:
    """Cache per node (bytes) below which no setup keeps ``target`` GPU utilisation after the first
    epoch: the origin link alone would take longer (module docstring)."""
    per_rank = math.ceil(wl.num_samples / (cfg.nodes * cfg.gpus_per_node))
    gpu_s = GPU_SLACK * per_rank / cfg.gpu_rate
    origin_Bps = cfg.store_gbit * 1e9 / 8
    return max(0, math.floor((wl.total_bytes - gpu_s * origin_Bps / target) / cfg.nodes))


def min_cache(
    curve: Callable[[int], float], low: int, highs: list[int], step: int, target: float = TARGET_UTILIZATION
) -> int | None:
    """The smallest cache per node (bytes, to ``step``) at which ``curve`` reaches ``target``:
    the first of ``highs`` (ascending) that reaches it is the bracket's top, ``low`` its bottom
    (known to fall short, not run: a cache of 0 bytes is the ``direct`` setup's); bisection until
    the bracket is ``step`` wide. None when no point of ``highs`` reaches it."""
    hi = next((h for h in highs if h > low and curve(h) >= target), None)
    if hi is None:
        return None
    lo = max(low, max((c for c, u in _points(curve) if c < hi and u < target), default=low))
    while hi - lo > step:
        mid = (lo + hi) // 2
        if curve(mid) >= target:
            hi = mid
        else:
            lo = mid
    return hi


def levels_off(curve: _Curve, given: TdcsConfig, step: int, at_cache: int | None = None) -> dict:
    """Where ``curve`` (a setup that reaches the target at no cache size searched) levels off:
    ``{best_utilization, best_cache_per_node_bytes, plateau_cache_per_node_bytes,
    plateau_utilization, tolerance, bound}``. ``best_*``: the highest utilisation of every point
    run (the smallest cache at it); ``plateau_*``: the smallest cache per node within
    :data:`stoker_lab.sim.plateau.PLATEAU_TOLERANCE` of it, by :func:`min_cache` with that level as
    its target (to ``step`` bytes; below the best's cache the curve is taken to rise with the
    cache, as a bisection must); ``bound``: :func:`stoker_lab.sim.plateau.bound` of the plateau's
    warm epoch on the user's figures ``given``, from one what-if run per knob that applies
    (:func:`stoker_lab.sim.plateau.knobs`) at the plateau's cache. A point the bisection finds above the best
    becomes the best and the search runs again (at most 3 times). ``direct`` has no cache: its
    best and plateau are at 0. ``at_given``: where the user's own cache per node ``at_cache``
    gives :data:`stoker_lab.sim.plateau.AT_GIVEN_GAP` less than the best or worse (the curve falls
    with more cache when the cache reads or peers are slower than the origin),
    ``{cache_per_node_bytes, utilization, bound}`` there, the bound by what-if runs at that
    cache; else None."""
    for _ in range(3):
        best_c, best_u = max(curve.points.items(), key=lambda p: (p[1], -p[0]))
        level = best_u * (1 - PLATEAU_TOLERANCE)
        if curve.setup == "direct" or level <= 0:
            plateau = min(c for c, u in curve.points.items() if u >= level)
            break
        low = lower_bound(curve.cfg, curve.wl, level)
        plateau = best_c if best_c <= low else min_cache(curve, low, [best_c], step, level) or best_c
        if max(curve.points.values()) <= best_u:
            break
    at_given = None
    if at_cache is not None and at_cache in curve.warm and curve.points[at_cache] < best_u * (1 - AT_GIVEN_GAP):
        at_given = {
            "cache_per_node_bytes": at_cache,
            "utilization": curve.points[at_cache],
            "bound": _bound_at(curve, given, at_cache),
        }
    return {
        "best_utilization": best_u,
        "best_cache_per_node_bytes": best_c,
        "plateau_cache_per_node_bytes": plateau,
        "plateau_utilization": curve.points[plateau],
        "tolerance": PLATEAU_TOLERANCE,
        "bound": _bound_at(curve, given, plateau),
        "at_given": at_given,
    }


def _bound_at(curve: _Curve, given: TdcsConfig, cache_bytes: int) -> dict:
    """:func:`stoker_lab.sim.plateau.bound` of ``curve``'s warm epoch at ``cache_bytes`` per node,
    from one what-if run per knob that applies there."""
    row, at = curve.warm[cache_bytes], curve.points[cache_bytes]
    what_if = {k: _warm_at(relaxed(curve.cfg, k), curve, cache_bytes) for k in knobs(row, curve.cfg)}
    return bound(row, at, what_if, given)


def _warm_at(cfg: TdcsConfig, curve: _Curve, cache_bytes: int) -> float:
    """The warm utilisation of ``curve``'s setup on ``cfg`` at ``cache_bytes`` per node (a what-if run)."""
    what_if = _Curve(cfg, curve.setup, curve.wl)
    return what_if(cache_bytes)


def _points(curve) -> list[tuple[int, float]]:
    return list(getattr(curve, "points", {}).items())


def _setup_report(rows: list[dict]) -> dict:
    kinds = list(rows[0]["bytes"]) if rows else []
    return {
        "epoch_s": [r["epoch_s"] for r in rows],
        "gpu_utilization": [r["gpu_utilization"] for r in rows],
        "bytes": {k: [r["bytes"][k] for r in rows] for k in kinds},
        "byte_cores_per_node": [r["byte_cores_per_node"]["total"] for r in rows],
        "byte_cores_by_path": {k: [r["byte_cores_per_node"][k] for r in rows] for k in PATHS},
        "decode_cores_per_node": [r["decode_cores_per_node"] for r in rows],
        "bottleneck": [r["bottleneck"]["name"] for r in rows],
        "resource_utilization": [r["bottleneck"]["utilization"] for r in rows],
    }


def plan(
    cfg: TdcsConfig,
    cache_bytes: int,
    sources: dict[str, str] | None = None,
    disk_bytes: int | None = None,
    curve_fractions: tuple[float, ...] = (),
    on_step: Callable[[str], None] | None = None,
    setups: tuple[str, ...] = PLAN_SETUPS,
) -> dict:
    """The plan for ``cfg`` with ``cache_bytes`` of cache per node (``cfg.cache_fraction`` is
    ignored): ``{dataset_per_node_bytes, assumptions, setups, min_cache_per_node_bytes,
    colocated_changes_min_cache, curves}`` (``dataset_per_node_bytes``: :func:`share_bytes`).

    ``assumptions``: every parameter ``{name: {value, source}}`` (``sources`` override the TDCS
    defaults'). ``setups``: for each setup run, per epoch ``epoch_s`` (seconds),
    ``gpu_utilization``, ``bytes`` (``{origin|host_to_host|local: [bytes per epoch]}``),
    ``byte_cores_per_node`` (cores per node moving bytes at the epoch's pace, from the assumptions'
    ``*_cpu_s_per_GB``: :func:`stoker_lab.sim.byte_cpu.byte_cores`), ``byte_cores_by_path``
    (``{fill|peer_send|peer_receive|warm_read: [cores]}``), ``decode_cores_per_node`` (decode cores
    busy), ``bottleneck`` (the busiest resource's name; ``CPU`` where byte-moving and decode cores
    need more than ``cores_per_node``) and ``resource_utilization`` (each resource's).
    ``min_cache_per_node_bytes``: per setup the smallest cache per node for at least
    :data:`TARGET_UTILIZATION` after the first epoch (:func:`min_cache`, searched up to the node
    disk ``disk_bytes`` if given, else the whole dataset; ``direct`` has no cache: 0 when it
    reaches it, else None). ``levels_off``: for each setup where that is None, the best
    utilisation, where it levels off and what bounds it there (:func:`levels_off`).
    ``curves``: per setup ``[[cache bytes, utilisation], ...]`` of every point run, and of
    ``curve_fractions`` (of ``dataset / nodes``) too, for the plot.
    ``on_step`` gets a line of progress per stage. ``setups``: which of :data:`SETUP_NOTES` to run
    (default :data:`PLAN_SETUPS`); ``setup_notes`` in the report says of each its model and the
    ``stoker bench cluster --netns`` placement it stands for. A dataset of over
    :data:`MAX_SAMPLES` samples is modelled scaled down (:func:`scaled`; ``sample_scale`` in
    ``assumptions`` gives the factor, the other assumptions are the user's figures). Raises ValueError for a
    ``cache_bytes`` over ``disk_bytes`` or an unknown setup."""
    say = on_step or (lambda _line: None)
    bad = [s for s in setups if s not in SETUP_NOTES]
    if bad or not setups:
        raise ValueError(f"setups {', '.join(bad) or '(none)'}: give some of {', '.join(SETUP_NOTES)}")
    if disk_bytes is not None and cache_bytes > disk_bytes:
        raise ValueError(f"cache per node {cache_bytes} bytes is larger than the node's disk, {disk_bytes} bytes")
    given = cfg
    cfg, scale = scaled(cfg)
    if scale > 1:
        say(f"{given.samples} samples planned as {cfg.samples} of {scale:.4g}x the bytes each (sample_scale)")
    wl = workload(cfg)
    share = share_bytes(wl, cfg.nodes)
    user = replace(cfg, cache_fraction=cache_bytes / share)
    top = int(disk_bytes if disk_bytes is not None else wl.block_bytes.sum())
    highs = sorted({min(top, int(math.ceil(share * f))) for f in (1.0, 1.5)} | {top})
    step = max(1, int(share * RESOLUTION))
    low = lower_bound(cfg, wl)
    out, best, curves, short = {}, {}, {}, {}
    for s in setups:
        rows = run_setup(user, s, wl)
        out[s] = _setup_report(rows)
        say(f"{s}: {len(rows)} epochs at {cache_bytes} bytes of cache per node")
        curve = _Curve(cfg, s, wl)
        if cfg.epochs >= 2:
            curve.add(0 if s == "direct" else cache_bytes, rows)
        if s == "direct":  # no cache: its answer does not depend on one
            u = curve(0)
            best[s] = 0 if u >= TARGET_UTILIZATION else None
            curves[s] = [[0, u]]
            if best[s] is None:
                short[s] = levels_off(curve, given, step)
            continue
        best[s] = min_cache(curve, low, highs, step)
        if best[s] is None:
            lv = levels_off(curve, given, step, at_cache=cache_bytes)
            if lv["best_utilization"] >= TARGET_UTILIZATION:  # below the searched sizes: the curve falls
                best[s] = min(c for c, u in curve.points.items() if u >= TARGET_UTILIZATION)
            else:
                short[s] = lv
        for f in curve_fractions:
            curve(max(1, min(top, int(share * f))))
        curves[s] = sorted([c, u] for c, u in curve.points.items())
        found = f"{best[s]} bytes" if best[s] is not None else f"none reaches {TARGET_UTILIZATION:.0%}"
        if s in short:
            lv = short[s]
            found += (
                f"; best {lv['best_utilization']:.2f}, levelling off from {lv['plateau_cache_per_node_bytes']} bytes "
                f"(bound: {lv['bound']['resource']})"
            )
        say(f"{s}: smallest cache per node for {TARGET_UTILIZATION:.0%} GPU utilisation: {found}")
    src = {
        "cache_per_node_bytes": "given (--cache-per-node)",
        "disk_bytes": "given (--disk)" if disk_bytes is not None else "not given: the search goes up to the dataset",
        "target_utilization": "the planner's question: GPUs at least this busy after the first epoch",
        "search_resolution_bytes": f"bisection stops at {RESOLUTION:.0%} of dataset / nodes",
        "search_epochs": "each search point runs a cold epoch and one warm one (later warm epochs repeat it)",
        "search_lower_bound_bytes": "no run: below it the origin link alone keeps the GPUs under the target "
        f"(dataset - {GPU_SLACK:g} x GPU seconds x origin bandwidth / target) / nodes",
        "sample_scale": f"no scaling: at most {MAX_SAMPLES} samples, the model walks each"
        if scale == 1
        else f"the model walks each sample: over {MAX_SAMPLES} samples it would take too long and too much "
        f"memory, so it ran {cfg.samples} samples of {scale:.4g}x the bytes (GPU and decode rates / "
        f"{scale:.4g}; block, shard and prefetch bytes and request latencies x {scale:.4g}): the same bytes "
        "and rates, each modelled chunk standing for that many chunks",
        **(sources or {}),
    }
    extra = {
        "sample_scale": scale,
        "cache_per_node_bytes": cache_bytes,
        "disk_bytes": disk_bytes,
        "target_utilization": TARGET_UTILIZATION,
        "search_resolution_bytes": step,
        "search_epochs": SCALING_EPOCHS,
        "search_lower_bound_bytes": low,
    }
    table = assumptions(replace(given, cache_fraction=user.cache_fraction), src)
    table |= {k: {"value": v, "source": src[k]} for k, v in extra.items()}
    return {
        "dataset_per_node_bytes": share,
        "assumptions": table,
        "setups": out,
        "setup_notes": {s: SETUP_NOTES[s] for s in setups},
        "min_cache_per_node_bytes": best,
        "levels_off": short,
        "colocated_changes_min_cache": changes(best, step)
        if {"presence", "colocated"} <= set(setups)
        else {"changes": None, "why": "presence and colocated were not both planned (--setups)"},
        "curves": curves,
    }


def changes(best: dict, step: int) -> dict:
    """Whether co-located scheduling changes the smallest cache per node against presence-only
    affinity: ``{changes: bool, presence_bytes, colocated_bytes, why}`` (a difference under one
    search ``step`` is no change)."""
    p, c = best.get("presence"), best.get("colocated")
    if p is None and c is None:
        why = "neither reaches the target at any cache size searched"
        diff = False
    elif p is None or c is None:
        why = f"only {'colocated' if p is None else 'presence'} reaches the target"
        diff = True
    else:
        diff = abs(p - c) > step
        why = (
            f"colocated needs {c / max(p, 1):.2f}x the cache of presence"
            if diff
            else "the same cache per node, to the search's resolution"
        )
    return {"changes": diff, "presence_bytes": p, "colocated_bytes": c, "why": why}
