"""Cluster mode on a 3-node ray.cluster_utils.Cluster (each node its own raylet and object store)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from _helpers import loader_epoch
from stoker.cluster import ClusterOptions

ray = pytest.importorskip("ray")

BLOCK = 64 << 10  # small cache blocks: the 120-photo test set gives ~100 blocks to place


def _node_ids():
    from stoker.cluster.service.cache_service import alive_nodes

    return [n["NodeID"] for n in alive_nodes()]


def _job_ids_ok(results, n):
    """Every sample exactly once across the ranks in every epoch, equal counts per rank."""
    for e in range(len(results[0]["epochs"])):
        ids = np.concatenate([np.asarray(r["epochs"][e]["ids"]) for r in results])
        assert np.array_equal(np.sort(ids), np.arange(n)), f"epoch {e}: not exactly once"
        assert len({len(r["epochs"][e]["ids"]) for r in results}) == 1


def _sum(results, epoch, key):
    return sum(r["epochs"][epoch][key] for r in results)


def test_two_jobs_read_the_origin_once_then_colocated_reads_stay_local(
    cluster, s3_origin, s3_dataset, tmp_path_factory
):
    from functools import partial

    from stoker.cluster import read_epochs, run
    from stoker.store.dataset import open_dataset

    url, opts = s3_dataset
    n = len(open_dataset(url, storage_options=opts, cache=False))
    dataset_bytes = int(open_dataset(url, storage_options=opts, cache=False).index.length.sum())
    served0 = s3_origin.stats()["bytes_served"]
    common = dict(
        storage_options=opts,
        cache_dir=str(tmp_path_factory.mktemp("cache")),
        cache_bytes=64 << 20,
        block_bytes=BLOCK,
    )
    # epoch 0: two jobs at once on a cold cluster cache
    ra, rb = [
        ray.get(refs, timeout=120)
        for refs in [
            run(
                partial(read_epochs, epochs=1, keep_ids=True),
                url,
                3,
                {"CPU": 0.5},
                cluster=ClusterOptions(job=j, wait=False),
                **common,
            )
            for j in ("a", "b")
        ]
    ]
    served = s3_origin.stats()["bytes_served"] - served0
    # the shards came from the origin once for both jobs (plus the index, a few KB per reader)
    assert dataset_bytes <= served < 1.25 * dataset_bytes
    # epoch 1 (after warm-up; the ranks run unsynchronised, so epochs are separate runs here)
    wa, wb = [
        ray.get(refs, timeout=120)
        for refs in [
            run(
                partial(read_epochs, epochs=1, first_epoch=1, keep_ids=True),
                url,
                3,
                {"CPU": 0.5},
                cluster=ClusterOptions(job=j, wait=False),
                **common,
            )
            for j in ("a", "b")
        ]
    ]
    for cold, res in ((ra, wa), (rb, wb)):
        assert sorted(r["node_id"] for r in res) == sorted(_node_ids())  # one rank per node
        _job_ids_ok(cold, n)
        _job_ids_ok(res, n)
        assert _sum(res, 0, "origin_bytes") == 0 and _sum(res, 0, "fallbacks") == 0
        local = _sum(res, 0, "local_bytes")
        assert local / (local + _sum(res, 0, "peer_bytes")) >= 0.9
    # random placement on the same (now warm) cluster cache: measurably less local
    rr = run(
        partial(read_epochs, epochs=1, keep_ids=True),
        url,
        3,
        {"CPU": 0.5},
        cluster=ClusterOptions(job="r", placement="random", seed=1),
        **common,
    )
    _job_ids_ok(rr, n)
    assert _sum(rr, 0, "origin_bytes") == 0
    local_r = _sum(rr, 0, "local_bytes") / (_sum(rr, 0, "local_bytes") + _sum(rr, 0, "peer_bytes"))
    assert local_r < 0.7


def test_warm_fills_every_node_by_placement(cluster, s3_origin, s3_dataset, tmp_path_factory):
    from stoker.cluster import warm
    from stoker.store.pack import pack

    url, opts = s3_dataset
    url2 = url + "-small-shards"  # another dataset version: not cached yet
    pack(s3_origin.url("cluster/raw"), url2, storage_options=opts, shard_bytes=512 << 10, progress=False)
    r = warm(
        url2,
        opts,
        cache_dir=str(tmp_path_factory.mktemp("cache")),
        cache_bytes=64 << 20,
        block_bytes=BLOCK,
        progress=False,
    )
    assert set(r["nodes"]) == set(_node_ids())
    assert r["cached_fraction"] == 1.0 and r["origin_bytes"] == r["dataset_bytes"]
    assert all(v["cached_fraction"] == 1.0 and v["owned_bytes"] > 0 for v in r["nodes"].values())
    again = warm(url2, opts, block_bytes=BLOCK, progress=False)
    assert again["origin_bytes"] == 0 and again["cached_fraction"] == 1.0


def _read_and_kill(ctx, victim: str, pid_before: int, epochs: int = 2):
    """Read the rank's plan; rank 0 kills the victim node's cache service a third into epoch 0;
    every rank waits before epoch 1 until the service answers from a new process (the ranks run
    unsynchronised: a rank that finished epoch 0 before rank 0's kill must not start epoch 1
    with the old service, or the kill would fall in its epoch 1)."""
    import logging

    from stoker.cluster.service.cache_service import get_service

    seen: list[str] = []  # the router's fallback warnings, shown when an assertion fails

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(f"{time.time():.2f} {record.getMessage()[:300]}")

    logging.getLogger("stoker.cluster.service.reader").addHandler(Keep(logging.WARNING))
    for e in range(epochs):
        if e == 1:  # wait for the kill and for Ray to restart the service
            deadline = time.monotonic() + 120
            while True:
                try:
                    if ray.get(get_service(victim).info.remote(), timeout=10)["pid"] != pid_before:
                        break
                except ray.exceptions.RayActorError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"cache service of {victim} not restarted in 120 s")
                time.sleep(0.2)
            while victim in ctx.dataset.reader.router.suspects():  # the router's own ping has found it back
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the router still takes {victim} for down after 120 s")
                time.sleep(0.05)
            time.sleep(0.25)  # past the retry_s (0.2 s) after its last failed call
        ids = ctx.plan(e)
        with ctx.measure(e, samples=len(ids)) as rec:
            for k, i in enumerate(ids):
                if e == 0 and ctx.rank == 0 and k == len(ids) // 3:
                    ray.kill(get_service(victim), no_restart=False)  # Ray restarts it
                ctx.dataset.read(int(i))
            rec["ids"] = ids.tolist()
            rec["warnings"], rec["end"] = list(seen), time.time()
            seen.clear()
    return None


def test_cache_service_killed_mid_epoch_falls_back_and_rejoins(cluster, s3_dataset, tmp_path_factory):
    from functools import partial

    from stoker.cluster import run, warm
    from stoker.cluster.service.cache_service import find_services
    from stoker.store.dataset import open_dataset

    url, opts = s3_dataset
    n = len(open_dataset(url, storage_options=opts, cache=False))
    victim = _node_ids()[1]
    cache_dir = str(tmp_path_factory.mktemp("cache"))
    # every node's blocks cached first (run after the other tests, they are already): a read of the
    # victim's blocks after the kill then falls back, where a cold one reads the origin anyway
    warm(url, opts, cache_dir=cache_dir, cache_bytes=64 << 20, block_bytes=BLOCK, progress=False)
    pid_before = find_services()[victim]["pid"]
    res = run(
        partial(_read_and_kill, victim=victim, pid_before=pid_before),
        url,
        3,
        {"CPU": 0.5},
        storage_options=opts,
        cache_dir=cache_dir,
        cache_bytes=64 << 20,
        block_bytes=BLOCK,
        cluster=ClusterOptions(placement="random", seed=3, job="kill", retry_s=0.2, timeout_s=180),
    )
    _job_ids_ok(res, n)  # every sample exactly once in both epochs despite the kill
    killer = next(r for r in res if r["rank"] == 0)
    if killer["node_id"] != victim:  # rank 0 reads the victim's blocks from it after the kill: some fall back
        # (Ray may place rank 0 on the victim's node, whose blocks it reads from its own node cache, and the
        # other ranks, unsynchronised, may be past their reads of the victim's blocks when it dies)
        assert _sum(res, 0, "fallbacks") >= 1, [(r["rank"], r["node_id"], r["epochs"][0]["warnings"]) for r in res]
    assert _sum(res, 0, "origin_bytes") > 0
    assert find_services()[victim]["pid"] != pid_before  # restarted
    # epoch 1: the restarted service serves its blocks again (from its cache files), no fallbacks
    why = [(r["rank"], r["epochs"][1]["warnings"], r["epochs"][0]["end"]) for r in res]
    assert _sum(res, 1, "fallbacks") == 0 and _sum(res, 1, "origin_bytes") == 0, why
    readers = [r for r in res if r["node_id"] != victim]
    assert sum(r["epochs"][1]["peer_bytes"] for r in readers) > 0


def _loader_epoch_and_own_links(ctx):
    """:func:`loader_epoch`, and how many connections to peers' data endpoints the rank's own
    process holds at its end."""
    return {"epochs": loader_epoch(ctx), "rank_links": len(ctx.dataset.reader.router.links)}


def _accepted() -> int:
    """Connections that passed the challenge at every service's data endpoint so far."""
    from stoker.cluster.service.cache_service import find_services

    return sum(info["data_endpoint"]["accepted"] for info in find_services().values())


def test_cluster_loader_decode_workers_read_peers_over_their_own_connections(cluster, s3_dataset, tmp_path_factory):
    """A Loader with a decode worker and a prefetcher (forked from the rank) in cluster mode: every
    sample once, bytes from peers and no fallback; the services' endpoints took more connections
    than the ranks' own processes hold, one per peer: the worker processes connected themselves
    (no hop through the rank)."""
    from stoker.cluster import run

    url, opts = s3_dataset
    before = _accepted()
    res = run(
        _loader_epoch_and_own_links,
        url,
        3,
        {"CPU": 0.5},
        storage_options=opts,
        cache_dir=str(tmp_path_factory.mktemp("c")),
        cache_bytes=64 << 20,
        block_bytes=BLOCK,
        cluster=ClusterOptions(placement="random", seed=1, job="loader", timeout_s=180),
    )
    accepted = _accepted() - before
    recs = [r["result"]["epochs"][0] for r in res]
    assert all(rec["exactly_once"] and rec["samples"] == 40 for rec in recs)
    assert sum(rec["peer_bytes"] for rec in recs) > 0
    assert sum(rec["fallbacks"] for rec in recs) == 0
    rank_links = sum(r["result"]["rank_links"] for r in res)
    assert 0 < rank_links <= 3 * 2  # each rank's own process: one connection per peer it reads
    assert accepted >= rank_links + len(res), (accepted, rank_links)  # and each rank's workers theirs


def test_cluster_state_feeds_the_extender(cluster, s3_dataset, tmp_path):
    import json
    import urllib.request

    from stoker.cluster import cluster_state, ray_state
    from stoker.cluster.extender.scoring import file_state, scores, serve

    url, opts = s3_dataset
    state = cluster_state([url], opts, block_bytes=BLOCK)
    source = ray_state([url], opts, block_bytes=BLOCK)  # the extender's other source: the services themselves
    deadline = time.monotonic() + 60
    while not source()["time"] and time.monotonic() < deadline:  # refreshed in the background
        time.sleep(0.1)
    live = source()
    source.stop()
    assert scores(url, list(state["nodes"]), live) == scores(url, list(state["nodes"]), state)
    assert sum(v["datasets"][url] for v in state["nodes"].values()) > 0
    path = tmp_path / "state.json"
    path.write_text(json.dumps(state))
    srv = serve(file_state(str(path)), port=0)
    try:
        assert srv.server_address[0] == "127.0.0.1"
        names = list(state["nodes"])
        args = {
            "Pod": {"metadata": {"name": "p", "annotations": {"stoker.io/dataset": url}}},
            "Nodes": None,
            "NodeNames": names,
        }
        req = urllib.request.Request(
            f"http://127.0.0.1:{srv.server_address[1]}/stoker/prioritize",
            data=json.dumps(args).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=10) as resp:
            got = json.loads(resp.read())
        best = max(names, key=lambda n: state["nodes"][n]["datasets"][url])
        assert max(got, key=lambda h: h["Score"])["Host"] == best
    finally:
        srv.shutdown()


def test_warm_and_cluster_state_commands(cluster, s3_dataset, tmp_path, capsys):
    import json

    from stoker.cli import main

    url, opts = s3_dataset
    args = ["--storage-options", json.dumps(opts), "--block-size", str(BLOCK)]
    assert main(["warm", url, "--no-progress", *args]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["cached_fraction"] == 1.0 and len(report["nodes"]) == 3
    out = tmp_path / "state.json"
    assert main(["cluster-state", url, "--out", str(out), *args]) == 0
    state = json.loads(out.read_text())
    assert sum(v["datasets"][url] for v in state["nodes"].values()) == report["dataset_bytes"]


def test_warm_with_a_failing_shard_reports_it_and_a_rerun_fetches_only_what_is_missing(
    cluster, packed_local, tmp_path, capsys
):
    """A corrupt sample in one shard: the warm-up caches the rest, names the shard and exits 1 (no
    traceback); with the shard repaired and the services restarted, the rerun fetches only that."""
    import json
    import shutil

    from stoker.cli import main
    from stoker.cluster.service.cache_service import stop_services
    from stoker.store.dataset import open_dataset

    url = str(tmp_path / "ds")
    shutil.copytree(packed_local, url)
    ds = open_dataset(url, cache=False, check=False, block_bytes=BLOCK)
    b = int(np.flatnonzero(ds.blocks.shard == 1)[0])
    i = int(np.flatnonzero(ds.blocks.sample_block == b)[0])
    shard = ds.index.shard_name(1)
    path, at = f"{url}/{shard}", int(ds.index.offset[i]) + int(ds.index.length[i]) // 2
    with open(path, "r+b") as f:
        f.seek(at)
        good = f.read(1)
        f.seek(at)
        f.write(bytes([good[0] ^ 0xFF]))
    stop_services()  # fresh services on a fresh cache root
    args = [
        "warm",
        url,
        "--no-progress",
        "--block-size",
        str(BLOCK),
        "--cache-dir",
        str(tmp_path / "cache"),
        "--cache-bytes",
        str(64 << 20),
    ]
    capsys.readouterr()
    assert main(args) == 1
    out, err = capsys.readouterr()
    first = json.loads(out)
    assert not first["complete"] and 0 < first["cached_fraction"] < 1
    assert list(first["failed_shards"]) == [shard] and "checksum" in first["failed_shards"][shard]
    assert sum(n["failed"] for n in first["nodes"].values()) == 1
    assert "Traceback" not in err and f"failed: {shard}" in err and "partial" in err
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(good)
    dirs = {n["cache_dir"] for n in first["nodes"].values()}
    stop_services()  # the services start again (as after a restart) and find their directories
    assert main(args) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["complete"] and again["failed_shards"] == {}
    assert {n["cache_dir"] for n in again["nodes"].values()} == dirs
    assert again["origin_bytes"] == first["dataset_bytes"] - sum(n["cached_bytes"] for n in first["nodes"].values())
    assert again["origin_bytes"] == int(ds.blocks.nbytes(b))
