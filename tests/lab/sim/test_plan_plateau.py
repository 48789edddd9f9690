"""`stoker plan` where no cache size reaches the target: the best utilisation per setup, the cache
per node where it levels off, and the assumption that bounds it with the flag that changes it (a
what-if run on the model); a setup that reaches the target is reported as before."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from stoker.cli import main
from stoker_lab.sim.plan import TARGET_UTILIZATION, plan
from stoker_lab.sim.plateau import AT_GIVEN_GAP, MIN_GAIN, PLATEAU_TOLERANCE, bound
from stoker_lab.sim.tdcs import TdcsConfig

MB = 10**6
#: 4,000 samples of 100 kB on 2 nodes x 2 GPUs at 100 samples/s: each node's GPUs take 20 MB/s.
SMALL = TdcsConfig(
    nodes=2, gpus_per_node=2, gpu_rate=100.0, samples=4000, mean_sample_bytes=100_000, decode_cores=0, epochs=2
)
#: A node's cache reads 17 MB/s, under the 20 MB/s its GPUs take, and the origin is slower still
#: (20 Mbit/s): more cache helps until the cache reads bind, short of the target.
CACHE_BOUND = replace(SMALL, cache_read_GBps=0.017, store_gbit=0.02)
DECODE_FLAG = "--decode-rate (or --decode-cores)"
ARGV = "plan --nodes 2 --gpus-per-node 2 --gpu-rate 100 --samples 4000 --dataset-bytes 400MB --decode-cores 0 "
ARGV += "--cache-per-node 100MB --epochs 2 --cache-read 17MB/s --origin-bandwidth 20Mbit"


def test_a_setup_bound_by_its_cache_reads_gets_the_best_the_plateau_and_the_cache_read_flag():
    rep = plan(CACHE_BOUND, 100 * MB, setups=("colocated",))
    assert rep["min_cache_per_node_bytes"]["colocated"] is None
    lv = rep["levels_off"]["colocated"]
    curve = dict((c, u) for c, u in rep["curves"]["colocated"])
    best = max(curve.values())
    assert lv["best_utilization"] == best < TARGET_UTILIZATION
    assert curve[lv["best_cache_per_node_bytes"]] == best
    # the plateau: the smallest cache within the tolerance of the best; every point run below it is under that
    level = best * (1 - PLATEAU_TOLERANCE)
    assert lv["tolerance"] == PLATEAU_TOLERANCE
    assert lv["plateau_cache_per_node_bytes"] <= lv["best_cache_per_node_bytes"]
    assert lv["plateau_utilization"] == curve[lv["plateau_cache_per_node_bytes"]] >= level
    assert all(u < level for c, u in curve.items() if c < lv["plateau_cache_per_node_bytes"])
    b = lv["bound"]
    assert (b["resource"], b["assumption"], b["flag"]) == ("cache reads", "cache_read_GBps", "--cache-read")
    assert b["value"] == pytest.approx(0.017) and b["relaxed_value"] == pytest.approx(0.034)
    assert b["relaxed_utilization"] > lv["plateau_utilization"] * (1 + MIN_GAIN)
    assert b["relaxed_utilization"] == max(b["what_if"].values())
    # the what-if holds: with twice the cache read bandwidth the same setup does better at that cache
    at = lv["plateau_cache_per_node_bytes"]
    faster = plan(replace(CACHE_BOUND, cache_read_GBps=0.034), at, setups=("colocated",))
    assert faster["setups"]["colocated"]["gpu_utilization"][1] > lv["plateau_utilization"]


@pytest.mark.parametrize(
    "cfg,setup,resource,flag",
    [
        (replace(SMALL, decode_cores=1, decode_rate=150), "presence", "decode cores", DECODE_FLAG),
        (replace(SMALL, nic_gbit=0.1), "presence", "NICs", "--nic"),
        (replace(SMALL, store_gbit=0.02), "direct", "origin link", "--origin-bandwidth"),
    ],
)
def test_the_bound_names_the_limit_that_binds_and_its_flag(cfg, setup, resource, flag):
    rep = plan(cfg, 100 * MB, setups=(setup,))
    assert rep["min_cache_per_node_bytes"][setup] is None
    b = rep["levels_off"][setup]["bound"]
    assert (b["resource"], b["flag"]) == (resource, flag)
    assert b["busy"] > 0.75  # the resource that binds is busy most of the warm epoch


def test_direct_has_no_cache_so_its_best_and_plateau_are_at_zero():
    lv = plan(replace(SMALL, store_gbit=0.02), 100 * MB, setups=("direct",))["levels_off"]["direct"]
    assert lv["best_cache_per_node_bytes"] == lv["plateau_cache_per_node_bytes"] == 0
    assert lv["best_utilization"] == lv["plateau_utilization"] < TARGET_UTILIZATION


def test_the_command_prints_the_answer_first_and_writes_the_same_fields(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main([*ARGV.split(), "--setups", "direct,colocated", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    rep = json.loads(out.read_text())
    lv = rep["levels_off"]["colocated"]
    lines = printed.splitlines()
    at = lines.index("  colocated: none reaches it")
    assert lines[at + 1].startswith(f"    best {lv['best_utilization']:.2f} GPU utilisation, at ")
    assert f"it levels off from {lv['plateau_cache_per_node_bytes'] / 1e9:.2f} GB per node" in lines[at + 1]
    assert "within 1% of the best" in lines[at + 1]
    assert lines[at + 2].startswith("    bound by the cache reads, busy ")
    assert "at 0.034 instead of 0.017 (cache_read_GBps)" in lines[at + 2]
    assert lines[at + 2].endswith("; change it with --cache-read")
    assert "bound by the origin link" in printed and "change it with --origin-bandwidth" in printed
    assert printed.index("smallest cache per node") < printed.index("| setup |") < printed.index("assumptions:")
    assert set(lv) == {
        "best_utilization",
        "best_cache_per_node_bytes",
        "plateau_cache_per_node_bytes",
        "plateau_utilization",
        "tolerance",
        "at_given",
        "bound",
    }
    assert lv["bound"]["flag"] == "--cache-read" and lv["bound"]["assumption"] == "cache_read_GBps"


def test_a_setup_that_reaches_the_target_is_reported_as_before(capsys):
    argv = ARGV.replace("--cache-read 17MB/s --origin-bandwidth 20Mbit", "--cache-per-node 400MB").split()
    argv.remove("100MB")
    argv.remove("--cache-per-node")
    assert main([*argv, "--setups", "colocated"]) == 0
    lines = capsys.readouterr().out.splitlines()
    answer = f"smallest cache per node for >= {TARGET_UTILIZATION:.0%} GPU utilisation after the first epoch:"
    head = lines.index(answer)
    assert lines[head + 1].startswith("  colocated: ") and lines[head + 1].endswith(" bytes)")
    assert lines[head + 2].startswith("co-located scheduling against presence-only affinity: ")
    assert "levels off" not in "\n".join(lines)


def test_a_plan_that_reaches_the_target_has_no_levels_off_entry():
    rep = plan(SMALL, 400 * MB, setups=("colocated",))
    assert rep["min_cache_per_node_bytes"]["colocated"] is not None
    assert rep["levels_off"] == {}


def test_no_what_if_that_moves_it_names_no_flag():
    row = {"bottleneck": {"utilization": {"origin link": 0.5}}, "bytes": {"origin": 1}}
    b = bound(row, 0.5, {"origin link": 0.5 * (1 + MIN_GAIN / 2), "origin latency": 0.5}, SMALL)
    assert b["resource"] is None and b["flag"] is None
    assert "--origin-bandwidth, --origin-latency" in b["why"]
    b = bound(row, 0.5, {"origin link": 0.6, "origin latency": 0.55}, SMALL)
    assert (b["resource"], b["flag"], b["busy"]) == ("origin link", "--origin-bandwidth", 0.5)


def test_where_more_cache_lowers_it_the_users_own_cache_gets_its_bound():
    """The cache reads (5 MB/s) are slower than the origin (120 Mbit/s): utilisation is best with
    almost no cache and falls as the cache grows. The plateau is then at a tiny cache, bound by
    something else; the user's own cache per node gets a line of its own that names the cache
    reads and ``--cache-read`` (before: never named, a new user's plan said "more cache does
    not help" and pointed elsewhere)."""
    cfg = replace(SMALL, cache_read_GBps=0.005, store_gbit=0.12)
    rep = plan(cfg, 200 * MB, setups=("colocated",))
    lv = rep["levels_off"]["colocated"]
    g = lv["at_given"]
    assert g is not None and g["cache_per_node_bytes"] == 200 * MB
    assert g["utilization"] < lv["best_utilization"] * (1 - AT_GIVEN_GAP)
    assert g["cache_per_node_bytes"] > lv["best_cache_per_node_bytes"]
    assert (g["bound"]["resource"], g["bound"]["flag"]) == ("cache reads", "--cache-read")
    from stoker_lab.sim.plan_report import short_lines

    text = "\n".join(short_lines("colocated", lv))
    assert "at your 0.20 GB per node" in text and "more cache lowers it here" in text and "--cache-read" in text


def test_a_users_cache_on_the_plateau_gets_no_line_of_its_own():
    rep = plan(CACHE_BOUND, 400 * MB, setups=("colocated",))
    assert rep["levels_off"]["colocated"]["at_given"] is None
