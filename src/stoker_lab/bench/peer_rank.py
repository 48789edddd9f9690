"""The rank of the peer stage of ``stoker bench io`` (:mod:`stoker_lab.bench.peer_stage`): a Ray actor
on node B that fetches every block of a dataset from node A's cache service through a
:class:`stoker.cluster.service.reader.BlockRouter`, in its own Ray worker (``direct``) or in a child
process with a copy of the router (``worker``: a cluster-mode Loader's prefetcher and decode workers
get such a copy and read the peer over their own connection)."""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any


class PeerRank:
    """A rank on node B: the dataset opened without a cache, a :class:`BlockRouter` whose every
    block is owned by the one member node (node A's cache service), its byte counters, and on
    first use of :meth:`read_blocks_worker` a child process started with ``spawn`` and a pickled
    copy of the router (as a Loader started with ``spawn`` or ``forkserver`` hands its workers).

    ``url`` / ``storage_options`` / ``block_bytes``: the dataset; ``member``: node A's Ray node id;
    ``concurrency``: block fetches in flight; ``rounds``: how many times a pass reads every block
    (so that a pass moves enough bytes to have seconds of CPU behind it). Raises RuntimeError when
    node A's service does not answer."""

    def __init__(self, url: str, storage_options: dict, block_bytes: int, member: str, concurrency: int, rounds: int):
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
        self.ds, self.concurrency, self.rounds = ds, max(1, int(concurrency)), max(1, int(rounds))
        self.pool = Fetcher(ds, self.router, self.concurrency)
        self.child: Any = None
        self.conn: Any = None

    def pids(self) -> dict:
        """``{"rank": this process, "worker": the reading child (once started)}``."""
        out = {"rank": os.getpid()}
        if self.child is not None:
            out["worker"] = self.child.pid
        return out

    def _counted(self, run) -> dict:
        before = self.counters.read()
        out = run()
        after = self.counters.read()
        out["counters"] = {k: after[k] - before[k] for k in after}
        return out

    def read_blocks(self) -> dict:
        """One pass in this process (:meth:`Fetcher.run`, ``rounds`` times every block), with the
        pass's ByteCounters deltas under ``counters``."""
        return self._counted(lambda: self.pool.run(self.rounds))

    def read_heads(self, nbytes: int = 1024) -> dict:
        """The first ``nbytes`` bytes of every block through the router (not verified: a part of a
        block), as :meth:`read_blocks` with one round: what one request costs apart from its bytes."""
        return self._counted(lambda: self.pool.run(1, nbytes))

    def verify_cpu_s(self) -> dict:
        """The CPU the index check of the fetched blocks costs on its own: every block read once,
        then checked ``rounds`` times (:func:`stoker.store.checks.verify_block`) in this thread;
        ``{"bytes", "cpu_s"}`` (this thread's CPU time)."""
        from stoker.store.checks import verify_block

        ds = self.ds
        blocks = [
            self.router.read(ds, b, int(ds.blocks.start[b]), int(ds.blocks.end[b])) for b in range(len(ds.blocks))
        ]
        c0 = time.thread_time()
        for _ in range(self.rounds):
            for b, data in enumerate(blocks):
                verify_block(ds, b, data)
        return {"bytes": self.rounds * sum(len(d) for d in blocks), "cpu_s": time.thread_time() - c0}

    def start_worker(self) -> int:
        """Start the reading child (a spawned process with a copy of the router, which opens its own
        connection to the peer's data endpoint); returns its pid. RuntimeError when it does not start."""
        import multiprocessing as mp

        if self.child is None:
            ctx = mp.get_context("spawn")
            self.conn, child_conn = ctx.Pipe()
            self.child = ctx.Process(
                target=worker_main, args=(self.ds, self.router, self.concurrency, child_conn), daemon=True
            )
            self.child.start()
            child_conn.close()
            if not self.conn.poll(120):
                raise RuntimeError("the peer stage's worker child did not start in 120 s")
            ready = self.conn.recv()
            if ready != "ready":
                raise RuntimeError(f"the peer stage's worker child failed to start: {ready}")
        return self.child.pid

    def read_blocks_worker(self) -> dict:
        """One pass in the child (as :meth:`read_blocks`; the counters are shared by both processes)."""

        def run():
            self.start_worker()
            self.conn.send(self.rounds)
            if not self.conn.poll(600):
                raise RuntimeError("the peer stage's worker child did not answer in 600 s")
            out = self.conn.recv()
            if isinstance(out, str):
                raise RuntimeError(f"the peer stage's worker child failed: {out}")
            return out

        return self._counted(run)

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
        self.pool.close()
        self.router.close()
        self.counters.close()


class Fetcher:
    """Every block of ``ds`` fetched whole as a cluster-mode Loader fetches a peer's block
    (:meth:`stoker.store.blocks.BlockReader.fetch_block`: ``router.read(..., block=True)``, then the
    index check of every sample in it), ``concurrency`` at a time, on threads made before the first
    pass (a Loader's fill threads exist before its fills too)."""

    def __init__(self, ds, router, concurrency: int):
        from stoker.store.blocks import BlockReader

        self.ds, self.reader, self.concurrency = ds, BlockReader(ds, router=router), concurrency
        self.pool = ThreadPoolExecutor(concurrency, thread_name_prefix="peer-read")
        list(self.pool.map(lambda _: None, range(concurrency)))

    def run(self, rounds: int, head: int | None = None) -> dict:
        """One pass: every block ``rounds`` times; ``{bytes, wall_s, digest}`` (xxh3-64 of the last
        round's blocks in order, after the clock); ``head``: only the first ``head`` bytes of each
        block, read but not checked (one round).

        Each of the pool's threads takes the next block as it finishes one and drops each block once
        counted (a Loader's fill thread writes it to the cache and drops it); only the last round's
        are kept, for the digest."""
        import xxhash

        ds, reader = self.ds, self.reader
        nb = len(ds.blocks)

        def fetch(b: int):
            if head is None:
                return reader.fetch_block(b)
            s = int(ds.blocks.start[b])
            return reader.source_read(b, s, min(int(ds.blocks.end[b]), s + head), block=True)

        todo, lock = iter(range(nb * rounds)), threading.Lock()
        last: list = [None] * nb
        moved = [0]

        def loop() -> None:
            while True:
                with lock:
                    i = next(todo, None)
                if i is None:
                    return
                data = fetch(i % nb)
                with lock:
                    moved[0] += len(data)
                    if i >= nb * (rounds - 1):
                        last[i % nb] = data
                del data

        t0 = time.perf_counter()
        for f in [self.pool.submit(loop) for _ in range(self.concurrency)]:
            f.result()
        wall = time.perf_counter() - t0
        h = xxhash.xxh3_64()
        for d in last:
            h.update(d)
        return {"bytes": moved[0], "wall_s": wall, "digest": h.hexdigest()}

    def close(self) -> None:
        self.pool.shutdown()


def worker_main(ds, router, concurrency: int, conn) -> None:
    """The worker child: one :meth:`Fetcher.run` of the number of rounds received on ``conn``,
    its result sent back, until ``"stop"`` or the pipe closes."""
    import traceback

    try:
        reader = Fetcher(ds, router, concurrency)
    except Exception:  # noqa: BLE001 - reported to the rank
        conn.send(traceback.format_exc())
        return
    conn.send("ready")
    try:
        while True:
            try:
                cmd = conn.recv()
            except EOFError:
                return
            if not isinstance(cmd, int):
                return
            try:
                conn.send(reader.run(cmd))
            except Exception:  # noqa: BLE001 - reported to the rank
                conn.send(traceback.format_exc())
    finally:
        reader.close()
        router.close()
