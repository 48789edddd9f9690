"""The rank of the peer stage of ``stoker bench io`` (:mod:`stoker_lab.bench.peer_stage`): a Ray actor
on node B that reads every block of a dataset from node A's cache service through a
:class:`stoker.cluster.service.reader.BlockRouter`, in its Ray worker or from a child process through the
router's relay (the path of a cluster-mode Loader's prefetcher)."""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any


class PeerRank:
    """A rank on node B: the dataset opened without a cache, a :class:`BlockRouter` whose every
    block is owned by the one member node (node A's cache service), its byte counters, and on
    first use of :meth:`read_blocks_relay` the router's :class:`stoker.cluster.service.reader.Relay` and
    a child process that reads through it (as a Loader's prefetcher does).

    ``url`` / ``storage_options`` / ``block_bytes``: the dataset; ``member``: node A's Ray node id;
    ``concurrency``: reads in flight. Raises RuntimeError when node A's service does not answer."""

    def __init__(self, url: str, storage_options: dict, block_bytes: int, member: str, concurrency: int):
        import numpy as np

        from stoker.cluster.counters import ByteCounters
        from stoker.cluster.service.cache_service import dataset_ref
        from stoker.cluster.service.reader import BlockRouter
        from stoker.store.dataset import open_dataset

        ds = open_dataset(url, storage_options=storage_options, cache=False, check=False, block_bytes=block_bytes)
        self.counters = ByteCounters()
        self.counters.size_tags(len(ds.blocks))
        self.router = BlockRouter(
            dataset_ref(ds, storage_options),
            [member],
            np.zeros(len(ds.blocks), dtype=np.int64),
            -1,
            self.counters,
        )
        failed = self.router.connect()
        if failed:
            raise RuntimeError(f"the cache service of node {member} does not answer")
        self.ds, self.concurrency = ds, max(1, int(concurrency))
        self.pool = _Reader(ds, self.router, self.concurrency)
        self.relay: Any = None
        self.child: Any = None
        self.conn: Any = None

    def pids(self) -> dict:
        """``{"rank": this process, "relay child": the relay's reader (once started)}``."""
        out = {"rank": os.getpid()}
        if self.child is not None:
            out["relay child"] = self.child.pid
        return out

    def read_blocks(self) -> dict:
        """Read every block once through the router in this process (:meth:`_Reader.run`), with
        the pass's ByteCounters deltas under ``counters``."""
        before = self.counters.read()
        out = self.pool.run()
        after = self.counters.read()
        out["counters"] = {k: after[k] - before[k] for k in after}
        return out

    def read_heads(self, nbytes: int = 1024) -> dict:
        """Read the first ``nbytes`` bytes of every block through the router, as :meth:`read_blocks`
        (a value that small travels inside Ray's reply, not through the object stores): what one
        call costs apart from moving the block."""
        before = self.counters.read()
        out = self.pool.run(nbytes)
        after = self.counters.read()
        out["counters"] = {k: after[k] - before[k] for k in after}
        return out

    def start_relay(self) -> int:
        """Start the relay and its reader child (a spawned process with a copy of the router,
        which therefore reads through the relay); returns the child's pid."""
        import multiprocessing as mp

        if self.child is None:
            self.relay = self.router.start_relay()
            ctx = mp.get_context("spawn")
            self.conn, child_conn = ctx.Pipe()
            self.child = ctx.Process(
                target=_relay_child, args=(self.ds, self.router, self.concurrency, child_conn), daemon=True
            )
            self.child.start()
            child_conn.close()
            if not self.conn.poll(120):
                raise RuntimeError("the relay's reader child did not start in 120 s")
            self.conn.recv()
        return self.child.pid

    def read_blocks_relay(self) -> dict:
        """Read every block once in the child, through the relay (as :meth:`read_blocks`)."""
        self.start_relay()
        before = self.counters.read()
        self.conn.send("go")
        if not self.conn.poll(600):
            raise RuntimeError("the relay's reader child did not answer in 600 s")
        out = self.conn.recv()
        if isinstance(out, str):
            raise RuntimeError(f"the relay's reader child failed: {out}")
        after = self.counters.read()
        out["counters"] = {k: after[k] - before[k] for k in after}
        return out

    def close(self) -> None:
        if self.child is not None:
            try:
                self.conn.send("stop")
            except OSError:
                pass
            self.child.join(10)
            if self.child.is_alive():
                self.child.kill()
                self.child.join()
        if self.relay is not None:
            self.relay.close()
        self.pool.close()
        self.counters.close()


class _Reader:
    """Every block of ``ds`` read whole through ``router``, ``concurrency`` at a time, on threads
    made before the first pass (a Loader's fill threads exist before its fills too)."""

    def __init__(self, ds, router, concurrency: int):
        self.ds, self.router = ds, router
        self.ranges = [(b, int(ds.blocks.start[b]), int(ds.blocks.end[b])) for b in range(len(ds.blocks))]
        self.pool = ThreadPoolExecutor(concurrency, thread_name_prefix="peer-read")
        list(self.pool.map(lambda _: None, range(concurrency)))

    def run(self, head: int | None = None) -> dict:
        """One pass: ``{bytes, wall_s, digest}`` (xxh3-64 of the blocks in order, after the clock);
        ``head``: only the first ``head`` bytes of each block."""
        import xxhash

        ds, router = self.ds, self.router
        ranges = self.ranges if head is None else [(b, s, min(e, s + head)) for b, s, e in self.ranges]
        t0 = time.perf_counter()
        got = list(self.pool.map(lambda r: router.read(ds, r[0], r[1], r[2], block=True), ranges))
        wall = time.perf_counter() - t0
        h = xxhash.xxh3_64()
        for d in got:
            h.update(d)
        return {"bytes": sum(len(d) for d in got), "wall_s": wall, "digest": h.hexdigest()}

    def close(self) -> None:
        self.pool.shutdown()


def _relay_child(ds, router, concurrency: int, conn) -> None:
    """The relay's reader: one :meth:`_Reader.run` per ``"go"`` on ``conn``, until ``"stop"``."""
    import traceback

    reader = _Reader(ds, router, concurrency)
    conn.send("ready")
    try:
        while True:
            try:
                cmd = conn.recv()
            except EOFError:
                return
            if cmd != "go":
                return
            try:
                conn.send(reader.run())
            except Exception:  # noqa: BLE001 - reported to the rank
                conn.send(traceback.format_exc())
    finally:
        reader.close()
