"""Co-located scheduling (TDCS): training workers on the nodes that hold their data, and each
rank given the samples cached on its node as far as exactly-once and equal counts allow.

Pure functions (no Ray), so every rank computes the same assignment from the same inputs.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from ..order import EpochShares, interleaved_shares


def choose_nodes(nodes: list[str], cached_bytes, budgets, num_workers: int, slots=None) -> list[str]:
    """The node of each of ``num_workers`` ranks, co-located with the data.

    Ranks go one at a time to the node with the most cached bytes of the dataset per rank
    already placed there (``cached / (placed + 1)``), so a node holding twice the bytes gets
    about twice the ranks; ties go to the larger cache budget, then the smaller node id. A
    dataset cached nowhere yet thus spreads its ranks over the nodes by budget, and its cache
    then goes to those nodes. ``slots``: most ranks per node (None = no limit).
    Raises ValueError when the slots cannot hold ``num_workers`` ranks.
    """
    cached = np.asarray(cached_bytes, dtype=np.float64)
    budget = np.asarray(budgets, dtype=np.float64)
    free = np.full(len(nodes), np.inf) if slots is None else np.asarray(slots, dtype=np.float64).copy()
    if free.sum() < num_workers:
        raise ValueError(f"{num_workers} workers do not fit in {int(free.sum())} slots on {len(nodes)} nodes")
    placed = np.zeros(len(nodes))
    base = cached if cached.sum() > 0 else budget
    out = []
    for _ in range(num_workers):
        score = np.where(free > placed, base / (placed + 1), -np.inf)
        cand = [i for i in range(len(nodes)) if score[i] == score.max()]
        i = min(cand, key=lambda j: (-budget[j], nodes[j]))
        placed[i] += 1
        out.append(nodes[i])
    return out


def colocated_shares(perm: np.ndarray, sample_node, rank_node: list, even: str = "pad", served=None) -> EpochShares:
    """Every rank's share of one epoch, preferring samples cached on the rank's node
    (:class:`stoker.order.EpochShares`).

    ``perm``: the epoch's permutation, int64 (N,); ``sample_node``: the node (any hashable
    label, e.g. a node index; -1 = nowhere) caching each sample, array (N,); ``rank_node``: the
    node of each rank; ``served``: samples served already (bool by sample id: a resumed epoch),
    None for none. The entries owed (the ids of ``perm`` not served, in its order) are first made
    even exactly as :func:`stoker.order.rank_plan` does (``pad`` repeats the first
    ``ceil(n/W)*W - n`` positions of ``perm``, ``drop`` leaves out the last ``n mod W``), so every
    rank gets the same count q and every sample owed is served exactly once across ranks (n
    divisible by W) or as ``rank_plan`` would. Then each node's entries are dealt round-robin to
    that node's ranks up to q each; the entries left (nodes without ranks, overflow) fill the
    ranks that still have room, in permutation order. Each rank's ids keep the permutation's
    order, so a blockwise order stays blockwise per rank, and its repeats come last.
    """
    base = interleaved_shares(perm, len(rank_node), even, served)  # the entries rank_plan serves
    w, ids = len(rank_node), base.perm[base.entries]
    q = len(ids) // w
    where = np.asarray(sample_node)[ids] if len(ids) else np.zeros(0, dtype=np.int64)
    owner_rank = np.full(len(ids), -1, dtype=np.int64)  # rank each entry goes to
    ranks_on: dict = {}
    for r, n in enumerate(rank_node):
        ranks_on.setdefault(n, []).append(r)
    for n, rs in ranks_on.items():  # deal the node's entries round-robin, q per rank
        mine = np.flatnonzero(where == n)[: len(rs) * q]
        owner_rank[mine] = np.asarray(rs, dtype=np.int64)[np.arange(len(mine)) % len(rs)]
    have = np.bincount(owner_rank[owner_rank >= 0], minlength=w)
    left = np.flatnonzero(owner_rank < 0)  # in permutation order
    owner_rank[left] = np.repeat(np.arange(w), q - have)  # fill the ranks with room, in rank order
    return replace(base, owner=owner_rank)


def colocated_plans(perm: np.ndarray, sample_node: np.ndarray, rank_node: list, even: str = "pad") -> list:
    """Every rank's sample ids for one epoch (a list of W int64 arrays), preferring samples
    cached on the rank's node: :func:`colocated_shares`' plans."""
    shares = colocated_shares(perm, sample_node, rank_node, even)
    return [shares.plan(r) for r in range(len(rank_node))]
