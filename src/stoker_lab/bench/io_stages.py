"""The stages of ``stoker bench io``: each one measured beside its floor on the same bytes.

A stage is a pair of loops over the same work (the same ranges of the same shards, the same block
buffers, the same sample ranges): stoker's code path and the floor, the bare library call that the
path must at least make (a ranged GET of the same client library, ``os.pwrite`` of the same
buffers into new files, ``os.pread`` of the same ranges from open files). Both run in this
process; their CPU is ``time.process_time()`` (every thread of the process: obstore's and s3fs's
I/O threads included) and the pair is repeated ``reps`` times alternately (A, B, A, B), keeping the
smallest CPU of each, the steadiest figure on a shared machine.
"""

from __future__ import annotations

import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor

GB = 1e9


def timed(fn) -> tuple[float, float, object]:
    """(CPU seconds of this process, wall seconds, result) of ``fn()``."""
    c0, t0 = time.process_time(), time.perf_counter()
    out = fn()
    return time.process_time() - c0, time.perf_counter() - t0, out


def figures(nbytes: int, cpu_s: float, wall_s: float) -> dict:
    """``{bytes, cpu_s, wall_s, cpu_s_per_GB, GBps}`` of one measured loop over ``nbytes`` bytes."""
    return {
        "bytes": int(nbytes),
        "cpu_s": cpu_s,
        "wall_s": wall_s,
        "cpu_s_per_GB": cpu_s / (nbytes / GB) if nbytes else 0.0,
        "GBps": nbytes / GB / wall_s if wall_s > 0 else 0.0,
    }


def alternate(variants: dict, reps: int, nbytes: int, before=None) -> dict:
    """Run each of ``variants`` (name -> callable returning the bytes it moved) ``reps`` times,
    alternating (A, B, A, B); ``before()`` runs untimed before each call (e.g. removing what the
    last one wrote). Returns name -> :func:`figures` of the run with the least CPU.
    Raises RuntimeError when a variant moved other than ``nbytes`` bytes."""
    best: dict = {}
    for _ in range(max(1, reps)):
        for name, fn in variants.items():
            if before is not None:
                before()
            cpu, wall, moved = timed(fn)
            if moved != nbytes:
                raise RuntimeError(f"{name} moved {moved} bytes, expected {nbytes}")
            if name not in best or cpu < best[name]["cpu_s"]:
                best[name] = figures(nbytes, cpu, wall)
    return best


def row(stage: str, stoker: dict, floor: dict, floor_what: str, exception: str | None = None, **extra) -> dict:
    """One ``stages`` entry of the report: stoker's figures, the floor's, their CPU ratio."""
    ratio = stoker["cpu_s_per_GB"] / floor["cpu_s_per_GB"] if floor["cpu_s_per_GB"] > 0 else None
    return {
        "stage": stage,
        "bytes": stoker["bytes"],
        "cpu_s": stoker["cpu_s"],
        "wall_s": stoker["wall_s"],
        "cpu_s_per_GB": stoker["cpu_s_per_GB"],
        "GBps": stoker["GBps"],
        "floor": {
            "what": floor_what,
            "cpu_s": floor["cpu_s"],
            "cpu_s_per_GB": floor["cpu_s_per_GB"],
            "GBps": floor["GBps"],
        },
        "ratio": ratio,
        "exception": exception,
        **extra,
    }


# -- origin -> memory ---------------------------------------------------------
def block_ranges(ds) -> list[tuple[str, int, int]]:
    """(shard object name, start, end) of every block of ``ds``: the ranged GETs of a cold fill."""
    return [
        (ds.index.shard_name(ds.blocks.shard[b]), int(ds.blocks.start[b]), int(ds.blocks.end[b]))
        for b in range(len(ds.blocks))
    ]


def origin_stage(url: str, storage_options: dict, ranges: list, concurrency: int, reps: int) -> tuple[list, list]:
    """origin -> memory, once per client library: stoker's :meth:`stoker.storage.Origin.read_range`
    (obstore via ``use_native``, then s3fs) against a bare loop of the same library over the same
    ranges, both on a pool of ``concurrency`` threads. Returns (rows, the blocks' bytes in
    ``ranges`` order, from the bare obstore loop)."""
    import obstore
    from obstore.store import S3Store

    from stoker.storage import Origin, url_to_fs
    from stoker.storage._s3_config import resolve

    nbytes = sum(e - s for _, s, e in ranges)
    bucket = url.split("://", 1)[1].split("/", 1)[0]
    prefix = url.split("://", 1)[1].split("/", 1)[1].rstrip("/")
    kw, why = resolve(bucket, storage_options)
    if kw is None:
        raise RuntimeError(f"obstore cannot take these storage options: {why}")
    store = S3Store(bucket, retry_config={"max_retries": 0}, **kw)
    fs, _ = url_to_fs(url, storage_options)
    native, plain = Origin(url, storage_options), Origin(url, storage_options)
    if not native.use_native():
        raise RuntimeError("stoker's Origin did not take obstore (STOKER_NATIVE_S3=0?)")
    plain.warm()
    pool = ThreadPoolExecutor(concurrency)
    kept: list = []

    def loop(read):
        return lambda: sum(pool.map(lambda r: len(read(*r)), ranges))

    def bare_obstore():
        out = list(pool.map(lambda r: obstore.get_range(store, f"{prefix}/{r[0]}", start=r[1], end=r[2]), ranges))
        kept[:] = out
        return sum(len(memoryview(b)) for b in out)

    for o in (native, plain):  # first requests (connections, credentials) are not measured
        o.read_range(ranges[0][0], ranges[0][1], ranges[0][1] + 1)
    obstore.get_range(store, f"{prefix}/{ranges[0][0]}", start=0, end=1)
    fs.cat_file(f"{bucket}/{prefix}/{ranges[0][0]}", start=0, end=1)
    try:
        got = alternate(
            {
                "stoker_obstore": loop(native.read_range),
                "bare_obstore": bare_obstore,
                "stoker_s3fs": loop(plain.read_range),
                "bare_s3fs": loop(lambda k, s, e: fs.cat_file(f"{bucket}/{prefix}/{k}", start=s, end=e)),
            },
            reps,
            nbytes,
        )
    finally:
        pool.shutdown()
    what = f"a bare loop of {{}} ranged GETs over the same {len(ranges)} ranges, {concurrency} threads"
    rows = [
        row(
            "origin->memory (obstore)",
            got["stoker_obstore"],
            got["bare_obstore"],
            what.format("obstore.get_range"),
            requests=len(ranges),
        ),
        row(
            "origin->memory (s3fs)",
            got["stoker_s3fs"],
            got["bare_s3fs"],
            what.format("s3fs cat_file"),
            requests=len(ranges),
        ),
    ]
    return rows, [bytes(b) for b in kept]


def _link_floor_child(url: str, storage_options: dict, ranges: list, concurrency: int, root: str) -> dict:
    """In a fresh process: every range of ``ranges`` read with a bare ``obstore.get_range`` and
    written with ``os.open`` + ``os.write`` + ``close`` into a new file under ``root``, on
    ``concurrency`` threads. Returns :func:`figures` of that loop (this process's CPU)."""
    import obstore
    from obstore.store import S3Store

    from stoker.storage._s3_config import resolve

    bucket = url.split("://", 1)[1].split("/", 1)[0]
    prefix = url.split("://", 1)[1].split("/", 1)[1].rstrip("/")
    kw, why = resolve(bucket, storage_options)
    if kw is None:
        raise RuntimeError(f"obstore cannot take these storage options: {why}")
    store = S3Store(bucket, retry_config={"max_retries": 0}, **kw)
    obstore.get_range(store, f"{prefix}/{ranges[0][0]}", start=0, end=1)  # connection, credentials
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)

    def one(k: int) -> int:
        key, start, end = ranges[k]
        data = obstore.get_range(store, f"{prefix}/{key}", start=start, end=end)
        fd = os.open(os.path.join(root, f"{k:06d}"), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        try:
            return os.write(fd, data)
        finally:
            os.close(fd)

    with ThreadPoolExecutor(concurrency) as pool:
        cpu, wall, moved = timed(lambda: sum(pool.map(one, range(len(ranges)))))
    shutil.rmtree(root, ignore_errors=True)
    assert isinstance(moved, int)
    return figures(moved, cpu, wall)


def link_floor(url: str, storage_options: dict, ranges: list, concurrency: int, root: str) -> dict:
    """The floor of origin -> cache over the cold epoch's own link: a bare GET + write loop of the
    same blocks (``ranges``: (shard, start, end)) through the same (throttled) endpoint, with
    ``concurrency`` GETs in flight, run in a fresh spawned process (this one stays free of
    obstore's runtime, so a Loader started here afterwards still forks). Returns its
    :func:`figures`.

    Why the link, not the direct endpoint: a client's CPU per byte depends on how the bytes
    arrive. Over a rate-limited link each read returns less, so the same client spends more CPU
    per GB (the bare obstore loop measured 0.6-0.9 CPU-s/GB on the direct endpoint and 0.8-2.1
    through the 100 MB/s throttle on this 2-core machine, between runs)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as ex:
        return ex.submit(_link_floor_child, url, storage_options, ranges, concurrency, root).result()


# -- memory -> cache tier -----------------------------------------------------
def _bare_pwrite(root: str, blocks: list) -> int:
    os.makedirs(root, exist_ok=True)
    n = 0
    for k, data in enumerate(blocks):
        fd = os.open(os.path.join(root, f"{k:06d}"), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        try:
            n += os.pwrite(fd, data, 0)
        finally:
            os.close(fd)
    return n


def clear_cache(ds) -> None:
    """Remove every block of ``ds`` from its cache (untimed, between repetitions)."""
    for b in range(len(ds.blocks)):
        ds.cache.remove(ds.version, ds.blocks.name(b))


def cache_put_stage(tiers: dict, blocks: list, floor_roots: dict, reps: int) -> list:
    """memory -> cache tier: ``ds.cache.put`` of every block (``tiers``: tier name -> a Dataset whose
    cache puts into that tier) against bare ``os.pwrite`` of the same buffers into new files in a
    directory of the same filesystem (``floor_roots``: tier name -> directory). The caches are left
    full (the next stage reads them)."""
    nbytes = sum(len(b) for b in blocks)
    rows = []
    for tier, ds in tiers.items():
        root = floor_roots[tier]

        def put(ds=ds):
            return sum(len(d) for b, d in enumerate(blocks) if ds.cache.put(ds.version, ds.blocks.name(b), d))

        def before(ds=ds, root=root):
            shutil.rmtree(root, ignore_errors=True)
            clear_cache(ds)

        got = alternate({"stoker": put, "floor": lambda root=root: _bare_pwrite(root, blocks)}, reps, nbytes, before)
        shutil.rmtree(root, ignore_errors=True)
        put()  # left full for the reads
        rows.append(
            row(
                f"memory->cache ({tier} tier)",
                got["stoker"],
                got["floor"],
                f"bare os.open + os.pwrite + close of the same {len(blocks)} buffers into new files "
                f"on the same filesystem",
                blocks=len(blocks),
            )
        )
    return rows


def verify_stage(ds, blocks: list, reps: int) -> dict:
    """The fill's checksum pass: :func:`stoker.store.checks.verify_block` (xxh3-64 of every sample
    of every block, as a fill does before the put) against xxh3-64 of each whole block buffer."""
    import xxhash

    from stoker.store.checks import verify_block

    nbytes = sum(len(b) for b in blocks)

    def verify():
        return sum(len(verify_block(ds, b, d)) for b, d in enumerate(blocks))

    def floor():
        for d in blocks:
            xxhash.xxh3_64_intdigest(d)
        return nbytes

    got = alternate({"stoker": verify, "floor": floor}, reps, nbytes)
    return row(
        "fill checksum pass (in memory)",
        got["stoker"],
        got["floor"],
        "xxh3-64 of each whole block buffer",
        blocks=len(blocks),
    )


# -- cache tier -> worker -----------------------------------------------------
def cache_read_stage(tiers: dict, reps: int) -> list:
    """cache tier -> worker: ``ds.read(i)`` of every sample (the decode workers' read: cache
    lookup, checksum, bytes) against bare ``os.pread`` of the same ranges from the block files,
    opened once."""
    rows = []
    for tier, ds in tiers.items():
        cache = ds.cache.memory if tier == "memory" else getattr(ds.cache, "disk", ds.cache)
        n = len(ds)
        ids = range(n)
        nbytes = int(sum(int(ds.index.length[i]) for i in ids))

        def bare(ds=ds, cache=cache, ids=ids):
            fds = {}
            total = 0
            try:
                for i in ids:
                    b = int(ds.blocks.sample_block[i])
                    fd = fds.get(b)
                    if fd is None:
                        fd = fds[b] = os.open(cache.path(ds.version, ds.blocks.name(b)), os.O_RDONLY)
                    at = int(ds.index.offset[i]) - int(ds.blocks.start[b])
                    total += len(os.pread(fd, int(ds.index.length[i]), at))
            finally:
                for fd in fds.values():
                    os.close(fd)
            return total

        def stoker(ds=ds, ids=ids):
            return sum(len(ds.read(i)) for i in ids)

        if not cache.contains(ds.version, ds.blocks.name(0)):
            raise RuntimeError(f"the {tier} tier does not hold the blocks the read stage needs")
        got = alternate({"stoker": stoker, "floor": bare}, reps, nbytes)
        rows.append(
            row(
                f"cache ({tier} tier)->worker",
                got["stoker"],
                got["floor"],
                f"bare os.pread of the same {n} sample ranges from the block files, opened once",
                samples=n,
                us_per_sample=1e6 * got["stoker"]["cpu_s"] / n,
                floor_us_per_sample=1e6 * got["floor"]["cpu_s"] / n,
            )
        )
    return rows
