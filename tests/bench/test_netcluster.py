"""The namespace cluster of ``stoker bench cluster --netns``: namespaces, shaped links, kernel
byte counters, tear-down (on exit, error, Ctrl-C, and of stale namespaces from a killed run).

Tests that make namespaces need CAP_NET_ADMIN and skip without it, with the reason; under
``$CI`` a machine that has the capability but cannot run them fails instead of skipping.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from stoker.bench import netcluster
from stoker.bench.netcluster import (
    PREFIX,
    NetCluster,
    NetnsUnavailable,
    check_capability,
    has_cap_net_admin,
    kernel_delta,
    list_namespaces,
)
from stoker.bench.netcluster_bench import summary


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
    _fake_status(tmp_path, monkeypatch, 0x1fffeffefff)  # every capability but bit 12
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
    after = {"origin": {"rx_bytes": 100, "tx_bytes": 1100}, "h0": {"rx_bytes": 1100, "tx_bytes": 400},
             "h1": {"rx_bytes": 400, "tx_bytes": 100}}
    d = kernel_delta(before, after)
    assert d["origin_link_bytes"] == 1000
    assert d["host_link_bytes"] == 300
    assert d["links"]["h0"] == {"rx_bytes": 1000, "tx_bytes": 300}


def test_summary_reports_agreement_and_placement_ratios():
    def row(p, e, korigin, khost, sorigin, speer):
        return {"placement": p, "job": "job1", "epoch": e, "samples_per_s": 10.0, "exactly_once": True,
                "kernel": {"origin_link_bytes": korigin, "host_link_bytes": khost},
                "stoker": {"local_bytes": 0, "peer_bytes": speer, "origin_bytes": sorigin}}
    mb = 1 << 20
    report = {"dataset": {"bytes": 100 * mb}, "runs": [
        row("random", 0, 105 * mb, 50 * mb, 100 * mb, 48 * mb), row("random", 1, 0, 40 * mb, 0, 38 * mb),
        row("colocated", 0, 104 * mb, 5 * mb, 100 * mb, 4 * mb), row("colocated", 1, mb // 2, 2 * mb, 0, 0)]}
    s = summary(report)
    assert report["runs"][0]["agreement"]["origin_excess_pct"] == pytest.approx(5.0)
    assert report["runs"][3]["agreement"]["origin_excess_pct"] is None  # stoker counted under 1 MiB
    assert s["placements"]["colocated"]["warm_origin_link_fraction"] == pytest.approx(0.005)
    assert s["colocated_vs_random_host"] == pytest.approx(2 / 40)
    assert s["all_exactly_once"]


# -- with namespaces ---------------------------------------------------------------------------------
def test_links_shaped_and_counted_by_the_kernel():
    _need_netns()
    with NetCluster(hosts=2, host_mbit=300, origin_mbit=150) as net:
        names = set(list_namespaces())
        assert {*net.host_ns, net.origin_ns} <= names
        qd = subprocess.run(["tc", "-n", net.origin_ns, "qdisc", "show", "dev", "eth0"], capture_output=True,
                            text=True).stdout
        assert "tbf" in qd and "150Mbit" in qd
        server = subprocess.Popen(
            [*net.exec_prefix(net.origin_ns), sys.executable, "-c",
             f"import socket\ns = socket.create_server(({net.origin_ip!r}, 9000))\nc, _ = s.accept()\nn = 0\n"
             "while (b := c.recv(1 << 16)):\n    n += len(b)\nprint(n)"],
            stdout=subprocess.PIPE, text=True)
        before = net.counters()
        sent = 2_000_000
        client = [*net.exec_prefix(net.host_ns[0]), sys.executable, "-c",
                  "import socket, time\nfor _ in range(100):\n    try:\n"
                  f"        c = socket.create_connection(({net.origin_ip!r}, 9000)); break\n"
                  f"    except OSError: time.sleep(0.05)\nc.sendall(bytes({sent})); c.close()"]
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
    from stoker.bench.netcluster_driver import cluster_counts
    recs = [{"local_bytes": 10, "peer_bytes": 5, "origin_bytes": 7, "peer_origin_bytes": 3},
            {"local_bytes": 1, "peer_bytes": 0, "origin_bytes": 0, "peer_origin_bytes": 0}]
    # rank 0 read 4 bytes from the origin itself and got 3 from a peer that fetched them; the
    # services fetched whole blocks: 100 bytes
    out = cluster_counts(recs, service_origin_bytes=100)
    assert [r["origin_bytes"] for r in out] == [4 + 100, 0]
    assert [r["peer_bytes"] for r in out] == [5 + 3, 0]
    assert sum(r["origin_bytes"] for r in out) == 104


def test_rows_check_exactly_once_over_the_job_ranks():
    from stoker.bench.netcluster_driver import _row
    k = {"origin_link_bytes": 0, "host_link_bytes": 0}

    def recs(*plans):
        return [{"ids": p, "samples": len(p), "seconds": 1.0, "local_bytes": 0, "peer_bytes": 0, "origin_bytes": 0}
                for p in plans]
    assert _row("direct", "job1", 0, recs([0, 2], [1, 3]), 4, k, 0)["exactly_once"]
    assert not _row("direct", "job1", 0, recs([0, 2], [2, 3]), 4, k, 0)["exactly_once"]  # 1 missing, 2 twice
    assert not _row("direct", "job1", 0, recs([0, 2], [1]), 4, k, 0)["exactly_once"]
