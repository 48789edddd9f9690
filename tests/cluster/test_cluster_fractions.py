"""Cluster byte counters: every byte a rank reads is counted once (local, peer or origin).

Runs the cluster read path (BlockRouter + ByteCounters) on one node without Ray: the node owns
every block, so nothing goes to a peer."""

import os

import numpy as np
from _dataplane import SECRET

from stoker.cluster.counters import ByteCounters, fractions
from stoker.cluster.service.reader import BlockRouter
from stoker.loader import Loader, ReadOptions
from stoker.store.blocks import BlockReader
from stoker.store.dataset import open_dataset


def _epoch(loader, counters):
    counters.clear_tags()  # as WorkerContext.measure does at each epoch's start
    before = counters.read()
    for _ in loader:
        pass
    after = counters.read()
    return {k: after[k] - before[k] for k in after}


def test_local_peer_origin_add_up_to_the_bytes_read(packed_local, tmp_path):
    ds = open_dataset(packed_local, cache_dir=str(tmp_path / "cache"), cache_bytes=1 << 30, block_bytes=256 << 10)
    counters = ByteCounters()
    counters.size_tags(len(ds.blocks))
    try:
        # one node, no peer: a secret of its own (BlockRouter would ask Ray for the cluster's, and no Ray runs here)
        router = BlockRouter({"url": ds.url}, ["node0"], np.zeros(len(ds.blocks), np.int64), 0, counters, secret=SECRET)
        ds = ds.with_reader(BlockReader(ds, router=router))  # as a rank reads (stoker.cluster.jobs.job)
        # prefetch_next_epoch=False: the next epoch's first batches would be read (and counted)
        # inside this epoch's window, and the test compares each window with its epoch's plan
        with Loader(ds, 16, num_workers=2, seed=3, read=ReadOptions(prefetch_next_epoch=False)) as loader:
            epochs = [_epoch(loader, counters) for _ in range(2)]
            plans = [loader.plan(e) for e in range(2)]
        for d, plan in zip(epochs, plans, strict=True):
            read = int(ds.index.length[plan].sum())
            assert d["local"] + d["peer"] + d["origin"] + d["peer_origin"] == read, (d, read)
            f = fractions(d)
            assert abs(f["local_fraction"] + f["peer_fraction"] + f["origin_fraction"] - 1.0) < 1e-9
        cold, warm = epochs
        assert cold["local"] == 0 and fractions(cold)["origin_fraction"] == 1.0  # an empty cache: all origin
        # the bytes received are counted apart: whole blocks, at least the samples read of them
        assert cold["origin"] <= cold["fetch_origin"] <= int((ds.blocks.end - ds.blocks.start).sum())
        assert warm["origin"] == 0 and warm["fetch_origin"] == 0 and fractions(warm)["local_fraction"] == 1.0
    finally:
        counters.close()


def test_counter_files_of_killed_ranks_are_swept_by_the_next_rank(tmp_path, monkeypatch):
    """A rank killed before close() leaves its counter file in /dev/shm; the next counters made
    on the node remove it (its pid is gone), and leave a live process's file alone."""
    import subprocess
    import sys

    from stoker.cluster import counters

    monkeypatch.setattr(counters.os.path, "isdir", lambda p: False)  # no /dev/shm: the temp dir
    monkeypatch.setattr("stoker.loader.shm.by_descriptor", lambda fd: False)  # no /proc reopen: named files
    monkeypatch.setattr(counters.tempfile, "gettempdir", lambda: str(tmp_path))
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = tmp_path / f"{counters.PREFIX}{int(child.stdout)}-abc"
    dead.write_bytes(b"x")
    live = counters.ByteCounters()
    assert not dead.exists() and os.path.basename(live.path).startswith(f"{counters.PREFIX}{os.getpid()}-")
    other = counters.ByteCounters()  # made by a live process (this one): kept
    assert os.path.exists(live.path) and os.path.exists(other.path)
    live.close()
    other.close()
    assert not any(p.name.startswith(counters.PREFIX) for p in tmp_path.iterdir())


def test_the_counter_file_goes_with_the_process_that_made_it(tmp_path):
    """Where /proc allows it the file is unlinked at once: other processes add through its path,
    and a maker killed by SIGKILL (a Ray worker's end) leaves nothing in /dev/shm."""
    import os
    import signal
    import subprocess
    import sys

    from stoker.cluster import counters

    script = (
        "import os, sys, time\n"
        "from stoker.cluster.counters import ByteCounters\n"
        "c = ByteCounters()\n"
        "c.add(local=5)\n"
        "print(c.path, flush=True)\n"
        "time.sleep(60)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        path = child.stdout.readline().strip()
        assert path.startswith(f"/proc/{child.pid}/fd/"), path
        assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"{counters.PREFIX}{child.pid}-")]
        other = counters.ByteCounters(path)  # another process of the rank, by the path it was given
        other.add(local=7, origin=3)
        assert other.read()["local"] == 12 and other.read()["origin"] == 3
        other.close()  # a copy's close leaves the maker's file alone
        assert other.read()["local"] == 12
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    assert not os.path.exists(path)
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"{counters.PREFIX}{child.pid}-")]
