"""A node's cache identity (stoker.cluster.identity): one directory per host slot, the same one
after a restart, never shared by two live services. No Ray."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from stoker.cluster.identity import claim_cache_dir, host_name


def test_a_restarted_ray_gets_the_same_directory_on_the_same_host(tmp_path):
    first = claim_cache_dir(str(tmp_path), owner="ray-node-aaaa", host="h1")
    (tmp_path / first.key / "block").write_bytes(b"x")
    first.release()  # Ray stops; the next Ray start names the node anew
    again = claim_cache_dir(str(tmp_path), owner="ray-node-bbbb", host="h1")
    assert again.path == first.path and again.key == "node-h1-0"
    assert (tmp_path / again.key / "block").read_bytes() == b"x"
    again.release()


def test_live_services_never_share_a_slot_and_a_restarted_one_gets_its_own_back(tmp_path):
    claims = [claim_cache_dir(str(tmp_path), owner=f"id{k}", host="h1") for k in range(3)]
    assert [c.key for c in claims] == ["node-h1-0", "node-h1-1", "node-h1-2"]
    claims[1].release()  # id1's service dies; Ray restarts it with the same node id
    back = claim_cache_dir(str(tmp_path), owner="id1", host="h1")
    assert back.key == "node-h1-1"
    # a slot still held by a process that has not ended: wait, then take another
    other = claim_cache_dir(str(tmp_path), owner="id0", host="h1", wait_s=0.2)
    assert other.key == "node-h1-3"
    other_host = claim_cache_dir(str(tmp_path), owner="id9", host="h2")
    assert other_host.key == "node-h2-0"
    for c in (*claims, back, other, other_host):
        c.release()


def test_a_killed_holder_frees_its_slot(tmp_path):
    code = (
        "import sys, time; from stoker.cluster.identity import claim_cache_dir; "
        f"c = claim_cache_dir({str(tmp_path)!r}, owner='old', host='h1'); print(c.key, flush=True); time.sleep(60)"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert p.stdout.readline().strip() == "node-h1-0"
        held = claim_cache_dir(str(tmp_path), owner="new", host="h1", wait_s=0)
        assert held.key == "node-h1-1"
        held.release()
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait(10)
    after = claim_cache_dir(str(tmp_path), owner="newer", host="h1", wait_s=0)
    assert after.key == "node-h1-0"
    after.release()


def test_host_name_comes_from_node_name_and_is_safe_in_a_path(monkeypatch):
    monkeypatch.setenv("NODE_NAME", "gpu-node/7 a")
    assert host_name() == "gpu-node_7_a"
    monkeypatch.delenv("NODE_NAME")
    assert host_name() and "/" not in host_name()


def test_blocks_are_placed_by_the_stable_cache_keys():
    import pytest

    pytest.importorskip("ray")
    from stoker.cluster.service.cache_service import placement_keys

    services = {"ray-a": {"cache_key": "node-h1-0"}, "ray-b": {"cache_key": "node-h2-0"}, "ray-c": {}}
    assert placement_keys(services, ["ray-b", "ray-a", "ray-c"]) == ["node-h2-0", "node-h1-0", "ray-c"]
    twins = {"ray-a": {"cache_key": "node-localhost-0"}, "ray-b": {"cache_key": "node-localhost-0"}}
    assert placement_keys(twins, ["ray-a", "ray-b"]) == ["node-localhost-0@ray-a", "node-localhost-0@ray-b"]


def test_a_node_is_named_by_its_cache_directory_and_else_by_its_ray_id():
    from stoker.cluster.identity import node_label, node_labels

    services = {"5f3a9c": {"cache_key": "node-h1-0"}, "77b0e1": {"cache_key": "node-h1-1"}}
    assert node_label("5f3a9c", services) == "node-h1-0"  # the directory `stoker cache status` lists
    assert node_labels(["77b0e1", "5f3a9c"], services) == ["node-h1-1", "node-h1-0"]
    assert node_label("9d9d9d", services) == "Ray node 9d9d9d"  # its service never answered
    assert node_label("9d9d9d", host="gpu-7") == "Ray node 9d9d9d on host gpu-7"
