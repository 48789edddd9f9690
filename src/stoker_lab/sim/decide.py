"""The decisions of a simulated job, made by stoker's own code.

Every choice the model needs comes from the product: the epoch order
(:func:`stoker.order.permutation`, :func:`stoker.order.rank_plan`), the block owners
(:func:`stoker.cluster.placement.bounded_owners`), the dataset's members
(:func:`stoker.cluster.membership.widen`, with the first-claim rule of
:func:`stoker.cluster.jobs.job.run`), rank placement and read plans
(:func:`stoker.cluster.schedule.choose_nodes`, :func:`stoker.cluster.schedule.colocated_plans`)
and the budget split between datasets (:func:`stoker.cache.policy.share_budget`). This module
only orders the calls the way :func:`stoker.cluster.jobs.job.run` does, for node labels instead of
Ray nodes. A change to any of them changes the model's answer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from stoker.cache.policy import share_budget
from stoker.cluster.membership import widen
from stoker.cluster.placement import bounded_owners
from stoker.cluster.schedule import choose_nodes, colocated_plans
from stoker.order import permutation, rank_plan

from .workload import Workload

#: The four setups of the TDCS comparison.
SETUPS = ("direct", "random", "presence", "colocated")


def node_names(n: int) -> list[str]:
    """Names of ``n`` simulated nodes (the keys blocks are placed by)."""
    return [f"node{i:03d}" for i in range(n)]


@dataclass
class Placement:
    """One job's placement. ``rank_node`` int64 (W,) node index of each rank; ``owner`` int64
    (B,) node index owning each block (-1 for ``direct``: every node caches for itself)."""

    rank_node: np.ndarray
    owner: np.ndarray


class ClusterState:
    """What persists between jobs of one dataset: its recorded members (first claim wins) and
    the blocks each node holds. ``keys``: each node's placement key (the name its blocks are
    placed by, :func:`stoker.cluster.service.cache_service.placement_keys`; default :func:`node_names`)."""

    def __init__(self, num_nodes: int, wl: Workload, keys: list[str] | None = None):
        if keys is not None and len(keys) != num_nodes:
            raise ValueError(f"{len(keys)} node keys for {num_nodes} nodes")
        self.num_nodes = num_nodes
        self.keys = list(keys) if keys is not None else node_names(num_nodes)
        self.members: list[int] | None = None
        self.cached = np.zeros((num_nodes, wl.num_blocks), dtype=bool)
        self.used_bytes = np.zeros(num_nodes)

    def cached_bytes(self, wl: Workload) -> np.ndarray:
        """Bytes of the dataset each node holds, float64 (nodes,)."""
        return self.cached.astype(np.float64) @ wl.block_bytes.astype(np.float64)


def dataset_budget(cache_bytes: float, wl: Workload, jobs_reading: int, epoch_s: float | None = None) -> int:
    """Bytes of one node's cache the dataset gets (:func:`stoker.cache.policy.share_budget` with
    this one dataset, whose cached size is its blocks' bytes; 0 when no job reads it)."""
    if jobs_reading < 1:
        return 0
    return share_budget(int(cache_bytes), {wl.name: (int(wl.block_bytes.sum()), epoch_s)})[wl.name]


_OWNERS: dict[tuple, np.ndarray] = {}


def _owners(wl: Workload, members: list[str], budgets: list[float]) -> np.ndarray:
    """:func:`stoker.cluster.placement.bounded_owners` of the dataset's blocks (their keys) on the
    members' placement keys ``members``, remembered for the
    last 16 (workload, members, budgets): the setups of one experiment place the same blocks on
    the same members, and hashing every (block, node) pair is most of a placement's time."""
    # equal budgets place alike whatever their value (the weights enter as w / -ln(h) and w / sum(w)),
    # so the points of a cache-size curve share one placement
    same = ("equal", len(budgets)) if len(set(budgets)) == 1 and budgets[0] > 0 else tuple(budgets)
    key = (
        bounded_owners,
        wl.name,
        None if wl.keys is None else tuple(wl.keys),
        wl.block_bytes.tobytes(),
        tuple(members),
        same,
    )
    if key not in _OWNERS:
        if len(_OWNERS) >= 16:
            _OWNERS.pop(next(iter(_OWNERS)))
        _OWNERS[key] = bounded_owners(wl.block_keys(), members, budgets, wl.block_bytes)
    return _OWNERS[key].copy()


def _random_nodes(rng: np.random.Generator, n: int, w: int, slots: int | None, allowed: list[int]) -> list[int]:
    if slots is None:  # job.run's random placement: nodes drawn with replacement
        return [allowed[i] for i in rng.integers(0, len(allowed), w)]
    free = np.repeat(np.asarray(allowed), slots)
    if len(free) < w:
        raise ValueError(f"{w} ranks do not fit in {len(free)} slots")
    return [int(x) for x in rng.permutation(free)[:w]]


def place_job(
    setup: str,
    state: ClusterState,
    wl: Workload,
    world: int,
    budgets: np.ndarray,
    seed: int,
    slots: int | None,
    rank_nodes: list[int] | None = None,
) -> Placement:
    """Place one job of ``world`` ranks, as ``stoker.cluster.run`` would for ``setup``.

    ``direct``: rank r on node r // slots (r with no slot limit), no shared cache; ``random``:
    ranks on random nodes (seeded, :func:`stoker.cluster.jobs.job.run`'s draw), the dataset on the
    recorded members; ``presence``: like random but only on nodes that are members of the
    dataset (Fluid's affinity: any node with a cache worker for it); ``colocated``: stoker's
    TDCS placement. ``budgets``: the dataset's cache bytes per node. ``rank_nodes``: the node
    (index) of each rank as a measured run placed them, instead of the setup's own choice (the
    dataset's members, owners and plans then follow from those nodes, as they did in the run).
    Raises ValueError for an unknown setup, too few slots or ``rank_nodes`` not ``world`` nodes.
    """
    n = state.num_nodes
    names = node_names(n)
    if rank_nodes is not None and (len(rank_nodes) != world or not all(0 <= int(v) < n for v in rank_nodes)):
        raise ValueError(f"rank nodes {rank_nodes} are not {world} nodes of {n}")
    if setup == "direct" and rank_nodes is not None:
        return Placement(np.asarray(rank_nodes, dtype=np.int64), np.full(wl.num_blocks, -1))
    if setup == "direct":
        per = slots or 1
        if world > n * per:
            raise ValueError(f"{world} ranks do not fit in {n * per} slots")
        return Placement(np.arange(world) // per if slots else np.arange(world) % n, np.full(wl.num_blocks, -1))
    if setup not in SETUPS:
        raise ValueError(f"setup must be one of {SETUPS}, got {setup!r}")
    cached = state.cached_bytes(wl)
    slot_list = None if slots is None else [slots] * n
    rng = np.random.default_rng(seed)
    if rank_nodes is not None:
        ranks = [int(v) for v in rank_nodes]
    elif setup == "colocated":
        ranks = [names.index(x) for x in choose_nodes(names, cached, budgets, world, slot_list)]
    elif setup == "presence" and state.members:
        ranks = _random_nodes(rng, n, world, slots, state.members)
    else:
        ranks = _random_nodes(rng, n, world, slots, list(range(n)))
    have = [i for i in range(n) if cached[i] > 0]
    if state.members is None:
        state.members = sorted(have or set(ranks))
    grown = widen(
        [names[i] for i in state.members],
        names,
        {names[i]: int(budgets[i]) for i in range(n)},
        wl.total_bytes,
        [names[i] for i in ranks],
    )
    state.members = sorted(names.index(x) for x in grown)
    members = state.members
    idx = _owners(wl, [state.keys[i] for i in members], [float(budgets[i]) for i in members])
    owner = np.asarray(members, dtype=np.int64)[idx]
    if setup == "colocated" and set(members) - set(have):  # ranks go where the data will be
        owned = np.bincount(owner, weights=wl.block_bytes, minlength=n)
        ranks = [names.index(x) for x in choose_nodes(names, owned, budgets, world, slot_list)]
    if rank_nodes is not None:
        ranks = [int(v) for v in rank_nodes]
    return Placement(np.asarray(ranks, dtype=np.int64), owner)


#: Permutations remembered: the last :data:`_PERM_KEPT` (workload, seed, epoch, order, window).
_PERM: dict = {}
#: Enough for the epochs of a few runs of one workload in turn (``stoker plan``'s setups and
#: search points each run epochs 0, 1, ...); each is 8 bytes a sample.
_PERM_KEPT = 4


def epoch_plans(
    setup: str,
    wl: Workload,
    placement: Placement,
    epoch: int,
    seed: int = 0,
    order: str = "blockwise",
    window: int = 16,
) -> list[np.ndarray]:
    """Every rank's sample ids for ``epoch`` (list of W int64 arrays): the permutation of
    :mod:`stoker.order` split by :func:`stoker.order.rank_plan`, or for ``colocated`` by
    :func:`stoker.cluster.schedule.colocated_plans` (samples cached on the rank's node first).
    The permutation is padded once the way ``rank_plan`` pads it (cyclically, to a multiple of
    the world size), so that ``rank_plan`` gives the same plans without a copy per rank, and the
    last few are remembered (jobs of one epoch share one, runs of one workload the epochs')."""
    key = (id(wl), seed, epoch, order, window)  # the jobs of one epoch share its permutation
    if key not in _PERM or _PERM[key][0] is not wl:  # the workload kept with it: an id is reused
        _PERM[key] = (wl, permutation(wl.num_samples, seed, epoch, order, groups=wl.sample_block, window=window))
        while len(_PERM) > _PERM_KEPT:
            del _PERM[next(iter(_PERM))]
    perm = _PERM[key][1]
    w = len(placement.rank_node)
    total = -(-len(perm) // w) * w  # rank_plan's cyclic padding, done once for all ranks (it copies
    padded = np.resize(perm, total) if total > len(perm) else perm  # the permutation on each call)
    if setup == "colocated":  # the same plans as from perm: colocated_plans pads it as rank_plan does
        return colocated_plans(padded, placement.owner[wl.sample_block], list(placement.rank_node))
    return [rank_plan(padded, r, w) for r in range(w)]
