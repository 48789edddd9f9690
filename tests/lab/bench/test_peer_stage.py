"""The peer stage of ``stoker bench io``: a cache service on one Ray node serving a rank on another,
beside a bare TCP transfer of the same bytes. The report's shape and the bytes moved are checked,
never the speed."""

import math
import os

import pytest
import xxhash

from stoker_lab.bench import netcluster
from stoker_lab.bench.io_bench import IoConfig, peer_links, peer_stages
from stoker_lab.bench.peer_floor import transfer
from stoker_lab.bench.peer_stage import loopback_process

ROW_KEYS = {"stage", "bytes", "cpu_s_per_GB", "GBps", "floor", "ratio", "exception"}


def _finite_positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def _blocks(url: str, block_bytes: int) -> tuple[int, str, int]:
    """(bytes, xxh3-64 of every block in order, blocks) read straight from the packed shards."""
    from stoker.store.dataset import open_dataset

    ds = open_dataset(url, cache=False, block_bytes=block_bytes)
    h, n = xxhash.xxh3_64(), 0
    for b in range(len(ds.blocks)):
        data = ds.origin.read_range(
            ds.index.shard_name(ds.blocks.shard[b]), int(ds.blocks.start[b]), int(ds.blocks.end[b])
        )
        h.update(data)
        n += len(data)
    return n, h.hexdigest(), len(ds.blocks)


def test_loopback_peer_stage_moves_every_block_through_the_service(packed_local, tmp_path):
    pytest.importorskip("ray")
    block_bytes = 256 << 10
    nbytes, digest, blocks = _blocks(packed_local, block_bytes)
    workdir = tmp_path / "w"
    # in a process of its own (as stoker bench io runs it): it starts and stops a 2-node Ray cluster;
    # passes of at least 2.5 times the dataset: every block read 3 times a pass
    rows = loopback_process(
        packed_local,
        {},
        block_bytes,
        str(workdir),
        concurrency=4,
        reps=1,
        profile_s=0,
        timeout_s=240,
        pass_bytes=int(2.5 * nbytes),
    )
    assert os.listdir(workdir) == []  # the node cache and the run's files are removed
    assert [(r["stage"], r["via"]) for r in rows] == [
        ("peer cache service->rank (loopback)", "direct"),
        ("peer cache service->rank (loopback, a worker process)", "worker"),
    ]
    for r in rows:
        assert set(r) >= ROW_KEYS
        # the bytes moved are the blocks' bytes, all served from the peer's cache, none from the origin
        assert r["rounds"] == 3 and r["bytes"] == 3 * nbytes and r["peer_bytes"] == 3 * nbytes
        assert r["fallbacks"] == 0
        assert r["digest"] == digest and r["digest_matches_floor"]
        assert r["fill"]["filled"] + r["fill"]["cached"] == blocks
        # each end apart, and their sum; a raylet counts by its increment over its rest
        sender, receiver = r["sender"], r["receiver"]
        assert set(sender["by_process"]) == {"service", "raylet A (increment)"}
        readers = {"rank"} | ({"worker"} if r["via"] == "worker" else set())
        assert set(receiver["by_process"]) == readers | {"raylet B (increment)"}
        for side in (sender, receiver):
            assert side["cpu_s"] == pytest.approx(sum(side["by_process"].values()))
            assert side["cpu_s_per_GB"] == pytest.approx(side["cpu_s"] / (r["bytes"] / 1e9))
            assert side["raylet"]["increment_cpu_s"] == max(0.0, side["raylet"]["cpu_s"] - side["raylet"]["rest_cpu_s"])
        assert r["cpu_s_per_GB"] == pytest.approx(sender["cpu_s_per_GB"] + receiver["cpu_s_per_GB"])
        assert _finite_positive(r["cpu_s_per_GB"]) and _finite_positive(r["GBps"])
        assert _finite_positive(receiver["cpu_s_per_GB"]) and _finite_positive(sender["cpu_s_per_GB"])
        # the floor: the same blocks as many times over, each end apart
        floor = r["floor"]
        assert floor["bytes"] == r["bytes"] and "bare TCP" in floor["what"] and "sendfile" in floor["what"]
        assert _finite_positive(floor["cpu_s_per_GB"]) and _finite_positive(floor["GBps"])
        assert floor["cpu_s_per_GB"] == pytest.approx(
            floor["sender"]["cpu_s_per_GB"] + floor["receiver"]["cpu_s_per_GB"]
        )
        assert math.isclose(r["ratio"], r["cpu_s_per_GB"] / floor["cpu_s_per_GB"])
        assert math.isclose(r["ratio_receiver"], receiver["cpu_s_per_GB"] / floor["receiver"]["cpu_s_per_GB"])
        if r["ratio"] > 2:  # over 2x: the exception says why, with the profile (or why there is none)
            assert r["exception"].startswith(f"{r['ratio']:.1f}x its floor") and "by process" in r["exception"]
            assert r["profile"] is not None
        else:
            assert r["exception"] is None
    assert "worker" in rows[1]["cpu_s_by_process"] and "worker" not in rows[0]["cpu_s_by_process"]
    assert rows[0]["network"]["kind"] == "loopback"
    assert rows[0]["network"]["floor_host"] == rows[0]["network"]["ray_node_ip"]
    assert rows[0]["calls"]["head_bytes"] == 1024 and _finite_positive(rows[0]["calls"]["cpu_s_per_call"])
    assert _finite_positive(rows[0]["verify_cpu_s_per_GB"])


def test_loopback_peer_stage_names_a_missing_dataset(tmp_path):
    pytest.importorskip("ray")
    with pytest.raises(RuntimeError, match="exited with code 1") as err:
        loopback_process(str(tmp_path / "no-such-dataset"), {}, 1 << 20, str(tmp_path / "w"), timeout_s=120)
    assert "no-such-dataset" in str(err.value)


def test_floor_sends_the_same_bytes(tmp_path):
    files = []
    for i, size in enumerate((1, 70_000, 1 << 20, 0, 333)):
        p = tmp_path / f"b{i}"
        p.write_bytes(os.urandom(size))
        files.append(str(p))
    want = xxhash.xxh3_64()
    for f in files:
        want.update(open(f, "rb").read())
    total = sum(os.path.getsize(f) for f in files)
    for rounds, inflight in ((1, 1), (3, 2), (2, 8)):
        r = transfer(files, "127.0.0.1", reps=2, rounds=rounds, inflight=inflight, timeout_s=60)
        assert r["bytes"] == rounds * total and r["digest"] == want.hexdigest()
        assert len(r["rounds"]) == 2 and r["cpu_s"] == r["server_cpu_s"] + r["client_cpu_s"] > 0


def test_floor_reports_a_missing_block_file(tmp_path):
    with pytest.raises((RuntimeError, FileNotFoundError), match="missing"):
        transfer([str(tmp_path / "missing")], "127.0.0.1", reps=1, timeout_s=30)


def test_peer_links():
    assert peer_links("off") == ()
    assert peer_links("loopback") == ("loopback",)
    assert peer_links("netns, loopback,netns") == ("netns", "loopback")
    for bad in ("", "bogus", "off,loopback", "loopback,wan"):
        with pytest.raises(ValueError, match="peer must be"):
            peer_links(bad)


def test_peer_stage_off_and_without_namespaces_say_why(tmp_path, monkeypatch):
    (row,) = peer_stages((), "unused", {}, str(tmp_path), IoConfig())
    assert row["stage"] == "peer cache service->rank" and row["exception"].startswith("not measured (--peer off")
    status = tmp_path / "status"
    status.write_text("Name:\tpython\nCapEff:\t0000000000000000\n")
    monkeypatch.setattr(netcluster, "_STATUS_PATH", str(status))
    (row,) = peer_stages(("netns",), "unused", {}, str(tmp_path), IoConfig())
    assert row["stage"] == "peer cache service->rank (netns)" and set(row) >= ROW_KEYS
    assert row["exception"].startswith("not measured: network namespaces") and "CAP_NET_ADMIN" in row["exception"]
    assert row["cpu_s_per_GB"] is None and row["ratio"] is None


def test_profile_top_frames_from_py_spy_raw_output(tmp_path):
    from stoker_lab.bench.peer_profile import _pyspy_top

    raw = tmp_path / "p.txt"
    raw.write_text(
        "main (a.py:1);get (w.py:9) 6\nmain (a.py:1);dump (c.py:3) 3\nmain (a.py:1);get (w.py:9) 1\nbad line\n"
    )
    assert _pyspy_top(str(raw), 2) == [[70.0, "get (w.py:9)"], [30.0, "dump (c.py:3)"]]


def test_a_peer_row_prints_each_end_beside_the_floor():
    from stoker_lab.bench.io_bench import _ends_line

    row = {
        "sender": {"cpu_s_per_GB": 0.1},
        "receiver": {"cpu_s_per_GB": 0.45},
        "floor": {"sender": {"cpu_s_per_GB": 0.05}, "receiver": {"cpu_s_per_GB": 0.3}, "link_fraction": 0.96},
        "link_fraction": 0.955,
    }
    (line,) = _ends_line(row)
    assert "sender 0.100 (floor 0.050), receiver 0.450 (floor 0.300) CPU-s/GB" in line
    assert "95.5% of the link (floor 96.0%)" in line
    assert _ends_line({"sender": {"cpu_s_per_GB": None}, "receiver": {"cpu_s_per_GB": None}}) == []
    assert _ends_line({"stage": "cache (disk tier)->worker"}) == []
