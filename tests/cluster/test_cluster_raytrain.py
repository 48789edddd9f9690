"""Ray Train drop-in: a TorchTrainer (2 workers, gloo, CPU) placed by stoker.cluster.placement_hint
reads through stoker.cluster.rank_loader (node cache -> peer -> origin, co-located plans)."""

from __future__ import annotations

import json
import os
import signal
import uuid

import numpy as np
import pytest

from stoker.cluster import ClusterOptions
from stoker.errors import CapacityError

ray = pytest.importorskip("ray")
pytest.importorskip("torch")

BLOCK = 64 << 10  # small cache blocks: the 120-photo test set gives ~100 blocks to place


def _train(config):
    """One Ray Train worker: epoch 0 through the RankLoader, epoch 1 through
    ray.train.torch.prepare_data_loader(loader); its plans, records and node written to a file."""
    import ray.train
    import ray.train.torch

    from stoker import ImageOptions, ReadOptions
    from stoker.cluster import rank_loader
    from stoker.loader.adapters import LoaderSampler

    loader = rank_loader(
        config["url"],
        8,
        storage_options=config["opts"],
        cache_dir=config["cache_dir"],
        cache_bytes=64 << 20,
        block_bytes=BLOCK,
        num_workers=1,
        transform="eval",
        image=ImageOptions(image_size=32),
        read=ReadOptions(prefetch_bytes=1 << 20),
    )
    with loader:
        plans = [loader.plan(e).tolist() for e in (0, 1)]
        stats = []
        for _ in loader:  # epoch 0: cold
            pass
        stats.append({"samples": loader.stats.samples, "exactly_once": loader.stats.exactly_once})
        # kept, not rebuilt as a DataLoader: the Loader's sampler is a DistributedSampler
        assert isinstance(loader.sampler, LoaderSampler)
        wrapped = ray.train.torch.prepare_data_loader(loader)
        saved_at_2 = None
        for step, _batch in enumerate(wrapped, 1):  # epoch 1 (warm), through the wrapper that moves batches
            if step == 2:  # to the device, one batch ahead of the loop: the state counts the 2 handed on
                saved_at_2 = loader.state_dict()["batches_done"]
        kept = loader.epoch == 2  # the wrapper iterated the Loader itself
        stats.append({"samples": loader.stats.samples, "exactly_once": loader.stats.exactly_once})
        ctx = loader.context
        out = {
            "rank": ctx.rank,
            "world_size": ctx.world_size,
            "node_id": ctx.node_id,
            "actual_node": ray.get_runtime_context().get_node_id(),
            "plans": plans,
            "stats": stats,
            "epochs": [{k: v for k, v in rec.items() if isinstance(v, (int, float, str, bool))} for rec in ctx.epochs],
            "prepared_keeps_loader": kept,
            "saved_at_2": saved_at_2,
        }
    with open(os.path.join(config["out"], f"rank{ctx.rank}.json"), "w") as f:
        json.dump(out, f)


def test_torch_trainer_reads_colocated_through_the_cluster(cluster, fresh_services, s3_dataset, tmp_path):
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from stoker.cluster import placement_hint
    from stoker.store.dataset import open_dataset

    url, opts = s3_dataset
    n = len(open_dataset(url, storage_options=opts, cache=False))
    cache_dir, out = str(tmp_path / "cache"), tmp_path / "out"
    out.mkdir()
    hint = placement_hint(
        url, 2, {"CPU": 1}, storage_options=opts, cache_dir=cache_dir, cache_bytes=64 << 20, block_bytes=BLOCK
    )
    chosen = [sel["ray.io/node-id"] for sel in hint["label_selector"]]
    assert len(set(chosen)) == 2  # a cold dataset: spread over the nodes by budget, one per node
    trainer = TorchTrainer(
        _train,
        train_loop_config={"url": url, "opts": opts, "cache_dir": cache_dir, "out": str(out)},
        torch_config=TorchConfig(backend="gloo"),
        scaling_config=ScalingConfig(**hint),
        run_config=RunConfig(storage_path=str(tmp_path / "runs"), name=f"stoker-{uuid.uuid4().hex[:8]}"),
    )
    sigint = signal.getsignal(signal.SIGINT)
    try:
        trainer.fit()
    finally:  # Ray Train's fit() leaves its own SIGINT handler (an abort, then sys.exit) behind
        signal.signal(signal.SIGINT, sigint)
    res = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    # the workers ran where the hint put them
    assert sorted(r["actual_node"] for r in res) == sorted(chosen)
    assert all(r["node_id"] == r["actual_node"] and r["world_size"] == 2 for r in res)
    for e in (0, 1):
        ids = np.concatenate([r["plans"][e] for r in res])
        assert np.array_equal(np.sort(ids), np.arange(n)), f"epoch {e}: not exactly once across the ranks"
        assert len({len(r["plans"][e]) for r in res}) == 1
        for r in res:  # each rank delivered its plan, every sample once
            assert r["stats"][e] == {"samples": len(r["plans"][e]), "exactly_once": True}
            assert r["epochs"][e]["epoch"] == e and r["epochs"][e]["fallbacks"] == 0
    cold = sum(r["epochs"][0]["origin_bytes"] for r in res)
    assert cold > 0  # epoch 0 read the origin (a fresh cache)
    warm_local = sum(r["epochs"][1]["local_bytes"] for r in res)
    warm_read = sum(r["epochs"][1]["read_bytes"] for r in res)
    warm = [
        {k: r["epochs"][1][k] for k in ("rank", "local_bytes", "peer_bytes", "origin_bytes", "peer_origin_bytes")}
        for r in res
    ]
    print(f"ray train: cold origin {cold} B; warm {warm}")  # shown with -s
    assert warm_local >= 0.9 * warm_read, warm
    assert all(r["prepared_keeps_loader"] for r in res)
    assert [r["saved_at_2"] for r in res] == [2, 2]  # not the batch the wrapper holds


def test_placement_hint_prefers_the_nodes_holding_the_data(cluster, fresh_services, s3_dataset, tmp_path):
    """Warm one node's cache (a one-rank job on it), then the hint for one worker names that node."""
    from stoker.cluster import placement_hint, rank_context
    from stoker.cluster.service.cache_service import alive_nodes

    url, opts = s3_dataset
    common = dict(storage_options=opts, cache_dir=str(tmp_path / "cache"), cache_bytes=64 << 20, block_bytes=BLOCK)
    target = alive_nodes()[-1]["NodeID"]

    @ray.remote(num_cpus=0.5)
    def one_rank():
        with rank_context(url, 0, 1, cluster=ClusterOptions(job="warm-one"), **common) as ctx:
            for i in ctx.plan(0):
                ctx.dataset.read(int(i))
            return ctx.node_id

    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    assert (
        ray.get(one_rank.options(scheduling_strategy=NodeAffinitySchedulingStrategy(target, soft=False)).remote())
        == target
    )
    hint = placement_hint(url, 1, **common)
    assert hint == {"num_workers": 1, "label_selector": [{"ray.io/node-id": target}]}
    with pytest.raises(ValueError, match="num_workers"):
        placement_hint(url, 0, **common)
    with pytest.raises(CapacityError, match=r"99 ranks asking for \{'CPU': 1\.0\}.*total") as ei:
        placement_hint(url, 99, {"CPU": 1}, **common)  # the cluster's totals never hold them: no wait
    assert "waited" not in str(ei.value)


def test_rank_context_without_a_process_group_gathers_through_a_ray_actor(
    cluster, fresh_services, s3_dataset, tmp_path
):
    """Two plain Ray tasks (no torch.distributed) with job=: same co-located plans, exactly once;
    the gather actor is gone afterwards; a rank whose partner never comes fails naming the ranks."""
    from stoker.cluster import rank_context
    from stoker.errors import RankSetupError
    from stoker.store.dataset import open_dataset

    url, opts = s3_dataset
    n = len(open_dataset(url, storage_options=opts, cache=False))
    common = dict(storage_options=opts, cache_dir=str(tmp_path / "cache"), cache_bytes=64 << 20, block_bytes=BLOCK)

    @ray.remote(num_cpus=0.5)
    def rank(r, w, job, timeout_s=60.0):
        import os

        with rank_context(url, r, w, cluster=ClusterOptions(job=job, timeout_s=timeout_s), **common) as ctx:
            plan = ctx.plan(0).tolist()
            loader = ctx.loader(8, num_workers=0)
            router = ctx.dataset.reader.router
        # the rank's byte-counter file: unlinked from the start where /proc allows, else named by its pid
        left = [f"/dev/shm/{n}" for n in os.listdir("/dev/shm") if n.startswith(f"stoker-bytes-{os.getpid()}-")]
        try:  # closed with the context: no epoch, and nothing of the rank left on disk
            iter(loader)
        except RankSetupError as exc:
            refused = str(exc)
        else:
            refused = ""
        return (
            plan,
            refused,
            [p for p in left if os.path.exists(p)] + [f"{len(router.links)} peer links"] * (len(router.links) > 0),
        )

    out = ray.get([rank.remote(r, 2, "plain-tasks") for r in range(2)], timeout=120)
    plans = [o[0] for o in out]
    assert np.array_equal(np.sort(np.concatenate(plans)), np.arange(n)) and len(plans[0]) == len(plans[1])
    assert all("are closed" in o[1] and o[2] == [] for o in out), out
    with pytest.raises(ValueError):
        ray.get_actor("stoker-gather-plain-tasks", namespace="stoker")  # ended by the last reader
    with pytest.raises(RankSetupError, match=r"ranks \[1\] of 2 did not report"):
        try:
            ray.get(rank.remote(0, 2, "alone", 2.0), timeout=60)
        except ray.exceptions.RayTaskError as exc:
            raise exc.cause from None
