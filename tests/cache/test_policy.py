"""The future-aware policy: budget split between datasets by the bytes each cached byte saves."""

import subprocess
import sys

import pytest

from stoker.cache import DiskCache
from stoker.cache.policy import JobRegistry, share_budget


def test_share_budget_is_a_fractional_knapsack_by_epoch_rate():
    # a is read 4x as often as b: all of a first, the rest to b
    q = share_budget(100, {"a": (60, 4.0), "b": (200, 1.0)})
    assert q == {"a": 60, "b": 40}
    # the budget covers everything: each dataset gets its size
    assert share_budget(1000, {"a": (60, 4.0), "b": (200, 1.0)}) == {"a": 60, "b": 200}
    # equal rates (within 10 %): shares in proportion to size, so equal hit ratios
    q = share_budget(100, {"a": (100, 1.0), "b": (300, 1.05)})
    assert q == {"a": 25, "b": 75}
    # unknown rates count as the mean of the known ones
    q = share_budget(100, {"a": (100, None), "b": (100, 2.0), "c": (100, 0.2)})
    assert q["b"] == 100 and q["a"] == 0 and q["c"] == 0
    assert share_budget(50, {}) == {}
    # never more than the budget, never more than a dataset's size
    q = share_budget(7, {"a": (5, 1.0), "b": (5, 1.0), "c": (5, 1.0)})
    assert sum(q.values()) <= 7 and all(v <= 5 for v in q.values())


@pytest.fixture
def other_process():
    """A live process other than this one (a second job on the node)."""
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield p.pid
    p.kill()
    p.wait()


def test_registry_sums_rates_of_live_jobs_and_drops_dead_ones(tmp_path, other_process):
    reg = JobRegistry(str(tmp_path))
    reg.register("a", 1000, epoch_s=10.0)
    reg.register("a", 1000, epoch_s=5.0, pid=other_process)
    reg.register("b", 500, pid=2**22 + 12345)  # no such process
    live = reg.live()
    assert set(live) == {"a"} and live["a"][0] == 1000
    assert live["a"][1] == pytest.approx(0.1 + 0.2)
    assert reg.remove_dead() == 1


def _fill(c, ns, n, size, prefix="b"):
    return sum(c.put(ns, f"{prefix}{i}", bytes(size)) for i in range(n))


def test_future_policy_moves_budget_to_the_faster_job_without_thrashing(tmp_path, other_process):
    c = DiskCache(str(tmp_path), 10_000, "future")
    c.register("slow", 8_000, epoch_s=40.0)  # this process
    c.jobs.register("fast", 8_000, epoch_s=10.0, pid=other_process)  # another job, 4x the rate
    assert c.budget.quotas() == {"fast": 8_000, "slow": 2_000}
    # the slow job arrives first and takes the free space (work-conserving admission)
    assert _fill(c, "slow", 8, 1000) == 8
    assert c.stats.evictions == 0
    # the fast job's fills evict the slow job's blocks down to its share, not below
    assert _fill(c, "fast", 8, 1000) == 8
    assert c.stats.evictions == 6
    use = c.usage.namespace_usage()
    assert use == {"slow": 2_000, "fast": 8_000}
    assert c.used_bytes() == 10_000
    # steady state: neither evicts the other any more (no thrash), both are refused
    ev = c.stats.evictions
    assert _fill(c, "slow", 10, 1000, prefix="x") == 0
    assert _fill(c, "fast", 10, 1000, prefix="x") == 0
    assert c.stats.evictions == ev and c.usage.namespace_usage() == use


def test_future_policy_reclaims_a_dead_jobs_blocks_but_not_an_unannounced_readers(tmp_path, other_process):
    root = str(tmp_path)
    c = DiskCache(root, 5_000, "future")
    c.jobs.register("old", 5_000, pid=other_process)
    assert _fill(c, "old", 5, 1000) == 5
    # a reader that did not announce itself never evicts (no-eviction behaviour)
    assert _fill(c, "anon", 3, 1000) == 0
    c.register("new", 5_000)
    # while the old job lives the two share the budget by size
    assert c.budget.quotas() == {"old": 2_500, "new": 2_500}
    assert _fill(c, "new", 5, 1000) == 2
    assert c.usage.namespace_usage()["old"] == 3_000
    subprocess.run(["kill", "-9", str(other_process)], check=True)
    import os

    os.waitpid(other_process, 0)
    c.forget_quotas()
    assert c.budget.quotas() == {"new": 5_000}
    assert _fill(c, "new", 5, 1000, prefix="y") == 3
    assert c.usage.namespace_usage().get("old", 0) == 0
    # usage counters agree with the files after a recount
    assert c.recover()["used"] == 5_000 and c.usage.namespace_usage()["new"] == 5_000


def test_loader_reports_its_epoch_time_to_the_policy(packed_local, tmp_path):
    from stoker import Loader, open_dataset

    ds = open_dataset(packed_local, cache_dir=str(tmp_path / "c"), cache_bytes=1 << 30)
    recs = ds.cache.jobs.records()
    assert [(r["namespace"], r["dataset_bytes"], r["epoch_s"]) for r in recs] == [
        (ds.version, ds.index.total_bytes, None)
    ]
    with Loader(ds, 16, num_workers=0, seed=0) as loader:
        for _ in loader:
            pass
    (rec,) = ds.cache.jobs.records()
    assert rec["epoch_s"] and rec["epoch_s"] == pytest.approx(loader.stats.seconds, rel=0.01)
    assert ds.cache.budget.quotas() == {ds.version: ds.index.total_bytes}


def test_bench_cache_tiny(tmp_path):
    """The benchmark at a tiny size: the schema, the floor at C >= D, two jobs fill once."""
    from stoker_lab.bench.cache_bench import run, summary

    r = run(
        images=60,
        epochs=2,
        fractions=(0.5, 1.0),
        policies=("future", "lru"),
        workers=1,
        batch_size=16,
        latency_ms=1,
        bandwidth_MBps=400,
        two_jobs_fractions=(1.0,),
        workdir=str(tmp_path),
        staging_bytes=1 << 20,
        log=lambda *_: None,
    )
    D = r["dataset"]["bytes"]
    assert {(x["policy"], x["cache_fraction"], x["epoch"]) for x in r["runs"]} == {
        (p, f, e) for p in ("future", "lru") for f in (0.5, 1.0) for e in (0, 1)
    }
    for x in r["runs"]:
        assert (
            set(x)
            >= {"policy", "cache_fraction", "epoch", "origin_bytes", "dataset_bytes", "hit_ratio", "stall_fraction"}
            and x["dataset_bytes"] == D
            and x["exactly_once"]
        )
    warm = [x for x in r["runs"] if x["cache_fraction"] == 1.0 and x["epoch"] == 1]
    assert all(x["origin_bytes"] == 0 and x["hit_ratio"] == 1.0 for x in warm)
    half = {x["policy"]: x for x in r["runs"] if x["cache_fraction"] == 0.5 and x["epoch"] == 1}
    assert 0 < half["future"]["origin_bytes"] < D
    (two,) = r["two_jobs"]
    assert D <= two["origin_bytes_total"] < 1.1 * D + (1 << 20)  # one fill of every block, plus the index
    assert all(row["exactly_once"] for job in two["jobs"] for row in job)
    assert {s["policy"] for s in summary(r)} == {"future", "lru"}


def test_cache_command_shows_usage_jobs_and_split_and_clear_refuses_while_in_use(tmp_path, other_process, capsys):
    from stoker.cli import main

    c = DiskCache(str(tmp_path), 10_000, "future")
    c.jobs.register("aa", 6_000, epoch_s=10.0, pid=other_process)
    _fill(c, "aa", 3, 1000)
    _fill(c, "bb", 2, 1000)  # no live job on bb
    from stoker.cache.status import clear, status

    st = status(str(tmp_path), 4_000)
    assert st["namespaces"] == {"aa": 3000, "bb": 2000} and st["used_bytes"] == 5000
    assert st["quotas"] == {"aa": 4000} and [j["pid"] for j in st["jobs"]] == [other_process]
    assert main(["cache", "status", str(tmp_path), "--budget", "4000"]) == 0
    with pytest.raises(RuntimeError, match=f"pid {other_process}"):
        clear(str(tmp_path))
    assert main(["cache", "clear", str(tmp_path)]) == 2  # one-line error, exit 2
    err = capsys.readouterr().err
    assert str(tmp_path) in err and "CacheInUseError" not in err and err.count("\n") == 1
    with pytest.raises(ValueError, match="no dataset version 'nosuch'.*it holds: aa, bb"):
        clear(str(tmp_path), "nosuch")
    assert main(["cache", "clear", str(tmp_path), "--namespace", "nosuch"]) == 2
    assert clear(str(tmp_path), "bb") == 2000
    assert status(str(tmp_path))["namespaces"] == {"aa": 3000, "bb": 0}


def test_cache_clear_takes_the_version_prefix_that_status_prints(tmp_path, capsys):
    # `stoker cache status` prints a dataset's version as 12 characters; `cache clear` wanted the
    # whole hash and refused those. A unique prefix now names the version, an ambiguous one is
    # refused with the matches listed, and the option is `--version` (`--namespace` still works).
    from stoker.cache.status import clear, status
    from stoker.cli import main

    a, b, c = "3f2a9c0d11aa" + "0" * 52, "3f2a9c0d11bb" + "1" * 52, "77b0e1aa" + "2" * 56
    cache = DiskCache(str(tmp_path), 100_000, "noevict")
    for ns in (a, b, c):
        _fill(cache, ns, 2, 1000)
    with pytest.raises(ValueError, match=f"prefix '3f2a9c0d11' names 2 versions.*{a}, {b}"):
        clear(str(tmp_path), "3f2a9c0d11")
    assert main(["cache", "clear", str(tmp_path), "--version", "3f2a9c0d11"]) == 2
    assert "names 2 versions" in capsys.readouterr().err
    assert status(str(tmp_path))["namespaces"] == {a: 2000, b: 2000, c: 2000}  # nothing deleted
    assert main(["cache", "clear", str(tmp_path), "--version", a[:12]]) == 0
    assert "freed 2,000 bytes" in capsys.readouterr().out
    assert main(["cache", "clear", str(tmp_path), "--namespace", c[:12]]) == 0  # the old name
    assert status(str(tmp_path))["namespaces"] == {a: 0, b: 2000, c: 0}
    assert clear(str(tmp_path), b) == 2000  # the full version, as before


def test_cache_command_handles_nested_node_caches_and_side_stores(tmp_path):
    """`stoker warm --cache-dir D` keeps one cache per node under D: status and clear see them."""
    from stoker.cache.status import clear, status

    root = tmp_path / "warm"
    node = DiskCache(str(root / "node-abc"), 10_000, "noevict")
    _fill(node, "v1", 3, 1000)
    derived = DiskCache(str(root / "node-abc" / ".derived"), 10_000, "noevict")
    derived.put("v1-rgb", "7", bytes(500))
    st = status(str(root))
    assert st["used_bytes"] == 0 and [n["used_bytes"] for n in st["nested"]] == [3000]
    assert st["nested"][0]["stores"]["derived samples"]["bytes"] >= 500
    assert clear(str(root)) >= 3500
    assert status(str(root))["nested"][0]["used_bytes"] == 0
    assert not (root / "node-abc" / ".derived").exists()
