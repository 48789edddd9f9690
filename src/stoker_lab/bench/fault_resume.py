"""`stoker bench faults`, the cluster resume case: a co-located job's checkpoint resumed at
another world size or placement.

Four ranks of a co-located cluster plan (:class:`stoker.cluster.ClusterLoader` over a 3-node
layout: the blocks placed by :func:`stoker.cluster.placement.place_dataset`, ranks on nodes
0, 1, 2, 0) take 3 batches each and save their state; new jobs of 4 ranks on other nodes
(1, 2, 0, 0), of 3 and of 2 load it and finish the epoch. The plans are pure functions of that
layout, so no Ray cluster is started (Ray must be installed: the cluster loader imports it). Right:
every sample of the epoch exactly once across the old job and each new one (the labels read back
are the sample indexes), and every rank saving the same state. The job runs as a child with a
hard timeout (``python -m stoker_lab.bench.fault_resume LOCAL OUT``)."""

from __future__ import annotations

import collections
import json
import os
import sys
import time

import numpy as np

from .fault_harness import aggregate, child_env, run_child

NAME = "cluster_resume_other_world_size"
#: Samples per batch, and batches each of the 4 saving ranks takes (fewer on a tiny dataset).
BATCH, SAVED_BATCHES = 2, 3
#: The resuming jobs: name -> the node (0..2) of each rank.
RESUMES = {"4 ranks on other nodes": [1, 2, 0, 0], "3 ranks": [0, 1, 2], "2 ranks": [2, 1]}


def _label(fields, rng):
    """A Loader ``decode=``: the sample's label, which is its index in the bench's dataset."""
    return np.array([fields["__label__"]], np.int64)


def _job(ds, owner, rank_nodes: list, state: dict | None, batches: int | None) -> tuple[list, list]:
    """One co-located job, a rank at a time on epoch 0: each loads ``state`` (if any) and takes
    ``batches`` batches (None: the rest of the epoch). Returns (labels served, the repeats that
    only even the ranks left out; each rank's state_dict)."""
    from stoker.cluster.counters import ByteCounters
    from stoker.cluster.jobs.job import ClusterLoader, WorkerContext

    labels, states = [], []
    for rank, node in enumerate(rank_nodes):
        spec = {
            "rank": rank,
            "world_size": len(rank_nodes),
            "node_id": f"node-{node}",
            "job": "bench",
            "placement": "colocated",
            "rank_nodes": list(rank_nodes),
            "owner": owner,
            "rank_node_ids": [f"node-{n}" for n in rank_nodes],
            "token": "bench",
        }
        counters = ByteCounters()
        loader = ClusterLoader(WorkerContext(spec, ds, counters), BATCH, num_workers=0, seed=0, decode=_label)
        try:
            if state is not None:
                loader.load_state_dict(state)
            pads = loader.padding_mask(0)
            it = iter(loader)  # kept until the state is saved: a dropped iterator ends its epoch
            taken = it if batches is None else (next(it) for _ in range(batches))
            got = [int(v) for b in taken for v in np.asarray(b).reshape(-1)]
            pads = pads[len(pads) - len(got) :] if batches is None else pads[: len(got)]
            labels += [i for i, pad in zip(got, pads, strict=True) if not pad]
            states.append(json.loads(json.dumps(loader.state_dict())))
            del it
        finally:
            loader.close()
            counters.close()
    return labels, states


def _main(local: str, out: str) -> None:
    """The child: save with 4 ranks, resume with each of :data:`RESUMES`; writes
    ``{"rounds": [...], "same_state": bool}`` to ``out``."""
    from stoker.cluster.placement import place_dataset
    from stoker.store.dataset import open_dataset

    ds = open_dataset(local, cache=False, block_bytes=32 << 10)
    owner = place_dataset(ds, ["node-0", "node-1", "node-2"], [1 << 30] * 3)
    per_rank = -(-len(ds) // 4)
    batches = max(0, min(SAVED_BATCHES, -(-per_rank // BATCH) - 1))  # mid-epoch
    saved, states = _job(ds, owner, [0, 1, 2, 0], None, batches)
    rounds: list[dict] = []
    for name, nodes in RESUMES.items():
        t0 = time.perf_counter()
        try:
            rest, _ = _job(ds, owner, nodes, states[0], None)
        except ValueError as exc:
            rounds.append({"name": name, "outcome": "clean_error", "error": str(exc)})
            continue
        seen = collections.Counter(saved + rest)
        lost = len(set(range(len(ds))) - set(seen))
        dup = sum(c - 1 for c in seen.values())
        bad = lost or dup
        rounds.append(
            {
                "name": name,
                "outcome": "failed" if bad else "completed",
                "lost": lost,
                "duplicated": dup,
                "seconds": round(time.perf_counter() - t0, 3),
                "error": f"{name}: {dup} samples served twice, {lost} never" if bad else None,
            }
        )
    with open(out, "w") as f:
        json.dump({"rounds": rounds, "same_state": all(s == states[0] for s in states)}, f)


def cluster_resume(ctx) -> dict:
    """The case (see the module doc) for :func:`stoker_lab.bench.faults.run`: a report row
    (:func:`stoker_lab.bench.fault_harness.aggregate`), ``skipped`` without Ray."""
    try:
        import ray  # noqa: F401
    except ImportError:
        return {**aggregate(NAME, "completed", []), "outcome": "skipped", "details": {"reason": "ray is not installed"}}
    out = os.path.join(ctx.work, "cases", "cluster-resume.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    rc, err = run_child([sys.executable, "-m", "stoker_lab.bench.fault_resume", ctx.local, out], 180, child_env())
    if rc is None or rc != 0:
        rec = {"outcome": "hang" if rc is None else "failed", "error": err.strip()[-300:] or f"exit {rc}"}
        return aggregate(NAME, "completed", [rec])
    with open(out) as f:
        rep = json.load(f)
    row = aggregate(NAME, "completed", rep["rounds"])
    row["details"]["rounds"] = {r["name"]: r["outcome"] for r in rep["rounds"]}
    row["details"]["problems"] = [] if rep["same_state"] else ["the saving ranks' states differ"]
    return row


CASES = {NAME: (cluster_resume, True)}  # name -> (function, part of --quick)


if __name__ == "__main__":
    _main(sys.argv[1], sys.argv[2])
