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

from stoker.cluster import ClusterOptions

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
    from stoker.cluster.service.cache_service import start_services
    ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
    start_services(sys.argv[2], 64 << 20)
    print("ready", flush=True)
    sys.stdin.readline()   # exits when told
""")


def test_cache_services_outlive_the_driver_that_started_them(cluster, s3_dataset, tmp_path):
    """Driver A (a subprocess) starts the services and exits while driver B's job reads from
    peers: B's next epoch still reads its peers, no fallback, and every service still answers."""
    from stoker.cluster import run
    from stoker.cluster.service.cache_service import find_services, stop_services

    url, opts = s3_dataset
    stop_services()
    cache_root = str(tmp_path / "cache")
    a = subprocess.Popen(
        [sys.executable, "-c", _DRIVER_A, cluster.address, cache_root],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert a.stdout.readline().strip() == "ready"
        pids = {k: v["pid"] for k, v in find_services().items()}
        assert len(pids) == 3
        flag = str(tmp_path / "go")
        refs = run(
            partial(_read_two_epochs, flag=flag),
            url,
            3,
            {"CPU": 0.5},
            storage_options=opts,
            cache_dir=cache_root,
            cache_bytes=64 << 20,
            block_bytes=BLOCK,
            cluster=ClusterOptions(placement="random", seed=5, job="B", wait=False),
        )
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


def _one_rank_fails(ctx, out_dir: str):
    """Rank 0 fails once the others are in their loop (60 s long); each survivor writes how it ended."""
    if ctx.rank == 0:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not all(
            os.path.exists(os.path.join(out_dir, f"started{r}")) for r in range(1, ctx.world_size)
        ):
            time.sleep(0.05)
        raise RuntimeError("rank 0 broke")
    how = "finished"
    try:
        open(os.path.join(out_dir, f"started{ctx.rank}"), "w").close()
        end = time.monotonic() + 60
        while time.monotonic() < end:
            time.sleep(0.05)
    except BaseException as exc:  # noqa: BLE001 - the cancellation, recorded
        how = type(exc).__name__
        raise
    finally:
        with open(os.path.join(out_dir, f"rank{ctx.rank}"), "w") as f:
            f.write(how)


def test_a_failed_rank_cancels_the_other_ranks(cluster, s3_dataset, tmp_path):
    """The first failure ends the job: run raises it (naming the rank) and the other ranks are
    cancelled (their finally blocks run), not left running with nobody waiting for them."""
    from stoker.cluster import run

    url, opts = s3_dataset
    with pytest.raises(ray.exceptions.RayTaskError, match="rank 0 broke") as ei:
        run(
            partial(_one_rank_fails, out_dir=str(tmp_path)),
            url,
            3,
            {"CPU": 0.5},
            storage_options=opts,
            cache_dir=str(tmp_path / "cache"),
            cache_bytes=64 << 20,
            block_bytes=BLOCK,
            cluster=ClusterOptions(job="fails"),
        )
    assert any("rank 0" in note for note in getattr(ei.value, "__notes__", []))
    deadline = time.monotonic() + 120
    files = [tmp_path / f"rank{r}" for r in (1, 2)]
    while not all(f.exists() for f in files) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [f.read_text() for f in files] == ["KeyboardInterrupt"] * 2


def test_a_failed_rank_cancels_the_others_when_the_caller_holds_the_refs(cluster, s3_dataset, tmp_path):
    """``run(wait=False)`` and a plain ``ray.get`` (no :func:`gather`): the first failure still
    cancels the other ranks (a watcher in the driver), so nobody runs on with no one waiting."""
    from stoker.cluster import run

    url, opts = s3_dataset
    refs = run(
        partial(_one_rank_fails, out_dir=str(tmp_path)),
        url,
        3,
        {"CPU": 0.5},
        storage_options=opts,
        cache_dir=str(tmp_path / "cache"),
        cache_bytes=64 << 20,
        block_bytes=BLOCK,
        cluster=ClusterOptions(job="fails-nowait", wait=False),
    )
    with pytest.raises(ray.exceptions.RayTaskError, match="rank 0 broke"):
        ray.get(refs[0], timeout=120)
    deadline = time.monotonic() + 120
    files = [tmp_path / f"rank{r}" for r in (1, 2)]
    while not all(f.exists() for f in files) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [f.read_text() for f in files] == ["KeyboardInterrupt"] * 2  # cancelled, not run out (60 s)
    assert refs.error is not None


def _steps(ctx, out_dir: str):
    """Append a line to ``steps<rank>`` every 50 ms for up to 120 s; write how it ended to ``end<rank>``."""
    how = "finished"
    try:
        end = time.monotonic() + 120
        while time.monotonic() < end:
            with open(os.path.join(out_dir, f"steps{ctx.rank}"), "a") as f:
                f.write("step\n")
            time.sleep(0.05)
    except BaseException as exc:  # noqa: BLE001 - the cancellation, recorded
        how = type(exc).__name__
        raise
    finally:
        with open(os.path.join(out_dir, f"end{ctx.rank}"), "w") as f:
            f.write(how)


def test_a_rank_whose_node_dies_ends_the_job_and_the_others_are_cancelled(cluster, packed_local, tmp_path):
    """The node of one rank dies mid-job (its raylet and every process on it killed): ``run``
    raises promptly, naming that rank and node, and the job's other ranks are cancelled: they
    stop making progress instead of running on with nobody waiting for them. (An extra node,
    removed by the test: the session's three nodes stay.)"""
    import threading

    from stoker.cluster import run

    node = cluster.add_node(
        num_cpus=1, resources={"node_dies_mid_job": 1}, object_store_memory=100 << 20, node_ip_address="127.0.0.1"
    )
    cluster.wait_for_nodes()
    out = tmp_path / "out"
    out.mkdir()
    steps = [out / f"steps{r}" for r in range(4)]
    killed: dict = {}

    def kill_when_all_run():
        deadline = time.monotonic() + 120
        while not all(f.exists() for f in steps) and time.monotonic() < deadline:
            time.sleep(0.05)
        killed["t"] = time.monotonic()
        cluster.remove_node(node, allow_graceful=False)

    killer = threading.Thread(target=kill_when_all_run, daemon=True)
    killer.start()
    errors = (ray.exceptions.NodeDiedError, ray.exceptions.WorkerCrashedError)  # node gone, or its worker first
    try:
        with pytest.raises(errors) as ei:  # four nodes, one rank each: one rank on the doomed node
            run(
                partial(_steps, out_dir=str(out)),
                packed_local,
                4,
                {"CPU": 0.5},
                cache_dir=str(tmp_path / "cache"),
                cache_bytes=64 << 20,
                block_bytes=BLOCK,
                cluster=ClusterOptions(slots_per_node=1, job="node-dies"),
            )
        raised_after_s = time.monotonic() - killed["t"]
    finally:
        killer.join(180)
        if node in cluster.worker_nodes:
            cluster.remove_node(node, allow_graceful=False)
        # run may raise on the crashed worker before Ray's health check marks the node dead; a
        # later test's actor must not be placed on it meanwhile (it would die with the node)
        deadline = time.monotonic() + 120
        while any(n["NodeID"] == node.node_id and n["Alive"] for n in ray.nodes()) and time.monotonic() < deadline:
            time.sleep(0.2)
    assert raised_after_s < 90  # prompt: not the ranks' 120 s, nor a hang
    note = " ".join(getattr(ei.value, "__notes__", []))
    # the node as `stoker cache status` names it: its cache directory, whose slot lock records its Ray id
    locks = (tmp_path / "cache").glob(".node-*.lock")
    key = next(p.name[1:-5] for p in locks if p.read_text().strip() == node.node_id)
    assert f"on {key} failed" in note and node.node_id not in note, note
    victim = int(note.split("rank ", 1)[1].split()[0])
    survivors = [r for r in range(4) if r != victim]
    sizes = {r: steps[r].stat().st_size for r in survivors}
    time.sleep(1.0)  # the cancelled ranks have ended: no step after run raised
    assert {r: steps[r].stat().st_size for r in survivors} == sizes
    assert [(out / f"end{r}").read_text() for r in survivors] == ["KeyboardInterrupt"] * 3


@ray.remote(num_cpus=0, max_concurrency=256)
class _SlowPeer:
    """A cache service whose data endpoint hangs (as one on a node that died while Ray still
    lists it alive: connections are taken, nothing is answered) until :meth:`recover`, which
    serves every read from a real data endpoint on the same port."""

    def __init__(self):
        import socket

        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.address = self.sock.getsockname()
        self.ep = None

    def endpoint(self, dref=None):
        return self.address

    def serve_hit(self, op, key, b, start, stop, reply):
        from stoker.cluster.service import peerwire as pw

        reply.data(pw.FROM_CACHE, b"p" * (stop - start))
        return True

    def recover(self):
        from stoker.cluster.service.endpoint import DataEndpoint
        from stoker.cluster.service.peerwire import cluster_secret

        port = self.address[1]
        self.sock.close()
        self.ep = DataEndpoint(self, cluster_secret(), "127.0.0.1", port)


def test_a_peer_that_hangs_on_a_live_node_costs_one_stall(cluster, s3_dataset, monkeypatch):
    """A peer that stops answering while Ray lists its node alive costs one timed-out call; later
    reads go to the origin without calling it (only background pings do), and once it answers a
    ping reads go to it again."""
    import numpy as np

    import stoker.cluster.service.cache_service as service
    from stoker.cluster.counters import ByteCounters
    from stoker.cluster.service.reader import BlockRouter
    from stoker.store.dataset import open_dataset

    url, opts = s3_dataset
    peer = _SlowPeer.remote()
    ray.get(peer.endpoint.remote(), timeout=120)  # started: the first read reaches it
    monkeypatch.setattr(service, "get_service", lambda nid: peer)
    node = service.alive_nodes()[0]["NodeID"]  # alive in Ray's table throughout
    ds = open_dataset(url, storage_options=opts, cache=False, check=False, block_bytes=BLOCK)
    counters = ByteCounters()
    router = BlockRouter(
        service.dataset_ref(ds, opts),
        [node],
        np.zeros(len(ds.blocks), np.int64),
        -1,
        counters,
        timeout_s=0.5,
        retry_s=0.05,
    )

    def block(b):
        start = int(ds.blocks.start[b])
        return start, start + int(ds.blocks.nbytes(b))

    asked = []
    real = router.links.read
    monkeypatch.setattr(router.links, "read", lambda *a, **kw: asked.append(a) or real(*a, **kw))
    try:
        for b in range(8):
            truth = bytes(ds.origin.read_range(ds.index.shard_name(ds.blocks.shard[b]), *block(b)))
            assert router.read(ds, b, *block(b)) == truth  # from the origin
            time.sleep(0.06)  # past retry_s: the peer is due again
        assert len(asked) == 1  # the one stall; the rest did not ask it (only the background pings)
        assert counters.read()["fallbacks"] == 8 and counters.read()["peer"] == 0
        ray.get(peer.recover.remote())
        deadline = time.monotonic() + 60
        while counters.read()["peer"] == 0 and time.monotonic() < deadline:
            router.read(ds, 0, *block(0))
            time.sleep(0.05)
        assert counters.read()["peer"] > 0  # back: read from the peer again
    finally:
        counters.close()
        ray.kill(peer)


def test_a_peer_on_a_dead_node_is_not_called_again(cluster, s3_dataset, tmp_path, monkeypatch):
    """A peer whose node died costs one failed call; later reads of its blocks go straight to the
    origin (no call to its service) while Ray lists the node as dead. Every read is still right."""
    import numpy as np

    import stoker.cluster.service.cache_service as service
    from stoker.cluster.counters import ByteCounters
    from stoker.cluster.service.reader import BlockRouter
    from stoker.store.dataset import open_dataset

    url, opts = s3_dataset
    node = cluster.add_node(
        num_cpus=1, resources={"node_dies": 1}, object_store_memory=100 << 20, node_ip_address="127.0.0.1"
    )
    cluster.wait_for_nodes()
    service.start_services(str(tmp_path / "cache"), 64 << 20)
    ds = open_dataset(url, storage_options=opts, cache=False, check=False, block_bytes=BLOCK)
    counters = ByteCounters()
    router = BlockRouter(
        service.dataset_ref(ds, opts),
        [node.node_id],
        np.zeros(len(ds.blocks), np.int64),
        -1,
        counters,
        timeout_s=30,
        retry_s=0.0,
    )

    def block(b):
        start = int(ds.blocks.start[b])
        return start, start + int(ds.blocks.nbytes(b))

    def truth(b):
        return bytes(ds.origin.read_range(ds.index.shard_name(ds.blocks.shard[b]), *block(b)))

    try:
        assert router.read(ds, 0, *block(0)) == truth(0)
        assert counters.read()["fallbacks"] == 0  # from the peer
        cluster.remove_node(node, allow_graceful=False)
        deadline = time.monotonic() + 60
        while node.node_id in {n["NodeID"] for n in service.alive_nodes()} and time.monotonic() < deadline:
            time.sleep(0.2)
        assert router.read(ds, 1, *block(1)) == truth(1)  # the one failed call
        calls = []
        real = service.get_service
        monkeypatch.setattr(service, "get_service", lambda nid: calls.append(nid) or real(nid))
        for b in range(2, 8):  # retry_s=0: the peer is due for a retry at every read
            assert router.read(ds, b, *block(b)) == truth(b)
        assert calls == []
        assert counters.read()["fallbacks"] == 7
    finally:
        counters.close()


class _KillOnFirstFill:
    """A service handle whose first ``fill`` call is followed at once by ``ray.kill`` of the
    service: with ``restart`` Ray restarts it (the call in flight meets a dead, then restarting,
    service), without it the service is gone for good."""

    def __init__(self, handle, box, restart: bool = True):
        self._h, self._box, self._restart = handle, box, restart

    def __getattr__(self, name):
        attr = getattr(self._h, name)
        if name != "fill" or self._box["killed"]:
            return attr
        h, box, restart = self._h, self._box, self._restart

        class _Fill:
            @staticmethod
            def remote(*args):
                ref = attr.remote(*args)
                box["killed"] = True
                ray.kill(h, no_restart=not restart)
                return ref

        return _Fill


def test_warm_retries_a_fill_that_meets_a_restarting_service(cluster, packed_local, tmp_path, monkeypatch):
    """A node's service dies under a fill of ``stoker warm``: the chunk is sent again to the
    restarted service and the warm-up completes, nothing failed."""
    import stoker.cluster.service.warmup as warmup
    from stoker.cluster.service.cache_service import find_services, stop_services

    stop_services()  # fresh services on a fresh cache root: nothing cached yet
    box = {"killed": False}
    real = warmup.get_service
    chosen = {}

    def patched(nid):
        chosen.setdefault("victim", nid)
        h = real(nid)
        return _KillOnFirstFill(h, box) if nid == chosen["victim"] else h

    monkeypatch.setattr(warmup, "get_service", patched)
    r = warmup.warm(
        packed_local, cache_dir=str(tmp_path / "cache"), cache_bytes=64 << 20, block_bytes=BLOCK, progress=False
    )
    assert box["killed"]
    assert r["failed_shards"] == {} and sum(n["failed"] for n in r["nodes"].values()) == 0
    assert r["complete"] and r["cached_fraction"] == 1.0
    assert chosen["victim"] in find_services()  # restarted, answering


def test_warm_reports_a_node_whose_service_stays_down(cluster, packed_local, tmp_path, monkeypatch, capsys):
    """A node's service is killed for good under a fill of ``stoker warm`` (no restart): the warm-up
    does not hang or raise; the other nodes are filled, the report names what that node did not
    get and why, and the command exits 1."""
    import json

    import stoker.cluster.service.warmup as warmup
    from stoker.cli import main
    from stoker.cluster.service.cache_service import stop_services

    stop_services()  # fresh services on a fresh cache root: nothing cached yet
    box = {"killed": False}
    real = warmup.get_service
    chosen: dict = {}

    def patched(nid):
        chosen.setdefault("victim", nid)
        h = real(nid)  # raises ValueError once the victim's service is gone for good
        return _KillOnFirstFill(h, box, restart=False) if nid == chosen["victim"] else h

    monkeypatch.setattr(warmup, "get_service", patched)
    capsys.readouterr()
    rc = main(
        [
            "warm",
            packed_local,
            "--no-progress",
            "--block-size",
            str(BLOCK),
            "--cache-dir",
            str(tmp_path / "c"),
            "--cache-bytes",
            str(64 << 20),
        ]
    )
    out, err = capsys.readouterr()
    assert rc == 1 and box["killed"]
    r = json.loads(out)
    victim = r["nodes"].pop(chosen["victim"])
    assert not r["complete"] and 0 < r["cached_fraction"] < 1
    assert victim["failed"] > 0 and victim["cached_fraction"] < 1 and victim["owned_bytes"] > 0
    assert victim["error"] and "service" in victim["error"]
    assert victim["failed_shards"] and all("service" in why for why in victim["failed_shards"].values())
    assert [n["cached_fraction"] for n in r["nodes"].values()] == [1.0, 1.0]  # the others: filled
    assert "Traceback" not in err and "partial" in err and "did not answer" in err


def test_warm_goes_on_without_a_node_whose_service_cannot_start(cluster, packed_local, tmp_path, capsys):
    """One node's cache directory is unusable (a file where its directory goes), so its service
    fails at start and Ray does not restart it: ``stoker warm`` does not wait for it, fills the
    other nodes, lists that node with the reason and exits 1."""
    import json

    from stoker.cli import main
    from stoker.cluster.identity import host_name
    from stoker.cluster.service.cache_service import stop_services

    stop_services()
    root = tmp_path / "c"
    root.mkdir(mode=0o700)
    (root / f"node-{host_name()}-2").write_text("not a directory")  # the third slot of this host
    capsys.readouterr()
    rc = main(
        [
            "warm",
            packed_local,
            "--no-progress",
            "--block-size",
            str(BLOCK),
            "--cache-dir",
            str(root),
            "--cache-bytes",
            str(64 << 20),
        ]
    )
    out, err = capsys.readouterr()
    assert rc == 1
    r = json.loads(out)
    bad = [m for m, n in r["nodes"].items() if n["error"]]
    assert len(bad) == 1 and len(r["nodes"]) == 3
    assert "could not start" in r["nodes"][bad[0]]["error"] and f"node-{host_name()}-2" in r["nodes"][bad[0]]["error"]
    assert r["nodes"][bad[0]]["owned_bytes"] == 0
    assert r["complete"] and r["cached_fraction"] == 1.0  # the others hold the dataset between them
    assert "Traceback" not in err and "could not start" in err and "partial" in err


@ray.remote(num_cpus=0)
def _never_answers(seconds: float):
    time.sleep(seconds)
    return {}


class _HangingFill:
    """A service handle whose ``fill`` calls never answer (a service stuck while Ray lists its node
    alive); its other methods reach the real service."""

    def __init__(self, handle):
        self._h = handle

    def __getattr__(self, name):
        if name != "fill":
            return getattr(self._h, name)

        class _Fill:
            @staticmethod
            def remote(*args):
                return _never_answers.remote(120)

        return _Fill


def test_warm_gives_up_on_a_service_that_hangs(cluster, packed_local, tmp_path, monkeypatch):
    """A node's service takes fills and never answers them, its node alive: the warm-up gives that
    node up once none of its fills answered within the limit, fills the others and reports the
    node with the reason, instead of waiting for ever."""
    import stoker.cluster.service.warmup as warmup
    from stoker.cluster.service.cache_service import stop_services

    stop_services()
    real = warmup.get_service
    chosen: dict = {}

    def patched(nid):
        chosen.setdefault("victim", nid)
        h = real(nid)
        return _HangingFill(h) if nid == chosen["victim"] else h

    monkeypatch.setattr(warmup, "get_service", patched)
    t0 = time.monotonic()
    r = warmup.warm(
        packed_local, cache_dir=str(tmp_path / "c"), cache_bytes=64 << 20, block_bytes=BLOCK, fill_timeout_s=2.0
    )
    assert time.monotonic() - t0 < 100  # the fills would have answered after 120 s: it did not wait for them
    victim = r["nodes"].pop(chosen["victim"])
    assert "hangs" in victim["error"] and victim["owned_bytes"] > 0 and victim["filled"] == 0
    assert victim["failed"] > 0 and all("hangs" in why for why in victim["failed_shards"].values())
    assert not r["complete"]
    assert [n["cached_fraction"] for n in r["nodes"].values()] == [1.0, 1.0]  # the others: filled


def test_a_second_cache_dir_is_named_beside_the_running_services_one(cluster, packed_local, tmp_path, caplog):
    """Running services keep their cache directory: a job asking for another one reads and fills
    the old one, and a warning names both directories, every node, and ``stop_services``; after
    ``stop_services`` the next job's services take the new directory. The second job was silent."""
    import logging

    from stoker.cluster.service import stop_services
    from stoker.cluster.service.warmup import warm

    a, b = tmp_path / "a", tmp_path / "b"
    stop_services()
    first = warm(packed_local, cache_dir=str(a), cache_bytes="64MiB", block_bytes="64KiB")
    assert first["complete"] and len(first["nodes"]) == 3
    with caplog.at_level(logging.WARNING, logger="stoker.cluster.service.cache_service"):
        again = warm(packed_local, cache_dir=str(b), cache_bytes="64MiB", block_bytes="64KiB")
    assert {os.path.dirname(n["cache_dir"]) for n in again["nodes"].values()} == {str(a)}  # kept
    assert not b.exists()
    assert f"cache_dir='{b}' is not used" in caplog.text and f"under {a} (" in caplog.text
    for key in (n["cache_key"] for n in first["nodes"].values()):
        assert f"{key}: {a}" in caplog.text
    assert "stoker.cluster.service.stop_services()" in caplog.text
    stop_services()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="stoker.cluster.service.cache_service"):
        moved = warm(packed_local, cache_dir=str(b), cache_bytes="64MiB", block_bytes="64KiB")
    assert {os.path.dirname(n["cache_dir"]) for n in moved["nodes"].values()} == {str(b)}
    assert "is not used" not in caplog.text
    stop_services()


def test_cluster_sizes_take_size_strings(cluster, packed_local, tmp_path, caplog):
    """``cache_bytes`` and ``block_bytes`` of ``run``/``warm`` take size strings, as ``open_dataset``
    does; one that does not parse, or no budget at all, is a ValueError naming the argument before
    any service starts; asking running services for another budget says they keep theirs."""
    import logging

    from stoker.cluster import run
    from stoker.cluster.service.cache_service import stop_services
    from stoker.cluster.service.warmup import warm

    stop_services()
    r = warm(packed_local, cache_dir=str(tmp_path / "c"), cache_bytes="64MiB", block_bytes="64KiB")
    assert r["complete"] and {n["cache_bytes"] for n in r["nodes"].values()} == {64 << 20}
    with pytest.raises(ValueError, match="cache_bytes.*sixty"):
        run(lambda ctx: None, packed_local, 1, cache_bytes="sixty megs")
    with pytest.raises(ValueError, match="cache_bytes must give some node a budget above 0"):
        warm(packed_local, cache_bytes=0)
    with caplog.at_level(logging.WARNING, logger="stoker.cluster.service.cache_service"):
        r = warm(packed_local, cache_dir=str(tmp_path / "c"), cache_bytes="32MiB", block_bytes="64KiB")
    assert {n["cache_bytes"] for n in r["nodes"].values()} == {64 << 20}  # kept, as documented
    assert "keep their budgets" in caplog.text and f"{64 << 20:,} bytes" in caplog.text
    stop_services()
