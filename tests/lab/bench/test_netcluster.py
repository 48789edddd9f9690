"""The namespace cluster of ``stoker bench cluster --netns``: namespaces, shaped links, kernel
byte counters, tear-down (on exit, error, Ctrl-C, and of stale namespaces from a killed run).

Tests that make namespaces need CAP_NET_ADMIN and skip without it, with the reason; under
``$CI`` a machine that has the capability but cannot run them fails instead of skipping.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from stoker_lab.bench import netcluster
from stoker_lab.bench.netcluster import (
    PREFIX,
    NetCluster,
    NetnsUnavailable,
    check_capability,
    has_cap_net_admin,
    kernel_delta,
    list_namespaces,
)
from stoker_lab.bench.netcluster_bench import summary


def _need_netns():
    try:
        check_capability()
    except NetnsUnavailable as exc:
        if os.environ.get("CI"):
            try:
                capable = has_cap_net_admin()
            except NetnsUnavailable:
                capable = False
            if capable:
                pytest.fail(f"CAP_NET_ADMIN is there but namespaces cannot be made: {exc}")
        pytest.skip(f"needs network namespaces: {exc}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie (exited, not yet reaped) counts as gone
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def _sleeper(net: NetCluster, ns: str) -> subprocess.Popen:
    return subprocess.Popen([*net.exec_prefix(ns), sys.executable, "-c", "import time; time.sleep(600)"])


# -- without the capability ---------------------------------------------------------------------
def _fake_status(tmp_path, monkeypatch, cap_eff: int):
    path = tmp_path / "status"
    path.write_text(f"Name:\tpython\nCapEff:\t{cap_eff:016x}\n")
    monkeypatch.setattr(netcluster, "_STATUS_PATH", str(path))


def test_refuses_at_once_without_cap_net_admin(tmp_path, monkeypatch):
    _fake_status(tmp_path, monkeypatch, 0x1FFFEFFEFFF)  # every capability but bit 12
    before = list_namespaces() if os.geteuid() == 0 else []
    with pytest.raises(NetnsUnavailable, match="CAP_NET_ADMIN") as err:
        NetCluster().start()
    assert "\n" not in str(err.value)
    if os.geteuid() == 0:
        assert list_namespaces() == before  # nothing made


def test_cli_says_why_in_one_line(tmp_path, monkeypatch, capsys):
    from stoker.cli import main

    _fake_status(tmp_path, monkeypatch, 0)
    rc = main(["bench", "cluster", "--netns", "--workdir", str(tmp_path / "w")])
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert len(err.splitlines()) == 1 and "CAP_NET_ADMIN" in err
    assert not (tmp_path / "w").exists() or not any((tmp_path / "w").iterdir())


def test_sizes_are_checked():
    with pytest.raises(ValueError, match="hosts must be 1..6"):
        NetCluster(hosts=7)
    with pytest.raises(ValueError, match="Mbit/s"):
        NetCluster(host_mbit=0)


# -- pure accounting ------------------------------------------------------------------------------
def test_kernel_delta_splits_origin_and_host_to_host_bytes():
    before = {n: {"rx_bytes": 100, "tx_bytes": 100} for n in ("h0", "h1", "origin")}
    # the origin sent 1000 bytes to h0; h0 sent 300 bytes to h1
    after = {
        "origin": {"rx_bytes": 100, "tx_bytes": 1100},
        "h0": {"rx_bytes": 1100, "tx_bytes": 400},
        "h1": {"rx_bytes": 400, "tx_bytes": 100},
    }
    d = kernel_delta(before, after)
    assert d["origin_link_bytes"] == 1000
    assert d["host_link_bytes"] == 300
    assert d["links"]["h0"] == {"rx_bytes": 1000, "tx_bytes": 300}


def test_summary_reports_agreement_and_placement_ratios():
    def row(p, e, korigin, khost, sorigin, speer):
        return {
            "placement": p,
            "job": "job1",
            "epoch": e,
            "samples_per_s": 10.0,
            "exactly_once": True,
            "kernel": {"origin_link_bytes": korigin, "host_link_bytes": khost},
            "stoker": {"local_bytes": 0, "peer_bytes": speer, "origin_bytes": sorigin},
        }

    mb = 1 << 20
    report = {
        "dataset": {"bytes": 100 * mb},
        "runs": [
            row("random", 0, 105 * mb, 50 * mb, 100 * mb, 48 * mb),
            row("random", 1, 0, 40 * mb, 0, 38 * mb),
            row("colocated", 0, 104 * mb, 5 * mb, 100 * mb, 4 * mb),
            row("colocated", 1, mb // 2, 2 * mb, 0, 0),
        ],
    }
    s = summary(report)
    assert report["runs"][0]["agreement"]["origin_excess_pct"] == pytest.approx(5.0)
    assert report["runs"][3]["agreement"]["origin_excess_pct"] is None  # stoker counted under 1 MiB
    assert s["placements"]["colocated"]["warm_origin_link_fraction"] == pytest.approx(0.005)
    assert s["colocated_vs_random_host"] == pytest.approx(2 / 40)
    assert s["all_exactly_once"]


def test_summary_allows_each_placement_its_own_measured_control_bytes():
    """A job that starts a placement's ranks and services sends Ray and index traffic that is not
    data; the allowance for it is the placement's own probe (a job of that placement that read
    nothing), measured, also when no ``direct`` rows exist to estimate it from (a faults-only run)."""

    def row(e, khost, speer, korigin, sorigin):
        return {
            "placement": "colocated",
            "job": "job1",
            "epoch": e,
            "samples_per_s": 10.0,
            "exactly_once": True,
            "kernel": {"origin_link_bytes": korigin, "host_link_bytes": khost},
            "stoker": {"local_bytes": 0, "peer_bytes": speer, "origin_bytes": sorigin},
        }

    def report(probe_host_bytes):
        # figures of a real 3-host run: the cold epoch's host links carry 300 kB more than its
        # peer bytes plus headers, over the 5% allowance (180 kB)
        return {
            "dataset": {"bytes": 58_271_312},
            "runs": [row(0, 4_050_891, 3_587_112, 59_337_008, 59_002_544), row(1, 3_751_082, 3_565_449, 114_650, 0)],
            "control": {"colocated": {"host_link_bytes": probe_host_bytes, "origin_link_bytes": 120_000}},
        }

    s = summary(report(probe_host_bytes=320_000))
    assert s["all_agree"]
    assert s["control_bytes"] == {"colocated": {"host": 320_000, "origin": 120_000}}
    assert not summary(report(probe_host_bytes=50_000))["all_agree"]  # the probe bounds it: no blanket pass
    no_probe = report(0)
    del no_probe["control"]
    assert not summary(no_probe)["all_agree"]  # no direct rows to estimate from: nothing allowed


# -- with namespaces ---------------------------------------------------------------------------------
def test_links_shaped_and_counted_by_the_kernel():
    _need_netns()
    with NetCluster(hosts=2, host_mbit=300, origin_mbit=150) as net:
        names = set(list_namespaces())
        assert {*net.host_ns, net.origin_ns} <= names
        qd = subprocess.run(
            ["tc", "-n", net.origin_ns, "qdisc", "show", "dev", "eth0"], capture_output=True, text=True
        ).stdout
        assert "tbf" in qd and "150Mbit" in qd
        server = subprocess.Popen(
            [
                *net.exec_prefix(net.origin_ns),
                sys.executable,
                "-c",
                f"import socket\ns = socket.create_server(({net.origin_ip!r}, 9000))\nc, _ = s.accept()\nn = 0\n"
                "while (b := c.recv(1 << 16)):\n    n += len(b)\nprint(n)",
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        before = net.counters()
        sent = 2_000_000
        client = [
            *net.exec_prefix(net.host_ns[0]),
            sys.executable,
            "-c",
            "import socket, time\nfor _ in range(100):\n    try:\n"
            f"        c = socket.create_connection(({net.origin_ip!r}, 9000)); break\n"
            f"    except OSError: time.sleep(0.05)\nc.sendall(bytes({sent})); c.close()",
        ]
        subprocess.run(client, check=True, timeout=60)
        assert int(server.communicate(timeout=60)[0]) == sent
        d = kernel_delta(before, net.counters())
        assert sent <= d["links"]["origin"]["rx_bytes"] <= sent * 1.1  # payload + headers
        assert sent <= d["links"]["h0"]["tx_bytes"] <= sent * 1.1
        assert d["links"]["h1"]["rx_bytes"] < 10_000  # the bridge does not flood unicast
        assert d["host_link_bytes"] < 10_000
    assert not {*net.host_ns, net.origin_ns} & set(list_namespaces())


@pytest.mark.parametrize("fault", [RuntimeError, KeyboardInterrupt])
def test_everything_removed_on_error_and_ctrl_c(fault):
    _need_netns()
    with pytest.raises(fault):
        with NetCluster(hosts=1) as net:
            proc = _sleeper(net, net.host_ns[0])
            made = [*net.host_ns, net.origin_ns, net.switch_ns]
            time.sleep(0.2)
            raise fault("boom")
    proc.wait(timeout=10)  # ended by the tear-down, not by us
    assert proc.returncode == -signal.SIGTERM
    assert not set(made) & set(list_namespaces())


def test_stale_namespaces_of_a_killed_run_are_removed():
    _need_netns()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = f"{PREFIX}{dead.pid}-h0"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    try:
        inside = subprocess.Popen(["ip", "netns", "exec", stale, sys.executable, "-c", "import time; time.sleep(600)"])
        time.sleep(0.2)
        with NetCluster(hosts=1) as net:
            assert stale not in list_namespaces()
            assert net.host_ns[0] in list_namespaces()  # a live run's namespaces stay
        inside.wait(timeout=10)
        assert not _alive(inside.pid)
    finally:
        subprocess.run(["ip", "netns", "delete", stale], capture_output=True)


def test_cluster_counts_put_each_byte_on_the_link_it_crossed():
    from stoker_lab.bench.netcluster_driver import cluster_counts

    recs = [
        {
            "local_bytes": 10,
            "peer_bytes": 5,
            "origin_bytes": 7,
            "peer_origin_bytes": 3,
            "received_origin_bytes": 4,
            "received_peer_bytes": 8,
        },
        {
            "local_bytes": 1,
            "peer_bytes": 0,
            "origin_bytes": 0,
            "peer_origin_bytes": 0,
            "received_origin_bytes": 0,
            "received_peer_bytes": 0,
        },
    ]
    # rank 0 read 4 bytes from the origin itself and got 3 from a peer that fetched them; the
    # services fetched whole blocks: 100 bytes
    out = cluster_counts(recs, service_origin_bytes=100)
    assert [r["origin_bytes"] for r in out] == [4 + 100, 0]
    assert [r["peer_bytes"] for r in out] == [5 + 3, 0]
    assert sum(r["origin_bytes"] for r in out) == 104


def test_rows_check_exactly_once_over_the_job_ranks():
    from stoker_lab.bench.netcluster_driver import _row

    k = {"origin_link_bytes": 0, "host_link_bytes": 0}

    def recs(*plans):
        return [
            {"ids": p, "samples": len(p), "seconds": 1.0, "local_bytes": 0, "peer_bytes": 0, "origin_bytes": 0}
            for p in plans
        ]

    assert _row("direct", "job1", 0, recs([0, 2], [1, 3]), 4, k, 0)["exactly_once"]
    assert not _row("direct", "job1", 0, recs([0, 2], [2, 3]), 4, k, 0)["exactly_once"]  # 1 missing, 2 twice
    assert not _row("direct", "job1", 0, recs([0, 2], [1]), 4, k, 0)["exactly_once"]


def test_rows_keep_each_ranks_host_seconds_and_start():
    # what a model needs to take the measured placement and start-up skew
    from stoker_lab.bench.netcluster_driver import _row

    k = {"origin_link_bytes": 0, "host_link_bytes": 0}
    recs = [
        {
            "ids": [0],
            "samples": 1,
            "seconds": 2.0,
            "started_at": 100.25,
            "local_bytes": 0,
            "peer_bytes": 0,
            "origin_bytes": 0,
        },
        {
            "ids": [1],
            "samples": 1,
            "seconds": 1.5,
            "started_at": 100.0,
            "local_bytes": 0,
            "peer_bytes": 0,
            "origin_bytes": 0,
        },
    ]
    row = _row("random", "job1", 1, recs, 2, k, 0, rank_hosts=[2, 0])
    assert row["rank_hosts"] == [2, 0] and row["rank_seconds"] == [2.0, 1.5]
    assert row["rank_start_s"] == [0.25, 0.0] and row["seconds"] == 2.0
    assert "rank_hosts" not in _row("random", "job1", 1, recs, 2, k, 0)


# -- runs that look like training -----------------------------------------------------------------
@pytest.mark.parametrize(
    "argv,message",
    [
        (["--repeats", "0"], "repeats must be an integer >= 1, got 0"),
        (["--consumer-rate", "-1"], "consumer rate must be a number >= 0 samples/s per rank, got -1.0"),
        (["--consumer-rate", "nan"], "consumer rate must be a number >= 0"),
        (["--image-side", "600,400"], "image short side must be MIN,MAX pixels with 16 <= MIN <= MAX"),
        (["--image-side", "big"], "--image-side 'big': want MIN,MAX pixels, e.g. 400,600"),
    ],
)
def test_training_options_are_refused_in_one_line_before_anything_is_made(tmp_path, capsys, argv, message):
    from stoker.cli import main

    before = list_namespaces() if os.geteuid() == 0 else []
    rc = main(["bench", "cluster", "--netns", "--workdir", str(tmp_path / "w"), *argv])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and message in err, err
    assert not (tmp_path / "w").exists()
    if os.geteuid() == 0:
        assert list_namespaces() == before


def test_run_checks_the_training_options_first():
    from stoker_lab.bench.netcluster_bench import check_options, run

    check_options(3, 120.0, (400, 600))
    check_options(1, 0, None)
    with pytest.raises(ValueError, match="repeats"):
        run(repeats=0, faults=())
    with pytest.raises(ValueError, match="repeats"):
        check_options(True, 0, None)
    with pytest.raises(ValueError, match="short side"):
        check_options(1, 0, (400,))


def test_a_rank_reads_decodes_and_hands_each_sample_to_its_accelerator():
    import io

    from PIL import Image

    from stoker_lab.bench.netcluster_driver import Consumer, consume

    buf = io.BytesIO()
    Image.new("RGB", (64, 48), (200, 30, 30)).save(buf, format="JPEG")
    order = []

    def read(i: int) -> bytes:
        order.append(i)
        return buf.getvalue()

    t0 = time.perf_counter()
    got = consume(read, [3, 1, 2], True, 50.0, lambda i: f"k{i}")
    assert order == [3, 1, 2]
    assert got["consume_s"] >= 3 / 50.0 and time.perf_counter() - t0 >= 3 / 50.0
    assert got["decode_cpu_s"] > 0
    plain = consume(read, [0], False, 0.0, str)
    assert plain == {"decode_cpu_s": 0.0, "consume_s": 0.0}
    with pytest.raises(ValueError, match="consumer rate"):
        Consumer(-1.0)


def test_rows_keep_each_ranks_accelerator_and_decode_seconds():
    from stoker_lab.bench.netcluster_driver import _row

    k = {"origin_link_bytes": 0, "host_link_bytes": 0}
    recs = [
        {
            "ids": [i],
            "samples": 1,
            "seconds": 1.0,
            "local_bytes": 0,
            "peer_bytes": 0,
            "origin_bytes": 0,
            "consume_s": 0.5 + i,
            "decode_cpu_s": 0.01 * i,
        }
        for i in range(2)
    ]
    row = _row("direct", "job1", 0, recs, 2, k, 0)
    assert row["rank_consume_s"] == [0.5, 1.5] and row["rank_decode_cpu_s"] == [0.0, 0.01]


# -- faults ------------------------------------------------------------------------------------------
def test_fault_requests_kill_a_host_and_take_its_link_down_for_a_while(tmp_path):
    """The driver's fault requests, carried out by the process that owns the namespaces: ``kill``
    SIGKILLs every process of the host (the namespace stays), ``link_down`` takes the link down and
    brings it up after ``seconds``; an unknown action or the Ray head as victim is refused, named."""
    import threading

    from stoker_lab.bench.netcluster_faults import FaultHandler, request

    _need_netns()
    with NetCluster(hosts=2) as net:
        proc = _sleeper(net, net.host_ns[1])
        handler = FaultHandler(net, procs=None, request_dir=str(tmp_path / "req"))
        stop = threading.Event()

        def serve():
            while not stop.is_set():
                handler.poll()
                time.sleep(0.02)

        t = threading.Thread(target=serve, daemon=True)
        t.start()
        try:
            time.sleep(0.3)
            assert request(str(tmp_path / "req"), "kill", 1, timeout_s=30)["killed"] >= 1
            proc.wait(timeout=10)
            assert proc.returncode == -signal.SIGKILL
            assert net.host_ns[1] in list_namespaces()

            def state():
                out = subprocess.run(
                    ["ip", "-n", net.switch_ns, "-o", "link", "show", "h1"], capture_output=True, text=True
                ).stdout
                return "state UP" in out or ",UP" in out

            request(str(tmp_path / "req"), "link_down", 1, timeout_s=30, seconds=0.5)
            assert not state()
            deadline = time.monotonic() + 10
            while not state() and time.monotonic() < deadline:
                time.sleep(0.05)
            assert state()
            with pytest.raises(RuntimeError, match="not the Ray head"):
                request(str(tmp_path / "req"), "kill", 0, timeout_s=30)
            with pytest.raises(RuntimeError, match="unknown fault action 'melt'"):
                request(str(tmp_path / "req"), "melt", 1, timeout_s=30)
        finally:
            stop.set()
            t.join(5)
            handler.close()
    with pytest.raises(TimeoutError, match="'kill' on host 1: no answer in 0.2 s"):
        request(str(tmp_path / "req"), "kill", 1, timeout_s=0.2)


_RANK_HOST_DIES_DRIVER = """
import json, os, sys, time
from functools import partial

import ray

from stoker.cluster import ClusterOptions, run


def steps(ctx, out_dir):
    how = "finished"
    try:
        end = time.monotonic() + 120
        while time.monotonic() < end:
            with open(os.path.join(out_dir, f"steps{ctx.rank}"), "a") as f:
                f.write("step\\n")
            time.sleep(0.05)
    except BaseException as exc:
        how = type(exc).__name__
        raise
    finally:
        with open(os.path.join(out_dir, f"end{ctx.rank}"), "w") as f:
            f.write(how)


address, url, out_dir, result = sys.argv[1:5]
ray.init(address=address, logging_level="ERROR", log_to_driver=False)
out = {"error": None}
try:
    run(partial(steps, out_dir=out_dir), url, 2, {"CPU": 0.5},
        cluster=ClusterOptions(slots_per_node=1, job="host-dies"),
        cache_dir=os.path.join(out_dir, "cache"), cache_bytes=64 << 20, block_bytes=64 << 10)
except Exception as exc:
    out = {"error": type(exc).__name__, "notes": list(getattr(exc, "__notes__", []))}
out["raised_at"] = time.time()
with open(result, "w") as f:
    json.dump(out, f)
"""


def test_a_rank_whose_host_dies_ends_the_job_on_the_namespace_cluster(packed_local, tmp_path, monkeypatch):
    """Two hosts, one rank on each; every process of host 1 is SIGKILLed mid-job (its raylet, its
    cache service, its rank): ``stoker.cluster.run`` in the driver on host 0 raises promptly,
    naming that rank, and the rank on host 0 is cancelled (its steps stop). Namespaces removed."""
    from stoker_lab.bench.netcluster_ray import NetRay

    _need_netns()
    drv = tmp_path / "driver"
    drv.mkdir()
    (drv / "rank_host_dies.py").write_text(_RANK_HOST_DIES_DRIVER)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(drv), os.environ.get("PYTHONPATH")])))
    out = tmp_path / "out"
    out.mkdir()
    result = tmp_path / "result.json"
    work = tempfile.TemporaryDirectory(prefix="snc-", ignore_cleanup_errors=True)  # Ray's socket paths: short
    with work, NetCluster(hosts=2) as net:
        made = [*net.host_ns, net.origin_ns, net.switch_ns]
        procs = NetRay(net, work.name)
        procs.start_ray()
        killed: dict = {}

        def kill_host_1_once_both_run():
            if not killed and all((out / f"steps{r}").exists() for r in (0, 1)):
                killed["t"] = time.time()
                killed["n"] = net.kill_host(1)

        procs.driver(
            "rank_host_dies",
            procs.address,
            packed_local,
            str(out),
            str(result),
            timeout_s=300,
            poll=kill_host_1_once_both_run,
        )
    assert not set(made) & set(list_namespaces())
    got = json.loads(result.read_text())
    assert killed["n"] >= 1
    assert got["error"] in ("NodeDiedError", "WorkerCrashedError"), got
    assert got["raised_at"] - killed["t"] < 90  # prompt: not the ranks' 120 s
    ended = [r for r in (0, 1) if (out / f"end{r}").exists()]  # the killed rank wrote nothing more
    assert len(ended) == 1 and (out / f"end{ended[0]}").read_text() == "KeyboardInterrupt"
    victim = 1 - ended[0]
    assert any(f"rank {victim} on node" in n for n in got["notes"]), got
    size = (out / f"steps{ended[0]}").stat().st_size
    time.sleep(1.0)
    assert (out / f"steps{ended[0]}").stat().st_size == size  # cancelled: no step after run raised


# -- the Ray nodes of a namespace cluster (no namespaces needed) ---------------------------------------
class _FakeNet:
    hosts = 3
    host_ns = ["ns-h0", "ns-h1", "ns-h2"]
    host_ip = ["10.0.0.1", "10.0.0.2", "10.0.0.3"]

    def exec_prefix(self, ns):
        return ["ip", "netns", "exec", ns]


def test_ray_nodes_start_together_with_a_fast_health_check(tmp_path, monkeypatch):
    """The worker nodes' ``ray start`` run at the same time (all launched before any is waited
    for), every one with the health-check settings that find a killed host dead in seconds."""
    from stoker_lab.bench import netcluster_ray

    events = []

    class FakeProc:
        def __init__(self, cmd, env, **kw):
            self.host = cmd[cmd.index("exec") + 1]
            self.env, self.returncode = env, None
            events.append(("start", self.host, env))

        def wait(self, timeout=None):
            events.append(("wait", self.host, None))
            self.returncode = 0
            return 0

    monkeypatch.setattr(netcluster_ray.subprocess, "Popen", FakeProc)
    netcluster_ray.NetRay(_FakeNet(), str(tmp_path)).start_ray()
    assert [(e, h) for e, h, _ in events] == [
        ("start", "ns-h0"),
        ("wait", "ns-h0"),
        ("start", "ns-h1"),
        ("start", "ns-h2"),
        ("wait", "ns-h1"),
        ("wait", "ns-h2"),
    ]
    for _, _, env in (e for e in events if e[0] == "start"):
        assert {k: env[k] for k in netcluster_ray.HEALTH_CHECK_ENV} == netcluster_ray.HEALTH_CHECK_ENV
    period_ms = int(netcluster_ray.HEALTH_CHECK_ENV["RAY_health_check_period_ms"])
    timeout_ms = int(netcluster_ray.HEALTH_CHECK_ENV["RAY_health_check_timeout_ms"])
    failures = int(netcluster_ray.HEALTH_CHECK_ENV["RAY_health_check_failure_threshold"])
    assert period_ms * failures <= 5000  # a SIGKILLed host (checks refused at once): dead within 5 s
    assert (period_ms + timeout_ms) * failures > 2 * 5000  # a 5 s link-down (checks time out): alive


def test_namespace_ray_nodes_keep_their_namespace_addresses_under_the_tests_loopback_ray(tmp_path, monkeypatch):
    """The tests pin Ray to 127.0.0.1 (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, tests/conftest.py);
    the namespace cluster's ``ray start`` and driver run without that switch (it would stop a
    worker node's ``ray start`` and take 127.0.0.1 for the namespace's address), each node with
    its own namespace address."""
    from stoker_lab.bench import netcluster_ray

    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    started = []

    class FakeProc:
        def __init__(self, cmd, env, **kw):
            started.append((cmd, env))
            self.returncode = None

        def wait(self, timeout=None):
            self.returncode = 0
            return 0

    monkeypatch.setattr(netcluster_ray.subprocess, "Popen", FakeProc)
    netcluster_ray.NetRay(_FakeNet(), str(tmp_path)).start_ray()
    assert len(started) == 3
    for i, (cmd, env) in enumerate(started):
        assert "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER" not in env
        assert cmd[cmd.index("--node-ip-address") + 1] == _FakeNet.host_ip[i]
    assert "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER" not in netcluster_ray.node_env()


def test_a_ray_node_that_fails_to_start_is_named_with_its_log(tmp_path):
    """A ``ray start`` that exits non-zero or runs past its timeout names its namespace and why."""
    from stoker_lab.bench.netcluster_ray import NetRay

    procs = NetRay(_FakeNet(), str(tmp_path), start_timeout_s=0.5)
    (tmp_path / "ray-h2.log").write_text("raylet: cannot bind\n")
    with pytest.raises(RuntimeError, match=r"ns-h2 exited with code 3:\nraylet: cannot bind"):
        procs._wait_started({1: subprocess.Popen(["true"]), 2: subprocess.Popen(["sh", "-c", "exit 3"])})
    with pytest.raises(RuntimeError, match=r"ns-h1 not started in 0.5 s \(ray start timeout\)"):
        procs._wait_started({1: subprocess.Popen(["sleep", "30"])})


def test_machine_cpu_counts_busy_ticks_only(tmp_path):
    import os

    from stoker_lab.bench.netcluster import machine_cpu_s

    stat = tmp_path / "stat"
    # user nice system idle iowait irq softirq steal
    stat.write_text("cpu  100 20 30 5000 700 4 6 10 0 0\ncpu0 1 1 1 1 1 1 1 1 0 0\n")
    assert machine_cpu_s(str(stat)) == pytest.approx(170 / os.sysconf("SC_CLK_TCK"))
    stat.write_text("intr 1 2 3\n")
    with pytest.raises(RuntimeError, match="no cpu line"):
        machine_cpu_s(str(stat))
    assert machine_cpu_s() > 0  # the real file


def test_each_hosts_cpu_is_its_ranks_service_and_raylet_over_its_link_bytes():
    from stoker_lab.bench.netcluster_bench import host_cpu_table
    from stoker_lab.bench.netcluster_hostcpu import MIN_LINK_BYTES, host_rows, marks, placement_summary

    def rec(c0, c1):
        return {"cpu": [{"process_cpu_s": c0}, {"process_cpu_s": c1}]}

    links = {"h0": {"ns": "a"}, "h1": {"ns": "b"}, "origin": {"ns": "o"}}
    kernel = {
        "h0": {"rx_bytes": 1_500_000_000, "tx_bytes": 500_000_000},
        "h1": {"rx_bytes": 1000, "tx_bytes": 2000},  # control bytes only
        "origin": {"rx_bytes": 0, "tx_bytes": 0},
    }
    before = {"h0": {"raylet_s": 1.0, "service_s": 2.0}, "h1": {"raylet_s": 5.0, "service_s": 0.0}}
    after = {"h0": {"raylet_s": 1.1, "service_s": 2.3}, "h1": {"raylet_s": 5.2, "service_s": 0.0}}
    rows = host_rows(before, after, [rec(0.0, 0.4), rec(1.0, 1.2), rec(3.0, 3.5)], [0, 0, 1], kernel)
    h0, h1 = rows
    assert (h0["host"], h0["ranks"], h1["ranks"]) == ("h0", 2, 1)
    assert h0["ranks_s"] == pytest.approx(0.6) and h0["service_s"] == pytest.approx(0.3)
    assert h0["cpu_s"] == pytest.approx(0.6 + 0.3 + 0.1) and h0["link_bytes"] == 2_000_000_000
    assert h0["cpu_s_per_GB"] == pytest.approx(1.0 / 2.0)
    assert h1["link_bytes"] < MIN_LINK_BYTES and h1["cpu_s_per_GB"] is None  # CPU on no link bytes: no figure
    runs = [
        {"placement": "random", "epoch": 0, "host_cpu": rows},  # the cold epoch: left out
        {"placement": "random", "epoch": 1, "host_cpu": rows},
        {"placement": "random", "epoch": 2, "host_cpu": rows},
        {"placement": "direct", "epoch": 1},  # a report without host_cpu rows
    ]
    per = placement_summary(runs)
    assert set(per) == {"random"}
    assert per["random"]["h0"]["cpu_s"] == pytest.approx(2.0) and per["random"]["h0"]["link_bytes"] == 4_000_000_000
    assert per["random"]["h0"]["cpu_s_per_GB"] == pytest.approx(0.5) and per["random"]["h1"]["cpu_s_per_GB"] is None
    text = host_cpu_table({"runs": runs})
    assert "| random | 0.50 (2.00 s / 4000 MB) | - (0.0 MB) |" in text
    assert host_cpu_table({"runs": []}) == ""
    # the marks: each service by its node's host, raylets by name in each host's namespace (none here)
    import stoker_lab.bench.netcluster_hostcpu as hostcpu

    got = {}
    real = hostcpu.pids_named
    hostcpu.pids_named = lambda ns, comm: got.setdefault(ns, comm) and []
    try:
        m = marks(links, {"n1": 7.5, "n9": 1.0}, {"n0": 0, "n1": 1})
    finally:
        hostcpu.pids_named = real
    assert m == {"h0": {"raylet_s": 0.0, "service_s": 0.0}, "h1": {"raylet_s": 0.0, "service_s": 7.5}}
    assert got == {"a": "raylet", "b": "raylet"}
