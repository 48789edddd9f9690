"""The namespace benchmark's ranks start their clocks together at its gate (bench/start_gate.py),
on the 3-node Ray cluster: a rank held back before its epoch holds back the others' clocks."""

from __future__ import annotations

import time
from functools import partial

import pytest

from stoker.cluster import ClusterOptions

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.usefixtures("fresh_services")


def _late_rank0(ctx, gate, key):
    from stoker_lab.bench.netcluster_driver import read_plan

    if ctx.rank == 0:
        time.sleep(1.5)  # a rank that Ray started late
    return read_plan(ctx, 0, gate=gate, gate_key=key, gate_s=60.0)


@pytest.mark.parametrize("gated", [True, False])
def test_ranks_start_their_clocks_at_the_gate(cluster, s3_dataset, tmp_path_factory, gated):
    from stoker.cluster import run
    from stoker_lab.bench.netcluster_driver import _row
    from stoker_lab.bench.start_gate import start_gate

    url, opts = s3_dataset
    gate = start_gate() if gated else None
    res = run(
        partial(_late_rank0, gate=gate, key=f"gated-{gated}"),
        url,
        3,
        {"CPU": 0.5},
        storage_options=opts,
        cache_dir=str(tmp_path_factory.mktemp("cache")),
        cache_bytes=64 << 20,
        block_bytes=64 << 10,
        cluster=ClusterOptions(placement="random", job=f"gate-{gated}", timeout_s=120),
    )
    recs = [dict(r["epochs"][-1], origin_bytes=0, peer_bytes=0) for r in res]
    row = _row("random", "job", 0, recs, sum(r["samples"] for r in recs), {}, 0)
    assert row["exactly_once"]
    spread = max(row["rank_start_s"])
    if gated:
        assert spread < 0.5, row["rank_start_s"]
    else:
        assert spread > 1.0, row["rank_start_s"]


def test_peer_probe_reads_only_samples_its_peers_hold(cluster, s3_dataset, tmp_path_factory):
    import numpy as np

    from stoker.cluster import run
    from stoker_lab.bench.netcluster_driver import peer_probe, read_plan
    from stoker_lab.bench.start_gate import start_gate

    url, opts = s3_dataset
    common = dict(
        storage_options=opts,
        cache_dir=str(tmp_path_factory.mktemp("cache")),
        cache_bytes=64 << 20,
        block_bytes=64 << 10,
    )
    limits = dict(placement="random", timeout_s=120, seed=3)
    run(
        partial(read_plan, epoch=0), url, 3, {"CPU": 0.5}, cluster=ClusterOptions(job="warm", **limits), **common
    )  # every block cached by its owner
    gate = start_gate()
    res = run(
        partial(peer_probe, samples=20, gate=gate, gate_key="probe"),
        url,
        3,
        {"CPU": 0.5},
        cluster=ClusterOptions(job="probe", **limits),
        **common,
    )
    for r in res:
        rec = r["epochs"][-1]
        assert rec["epoch"] == -1 and len(rec["ids"]) == len(set(rec["ids"])) > 0
        assert rec["local_bytes"] == 0 and rec["origin_bytes"] == 0
        assert rec["peer_bytes"] == rec["read_bytes"] > 0
        assert np.all(np.diff(sorted(rec["ids"])) > 0)
