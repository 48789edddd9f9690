"""The live extender (``--dataset``) never joins Ray itself: each refresh is a child process with a
time limit, so a Ray cluster that is gone, hangs or never existed only ages the state; requests
are answered at once and the server stays up (the children are stand-ins, except in the last
test, which starts a real one-node Ray cluster of its own and shuts it down)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request

import pytest

from stoker.cluster.extender import scoring as extender
from stoker.cluster.extender.live_state import cluster_state_command, live_state, run_state_command

DS = "s3://b/ds"
ARGS = {
    "Pod": {
        "metadata": {"name": "p", "annotations": {extender.DATASET_ANNOTATION: DS, extender.REQUIRE_ANNOTATION: "true"}}
    },
    "Nodes": None,
    "NodeNames": ["n1", "n2"],
}


def _post(port, verb):
    req = urllib.request.Request(f"http://127.0.0.1:{port}/stoker/{verb}", data=json.dumps(ARGS).encode())
    t0 = time.monotonic()
    with urllib.request.urlopen(req, timeout=10) as resp:
        return resp.status, json.loads(resp.read()), resp.headers.get("X-Stoker-State-Age"), time.monotonic() - t0


def _py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_a_refresh_that_hangs_is_ended_at_its_limit_and_requests_do_not_wait():
    state = live_state([DS], command=_py("import time; time.sleep(600)"), every_s=0.2, timeout_s=1.0)
    srv = extender.serve(state, port=0)
    port = srv.server_address[1]
    try:
        for _ in range(3):
            code, got, age, took_s = _post(port, "prioritize")
            assert code == 200 and {h["Score"] for h in got} == {0} and took_s < 5
            code, got, _, _ = _post(port, "filter")
            assert code == 200 and got["NodeNames"] == [] and "old" in got["Error"]
    finally:
        state.stop()
        srv.shutdown()


def test_run_state_command_limits_and_names_failures():
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="no answer within 1 s"):
        run_state_command(_py("import time; time.sleep(600)"), timeout_s=1.0)
    assert time.monotonic() - t0 < 30
    with pytest.raises(RuntimeError, match="exited with 3: no Ray cluster at 10.0.0.1"):
        run_state_command(_py("import sys; sys.stderr.write('no Ray cluster at 10.0.0.1\\n'); sys.exit(3)"))
    with pytest.raises(ValueError, match="printed no JSON"):
        run_state_command(_py("print('hello')"))
    with pytest.raises(ValueError, match="nodes"):
        run_state_command(_py("print('[1, 2]')"))


def test_live_state_serves_what_the_child_printed_then_ages_when_it_fails(tmp_path):
    flag = tmp_path / "up"
    flag.write_text("1")
    now = time.time()
    good = {
        "time": now,
        "nodes": {"n1": {"cache_bytes": 100, "datasets": {DS: 80}}, "n2": {"cache_bytes": 100, "datasets": {DS: 10}}},
    }
    code = (
        f"import json, os, sys\nif not os.path.exists({str(flag)!r}): sys.exit('Ray cluster gone')\n"
        f"print(json.dumps({good!r}))"
    )
    state = live_state([DS], command=_py(code), every_s=0.1, timeout_s=20)
    srv = extender.serve(state, port=0, max_age_s=3600)
    port = srv.server_address[1]
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and state().get("time") != now:
            time.sleep(0.1)
        assert _post(port, "prioritize")[1] == [{"Host": "n1", "Score": 10}, {"Host": "n2", "Score": 1}]
        flag.unlink()  # the cluster is gone: refreshes fail, the last state is kept with its age
        time.sleep(1.0)
        code_, got, age, _ = _post(port, "prioritize")
        assert code_ == 200 and got[0] == {"Host": "n1", "Score": 10} and float(age) >= 1.0
    finally:
        state.stop()
        srv.shutdown()


def test_the_command_is_stoker_cluster_state_with_its_options():
    cmd = cluster_state_command([DS], "10.0.0.1:6379", {"anon": True}, 1 << 20, python="py")
    assert cmd == [
        "py",
        "-m",
        "stoker.cli",
        "cluster-state",
        DS,
        "--timeout",
        "65",
        "--ray-address",
        "10.0.0.1:6379",
        "--storage-options",
        '{"anon": true}',
        "--block-size",
        str(1 << 20),
    ]


def test_a_cluster_state_child_gives_up_by_itself_when_no_cluster_answers():
    """The refresh's child ends itself (exit 124, as coreutils timeout) even when no parent is
    left to stop it: an extender that was killed must not leave children waiting on Ray."""
    out = subprocess.run(
        [sys.executable, "-m", "stoker.cli", "cluster-state", DS, "--ray-address", "127.0.0.1:9", "--timeout", "3"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 124 and "no answer within 3 s" in out.stderr, out.stderr[-2000:]
    # and with its parent gone: the pipes it writes to are closed (its message cannot be written)
    proc = subprocess.Popen(
        [sys.executable, "-m", "stoker.cli", "cluster-state", DS, "--ray-address", "127.0.0.1:9", "--timeout", "3"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    proc.stdout.close()
    proc.stderr.close()
    assert proc.wait(timeout=120) == 124


def test_stoker_extender_with_a_ray_address_that_never_existed_stays_up_and_answers(tmp_path):
    """The CLI itself: no Ray at the address; the server starts, answers at once and keeps running."""
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "stoker.cli",
            "extender",
            "--dataset",
            DS,
            "--ray-address",
            "127.0.0.1:9",
            "--port",
            str(port),
            "--refresh-timeout",
            "5",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                code, got, _, took_s = _post(port, "prioritize")
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline
                time.sleep(0.2)
        assert code == 200 and {h["Score"] for h in got} == {0}
        assert _post(port, "filter")[1]["Error"]
        time.sleep(2)
        assert proc.poll() is None and _post(port, "prioritize")[0] == 200
    finally:
        proc.terminate()
        proc.communicate(timeout=30)


_RAY_HEAD = """
import json, sys, ray
from ray.cluster_utils import Cluster
from stoker.cluster.service.cache_service import start_services
c = Cluster(
    initialize_head=True,
    head_node_args={"num_cpus": 1, "object_store_memory": 80 << 20, "node_ip_address": "127.0.0.1"},
)
ray.init(address=c.address, logging_level="ERROR", log_to_driver=False)
start_services(sys.argv[1], 64 << 20)
print(json.dumps({"address": c.address, "node": ray.get_runtime_context().get_node_id()}), flush=True)
sys.stdin.readline()  # until told: then Ray goes away, GCS included
ray.shutdown()
c.shutdown()
"""


def _free_port() -> int:
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def test_stoker_extender_outlives_the_ray_cluster_it_asks(packed_local, tmp_path):
    """A real Ray cluster (its own, one node, with a cache service) feeds ``stoker extender``; then
    Ray shuts down. Ray ends a driver whose GCS stays unreachable for
    ``gcs_rpc_server_reconnect_timeout_s`` (60 s; 5 s here, for the extender and its refresh
    children alike): an extender that had joined Ray would die then. This one keeps answering
    every request within a second or two, past that point, and its state goes stale."""
    pytest.importorskip("ray")
    head = subprocess.Popen(
        [sys.executable, "-c", _RAY_HEAD, str(tmp_path / "cache")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    proc = None
    try:
        info = json.loads(head.stdout.readline())
        port = _free_port()
        env = dict(os.environ, RAY_gcs_rpc_server_reconnect_timeout_s="5")
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "stoker.cli",
                "extender",
                "--dataset",
                packed_local,
                "--ray-address",
                info["address"],
                "--port",
                str(port),
                "--refresh-every",
                "0.5",
                "--refresh-timeout",
                "15",
                "--max-age",
                "3",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=env,
        )
        args = {
            "Pod": {
                "metadata": {
                    "name": "p",
                    "annotations": {extender.DATASET_ANNOTATION: packed_local, extender.REQUIRE_ANNOTATION: "true"},
                }
            },
            "Nodes": None,
            "NodeNames": [info["node"], "elsewhere"],
        }

        def post(verb):
            req = urllib.request.Request(f"http://127.0.0.1:{port}/stoker/{verb}", data=json.dumps(args).encode())
            t0 = time.monotonic()
            with urllib.request.urlopen(req, timeout=30) as resp:
                return resp.status, json.loads(resp.read()), time.monotonic() - t0

        deadline = time.monotonic() + 120
        while True:  # the first refresh that reached Ray: the node with the cache service scores 10
            try:
                if post("prioritize")[1][0] == {"Host": info["node"], "Score": 10}:
                    break
            except OSError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        assert post("filter")[1]["NodeNames"] == [info["node"]]
        head.stdin.close()
        assert head.wait(timeout=60) == 0
        gone = time.monotonic()
        while time.monotonic() - gone < 12:  # past Ray's reconnect timeout (5 s), with room
            code, got, took_s = post("prioritize")
            assert code == 200 and took_s < 3, (code, got, took_s)
            assert proc.poll() is None
            time.sleep(0.5)
        code, got, took_s = post("filter")
        assert code == 200 and took_s < 3 and got["NodeNames"] == [] and "old" in got["Error"]  # stale, said so
        assert proc.poll() is None
    finally:
        if head.poll() is None:
            head.stdin.close()
            head.wait(timeout=60)
        if proc is not None:
            proc.terminate()
            proc.communicate(timeout=30)
