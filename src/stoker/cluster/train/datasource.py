"""A packed dataset as a Ray Data ``Dataset`` whose read tasks read through the cluster's node caches.

Ray Data reads a dataset again on every pass (``iter_batches``, ``iter_torch_batches``, a
``streaming_split``), and its only cache between passes is ``materialize()``: a copy of the whole
dataset in its object store, as big as the dataset and gone with the job. Here each pass reads
the cache blocks through the cache services of cluster mode instead
(:mod:`stoker.cluster.service.cache_service`): the first pass fills each block into the node cache
of the node that owns it (one origin read per block, for every job), and every later pass reads
the blocks from those caches, 0 bytes from the origin, with nothing kept in the object store
beyond the blocks in flight of Ray Data's streaming execution.

:func:`read` (the driver):

1. starts the cache services where missing and opens the dataset's index
   (:func:`stoker.cluster.service.cache_service.prepare`), settles its placement members on the
   services (:func:`stoker.cluster.service.records.settle_record`) and places its blocks
   (:func:`stoker.cluster.placement.place_dataset`), as a rank of ``stoker.cluster.run`` does;
2. puts the index once in Ray's object store (what every read task needs to find a sample; a
   read task never reads the index from the origin);
3. makes one :class:`BlockSource` (a ``ray.data.Datasource``) per node that owns blocks, whose
   read tasks each read a group of that node's blocks, and unions them.

Placement, as far as Ray Data 2.60 allows it: a ``Datasource`` cannot give each ``ReadTask`` its
own scheduling options (every read task of one ``read_datasource`` gets the same remote
arguments; ``ray_remote_args_fn`` is not open to reads, and ``locality_hints`` exist only for
``streaming_split``'s consumers). So the blocks of each node form their own read, whose tasks ask
for that node with ``NodeAffinitySchedulingStrategy(node, soft=True)`` (they run elsewhere only
when the node is gone), and the reads are joined with ``Dataset.union`` (which streams: it does
not wait for one input before the next). Ray 2.60 marks ``ray_remote_args`` of reads as
deprecated in favour of named parameters, but none of those names a soft node affinity
(``label_selector`` is hard; ``fallback_strategy`` is experimental), so this one call keeps it and
silences that warning.

A read task (:func:`read_blocks`) reads each of its blocks whole from the data endpoint of the
block's owner (:class:`stoker.cluster.service.reader.BlockRouter` with no node cache of its own: on
the owner's node the endpoint sends the cache file with ``sendfile`` over the loopback), which
fills it from the origin the first time; a block is checked against the index checksums before
its rows are made. An owner that is down costs an origin read of its blocks, as for a rank.
The first read task of a worker process takes the index out of the object store and makes the
router (the cluster's secret, the owners' endpoints, a connection to each); the next tasks of
that process reuse them (:func:`_opened`).
"""

from __future__ import annotations

import functools
import logging
import uuid
import warnings
from collections.abc import Iterator

import numpy as np
import ray

from ...cache.spec import CacheOptions
from ...store.checks import verify_block
from ..counters import ByteCounters
from ..handoff import previous_layout, prior_owner
from ..identity import node_labels
from ..placement import place_dataset
from ..service.cache_service import get_service, placement_keys, prepare
from ..service.reader import BlockRouter
from ..service.records import settle_record
from ..settings import ClusterOptions, cluster_door

log = logging.getLogger(__name__)

#: The columns of a row, in order: the sample's key (str), its id in the packed dataset (int64),
#: its label (int64, -1: none) and its primary payload (binary: the bytes ``Dataset.read`` gives).
COLUMNS = ("key", "id", "label", "bytes")
#: The least bytes of blocks a read task reads by default (fewer, larger tasks: each costs Ray
#: Data a task's scheduling, however few rows it has).
TASK_BYTES = 16 << 20
#: About how many bytes of blocks a read task gathers into one Ray Data block (one table).
YIELD_BYTES = 8 << 20


def _layout(url: str, opts: dict, cache: CacheOptions, block_bytes) -> tuple:
    """The driver's part (module doc, steps 1): ``(dataset without cache, layout)``; the layout
    is plain data: ``dref``, ``members``, ``names``, ``owner`` and ``prior`` (int64 per block)."""
    services, ds, dref = prepare(url, opts, cache, block_bytes)
    nodes = list(services)
    cached = ray.get([get_service(n).cached_bytes.remote(dref) for n in nodes])
    have = [n for n, c in zip(nodes, cached, strict=True) if c > 0]
    record = settle_record(services, ds.version, int(ds.index.total_bytes), have or nodes, nodes)
    members = [m for m in record["members"] if m in services] or nodes
    owner = place_dataset(ds, placement_keys(services, members), [int(services[m]["cache_bytes"]) for m in members])
    prior = prior_owner(ds, members, owner, previous_layout(services, members, record["previous"]))
    layout = {
        "token": uuid.uuid4().hex,  # names this read's dataset and router in its worker processes
        "dref": dref,
        "members": members,
        "names": node_labels(members, services),
        "owner": owner,
        "prior": prior,
    }
    return ds, layout


#: Per worker process: the dataset and router of the reads it ran last (Ray reuses its worker
#: processes from task to task): ``{key: (dataset, router, counters)}``, at most :data:`KEPT`.
_OPEN: dict = {}
KEPT = 4


def _opened(ds_ref, layout: dict, cluster: ClusterOptions) -> tuple:
    """``(dataset, router)`` for a read task of ``layout`` in this process: made by its first read
    task (the dataset from the object store, a :class:`BlockRouter` with the cluster's secret and
    its connections to the owners' data endpoints), reused by the next ones, so a task costs no
    Ray call and no handshake once its process has read the dataset. The oldest of more than
    :data:`KEPT` is closed."""
    key = (layout["token"], cluster.peer_timeout_s, cluster.retry_s)
    got = _OPEN.get(key)
    if got is None:
        ds = ray.get(ds_ref)
        counters = ByteCounters()
        counters.size_tags(len(ds.blocks))
        router = BlockRouter(
            layout["dref"],
            layout["members"],
            layout["owner"],
            -1,  # this process keeps no cache: every block comes from its owner's service
            counters,
            timeout_s=cluster.peer_timeout_s,
            retry_s=cluster.retry_s,
            prior=layout["prior"],
            names=layout["names"],
        )
        got = _OPEN[key] = (ds, router, counters)
        while len(_OPEN) > KEPT:
            _, old_router, old_counters = _OPEN.pop(next(iter(_OPEN)))
            old_router.close()
            old_counters.close()
    return got[0], got[1]


def read_blocks(ds, router: BlockRouter, blocks: np.ndarray) -> Iterator:
    """The rows of ``blocks`` (block ids of ``ds``) as ``pyarrow.Table`` objects (:data:`COLUMNS`)
    of about :data:`YIELD_BYTES` each (Ray Data stores and reports each one: one per cache block
    cost it more CPU than the reads). Each block is read whole through ``router`` (from its
    owner's data endpoint, module doc) and checked against the index checksums. ``ds``: the
    dataset, no cache (its index and origin). A block's payloads are gathered into the table's
    one value buffer (one copy, no Python object per sample).

    Raises :class:`stoker.ChecksumError` naming the sample's key, shard and the dataset's URL
    when the origin's bytes are wrong (a peer's wrong bytes are refused and the origin read),
    and :class:`stoker.OriginError` naming the shard's URL when the origin fails."""
    import pyarrow as pa

    index = ds.index
    tables: list = []
    held = 0
    for b in (int(x) for x in blocks):
        start, end = int(ds.blocks.start[b]), int(ds.blocks.end[b])
        data = router.read(ds, b, start, end, block=True, verify=functools.partial(verify_block, ds, b))
        ids = ds.blocks.samples(b)
        tables.append(
            pa.table(
                {
                    "key": index.keys.take(pa.array(ids)).cast(pa.string()),
                    "id": pa.array(ids, pa.int64()),
                    "label": pa.array(index.labels[ids], pa.int64()),
                    "bytes": payloads(data, index.offset[ids] - start, index.length[ids]),
                }
            )
        )
        held += end - start
        if held >= YIELD_BYTES:
            yield pa.concat_tables(tables)
            tables, held = [], 0
    if tables:
        yield pa.concat_tables(tables)


def payloads(data, offsets: np.ndarray, lengths: np.ndarray):
    """A ``pyarrow`` binary array of the ranges ``[offsets[k], offsets[k] + lengths[k])`` of
    ``data`` (bytes-like; int64 offsets and lengths in bytes), its values gathered into one
    buffer. ValueError when they add up to 2 GiB or more (a binary array's int32 offsets)."""
    import pyarrow as pa

    buf = np.frombuffer(data, dtype=np.uint8)
    ends = np.cumsum(np.asarray(lengths, np.int64))
    total = int(ends[-1]) if len(ends) else 0
    if total >= 1 << 31:
        raise ValueError(f"{total} bytes of samples in one block: a binary column holds less than 2 GiB")
    values = np.empty(total, dtype=np.uint8)
    at = 0
    for o, n in zip(np.asarray(offsets).tolist(), np.asarray(lengths).tolist(), strict=True):
        values[at : at + n] = buf[o : o + n]
        at += n
    starts = np.zeros(len(ends) + 1, dtype=np.int32)
    starts[1:] = ends
    return pa.Array.from_buffers(pa.binary(), len(ends), [None, pa.py_buffer(starts), pa.py_buffer(values)])


def task_groups(blocks: np.ndarray, tasks: int) -> list[np.ndarray]:
    """``blocks`` (block ids, in read order) cut into at most ``tasks`` contiguous groups of
    sizes that differ by at most one; no group is empty (``[]`` for no blocks)."""
    if len(blocks) == 0:
        return []
    return [g for g in np.array_split(np.asarray(blocks, np.int64), max(1, min(int(tasks), len(blocks)))) if len(g)]


def task_count(ds, blocks: np.ndarray, blocks_per_task: int | None = None) -> int:
    """How many read tasks read ``blocks`` (block ids of ``ds``): ``ceil(len / blocks_per_task)``,
    or by default one per :data:`TASK_BYTES` of blocks (at least 1, at most one per block). Ray
    Data is given this as ``override_num_blocks``: left to itself it asks for at least 200 read
    tasks and splits every task's output to make up the number, and its CPU per pass grows with
    the blocks it moves (a warm pass over 260 MB of 65 kB samples on 2 cores took 2.2 s split, 1.0 s not)."""
    n = len(blocks)
    if n == 0:
        return 1
    if blocks_per_task is not None:
        return -(-n // int(blocks_per_task))
    return max(1, min(n, int(ds.blocks.nbytes(np.asarray(blocks, np.int64)).sum()) // TASK_BYTES))


class BlockSource:
    """The blocks of one node as a ``ray.data.Datasource`` (made by :func:`datasource`, which
    subclasses Ray's class on first use: ``import stoker`` never imports Ray Data).

    ``ds_ref``: the dataset without cache, in Ray's object store; ``ds``: the same, for the
    sizes; ``layout``: :func:`_layout`'s; ``blocks``: this source's block ids, in read order;
    ``cluster``: :class:`ClusterOptions`. Its read tasks are as many as Ray Data's parallelism
    asks for (:func:`read` gives it :func:`task_count` as ``override_num_blocks``)."""

    def __init__(self, ds_ref, ds, layout: dict, blocks: np.ndarray, cluster: ClusterOptions):
        super().__init__()
        self._ref, self._layout, self._blocks, self._cluster = ds_ref, layout, blocks, cluster
        self._rows = np.array([len(ds.blocks.samples(int(b))) for b in blocks], dtype=np.int64)
        self._bytes = ds.blocks.nbytes(np.asarray(blocks, np.int64)).astype(np.int64)
        self._url = ds.url

    def get_name(self) -> str:
        return "StokerCluster"

    def estimate_inmemory_data_size(self) -> int:
        """Bytes of this source's blocks (the payloads, plus headers: an upper bound)."""
        return int(self._bytes.sum())

    def get_read_tasks(self, parallelism: int, per_task_row_limit=None, data_context=None) -> list:
        """One ``ReadTask`` per group of blocks (:func:`task_groups`); ``per_task_row_limit`` is
        passed on to Ray Data, which stops each task's rows there (a ``limit()``)."""
        from ray.data.block import BlockMetadata
        from ray.data.datasource import ReadTask

        pos = {int(b): k for k, b in enumerate(self._blocks)}
        out = []
        for group in task_groups(self._blocks, int(parallelism)):
            ks = [pos[int(b)] for b in group]
            meta = BlockMetadata(
                num_rows=int(self._rows[ks].sum()),
                size_bytes=int(self._bytes[ks].sum()),
                input_files=None,
                exec_stats=None,
            )
            fn = _task(self._ref, self._layout, group, self._cluster)
            out.append(ReadTask(fn, meta, schema=schema(), per_task_row_limit=per_task_row_limit))
        return out


def _task(ds_ref, layout: dict, group: np.ndarray, cluster: ClusterOptions):
    """The body of one read task: the dataset from the object store, then :func:`read_blocks`."""

    def run():
        ds, router = _opened(ds_ref, layout, cluster)
        yield from read_blocks(ds, router, group)

    return run


def schema():
    """The ``pyarrow.Schema`` of the rows (:data:`COLUMNS`)."""
    import pyarrow as pa

    return pa.schema([("key", pa.string()), ("id", pa.int64()), ("label", pa.int64()), ("bytes", pa.binary())])


_CLASS: list = []


def datasource(*args):
    """A :class:`BlockSource` that is a ``ray.data.Datasource`` (the class made once)."""
    if not _CLASS:
        from ray.data import Datasource

        _CLASS.append(type("StokerBlockSource", (BlockSource, Datasource), {"__module__": __name__}))
    return _CLASS[0](*args)


def read(
    url: str,
    *,
    storage_options: dict | None = None,
    cache_dir: str | None = None,
    cache_bytes: int | str | dict | None = None,
    cache: CacheOptions | None = None,
    block_bytes: int | str | None = None,
    cluster: ClusterOptions | None = None,
    blocks_per_task: int | None = None,
    num_cpus: float = 0.25,
):
    """The packed dataset at ``url`` as a ``ray.data.Dataset`` read through the node caches of
    the Ray cluster (module doc): one row per sample, every sample once per pass, with the
    columns ``key`` (string), ``id`` (int64: the sample id, as ``stoker.Dataset``'s), ``label``
    (int64, -1 where the sample has none) and ``bytes`` (binary: the primary payload, the bytes
    of ``Dataset.read(id)``, checked against the index). Decode with Ray Data's own
    ``map_batches``. Rows come in no fixed order (Ray Data's read tasks finish in any order).

    ``storage_options``, ``cache_dir``, ``cache_bytes``, ``cache`` and ``block_bytes``: as
    :func:`stoker.cluster.run` (they apply to cache services started now; running services keep
    theirs, with a warning); for 0 origin bytes from the second pass on, the services' budgets
    must hold the dataset. ``cluster``: :class:`ClusterOptions`, of which ``peer_timeout_s`` and
    ``retry_s`` apply. ``blocks_per_task``: the most cache blocks one read task reads (default:
    :data:`TASK_BYTES` of blocks per task, :func:`task_count`). ``num_cpus``:
    CPUs each read task reserves (its work is I/O and a copy).

    Needs ``ray.init()`` first (RuntimeError otherwise). Raises what
    :func:`stoker.cluster.service.cache_service.prepare` raises (``stoker.OriginNotFoundError``
    naming the index's URL when there is no dataset at ``url``, ``stoker.ServiceStartError``,
    ValueError for a budget of 0); ValueError for ``blocks_per_task`` below 1. A pass raises what
    :func:`read_blocks` raises, in Ray's error.
    """
    import ray.data
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    if blocks_per_task is not None and int(blocks_per_task) < 1:
        raise ValueError(f"blocks_per_task must be at least 1, got {blocks_per_task!r}")
    cache, cluster = cluster_door(
        "stoker.ray_data.read", cache, cache_dir, cache_bytes, cluster, {}, ("peer_timeout_s", "retry_s")
    )
    opts = dict(storage_options or {})
    ds, layout = _layout(url, opts, cache, block_bytes)
    ref = ray.put(ds)
    owner = np.asarray(layout["owner"])
    reads = []
    for k, node in enumerate(layout["members"]):
        blocks = np.flatnonzero(owner == k)
        if len(blocks) == 0:
            continue
        source = datasource(ref, ds, layout, blocks, cluster)
        tasks = task_count(ds, blocks, blocks_per_task)
        args = {"scheduling_strategy": NodeAffinitySchedulingStrategy(node, soft=True)}
        with warnings.catch_warnings():  # a soft node affinity has no named parameter (module doc)
            warnings.filterwarnings("ignore", message=".*ray_remote_args.*deprecated")
            reads.append(
                ray.data.read_datasource(source, ray_remote_args=args, num_cpus=num_cpus, override_num_blocks=tasks)
            )
    if not reads:  # a dataset with no samples: an empty dataset of the same columns
        return ray.data.from_arrow(schema().empty_table())
    return reads[0].union(*reads[1:]) if len(reads) > 1 else reads[0]
