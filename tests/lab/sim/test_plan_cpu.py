"""The planner counts the CPU that moving bytes costs: cores per node on each byte path follow from
the bytes, the epoch's seconds and each path's CPU-s/GB (hand-computed cases); a ``stoker bench io
--json`` report replaces the defaults it has figures for, and says so; CPU is named the bottleneck
where byte-moving and decode cores need more than the node's cores, and not otherwise."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from stoker.cli import main
from stoker_lab.sim.byte_cpu import DEFAULTS, FIELDS, PATHS, byte_cores, cpu_utilization, from_bench_io, node_cores
from stoker_lab.sim.plan import plan
from stoker_lab.sim.tdcs import TdcsConfig, run_setup, workload

REPO = Path(__file__).resolve().parents[3]
BENCH_IO = REPO / "benchmarks" / "bench_io.json"
BENCH_IO_PEER = REPO / "benchmarks" / "bench_io_peer.json"
MB = 10**6
#: test_plan.py's small cluster: 4,000 samples of 100 kB on 2 nodes x 2 GPUs at 100 samples/s (an
#: epoch's GPU time 10 s), no decode cost.
SMALL = TdcsConfig(
    nodes=2, gpus_per_node=2, gpu_rate=100.0, samples=4000, mean_sample_bytes=100_000, decode_cores=0, epochs=2
)
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
    "--cache-per-node",
    "300MB",
    "--epochs",
    "2",
]


def test_cores_on_each_path_are_bytes_per_node_and_second_times_its_cost():
    # 2 nodes, 4 s: origin 4 GB -> 0.5 GB/s a node x 2 CPU-s/GB = 1 core; host-to-host 2 GB ->
    # 0.25 GB/s a node, sent at 3 and received at 5 CPU-s/GB = 0.75 + 1.25; local 6 GB -> 0.75 GB/s
    # x 1 = 0.75. Total 3.75 cores.
    costs = {"fill": 2.0, "peer_send": 3.0, "peer_receive": 5.0, "warm_read": 1.0}
    got = byte_cores(costs, {"origin": 4e9, "host_to_host": 2e9, "local": 6e9}, nodes=2, seconds=4.0)
    assert got == pytest.approx(
        {"fill": 1.0, "peer_send": 0.75, "peer_receive": 1.25, "warm_read": 0.75, "total": 3.75}
    )
    assert byte_cores(costs, {"origin": 4e9}, nodes=2, seconds=0.0)["total"] == 0.0
    assert cpu_utilization(3.75, 4.25, 8) == pytest.approx(1.0)
    assert cpu_utilization(1.0, 0.0, 0) == 0.0


def test_the_plan_reports_each_setups_byte_cores_from_its_bytes_and_seconds():
    # Every figure follows from the report's own bytes and seconds at the assumptions' costs; the
    # direct setup's epochs read the 400 MB from the origin in about the GPU time (10 s): about
    # 400 MB / 2 nodes / 10 s x 2.55 CPU-s/GB = 0.051 cores a node.
    rep = plan(SMALL, 300 * MB)
    costs = {p: rep["assumptions"][FIELDS[p]]["value"] for p in PATHS}
    assert costs == {p: DEFAULTS[p].cpu_s_per_GB for p in PATHS}
    for s, r in rep["setups"].items():
        for e, secs in enumerate(r["epoch_s"]):
            b = {k: v[e] for k, v in r["bytes"].items()}
            want = byte_cores(costs, b, 2, secs)
            assert r["byte_cores_per_node"][e] == pytest.approx(want["total"]), (s, e)
            for p in PATHS:
                assert r["byte_cores_by_path"][p][e] == pytest.approx(want[p]), (s, e, p)
            assert r["resource_utilization"][e]["CPU"] == pytest.approx(want["total"] / 40), (s, e)
    direct = rep["setups"]["direct"]
    assert direct["byte_cores_per_node"][1] == pytest.approx(400 * MB / 2 / 10 * 2.55 / 1e9, rel=0.05)
    assert direct["byte_cores_by_path"]["peer_send"] == [0.0, 0.0]
    assert rep["assumptions"]["cores_per_node"]["value"] == 40


def test_cpu_is_named_where_peer_bytes_leave_the_cores_short_and_not_elsewhere():
    # Presence-only placement reads half of each warm epoch from the other node (about 200 MB in
    # 10 s, 10 MB/s a node); at 100 CPU-s/GB each end that is 2 cores a node, over a 1-core node.
    # Co-located placement reads its own node's blocks (a few MB from the peer, where equal counts
    # per rank force it): a tenth of a core, the GPUs stay the bottleneck.
    dear = replace(SMALL, cores_per_node=1, peer_send_cpu_s_per_GB=100.0, peer_receive_cpu_s_per_GB=100.0)
    rep = plan(dear, 300 * MB)
    presence, colocated = rep["setups"]["presence"], rep["setups"]["colocated"]
    assert presence["bytes"]["host_to_host"][1] > 100 * MB
    assert presence["byte_cores_per_node"][1] > 1
    assert presence["bottleneck"][1] == "CPU"
    assert colocated["bytes"]["host_to_host"][1] < 20 * MB
    assert colocated["byte_cores_per_node"][1] < 0.5
    assert colocated["bottleneck"][1] == "GPUs"
    assert rep["setups"]["direct"]["bottleneck"][1] == "GPUs"  # no peer bytes either
    # the same cluster at the default costs: a fraction of a core, the GPUs bind
    cheap = plan(replace(SMALL, cores_per_node=1), 300 * MB)["setups"]["presence"]
    assert cheap["byte_cores_per_node"][1] < 0.5
    assert cheap["bottleneck"][1] == "GPUs"


def test_byte_cores_and_decode_cores_together_can_leave_the_node_short():
    # Everything cached on each node (colocated, cache = dataset): 200 samples/s a node of 100 kB,
    # about 20 MB/s of warm reads. Decode: 200 samples/s at 110 a core, about 1.6-1.8 of the node's
    # 2 cores (the epoch runs a little over its 10 s of GPU time as decode nears its bound). At 0.2
    # CPU-s/GB the reads take 0.004 cores (the GPUs bind); at 30 CPU-s/GB about half a core: over 2
    # in all, CPU is named, though neither alone fills the node.
    cfg = replace(SMALL, decode_cores=2, decode_rate=110.0, cores_per_node=2, cache_fraction=2.0)
    for cost, name in ((0.2, "GPUs"), (30.0, "CPU")):
        warm = run_setup(replace(cfg, warm_read_cpu_s_per_GB=cost), "colocated")[1]
        decode, moving = warm["decode_cores_per_node"], warm["byte_cores_per_node"]
        assert decode == pytest.approx(4000 / 2 / 110 / warm["epoch_s"], rel=1e-6)  # core-s per node / s
        assert moving["warm_read"] == pytest.approx(warm["bytes"]["local"] / 2 / warm["epoch_s"] * cost / 1e9)
        assert decode < 2 and moving["total"] < 2
        assert warm["bottleneck"]["utilization"]["CPU"] == pytest.approx((decode + moving["total"]) / 2)
        assert (decode + moving["total"] > 2) == (name == "CPU")
        assert warm["bottleneck"]["name"] == name, cost


def test_a_bench_io_report_gives_every_figure_it_has_and_names_where_from():
    # benchmarks/bench_io_peer.json: the fill and warm-read stages, and four peer rows, each with its
    # sender's and receiver's CPU-s/GB; the costliest over both ends gives both peer paths, and the
    # defaults are its figures.
    rep = json.loads(BENCH_IO_PEER.read_text())
    stages = {s["stage"]: s for s in rep["stages"]}
    got = from_bench_io(str(BENCH_IO_PEER))
    assert got["fill"].cpu_s_per_GB == stages["origin->cache (prefetcher, cold epoch)"]["cpu_s_per_GB"]
    assert got["warm_read"].cpu_s_per_GB == stages["cache (disk tier)->worker"]["cpu_s_per_GB"]
    peers = [s for name, s in stages.items() if name.startswith("peer ")]
    assert len(peers) == 4 and all(s["sender"]["cpu_s_per_GB"] is not None for s in peers)
    dearest = max(peers, key=lambda s: s["cpu_s_per_GB"])
    assert got["peer_send"].cpu_s_per_GB == dearest["sender"]["cpu_s_per_GB"]
    assert got["peer_receive"].cpu_s_per_GB == dearest["receiver"]["cpu_s_per_GB"]
    assert got["peer_send"].cpu_s_per_GB + got["peer_receive"].cpu_s_per_GB == pytest.approx(dearest["cpu_s_per_GB"])
    for p in PATHS:
        assert got[p].source.startswith(f"{BENCH_IO_PEER} (stoker bench io, 2 cores): stage "), p
    assert dearest["stage"] in got["peer_send"].source and "sender.cpu_s_per_GB" in got["peer_send"].source
    for p in ("peer_send", "peer_receive"):  # the defaults are this report's figures, to 2 decimals
        assert DEFAULTS[p].cpu_s_per_GB == pytest.approx(got[p].cpu_s_per_GB, abs=0.005)
        assert dearest["stage"] in DEFAULTS[p].source


def test_a_report_without_a_peer_measurement_keeps_the_peer_defaults_saying_so():
    got = from_bench_io(str(BENCH_IO))  # its peer row: not measured (null figures)
    assert got["fill"].cpu_s_per_GB == json.loads(BENCH_IO.read_text())["origin_to_cache_cpu_s_per_GB"]
    for p in ("peer_send", "peer_receive"):
        assert got[p].cpu_s_per_GB == DEFAULTS[p].cpu_s_per_GB
        assert got[p].source.startswith(f"default, {BENCH_IO} has no figure for it: ")


def _report(tmp_path, stages: list, **top) -> str:
    path = tmp_path / "io.json"
    path.write_text(json.dumps({"machine": {"cores": 16}, "stages": stages, **top}))
    return str(path)


def test_each_end_of_a_peer_row_is_taken_as_given_and_a_sum_alone_is_split_as_the_defaults(tmp_path):
    ends = {"stage": "peer data endpoint->rank (loopback)", "cpu_s_per_GB": 0.9}
    ends |= {"sender": {"cpu_s_per_GB": 0.3}, "receiver": {"cpu_s_per_GB": 0.6}}
    got = from_bench_io(_report(tmp_path, [ends]))
    assert (got["peer_send"].cpu_s_per_GB, got["peer_receive"].cpu_s_per_GB) == (0.3, 0.6)
    assert "16 cores" in got["peer_send"].source and "sender.cpu_s_per_GB" in got["peer_send"].source
    assert got["fill"] == replace(DEFAULTS["fill"], source=got["fill"].source)  # the default's figure
    assert "has no figure for it" in got["fill"].source
    flat = {"stage": "peer x", "sender_cpu_s_per_GB": 0.25, "receiver_cpu_s_per_GB": 0.5}
    got = from_bench_io(_report(tmp_path, [flat]))
    assert (got["peer_send"].cpu_s_per_GB, got["peer_receive"].cpu_s_per_GB) == (0.25, 0.5)
    summed = from_bench_io(_report(tmp_path, [{"stage": "peer y", "cpu_s_per_GB": 2.0}]))
    share = DEFAULTS["peer_send"].cpu_s_per_GB / (
        DEFAULTS["peer_send"].cpu_s_per_GB + DEFAULTS["peer_receive"].cpu_s_per_GB
    )
    assert summed["peer_send"].cpu_s_per_GB == pytest.approx(2.0 * share, rel=0.01)
    assert summed["peer_send"].cpu_s_per_GB + summed["peer_receive"].cpu_s_per_GB == pytest.approx(2.0)
    assert "the defaults' split" in summed["peer_receive"].source


@pytest.mark.parametrize(
    "stages,needle",
    [
        (
            [{"stage": "cache (disk tier)->worker", "cpu_s_per_GB": -1}],
            "stage 'cache (disk tier)->worker' cpu_s_per_GB is -1",
        ),
        ([{"stage": "peer z", "sender": {"cpu_s_per_GB": "fast"}}], "stage 'peer z' sender.cpu_s_per_GB is 'fast'"),
        ([{"stage": "origin->cache (prefetcher)", "cpu_s_per_GB": True}], "cpu_s_per_GB is True"),
        ("not a list", "no 'stages' list"),
    ],
)
def test_a_bad_figure_in_the_report_is_refused_naming_the_key(tmp_path, stages, needle):
    path = _report(tmp_path, stages)
    with pytest.raises(ValueError, match="^--cpu-costs ") as e:
        from_bench_io(path)
    assert needle in str(e.value) and path in str(e.value)


def test_the_nodes_cores_and_the_decode_cores_given_alone_set_each_other():
    assert node_cores(None, 40, False) == (40, 40, {})
    cores, decode, why = node_cores(None, 64, True)
    assert (cores, decode) == (64, 64) and "--decode-cores 64" in why["cores_per_node"]
    assert node_cores(None, 0, True) == (40, 0, {})  # decoding costs nothing: the default node
    cores, decode, why = node_cores(20, 40, False)  # the default decode cores follow the node's
    assert (cores, decode) == (20, 20) and "--cores-per-node 20" in why["decode_cores"]
    assert node_cores(96, 64, True) == (96, 64, {"cores_per_node": "given (--cores-per-node)"})
    with pytest.raises(ValueError, match="--decode-cores 64 is more than the node's cores"):
        node_cores(16, 64, True)
    with pytest.raises(ValueError, match="--cores-per-node must be >= 1, got 0"):
        node_cores(0, 0, True)


def test_the_command_line_takes_a_bench_io_report_and_the_nodes_cores(tmp_path, capsys):
    out = tmp_path / "plan.json"
    argv = [*SMALL_ARGV, "--cpu-costs", str(BENCH_IO_PEER), "--cores-per-node", "8", "--json", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    rep = json.loads(out.read_text())
    a = rep["assumptions"]
    measured = from_bench_io(str(BENCH_IO_PEER))
    for p in PATHS:
        assert a[FIELDS[p]] == {"value": measured[p].cpu_s_per_GB, "source": measured[p].source}
    assert a["cores_per_node"] == {"value": 8, "source": "given (--cores-per-node)"}
    assert "| byte-moving cores/node | decode cores/node | bottleneck |" in printed
    for s in ("direct", "presence", "colocated"):
        assert len(rep["setups"][s]["byte_cores_per_node"]) == 2
        assert f"  {s}, epoch " in printed and " cores moving bytes (fill " in printed
    assert "need more than the node's 8 cores" in printed


@pytest.mark.parametrize(
    "extra,needle",
    [
        (["--cpu-costs", "/nonexistent/io.json"], "stoker plan: --cpu-costs /nonexistent/io.json: no such file"),
        (["--cores-per-node", "0"], "stoker plan: --cores-per-node must be >= 1, got 0"),
        (["--cores-per-node", "4", "--decode-cores", "8"], "--decode-cores 8 is more than the node's cores"),
    ],
)
def test_bad_cpu_input_is_refused_in_one_line(capsys, extra, needle):
    argv = list(SMALL_ARGV)
    if "--decode-cores" in extra:  # given once, by the case
        i = argv.index("--decode-cores")
        del argv[i : i + 2]
    assert main([*argv, *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err


def test_simulate_tdcs_counts_the_same_cores(tmp_path, capsys):
    out = tmp_path / "tdcs.json"
    argv = ["simulate", "tdcs", "--nodes", "2", "--gpus-per-node", "2", "--samples", "2000", "--epochs", "1"]
    argv += ["--decode-rate", "500", "--cores-per-node", "64", "--cpu-costs", str(BENCH_IO_PEER), "--json", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    rep = json.loads(out.read_text())
    assert rep["assumptions"]["cores_per_node"]["value"] == 64
    measured = from_bench_io(str(BENCH_IO_PEER))
    assert rep["assumptions"]["peer_send_cpu_s_per_GB"]["source"] == measured["peer_send"].source
    costs = {p: measured[p].cpu_s_per_GB for p in PATHS}
    for r in rep["rows"]:
        assert r["byte_cores_per_node"] == pytest.approx(byte_cores(costs, r["bytes"], 2, r["epoch_s"]))
        assert "CPU" in r["bottleneck"]["utilization"]
    assert "| byte-moving cores/node | decode cores/node | busiest |" in printed
    assert main(["simulate", "--validate", "--cores-per-node", "4"]) == 2
    assert "--cores-per-node is an option of stoker simulate tdcs, not of --validate" in capsys.readouterr().err


def test_the_tdcs_setup_moves_peer_bytes_on_under_a_core_a_node_and_the_ray_path_needed_eleven():
    # The TDCS setup (16 nodes x 8 GPUs at 1,200 images/s, ImageNet's 140 GB, 10 Gbit/s store,
    # 25 Gbit/s NICs) on a tenth of ImageNet's samples of the same size: the same bytes per node
    # and second. Presence-only placement reads 15/16 of a warm epoch from peers: 131 GB in 8.9 s
    # at full size, 8.2 GB a node. At the data endpoint's default 0.84 CPU-s/GB (both ends) that
    # is about 0.8 cores a node; at the Ray path's 11.5 (3.78 sending, 7.72 receiving) it was 10.6.
    # Co-located placement reads its own node's blocks. With the default 40 cores (13 decoding) the
    # GPUs bind either way; a node of 20 cores was short of CPU under presence placement only at
    # the Ray path's cost, and is not at the data endpoint's.
    cfg = TdcsConfig(samples=128_117, mean_sample_bytes=140e9 / 1_281_167, gpu_rate=1200.0, epochs=2)
    wl = workload(cfg)
    ray_path = {"peer_send_cpu_s_per_GB": 3.78, "peer_receive_cpu_s_per_GB": 7.72}
    warm = {}
    for name, costs in (("endpoint", {}), ("ray", ray_path)):
        for cores in (40, 20):
            c = replace(cfg, cores_per_node=cores, decode_cores=cores, **costs)
            warm[name, cores] = {s: run_setup(c, s, wl)[1] for s in ("direct", "presence", "colocated")}
    for name, both in (
        ("endpoint", DEFAULTS["peer_send"].cpu_s_per_GB + DEFAULTS["peer_receive"].cpu_s_per_GB),
        ("ray", 11.5),
    ):
        presence = warm[name, 40]["presence"]
        peer = presence["bytes"]["host_to_host"] / 16 / presence["epoch_s"] * both / 1e9
        moving = presence["byte_cores_per_node"]
        assert moving["peer_send"] + moving["peer_receive"] == pytest.approx(peer, rel=0.01)
        assert warm[name, 40]["colocated"]["byte_cores_per_node"]["total"] < 1
    assert 0.5 < warm["endpoint", 40]["presence"]["byte_cores_per_node"]["total"] < 1.5
    assert 9 < warm["ray", 40]["presence"]["byte_cores_per_node"]["total"] < 12
    bound = {"direct": "origin link", "presence": "GPUs", "colocated": "GPUs"}
    for key in (("endpoint", 40), ("endpoint", 20), ("ray", 40)):
        assert {s: r["bottleneck"]["name"] for s, r in warm[key].items()} == bound, key
    assert {s: r["bottleneck"]["name"] for s, r in warm["ray", 20].items()} == dict(bound, presence="CPU")


@pytest.mark.parametrize(
    "extra,needle",
    [
        (["--cores-per-node", "0"], "stoker simulate: --cores-per-node must be >= 1, got 0"),
        (["--decode-cores", "8", "--cores-per-node", "4"], "--decode-cores 8 is more than the node's cores"),
        (["--cpu-costs", "/nonexistent/io.json"], "stoker simulate: --cpu-costs /nonexistent/io.json: no such file"),
    ],
)
def test_simulate_tdcs_refuses_bad_cpu_input_in_one_line(capsys, extra, needle):
    assert main(["simulate", "tdcs", "--samples", "100", *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err
