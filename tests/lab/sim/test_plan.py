"""`stoker plan`: answers on cases with closed-form results (everything cached, the origin link as
the only bottleneck), the cache search, the JSON report, and bad input refused in one line."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from stoker.cli import main
from stoker_lab.cli.plan import latency, link_rate
from stoker_lab.sim.decide import epoch_plans, place_job
from stoker_lab.sim.plan import PLAN_SETUPS, TARGET_UTILIZATION, min_cache, plan
from stoker_lab.sim.tdcs import TdcsConfig, workload

MB = 10**6
#: 4,000 samples of 100 kB (400 MB) on 2 nodes x 2 GPUs at 100 samples/s: an epoch's GPU time is
#: 4,000 / (100 x 4) = 10 s. Decode costs nothing (0 cores), so the only other costs are the links.
SMALL = TdcsConfig(
    nodes=2, gpus_per_node=2, gpu_rate=100.0, samples=4000, mean_sample_bytes=100_000, decode_cores=0, epochs=3
)
GPU_S = 4000 / (100.0 * 4)
SMALL_ARGV = [
    "plan",
    "--nodes",
    "2",
    "--gpus-per-node",
    "2",
    "--gpu-rate",
    "100",
    "--samples",
    "4000",
    "--dataset-bytes",
    "400MB",
    "--decode-cores",
    "0",
]


def test_everything_cached_the_gpus_bind_and_warm_epochs_take_their_gpu_time():
    # cache per node = the whole dataset: after the cold epoch every read is a local hit. A warm
    # epoch is then the GPU time plus the first chunk's read (125 samples, 12.5 MB, from a 3 GB/s
    # cache: 4 ms, 0.04% of the epoch): within 1%.
    rep = plan(SMALL, 400 * MB)
    col = rep["setups"]["colocated"]
    for e in (1, 2):
        assert col["epoch_s"][e] == pytest.approx(GPU_S, rel=0.01)
        assert col["gpu_utilization"][e] == pytest.approx(1.0, abs=0.01)
        assert col["bottleneck"][e] == "GPUs"
        assert col["bytes"]["origin"][e] == 0
    assert rep["min_cache_per_node_bytes"]["colocated"] is not None


def test_the_origin_link_alone_sets_the_epoch_time_of_direct_reads():
    # GPUs 10^4x faster than the link, NICs and cache unbounded for its 100 Mbit/s: an epoch of
    # direct reads moves the dataset's 400 MB over the origin link, 32 s. The link is shared max-min
    # by the ranks and busy while any reads; outside it are the tail (the last chunk's 20 ms
    # request latency and its GPU time) and the ramp: within 2%.
    cfg = replace(SMALL, gpu_rate=1e6, store_gbit=0.1)
    rep = plan(cfg, 1)
    direct = rep["setups"]["direct"]
    for e in range(3):
        assert direct["epoch_s"][e] == pytest.approx(400 * MB / (0.1e9 / 8), rel=0.02)
        assert direct["bottleneck"][e] == "origin link"
        assert direct["bytes"]["origin"][e] == pytest.approx(400 * MB, rel=1e-6)
        assert direct["bytes"]["host_to_host"][e] == 0
    assert rep["min_cache_per_node_bytes"]["direct"] is None  # 32 s against 0.01 s of GPU time


def test_the_smallest_cache_is_near_dataset_over_nodes_when_the_origin_is_slow():
    # origin 100 Mbit/s: a warm epoch reading (1 - f) of the 400 MB from it keeps 10 s of GPU
    # time >= 90% busy only if (1 - f) x 32 s <= 11.1 s, f >= 0.65 (the lower bound the search
    # starts from); the cluster holds the dataset once at f = 1. The answer lies between.
    cfg = replace(SMALL, store_gbit=0.1)
    rep = plan(cfg, 400 * MB)
    low = rep["assumptions"]["search_lower_bound_bytes"]["value"]
    assert low == pytest.approx((400 * MB - 1.05 * GPU_S * 0.1e9 / 8 / TARGET_UTILIZATION) / 2, abs=1)
    for s in ("presence", "colocated"):
        best = rep["min_cache_per_node_bytes"][s]
        assert best is not None and low <= best <= rep["dataset_per_node_bytes"] + 1, s
        util = dict((c, u) for c, u in rep["curves"][s])
        assert util[best] >= TARGET_UTILIZATION
        below = [u for c, u in rep["curves"][s] if c < best]
        assert all(u < TARGET_UTILIZATION for u in below)
    assert rep["min_cache_per_node_bytes"]["direct"] is None


def test_min_cache_bisects_to_the_step_and_says_none_when_nothing_reaches_it():
    calls = []

    def curve(c: int) -> float:
        calls.append(c)
        return 0.95 if c >= 537 else 0.5

    got = min_cache(curve, 100, [1000, 2000], 10)
    assert 537 <= got <= 547
    assert min_cache(lambda c: 0.5, 0, [1000], 10) is None
    assert min_cache(lambda c: 0.95, 0, [1000], 10) <= 10
    assert 100 not in calls  # the lower bound is known to fall short: not run


def test_the_json_report_has_every_setup_per_epoch_and_every_assumption_sourced(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main([*SMALL_ARGV, "--cache-per-node", "300MB", "--epochs", "2", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    rep = json.loads(out.read_text())
    assert set(rep) >= {"assumptions", "setups", "min_cache_per_node_bytes"}
    for k, v in rep["assumptions"].items():
        assert set(v) == {"value", "source"} and v["source"], k
        assert f"  {k} = " in printed and v["source"] in printed
    assert set(rep["setups"]) == set(PLAN_SETUPS)
    for s, r in rep["setups"].items():
        for key in ("epoch_s", "gpu_utilization", "bottleneck"):
            assert len(r[key]) == 2, (s, key)
        assert set(r["bytes"]) == {"origin", "host_to_host", "local"}
        assert all(len(v) == 2 for v in r["bytes"].values())
        assert f"| {s} | 1 |" in printed
    for s in PLAN_SETUPS:
        v = rep["min_cache_per_node_bytes"][s]
        assert v is None or isinstance(v, int)
    assert rep["assumptions"]["gpu_rate"]["source"] == "given (--gpu-rate)"
    assert rep["assumptions"]["cache_per_node_bytes"]["value"] == 300 * MB


def test_the_plot_is_written(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "curve.png"
    assert main([*SMALL_ARGV, "--cache-per-node", "300MB", "--epochs", "2", "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_issue_command_line_is_read_as_a_user_writes_it(monkeypatch):
    seen = {}

    def fake(cfg, cache, sources, disk, **_):
        seen.update(cfg=cfg, cache=cache, sources=sources, disk=disk)
        raise SystemExit(0)

    monkeypatch.setattr("stoker_lab.sim.plan.plan", fake)
    argv = "plan --nodes 16 --gpus-per-node 8 --gpu-rate 1200 --samples 1281167 --dataset-bytes 140GB "
    argv += "--cache-per-node 2TB --origin-bandwidth 10Gbit --nic 25Gbit --json plan.json"
    with pytest.raises(SystemExit):
        main(argv.split())
    cfg = seen["cfg"]
    assert (cfg.nodes, cfg.gpus_per_node, cfg.gpu_rate, cfg.samples) == (16, 8, 1200, 1281167)
    assert cfg.mean_sample_bytes == pytest.approx(140e9 / 1281167)
    assert (cfg.store_gbit, cfg.nic_gbit) == (pytest.approx(10), pytest.approx(25))
    assert seen["cache"] == 2 * 10**12 and seen["disk"] is None


@pytest.mark.parametrize(
    "text,bps", [("10Gbit", 1.25e9), ("1.25GB/s", 1.25e9), ("400Mbit/s", 50e6), ("25Gbps", 3.125e9), ("1Gb/s", 125e6)]
)
def test_link_rates_in_bits_or_bytes(text, bps):
    assert link_rate(text, "--nic") == pytest.approx(bps)


def test_latencies():
    assert latency("20ms", "--origin-latency") == pytest.approx(0.02)
    assert latency("0.5s", "--origin-latency") == pytest.approx(0.5)
    assert latency("500us", "--origin-latency") == pytest.approx(5e-4)
    assert latency("0ms", "--peer-latency") == 0


def test_a_missing_gpu_rate_and_model_still_asks_for_one(capsys):
    argv = [x for x in SMALL_ARGV if x not in ("--gpu-rate", "100")]
    assert main([*argv, "--cache-per-node", "1GB"]) == 2
    assert "give one of --gpu-rate (images/s per GPU) and --model (" in capsys.readouterr().err


def test_the_progress_line_says_none_reaches_the_target_not_none(capsys):
    # GPUs 10^4x faster than a 100 Mbit/s origin: no cache size keeps them 90% busy
    argv = [x for x in SMALL_ARGV if x not in ("--gpu-rate", "100")]
    argv += ["--gpu-rate", "1000000", "--origin-bandwidth", "100Mbit", "--cache-per-node", "100MB", "--epochs", "2"]
    assert main([*argv, "--setups", "colocated"]) == 0
    err = capsys.readouterr().err
    assert "colocated: smallest cache per node for 90% GPU utilisation: none reaches 90%" in err
    assert "None" not in err


def test_gpus_per_node_help_says_what_it_is(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    assert "accelerators (GPUs) on each node" in capsys.readouterr().out


@pytest.mark.parametrize(
    "extra,needle",
    [
        (["--nodes", "0"], "--nodes must be >= 1"),
        (["--dataset-bytes=-5GB"], "--dataset-bytes '-5GB': "),
        (["--dataset-bytes", "-5GB"], "argument --dataset-bytes: expected one argument (a value starting with '-'"),
        (["--dataset-bytes", "0"], "--dataset-bytes '0': must be more than 0 bytes"),
        (["--cache-per-node=-1GB"], "--cache-per-node '-1GB': "),
        (["--cache-per-node", "0"], "--cache-per-node '0': must be more than 0 bytes"),
        (["--origin-bandwidth", "fast"], "--origin-bandwidth 'fast'"),
        (["--nic", "25"], "--nic '25': give a link rate with its unit"),
        (["--origin-bandwidth", "0Gbit"], "a link rate must be > 0"),
        (["--origin-latency", "soon"], "--origin-latency 'soon'"),
        (["--cache-per-node", "3TB", "--disk", "2TB"], "larger than the node's disk"),
        (["--gpu-rate", "0"], "--gpu-rate must be > 0"),
        (["--model", "resnet50-v100"], "give only one of --gpu-rate or --model"),
        (["--origin-latency", "20"], "--origin-latency '20': give a latency with its unit, e.g. 20ms"),
        (["--origin-latency=-5ms"], "--origin-latency '-5ms': a latency must be >= 0"),
        (["--origin-latency", "-5ms"], "written --origin-latency=VALUE; it takes a latency, >= 0)"),
        (["--peer-latency", "1"], "--peer-latency '1': give a latency with its unit"),
        (["--nodes", "--samples", "10"], "written --nodes=VALUE; it takes a number of nodes, >= 1)"),
        (["--cache-per-node", "5XB"], "--cache-per-node '5XB': cannot read '5XB' as a size"),
        (["--plot", "x.txt"], "--plot x.txt: name a file ending in a format matplotlib writes ("),
        (["--samples", "4.5"], "--samples '4.5': not an integer"),
        (["--epochs", "0"], "--epochs must be >= 1"),
        (["--json", "/no/such/dir/plan.json"], "--json /no/such/dir/plan.json: no directory"),
    ],
)
def test_bad_input_is_refused_in_one_line_exit_2(capsys, monkeypatch, extra, needle):
    def not_reached(*_a, **_k):
        raise AssertionError("the model ran on bad input")

    monkeypatch.setattr("stoker_lab.sim.plan.plan", not_reached)
    argv = [*SMALL_ARGV, "--cache-per-node", "1GB"]
    for opt in [x for x in extra if x.startswith("--")]:  # each option replaces the base's
        name = opt.split("=")[0]
        if name in argv:
            del argv[argv.index(name) : argv.index(name) + 2]
    argv += extra
    if "--plot" in argv:
        pytest.importorskip("matplotlib")
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse's own errors (an option without its value)
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("stoker plan: "), err
    assert needle in lines[0]
    assert "sizes must be" not in lines[0] or "size" in needle
    assert lines[0].count(extra[0].split("=")[0]) <= 2  # named once (an argparse line: in its own words too)


def test_a_missing_figure_is_named(capsys):
    rc = main(["plan", "--nodes", "2", "--gpus-per-node", "2", "--gpu-rate", "100", "--samples", "10"])
    err = capsys.readouterr().err
    assert rc == 2 and err.strip() == "stoker plan: --dataset-bytes is needed (see stoker plan --help)"


def test_a_remembered_permutation_gives_the_same_plans_after_other_epochs():
    wl = workload(SMALL)
    import numpy as np

    from stoker_lab.sim.decide import ClusterState

    pl = place_job("direct", ClusterState(2, wl), wl, 4, np.zeros(2), 0, 2)
    first = epoch_plans("direct", wl, pl, 0)
    for e in (1, 2, 3, 0):
        again = epoch_plans("direct", wl, pl, e)
    assert all(np.array_equal(a, b) for a, b in zip(first, again, strict=True))
    assert not all(np.array_equal(a, b) for a, b in zip(first, epoch_plans("direct", wl, pl, 1), strict=True))


def test_measure_takes_this_machines_decode_rate_and_says_so(monkeypatch):
    pytest.importorskip("skimage")
    pytest.importorskip("sklearn")
    seen = {}

    def fake(cfg, cache, sources, disk, **_):
        seen.update(cfg=cfg, sources=sources)
        raise SystemExit(0)

    monkeypatch.setattr("stoker_lab.sim.plan.plan", fake)
    with pytest.raises(SystemExit):
        main([*SMALL_ARGV, "--cache-per-node", "1GB", "--measure"])
    assert seen["cfg"].decode_rate > 0 and seen["cfg"].decode_rate != TdcsConfig().decode_rate
    assert seen["sources"]["decode_rate"].startswith("measured here (--measure)")


def test_a_model_name_gives_its_published_rate_and_source(monkeypatch):
    seen = {}

    def fake(cfg, cache, sources, disk, **_):
        seen.update(cfg=cfg, sources=sources)
        raise SystemExit(0)

    monkeypatch.setattr("stoker_lab.sim.plan.plan", fake)
    argv = [x for x in SMALL_ARGV if x not in ("--gpu-rate", "100")]
    with pytest.raises(SystemExit):
        main([*argv, "--cache-per-node", "1GB", "--model", "resnet50-a100"])
    assert seen["cfg"].gpu_rate == pytest.approx(16621 / 8)
    assert "DGX A100" in seen["sources"]["gpu_rate"] and "16621 img/s" in seen["sources"]["gpu_rate"]


#: A dataset ten times the scaling bound: 40,000 samples of 100 kB on 2 nodes x 2 GPUs at 100
#: samples/s, origin 100 Mbit/s (the origin binds, so the cache search has an answer), one decode
#: core each; chunks of 32 samples, so that the scaled model still has 31 chunks per rank.
BIG = TdcsConfig(
    nodes=2,
    gpus_per_node=2,
    gpu_rate=100.0,
    samples=40_000,
    mean_sample_bytes=100_000,
    decode_cores=1,
    decode_rate=300.0,
    store_gbit=0.1,
    chunk_samples=32,
    epochs=2,
)


def test_a_dataset_over_the_bound_is_planned_scaled_down_with_the_same_answers(monkeypatch):
    # with no bound the model walks all 40,000 samples; with a bound of 4,000 it walks 4,000 of
    # 10x the bytes (GPU and decode rates / 10). A scaled chunk is 10 of the user's back to back,
    # so the epoch's edges (the first chunk's wait, the last one's GPU time) are coarser: at most
    # two scaled chunks of a rank's 1,000 samples, 2 x 32 / 1000 = 6.4% of an epoch. Origin bytes
    # differ by the tar headers and padding (about 768 B of each 100 kB sample, ten times fewer
    # of them scaled): within 1%. The split of the rest between a node's own cache and its peers'
    # is drawn by block, 5,000 blocks unscaled and 500 scaled (8 MB each): within 2% of the 4 GB
    # (10 scaled blocks). The smallest cache moves with the utilisation curve: the same
    # 6.4% plus the search's resolution.
    import stoker_lab.sim.plan as plan_mod

    setups = ("direct", "colocated")
    monkeypatch.setattr(plan_mod, "MAX_SAMPLES", 10**9)
    full = plan(BIG, 10**9, setups=setups)
    monkeypatch.setattr(plan_mod, "MAX_SAMPLES", 4_000)
    lines: list[str] = []
    small = plan(BIG, 10**9, setups=setups, on_step=lines.append)
    assert full["assumptions"]["sample_scale"]["value"] == 1.0
    assert small["assumptions"]["sample_scale"]["value"] == pytest.approx(10.0)
    assert "4000 samples" in small["assumptions"]["sample_scale"]["source"]
    assert small["assumptions"]["samples"]["value"] == 40_000  # the user's figures, not the model's
    assert small["assumptions"]["gpu_rate"]["value"] == 100.0
    assert any("40000 samples planned as 4000" in line for line in lines)
    tol = 2 * 32 / 1000
    for s in setups:
        a, b = full["setups"][s], small["setups"][s]
        assert b["epoch_s"] == pytest.approx(a["epoch_s"], rel=tol), s
        assert b["gpu_utilization"] == pytest.approx(a["gpu_utilization"], rel=tol), s
        assert b["bytes"]["origin"] == pytest.approx(a["bytes"]["origin"], rel=0.01), s
        for kind in ("host_to_host", "local"):  # which node a block is read on: 500 blocks scaled
            assert b["bytes"][kind] == pytest.approx(a["bytes"][kind], abs=0.02 * 4e9), (s, kind)
        assert b["bottleneck"] == a["bottleneck"], s
    got, want = small["min_cache_per_node_bytes"]["colocated"], full["min_cache_per_node_bytes"]["colocated"]
    assert got is not None and want is not None
    assert got == pytest.approx(want, abs=(tol + 0.02) * full["dataset_per_node_bytes"])


def _peak_traced_bytes(samples: int) -> int:
    import tracemalloc

    import stoker_lab.sim.plan as plan_mod

    plan_mod.MAX_SAMPLES = 4_000
    tracemalloc.start()
    plan(replace(BIG, samples=samples, mean_sample_bytes=4e9 / samples), 10**9, setups=("colocated",))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak


def test_planning_a_dataset_over_the_bound_takes_the_memory_of_the_bound():
    from _helpers import in_child

    # the same 4 GB in 4,000 samples and in 400,000: past the bound the model walks 4,000 either
    # way, so the peak of traced memory does not grow with the samples (unscaled it grows 100x:
    # per-sample arrays of 8 bytes a sample, several of them)
    at_bound = in_child(_peak_traced_bytes, 4_000, timeout_s=300)
    over = in_child(_peak_traced_bytes, 400_000, timeout_s=300)
    assert over < 1.5 * at_bound + 1e6, (over, at_bound)
