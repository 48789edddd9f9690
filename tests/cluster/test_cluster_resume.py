"""A checkpoint of a co-located (cluster) job resumed at another world size or placement serves
every sample of the epoch exactly once, across the old job and the new one.

A co-located plan deals each node's samples to that node's ranks, so what the ranks have served
after k batches each is not the first ids of the permutation: the state says which samples they
were (``served``), and the new plan splits the rest. First a Hypothesis property over the real
:class:`stoker.cluster.ClusterLoader` and :class:`stoker.Loader` (their plans and states, built
without a Ray cluster: the plan is a pure function of the job's layout), then jobs on the
3-node test cluster: ``stoker.cluster.run`` and ``rank_loader`` (what a Ray Train worker uses),
with the sample ids read back from the bytes each batch delivered."""

from __future__ import annotations

import collections
import json
import re
from functools import partial

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from _helpers import batch_ids, pack_id_dataset, sample_id

ray = pytest.importorskip("ray")

from stoker import Loader, ReadOptions  # noqa: E402
from stoker.cluster import ClusterOptions  # noqa: E402

#: Samples of the property's datasets (ids packed into the bytes, :func:`_helpers.pack_id_dataset`).
SIZES = (1, 7, 24, 50)
SEED = 5


# -- the property: plans and states, no Ray cluster -------------------------------------------


@pytest.fixture(scope="module")
def id_datasets(tmp_path_factory) -> dict:
    """{samples: Dataset}: small samples in blocks of about two, so a placement has many blocks."""
    from stoker.store.dataset import open_dataset

    out = {}
    for n in SIZES:
        url = pack_id_dataset(tmp_path_factory.mktemp(f"ids{n}"), n, size=600, shard_bytes=8 << 10)
        out[n] = open_dataset(url, cache=False, block_bytes=1500)
    return out


def _ctx(ds, rank: int, world: int, rank_nodes: list, owner: list, opened: list):
    """A real :class:`WorkerContext` of a co-located job whose ranks sit on ``rank_nodes`` (member
    index per rank, ``-1 - r`` for a node that owns nothing) and whose blocks ``owner`` holds; its
    byte counters are appended to ``opened`` (the caller closes them)."""
    from stoker.cluster.counters import ByteCounters
    from stoker.cluster.jobs.job import WorkerContext

    spec = {
        "rank": rank,
        "world_size": world,
        "node_id": f"node-{rank_nodes[rank]}",
        "job": "prop",
        "placement": "colocated",
        "rank_nodes": list(rank_nodes),
        "owner": np.asarray(owner, dtype=np.int64),
        "rank_node_ids": [f"node-{n}" for n in rank_nodes],
        "token": "prop",
    }
    counters = ByteCounters()
    opened.append(counters)
    counters.size_tags(len(ds.blocks))
    return WorkerContext(spec, ds, counters)


def _loader(ds, cfg: dict, rank: int, world: int, layout, opened: list):
    """Rank ``rank`` of ``world``: a ClusterLoader on ``layout`` (rank nodes, block owners), or a
    plain Loader when ``layout`` is None; what must be closed besides it goes to ``opened``."""
    from stoker.cluster.jobs.job import ClusterLoader

    kw = dict(
        seed=SEED,
        num_workers=0,
        drop_last=cfg["drop_last"],
        decode=sample_id,
        read=ReadOptions(order=cfg["order"], even=cfg["even"]),
    )
    if layout is None:
        return Loader(ds, cfg["batch_size"], rank=rank, world_size=world, **kw)
    return ClusterLoader(_ctx(ds, rank, world, *layout, opened), cfg["batch_size"], **kw)


def _job(ds, cfg, world, layout, state, stop):
    """One job of ``world`` ranks over epoch 0: each rank loads ``state`` (None: a fresh start),
    takes at most ``stop`` batches (None: to the epoch's end). Returns (sample ids served, the
    repeats that only even the ranks left out; each rank's count of samples left in its plan;
    each rank's state_dict, JSON round-tripped)."""
    served, left, states, opened = [], [], [], []
    for rank in range(world):
        loader = _loader(ds, cfg, rank, world, layout, opened)
        try:
            if state is not None:
                loader.load_state_dict(json.loads(json.dumps(state)))
            if loader.epoch != 0:  # the saved epoch was over
                states.append(json.loads(json.dumps(loader.state_dict())))
                continue
            skip = loader.state_dict()["batches_done"]  # batches of this plan served before it
            plan, pads = loader.plan(0), loader.padding_mask(0)
            left.append(len(plan) - skip * cfg["batch_size"])
            mine: list[int] = []
            it = iter(loader)  # kept until the state is saved: a dropped iterator ends its epoch
            for batch in it if stop is None else (next(it, None) for _ in range(stop)):
                if batch is not None:
                    mine.extend(batch_ids(batch))
            start = skip * cfg["batch_size"]
            assert mine == plan[start : start + len(mine)].tolist()  # the plan, in order
            served.extend(i for i, pad in zip(mine, pads[start:], strict=False) if not pad)
            states.append(json.loads(json.dumps(loader.state_dict())))
            del it
        finally:
            loader.close()
            for c in opened:
                c.close()
    return served, left, states


def _layout(draw_nodes, n_blocks: int, world: int, rng: np.random.Generator):
    """A random co-located layout: the member (of ``draw_nodes``) owning each block, and each
    rank's member or none (``-1 - r``)."""
    owner = rng.integers(0, draw_nodes, n_blocks).tolist()
    ranks = [int(m) if m >= 0 else -1 - r for r, m in enumerate(rng.integers(-1, draw_nodes, world))]
    return ranks, owner


cuts = st.fixed_dictionaries(
    {
        "n": st.sampled_from(SIZES),
        "batch_size": st.integers(1, 6),
        "drop_last": st.booleans(),
        "even": st.sampled_from(["pad", "drop"]),
        "order": st.sampled_from(["blockwise", "uniform"]),
        "worlds": st.lists(st.integers(1, 5), min_size=2, max_size=3),  # the jobs, one after another
        "colocated": st.lists(st.booleans(), min_size=3, max_size=3),  # each job's kind of plan
        "cuts": st.lists(st.floats(0, 1), min_size=2, max_size=2),  # where each job but the last stops
        "nodes": st.integers(1, 3),
        "seed": st.integers(0, 2**16),
    }
)


@pytest.mark.filterwarnings("ignore:epoch .* delivers no sample:RuntimeWarning")
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cfg=cuts)
# the case in small: 4 co-located ranks cut after 3 batches, resumed by 3 co-located ranks
@example(
    cfg={
        "n": 50,
        "batch_size": 4,
        "drop_last": False,
        "even": "pad",
        "order": "blockwise",
        "worlds": [4, 3],
        "colocated": [True, True, True],
        "cuts": [0.6, 0.0],
        "nodes": 3,
        "seed": 1,
    }
)
def test_a_cut_epoch_resumed_at_any_world_size_and_placement_serves_every_sample_once(id_datasets, cfg):
    ds = id_datasets[cfg["n"]]
    rng = np.random.default_rng(cfg["seed"])
    served: list[int] = []
    state = None
    owed = cfg["n"]  # samples of the epoch not served before the job that ends it
    for j, world in enumerate(cfg["worlds"]):
        layout = _layout(cfg["nodes"], len(ds.blocks), world, rng) if cfg["colocated"][j] else None
        last = j == len(cfg["worlds"]) - 1
        opened: list = []
        probe = _loader(ds, cfg, 0, world, layout, opened)
        try:
            if state is not None:
                probe.load_state_dict(json.loads(json.dumps(state)))
            batches = len(probe) if probe.epoch == 0 else 0
        finally:
            probe.close()
            opened[0].close() if opened else None
        stop = None if last else int(cfg["cuts"][j] * (batches + 1))
        owed = cfg["n"] - len(served)
        got, left, states = _job(ds, cfg, world, layout, state, stop)
        assert len(set(left)) <= 1  # every rank the same count (DDP)
        assert all(s == states[0] for s in states)  # one state for the job: every rank says the same
        served.extend(got)
        state = states[0]
        if state["epoch"] != 0 or state["samples_done"] == cfg["n"]:  # this job finished the epoch
            break
    counts = collections.Counter(served)
    assert not [i for i, c in counts.items() if c > 1], "a sample served twice"
    missing = cfg["n"] - len(counts)
    if cfg["even"] == "pad" and not cfg["drop_last"]:
        assert missing == 0, f"{missing} samples never served"
    else:  # only what the job that ended the epoch dropped to even its ranks or cut its batches
        dropped = (world - 1 if cfg["even"] == "drop" else 0) + (
            world * (cfg["batch_size"] - 1) if cfg["drop_last"] else 0
        )
        assert missing <= min(dropped, owed)


def test_padding_mask_marks_the_repeats_of_the_colocated_plan(id_datasets):
    """7 samples on 3 co-located ranks: 2 repeats even the ranks, wherever the layout deals them
    (not where the interleaved split would put them); without them every sample once."""
    cfg = {"batch_size": 2, "drop_last": False, "even": "pad", "order": "blockwise"}
    ds = id_datasets[7]
    for seed in range(10):
        layout = _layout(3, len(ds.blocks), 3, np.random.default_rng(seed))
        served, left, _ = _job(ds, cfg, 3, layout, None, None)
        assert left == [3, 3, 3] and sorted(served) == list(range(7)), (seed, layout)


# -- jobs on the 3-node test cluster ----------------------------------------------------------

BLOCK = 16 << 10  # small cache blocks: the 120-photo test set gives a few hundred blocks to place
BATCH = 8


def _crc(fields, rng):
    """A Loader ``decode=``: the CRC-32 of the sample's bytes (every member, in order), read back
    to a sample id by the test (:func:`_ids_by_crc`)."""
    import zlib

    data = b"".join(v for k, v in fields.items() if not k.startswith("__"))
    return np.array([zlib.crc32(data)], np.int64)


def _ids_by_crc(url, opts) -> dict:
    """{CRC-32 of a sample's bytes: its id} over the dataset at ``url`` (every CRC distinct)."""
    import zlib

    from stoker.store.dataset import open_dataset

    ds = open_dataset(url, storage_options=opts, cache=False)
    out = {zlib.crc32(b"".join(ds.read_fields(i).values())): i for i in range(len(ds))}
    assert len(out) == len(ds)
    return out


def _take(loader, batches: int | None, state: dict | None) -> dict:
    """``loader`` (a ClusterLoader or RankLoader, epoch 0) given ``state``, then ``batches`` of its
    batches (None: the rest of the epoch): the CRCs it served (repeats that only even the ranks
    left out), its batches, its state_dict after them and its exactly-once check."""
    try:
        if state is not None:
            loader.load_state_dict(state)
        pads = loader.padding_mask(0)
        it = iter(loader)  # kept until the state is saved: a dropped iterator ends its epoch
        got = [batch_ids(b) for b in (it if batches is None else (next(it) for _ in range(batches)))]
        mine = [c for b in got for c in b]
        pads = pads[len(pads) - len(mine) :] if batches is None else pads[: len(mine)]
        out = {
            "crcs": [c for c, pad in zip(mine, pads, strict=True) if not pad],
            "batches": len(got),
            "state": loader.state_dict(),
            "exactly_once": None if batches is not None else loader.stats.exactly_once,
        }
        del it
        return out
    finally:
        loader.close()


def _run_rank(ctx, batches: int | None = None, state: dict | None = None) -> dict:
    """A ``stoker.cluster.run`` rank: :func:`_take` through ``ctx.loader``."""
    loader = ctx.loader(BATCH, num_workers=0, seed=SEED, decode=_crc, transform="eval")
    return {**_take(loader, batches, state), "rank": ctx.rank, "node": ctx.node_id}


@ray.remote(num_cpus=0.5)
def _train_rank(url, opts, where, rank, world, job, batches=None, state=None) -> dict:
    """A rank that Ray placed (as Ray Train places its workers): :func:`_take` through
    ``stoker.cluster.rank_loader``."""
    from stoker.cluster import rank_loader

    loader = rank_loader(
        url,
        BATCH,
        rank,
        world,
        storage_options=opts,
        cluster=ClusterOptions(job=job, timeout_s=120),
        num_workers=0,
        seed=SEED,
        decode=_crc,
        transform="eval",
        **where,
    )
    node = loader.context.node_id
    return {**_take(loader, batches, state), "rank": rank, "node": node}


def _pinned_job(url, opts, where, nodes: list, job: str, batches=None, state=None) -> list:
    """One rank per entry of ``nodes`` (a Ray node id each), pinned there, reading through
    ``rank_loader``: their :func:`_take` records, in rank order."""
    named = {n["NodeID"]: [k for k in n["Resources"] if re.fullmatch(r"node\d+", k)] for n in ray.nodes() if n["Alive"]}
    by_node = {node: names[0] for node, names in named.items() if names}  # node0..node2 (tests/cluster/conftest.py)
    refs = [
        _train_rank.options(resources={by_node[node]: 0.01}).remote(
            url, opts, where, r, len(nodes), job, batches, state
        )
        for r, node in enumerate(nodes)
    ]
    out = ray.get(refs, timeout=180)
    assert [o["node"] for o in out] == list(nodes)
    return out


def _one_state(records: list) -> dict:
    """The job's state: every rank saved the same one."""
    states = [r["state"] for r in records]
    assert all(s == states[0] for s in states), "the ranks saved different states"
    return states[0]


def _check_once(crc_ids: dict, first: list, rest: list) -> None:
    """Every sample of the epoch exactly once across the saving job's ranks (``first``) and the
    resuming job's (``rest``), each rank of the resuming job the same number of batches."""
    ids = [crc_ids[c] for rec in first + rest for c in rec["crcs"]]
    counts = collections.Counter(ids)
    twice = sorted(i for i, c in counts.items() if c > 1)
    missing = sorted(set(crc_ids.values()) - set(counts))
    assert not twice and not missing, f"served twice: {twice}; never served: {missing}"
    assert len({rec["batches"] for rec in rest}) == 1
    assert all(rec["exactly_once"] for rec in rest)  # each rank served its plan of the rest


def test_a_cluster_job_resumes_at_4_ranks_on_other_nodes_and_at_3_and_2(cluster, fresh_services, s3_dataset, tmp_path):
    """4 co-located ranks save after 3 batches each; new jobs of 4 ranks (on other nodes), 3 and
    2 load that state and finish the epoch: every sample once, across the old job and the new."""
    from stoker.cluster import run

    url, opts = s3_dataset
    crc_ids = _ids_by_crc(url, opts)
    where = dict(cache_dir=str(tmp_path / "cache"), cache_bytes=64 << 20, block_bytes=BLOCK)
    common = dict(storage_options=opts, **where)
    first = [
        r["result"]
        for r in run(partial(_run_rank, batches=3), url, 4, {"CPU": 0.5}, cluster=ClusterOptions(job="save"), **common)
    ]
    state = _one_state(first)
    assert state["samples_done"] == 4 * 3 * BATCH
    # 4 ranks, each on the node of the next old rank: the same world size, another placement
    old_nodes = [r["node"] for r in first]
    moved = old_nodes[1:] + old_nodes[:1]
    assert moved != old_nodes
    rest = _pinned_job(url, opts, where, moved, "resume-4", state=state)
    _check_once(crc_ids, first, rest)
    for world in (3, 2):
        rest = [
            r["result"]
            for r in run(
                partial(_run_rank, state=state),
                url,
                world,
                {"CPU": 0.5},
                cluster=ClusterOptions(job=f"resume-{world}"),
                **common,
            )
        ]
        _check_once(crc_ids, first, rest)
    assert state.get("served") is not None  # the state says which samples: not the permutation's first ids


def test_rank_loader_checkpoint_of_2_workers_resumes_on_1_and_on_3(cluster, fresh_services, s3_dataset, tmp_path):
    """What a Ray Train restart meets, with the ranks that Ray placed reading through
    ``rank_loader`` (plain Ray tasks, without a TorchTrainer: the state and plans are the same):
    2 workers save after 3 batches each, and 1 worker, then 3, finish the epoch from it."""
    from stoker.cluster.service.cache_service import alive_nodes

    url, opts = s3_dataset
    crc_ids = _ids_by_crc(url, opts)
    where = dict(cache_dir=str(tmp_path / "cache"), cache_bytes=64 << 20, block_bytes=BLOCK)
    nodes = [n["NodeID"] for n in alive_nodes()][:3]
    first = _pinned_job(url, opts, where, nodes[:2], "train-save", batches=3)
    state = _one_state(first)
    assert state["samples_done"] == 2 * 3 * BATCH
    for placed in ([nodes[2]], nodes):
        rest = _pinned_job(url, opts, where, placed, f"train-{len(placed)}", state=state)
        _check_once(crc_ids, first, rest)
