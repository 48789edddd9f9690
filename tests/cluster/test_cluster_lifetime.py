"""Cluster mode under real use: services that outlive a driver, a node that dies, a warm-up that
meets a restarting service (on the session's 3-node ray.cluster_utils.Cluster)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from functools import partial

import pytest

ray = pytest.importorskip("ray")

BLOCK = 64 << 10  # small cache blocks: the 120-photo test set gives ~100 blocks to place


def _read_two_epochs(ctx, flag: str):
    """Epoch 0, then wait (at most 120 s) for ``flag`` to exist, then epoch 1."""
    from stoker.cluster import read_epochs
    read_epochs(ctx, 1)
    deadline = time.monotonic() + 120
    while not os.path.exists(flag) and time.monotonic() < deadline:
        time.sleep(0.05)
    return read_epochs(ctx, 1, first_epoch=1)


_DRIVER_A = textwrap.dedent("""
    import sys, ray
    from stoker.cluster.service import start_services
    ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
    start_services(sys.argv[2], 64 << 20)
    print("ready", flush=True)
    sys.stdin.readline()   # exits when told
""")


def test_cache_services_outlive_the_driver_that_started_them(cluster, s3_dataset, tmp_path):
    """Driver A (a subprocess) starts the services and exits while driver B's job reads from
    peers: B's next epoch still reads its peers, no fallback, and every service still answers."""
    from stoker.cluster import run
    from stoker.cluster.service import find_services, stop_services
    url, opts = s3_dataset
    stop_services()
    cache_root = str(tmp_path / "cache")
    a = subprocess.Popen([sys.executable, "-c", _DRIVER_A, cluster.address, cache_root],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert a.stdout.readline().strip() == "ready"
        pids = {k: v["pid"] for k, v in find_services().items()}
        assert len(pids) == 3
        flag = str(tmp_path / "go")
        refs = run(partial(_read_two_epochs, flag=flag), url, 3, {"CPU": 0.5}, storage_options=opts, cache_root=cache_root,
                   cache_bytes=64 << 20, block_bytes=BLOCK, placement="random", seed=5, job="B", wait=False)
        a.stdin.close()
        assert a.wait(timeout=60) == 0
        time.sleep(1)
        open(flag, "w").close()
        res = ray.get(refs, timeout=180)
    finally:
        if a.poll() is None:
            a.kill()
    e1 = [r["result"][1] for r in res]
    assert sum(rec["fallbacks"] for rec in e1) == 0
    assert sum(rec["peer_bytes"] for rec in e1) > 0
    assert {k: v["pid"] for k, v in find_services().items()} == pids  # the same services, never restarted

