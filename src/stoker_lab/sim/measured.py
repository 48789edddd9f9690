"""Where a measured namespace run put things: its dataset's blocks, its nodes' keys, its ranks.

The model places blocks with stoker's own bounded rendezvous hashing (:mod:`stoker_lab.sim.decide`),
which is a pure function of the blocks' keys and the nodes' keys. A ``stoker bench cluster
--netns`` run placed the blocks of *its* dataset (keys: the content version and the block name,
:func:`stoker.cluster.placement.block_keys`) on *its* nodes (keys ``node-<NODE_NAME>-0``,
:func:`stoker.cluster.identity.cache_key`; the bench names every host after its network
namespace, new in every run). With made-up names the model draws a different split of the 57
blocks over the nodes, and so different peer bytes; with the run's own names it draws the run's.

- :func:`netns_dataset`: the bench's dataset is a pure function of its parameters
  (:func:`stoker_lab.sample_data.make_sample_data` writes byte-identical images for a seed, and
  ``stoker pack`` lays them out deterministically), so it is made again here and opened with
  stoker's own reader: the real sample sizes, blocks and block keys.
- :func:`netns_node_keys`: each host's placement key, from the report's namespace names.
- :func:`recorded_ranks`, :func:`recorded_starts`: where each rank ran and when it started. Ray
  lists nodes sorted by their random ids and ``placement="random"`` draws rank nodes by index in
  that list, so which hosts got the ranks is not in the seed; a report that records each rank's
  host (``rank_hosts``) says it, and the model puts the ranks there. Each rank times its own loop
  from its own start, and ranks of a job start up to seconds apart (``rank_start_s``): the model
  starts each rank at its recorded offset.
- :func:`host_order`: for older reports without ``rank_hosts``, which host each model node is,
  read off the kernel's per-host counters of the warm ``random`` epochs (a host's received bytes
  are its ranks' peer reads): of all orders, the one whose per-host received bytes are nearest the
  kernel's.
"""

from __future__ import annotations

import itertools
import os
import tempfile

import numpy as np

from .decide import ClusterState, dataset_budget, epoch_plans, place_job
from .workload import Workload, from_dataset

#: Classes of the bench's sample images (``stoker bench cluster --netns`` makes 10).
NETNS_CLASSES = 10
_MEMO: dict = {}


def _open(path: str, block_bytes: int):
    from stoker.store.dataset import open_dataset

    return open_dataset(path, cache=False, check=False, block_bytes=block_bytes)


def netns_dataset(report: dict, path: str, workdir: str | None = None) -> tuple[Workload | None, str]:
    """The dataset of a ``--netns`` report, made again: ``(workload, source)``, or ``(None, why
    not)`` when it cannot be made (scikit-image or scikit-learn missing) or does not match the
    report's samples, bytes, blocks (and content version, when the report has it).

    The images go under ``workdir`` (default ``$TMPDIR/stoker-sim``) and are packed there once
    (about 10 s for 900 images); later calls open the packed copy."""
    from stoker.store.pack import pack

    from ..sample_data import SHORT_SIDE, make_sample_data

    ds_info, cfg = report["dataset"], report["config"]
    images, seed = int(ds_info["samples"]), int(cfg.get("seed", 0))
    shard, block = int(cfg["shard_bytes"]), int(cfg["block_bytes"])
    lo, hi = (int(x) for x in cfg.get("image_short_side", SHORT_SIDE))  # reports before the option: the default
    side = (lo, hi)
    key = (images, seed, shard, block, workdir, side)
    if key not in _MEMO:
        name = f"netns-{images}-{seed}" + ("" if side == SHORT_SIDE else f"-side{side[0]}-{side[1]}")
        base = os.path.join(workdir or os.path.join(tempfile.gettempdir(), "stoker-sim"), name)
        packed = os.path.join(base, f"packed-{shard}")
        try:
            try:
                ds = _open(packed, block)
            except (OSError, ValueError):
                make_sample_data(
                    os.path.join(base, "data"), images=images, classes=NETNS_CLASSES, seed=seed, short_side=side
                )
                pack(os.path.join(base, "data", "train"), packed, shard_bytes=shard, overwrite=True, progress=False)
                ds = _open(packed, block)
            _MEMO[key] = (from_dataset(ds, "netns"), ds.version, packed)
        except (RuntimeError, OSError, ImportError, ValueError) as e:
            _MEMO[key] = (None, f"could not make it again ({type(e).__name__}: {e})", packed)
    wl, version, packed = _MEMO[key]
    if wl is None:
        return None, f"{path}: dataset {version}"
    got = (wl.num_samples, wl.total_bytes, wl.num_blocks)
    want = (images, int(ds_info["bytes"]), int(ds_info["blocks"]))
    if got != want or ds_info.get("version", version) != version:
        return None, (
            f"{path}: the dataset made again ({got[0]} samples, {got[1]} bytes, {got[2]} blocks, "
            f"version {version}) is not the report's ({want[0]}, {want[1]}, {want[2]}, "
            f"{ds_info.get('version', '?')})"
        )
    return wl, (
        f"{path}: its dataset made again ({images} images, seed {seed}, {NETNS_CLASSES} classes, "
        f"short side {side[0]}-{side[1]} px, "
        f"shards of {shard} bytes; {packed}): {got[0]} samples, {got[1]} bytes, {got[2]} blocks "
        f"as reported, version {version}"
    )


def netns_hosts(report: dict) -> list[str]:
    """The report's host names in host order (``h0``, ``h1`` ...)."""
    return [f"h{i}" for i in range(int(report["hosts"]))]


def netns_node_keys(report: dict) -> list[str]:
    """Each host's placement key, in host order: the key of slot 0 of a host named after its
    namespace (the bench sets ``NODE_NAME`` to it; one Ray node per host)."""
    from stoker.cluster.identity import cache_key, host_name

    return [cache_key(host_name(report["links"][h]["ns"]), 0) for h in netns_hosts(report)]


def _random_received(report: dict, wl: Workload, keys: list[str], rows: list[dict], jobs: list) -> np.ndarray:
    """Peer bytes each model node receives in each warm ``random`` row (float64 (rows, nodes)), from
    the decisions alone (every block cached on its owner, as in a warm epoch)."""
    n = int(report["hosts"])
    state = ClusterState(n, wl, keys)
    budgets = np.full(n, float(dataset_budget(report["config"]["cache_bytes_per_node"], wl, 1)))
    placed = {j.name: place_job("random", state, wl, j.world, budgets, j.seed, None) for j in jobs}
    out = np.zeros((len(rows), n))
    for k, r in enumerate(rows):
        pl = placed[r["job"]]
        for rank, plan in enumerate(epoch_plans("random", wl, pl, r["epoch"])):
            node = int(pl.rank_node[rank])
            out[k, node] += wl.sample_bytes[plan][pl.owner[wl.sample_block[plan]] != node].sum()
    return out


def recorded_ranks(report: dict, path: str) -> dict[tuple[str, str], list[int]] | None:
    """``{(placement, job): host index of each rank}`` from the rows' ``rank_hosts`` (rank order), or
    None when a row does not record them. A job is placed once, so its rows must agree: raises
    ValueError naming the report, placement and job when they do not, or a host out of range."""
    if not report["runs"] or not all("rank_hosts" in r for r in report["runs"]):
        return None
    n = int(report["hosts"])
    out: dict[tuple[str, str], list[int]] = {}
    for r in report["runs"]:
        hosts = [int(h) for h in r["rank_hosts"]]
        key = (r["placement"], r["job"])
        if out.setdefault(key, hosts) != hosts or not all(0 <= h < n for h in hosts):
            raise ValueError(
                f"{path}: {r['placement']} {r['job']} epoch {r['epoch']}: rank_hosts {hosts} "
                f"differ from its other epochs' {out[key]} or name a host not in 0..{n - 1}"
            )
    return out


def recorded_starts(report: dict, path: str) -> dict[tuple[str, str], dict[int, list[float]]]:
    """``{(placement, job): {epoch: each rank's start after the first rank's, seconds}}`` from the
    rows' ``rank_start_s`` (rows without it are left out: their ranks start together). Raises
    ValueError naming the row for a negative offset or one per rank missing."""
    out: dict[tuple[str, str], dict[int, list[float]]] = {}
    for r in report["runs"]:
        if "rank_start_s" not in r:
            continue
        starts = [float(x) for x in r["rank_start_s"]]
        if len(starts) != int(r["ranks"]) or min(starts) < 0:
            raise ValueError(
                f"{path}: {r['placement']} {r['job']} epoch {r['epoch']}: rank_start_s {starts} is "
                f"not {r['ranks']} offsets >= 0"
            )
        out.setdefault((r["placement"], r["job"]), {})[int(r["epoch"])] = starts
    return out


def host_order(report: dict, path: str, wl: Workload, jobs: list) -> tuple[list[int], str]:
    """``(order, source)``: ``order[i]`` is the host (index in :func:`netns_hosts`) that model node
    ``i`` stands for, ``jobs`` the report's jobs (:func:`stoker_lab.sim.calibrate.netns_jobs`), for a
    report without ``rank_hosts`` (:func:`recorded_ranks`).

    The order whose predicted received peer bytes per host are nearest (least squares) the
    kernel's ``rx_bytes`` per host over the warm ``random`` epochs; the host order itself when
    there are none."""
    n = int(report["hosts"])
    hosts, keys = netns_hosts(report), netns_node_keys(report)
    rand = [r for r in report["runs"] if r["placement"] == "random"]
    warm = [r for r in rand if r["stoker"]["origin_bytes"] == 0]
    if not warm:
        return list(range(n)), f"{path}: no warm random epoch; model node i is host h<i>"
    meas = np.array([[r["kernel"]["links"][h]["rx_bytes"] for h in hosts] for r in warm], dtype=np.float64)
    scored = []
    for perm in itertools.permutations(range(n)):
        pred = _random_received(report, wl, [keys[h] for h in perm], warm, jobs)
        by_host = np.zeros_like(pred)
        by_host[:, list(perm)] = pred
        scored.append((float(((by_host - meas) ** 2).sum()), list(perm)))
    scored.sort(key=lambda x: x[0])
    best, rms = scored[0][1], (scored[0][0] / meas.size) ** 0.5
    runner = (scored[1][0] / meas.size) ** 0.5 if len(scored) > 1 else float("nan")
    return best, (
        f"{path}: read off the kernel's rx bytes per host in its {len(warm)} warm random epochs: "
        f"model nodes are hosts {', '.join(hosts[h] for h in best)} (rms {rms / 1e6:.2f} MB per host "
        f"and epoch; the next best order {runner / 1e6:.2f} MB)"
    )
