"""``stoker.cluster.run(..., process_group=...)`` and ``WorkerContext.init_process_group``: a
``torch.distributed`` group over a job's ranks on the session's 3-node Ray cluster (every node
on 127.0.0.1, tests/cluster/conftest.py)."""

from __future__ import annotations

import os
import time

import pytest

from stoker.cluster import ClusterOptions

ray = pytest.importorskip("ray")
pytest.importorskip("torch.distributed")

BLOCK = 64 << 10
ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def _common(s3_dataset, tmp_path_factory) -> dict:
    url, opts = s3_dataset
    return dict(
        storage_options=opts,
        cache_dir=str(tmp_path_factory.mktemp("cache")),
        cache_bytes=64 << 20,
        block_bytes=BLOCK,
    )


#: the guard: a hung rank ends the job with GetTimeoutError, not the test run
GUARD = dict(timeout_s=120)


def _allreduce(ctx):
    """One allreduce of rank + 1 over the job's group; what the rank saw."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(ctx.rank + 1)])
    dist.all_reduce(t)
    return {
        "sum": float(t.item()),
        "env": {k: os.environ.get(k) for k in ENV},
        "backend": dist.get_backend(),
        "group_size": dist.get_world_size(),
        "group_rank": dist.get_rank(),
        "pid": os.getpid(),
    }


def _manual(ctx):
    """The manual form: the group exists only inside the ``with``; the environment before,
    inside and after it."""
    import torch
    import torch.distributed as dist

    before = {"initialized": dist.is_initialized(), "env": {k: os.environ.get(k) for k in ENV}}
    with ctx.init_process_group("gloo", timeout_s=60) as group:
        t = torch.tensor([float(ctx.rank + 1)])
        dist.all_reduce(t)
        inside = {"env": {k: os.environ.get(k) for k in ENV}, "local_rank": group.local_rank}
    after = {"initialized": dist.is_initialized(), "env": {k: os.environ.get(k) for k in ENV}}
    return {"sum": float(t.item()), "before": before, "inside": inside, "after": after, "pid": os.getpid()}


def _rank_1_fails(ctx):
    """Rank 1 raises before the collective; rank 0 waits in it for rank 1."""
    import torch
    import torch.distributed as dist

    if ctx.rank == 1:
        time.sleep(1.0)  # rank 0 is in its allreduce by now
        raise ValueError("rank 1 gives up")
    t = torch.ones(1)
    dist.all_reduce(t)  # fails when rank 1's group goes (never returns normally: rank 1 is gone)
    return float(t.item())


def _node_address(node_id: str) -> str:
    return next(n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node_id)


def test_every_node_of_the_test_cluster_is_on_loopback(cluster):
    """The test cluster's nodes are pinned to 127.0.0.1 (a second address of the machine is
    never taken), and so is what a rank sees as its node's address."""
    assert {n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]} == {"127.0.0.1"}

    @ray.remote(num_cpus=0)
    def ip():
        return ray.util.get_node_ip_address()

    assert ray.get(ip.remote(), timeout=60) == "127.0.0.1"


def test_gloo_group_allreduces_across_ranks_on_two_nodes(cluster, s3_dataset, tmp_path_factory):
    """``process_group="gloo"``: two ranks on two Ray nodes sum over an allreduce; each saw
    torchrun's variables, with rank 0's node address and one port; the group is gone after the
    job (the next job opens its own on the same pooled processes)."""
    from stoker.cluster import run

    url, _ = s3_dataset
    common = _common(s3_dataset, tmp_path_factory)
    res = run(
        _allreduce,
        url,
        2,
        {"CPU": 0.5},
        cluster=ClusterOptions(slots_per_node=1, process_group="gloo", job="pg", **GUARD),
        **common,
    )
    assert [r["rank"] for r in res] == [0, 1]
    assert res[0]["node_id"] != res[1]["node_id"]  # two Ray nodes
    out = [r["result"] for r in res]
    assert [o["sum"] for o in out] == [3.0, 3.0]
    assert [(o["backend"], o["group_size"], o["group_rank"]) for o in out] == [("gloo", 2, 0), ("gloo", 2, 1)]
    master = _node_address(res[0]["node_id"])
    assert master == "127.0.0.1"
    port = out[0]["env"]["MASTER_PORT"]
    assert 0 < int(port) < 65536
    for r, o in enumerate(out):
        assert o["env"] == {
            "MASTER_ADDR": master,
            "MASTER_PORT": port,
            "RANK": str(r),
            "WORLD_SIZE": "2",
            "LOCAL_RANK": "0",
            "LOCAL_WORLD_SIZE": "1",
        }
    # the same job again, by hand this time: nothing of the first group is left in the
    # processes (no group open, no variable set before init_process_group)
    again = run(
        _manual, url, 2, {"CPU": 0.5}, cluster=ClusterOptions(slots_per_node=1, job="pg-again", **GUARD), **common
    )
    for r in again:
        o = r["result"]
        assert o["sum"] == 3.0
        assert o["before"] == {"initialized": False, "env": dict.fromkeys(ENV)}
        assert o["after"] == o["before"]
    other = run(
        _allreduce,
        url,
        2,
        {"CPU": 0.5},
        cluster=ClusterOptions(slots_per_node=1, process_group="gloo", job="pg-3", **GUARD),
        **common,
    )
    assert [r["result"]["sum"] for r in other] == [3.0, 3.0]


def test_local_rank_counts_the_jobs_ranks_on_one_node(cluster, s3_dataset, tmp_path_factory):
    """Two ranks on one node (``node1``): LOCAL_RANK 0 and 1, LOCAL_WORLD_SIZE 2; the manual
    form's ``with`` destroys the group and puts the environment back."""
    from stoker.cluster import run

    url, _ = s3_dataset
    res = run(
        _manual,
        url,
        2,
        {"CPU": 0.5, "node1": 0.5},
        cluster=ClusterOptions(job="pg-local", **GUARD),
        **_common(s3_dataset, tmp_path_factory),
    )
    assert res[0]["node_id"] == res[1]["node_id"]
    for r in res:
        o = r["result"]
        assert o["sum"] == 3.0
        assert o["inside"]["env"]["LOCAL_RANK"] == str(r["rank"]) and o["inside"]["local_rank"] == r["rank"]
        assert o["inside"]["env"]["LOCAL_WORLD_SIZE"] == "2"
        assert o["after"] == o["before"]
    assert res[0]["result"]["inside"]["env"]["MASTER_PORT"] == res[1]["result"]["inside"]["env"]["MASTER_PORT"]


def test_a_failing_rank_tears_the_group_down_and_the_job_ends_with_its_error(cluster, s3_dataset, tmp_path_factory):
    """Rank 1 raises while rank 0 waits for it in an allreduce: rank 1's group goes with it, rank
    0's collective fails at once instead of waiting for torch's timeout, and run() raises rank
    1's error (the first failure, not rank 0's collective error that follows), well within the
    job's timeout guard."""
    from stoker.cluster import run

    url, _ = s3_dataset
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="rank 1 gives up") as info:
        pg = ClusterOptions(slots_per_node=1, process_group="gloo", job="pg-fail", **GUARD)
        run(_rank_1_fails, url, 2, {"CPU": 0.5}, cluster=pg, **_common(s3_dataset, tmp_path_factory))
    assert any("rank 1" in n and "failed first" in n for n in getattr(info.value, "__notes__", []))
    assert time.monotonic() - t0 < 120  # the guard: it did not wait for the job's timeout


def test_nccl_without_a_gpu_is_refused_before_any_rank_starts(cluster, s3_dataset):
    """``process_group="nccl"`` for ranks that ask for no GPU: ProcessGroupError naming the
    backend, raised before the cache services or the ranks start; an unknown backend: ValueError."""
    from stoker.cluster import run
    from stoker.errors import ProcessGroupError

    url, opts = s3_dataset
    with pytest.raises(ProcessGroupError, match="'nccl' needs a GPU"):
        run(
            _allreduce,
            url,
            2,
            {"CPU": 0.5},
            storage_options=opts,
            cache_dir="/nonexistent/x",
            cluster=ClusterOptions(process_group="nccl"),
        )
    with pytest.raises(ValueError, match="process_group must be one of"):
        run(
            _allreduce,
            url,
            2,
            storage_options=opts,
            cache_dir="/nonexistent/x",
            cluster=ClusterOptions(process_group="mpi"),
        )


def test_a_rank_whose_rank_0_never_publishes_gives_up_after_its_timeout(cluster):
    """Rank 1 of a group whose rank 0 never comes: ProcessGroupError after ``timeout_s``, naming
    the backend, with nothing left set in its process."""

    @ray.remote(num_cpus=0)
    def lonely():
        import torch.distributed as dist

        from stoker.cluster.jobs.rendezvous import ProcessGroup
        from stoker.errors import ProcessGroupError

        group = ProcessGroup(1, 2, ["a", "b"], "stoker-pg-nobody-here", "gloo", timeout_s=1.0)
        t0 = time.monotonic()
        try:
            group.open()
        except ProcessGroupError as exc:
            return str(exc), time.monotonic() - t0, dist.is_initialized(), os.environ.get("MASTER_ADDR")
        return None

    msg, waited, initialized, addr = ray.get(lonely.remote(), timeout=60)
    assert "rank 0 did not publish its address for the 'gloo' process group within 1.0 s" in msg
    assert 1.0 <= waited < 30 and not initialized and addr is None


def test_gather_raises_the_failure_that_came_first_not_the_first_reported(cluster, tmp_path):
    """Rank 0 fails first (its error stamped) but is still tearing down when rank 1, whose
    collective failed because of it, is reported: gather gives rank 0 its time to end and raises
    rank 0's error, naming it, not rank 1's."""
    from stoker.cluster.jobs.gang import gather, stamp_failure

    marker = str(tmp_path / "rank0-failed")

    @ray.remote(num_cpus=0, max_retries=0)
    def first_but_slow():
        exc = ValueError("rank 0: the real failure")
        stamp_failure(exc)
        open(marker, "w").close()
        time.sleep(1.5)  # its tear-down
        raise exc

    @ray.remote(num_cpus=0, max_retries=0)
    def caused_but_fast():
        deadline = time.monotonic() + 60
        while not os.path.exists(marker) and time.monotonic() < deadline:
            time.sleep(0.02)
        exc = RuntimeError("rank 1: Connection closed by peer")
        stamp_failure(exc)
        raise exc

    refs = [first_but_slow.remote(), caused_but_fast.remote()]
    with pytest.raises(ValueError, match="rank 0: the real failure") as info:
        gather(refs, ["node-a", "node-b"], timeout_s=120, settle_s=30)
    assert any("rank 0 on node-a failed first" in n for n in info.value.__notes__)
