"""Placement of a dataset's cache blocks on node caches: weighted rendezvous hashing.

Rendezvous (highest random weight, HRW) hashing (Thaler & Ravishankar, "Using name-based
mappings to increase hit rates", IEEE/ACM ToN 1998): every (key, node) pair gets a
pseudo-random score and a key goes to the node with the highest score. Removing a node
moves only the keys it owned; adding one takes only the keys it now wins. Weighted by each
node's cache budget with the logarithmic method (Schindelhauer & Schomaker, "Weighted
distributed hash tables", SPAA 2005; J. Resch, "New hashing algorithms for data storage"):
``score = w / -ln(h)`` with ``h`` uniform in (0, 1) from the hash, so node i wins a key with
probability ``w_i / sum(w)`` exactly. The cluster then holds the sum of the budgets, one copy
of each block (CoorDL's partitioned cache), not one copy per node.

The placement unit is the cache block (about 1 MiB of whole samples of one shard, see
:func:`stoker.store.blockmap.plan_blocks`), keyed by the dataset's content version and the
block name, so a re-packed dataset is placed afresh. Pure functions, no Ray.
"""

from __future__ import annotations

import numpy as np
import xxhash

_U53 = float(1 << 53)


def _unit(keys: list[str], node: str) -> np.ndarray:
    """Uniform (0, 1) float64 per key for ``node`` from xxh3-64 of ``node \\0 key`` (top 53 bits)."""
    seed = xxhash.xxh3_64_intdigest(node.encode())
    h = np.fromiter(
        (xxhash.xxh3_64_intdigest(k.encode(), seed=seed) >> 11 for k in keys), dtype=np.float64, count=len(keys)
    )
    return (h + 0.5) / _U53


def hrw_scores(keys: list[str], nodes: list[str], weights) -> np.ndarray:
    """Weighted rendezvous scores, float64 (len(keys), len(nodes)): ``w / -ln(h(key, node))``.

    ``weights``: positive numbers (e.g. cache budgets in bytes), one per node; a node with
    weight 0 never wins. Raises ValueError for mismatched lengths or negative weights.
    """
    w = np.asarray(weights, dtype=np.float64)
    if len(w) != len(nodes):
        raise ValueError(f"{len(nodes)} nodes but {len(w)} weights")
    if (w < 0).any():
        raise ValueError("weights must be >= 0")
    out = np.empty((len(keys), len(nodes)), dtype=np.float64)
    for j, node in enumerate(nodes):
        out[:, j] = w[j] / -np.log(_unit(keys, node))
    return out


def owners(keys: list[str], nodes: list[str], weights) -> np.ndarray:
    """Index into ``nodes`` of the owner of each key, int64 (len(keys),).

    Deterministic: a pure function of the keys, the node names and the weights, whatever
    the order of ``nodes`` (ties, which have probability ~0, go to the smaller node name).
    Raises ValueError when there are no nodes or every weight is 0.
    """
    if not nodes:
        raise ValueError("no nodes to place blocks on")
    if not np.any(np.asarray(weights, dtype=np.float64) > 0):
        raise ValueError("every node weight is 0")
    order = np.argsort(np.asarray(nodes, dtype=object), kind="stable")  # tie-break by name
    scores = hrw_scores(keys, [nodes[i] for i in order], np.asarray(weights, dtype=np.float64)[order])
    return order[np.argmax(scores, axis=1)].astype(np.int64)


def bounded_owners(keys: list[str], nodes: list[str], weights, sizes, balance: float = 1.05) -> np.ndarray:
    """:func:`owners` with bounded loads: no node gets more than ``balance`` times its weighted
    share of the total ``sizes`` (plus one key's size).

    Consistent hashing with bounded loads (Mirrokni, Thorup & Zadimoghaddam, SODA 2018) applied
    to rendezvous hashing: keys are taken in a fixed pseudo-random order (by their hash) and
    each goes to the highest-scoring node that still has room, so the split matches the weights
    within ``balance`` even for a few hundred keys (plain HRW is off by a binomial spread, which
    costs co-located ranks their locality when every rank must read the same number of
    samples). Deterministic like :func:`owners`; a node's departure can move a few other keys
    too. ``sizes``: bytes per key. Raises ValueError like :func:`owners` or for ``balance < 1``.
    """
    if balance < 1:
        raise ValueError("balance must be >= 1")
    if not nodes:
        raise ValueError("no nodes to place blocks on")
    w = np.asarray(weights, dtype=np.float64)
    if not np.any(w > 0):
        raise ValueError("every node weight is 0")
    sizes = np.asarray(sizes, dtype=np.float64)
    order = np.argsort(np.asarray(nodes, dtype=object), kind="stable")
    scores = hrw_scores(keys, [nodes[i] for i in order], w[order])
    prefs = np.argsort(-scores, axis=1, kind="stable")  # node preference per key (sorted-name indices)
    cap = balance * sizes.sum() * w[order] / w.sum() + (sizes.max() if len(sizes) else 0.0)
    load = np.zeros(len(nodes))
    out = np.empty(len(keys), dtype=np.int64)
    visit = np.argsort(_unit(keys, "\0order"), kind="stable")
    for k in visit:
        for j in prefs[k]:
            if load[j] + sizes[k] <= cap[j] or j == prefs[k][-1]:
                load[j] += sizes[k]
                out[k] = order[j]
                break
    return out


def block_keys(ds) -> list[str]:
    """Placement keys of a :class:`stoker.store.dataset.Dataset`'s blocks: ``version/block name``."""
    return [f"{ds.version}/{ds.blocks.name(b)}" for b in range(len(ds.blocks))]


def place_dataset(ds, nodes: list[str], weights, balance: float | None = 1.05) -> np.ndarray:
    """Owner node index of each block of ``ds``, int64 (len(ds.blocks),): :func:`bounded_owners`
    over the block sizes (``balance=None``: plain :func:`owners`)."""
    keys = block_keys(ds)
    if balance is None:
        return owners(keys, nodes, weights)
    return bounded_owners(keys, nodes, weights, ds.blocks.nbytes(np.arange(len(ds.blocks))), balance)


def placement_keys(services: dict, members: list[str]) -> list[str]:
    """The names the blocks are placed by (:func:`stoker.cluster.placement.place_dataset`), one per
    member node id: each service's ``cache_key`` (its host and slot, stable across Ray restarts, so
    every block keeps its node and its cached copy), else the node id. Keys that two nodes share
    (hosts of the same name) get the node id added. ``services``: ``{node id: info()}``."""
    keys = [services[m].get("cache_key") or m for m in members]
    return [k if keys.count(k) == 1 else f"{k}@{m}" for k, m in zip(keys, members, strict=True)]


def bytes_per_node(ds, owner: np.ndarray, num_nodes: int) -> np.ndarray:
    """Bytes of ``ds`` each node owns under ``owner`` (int64 (num_nodes,))."""
    return np.bincount(owner, weights=ds.blocks.nbytes(np.arange(len(ds.blocks))), minlength=num_nodes).astype(np.int64)
