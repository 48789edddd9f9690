"""``stoker.cluster.run``: training workers placed next to their cached data (TDCS on Ray).

The driver's steps are listed in this folder's README.md (the members it settles:
:mod:`stoker.cluster.service.records`). Each rank reads through its node cache, then the owning
peer, then the origin, and gets the samples cached on its node as far as exactly-once and equal
counts allow (:func:`colocated_shares`; ``ClusterOptions(placement="random")``: the plain split).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import time
import uuid

import numpy as np
import ray

from ...cache.spec import CacheOptions
from ...errors import ProcessGroupError
from ...loader import Loader
from ...loader.options import order_of
from ...order import EpochShares, interleaved_shares, permutation
from ..capacity import rank_request
from ..counters import ByteCounters, fractions
from ..handoff import previous_layout, prior_owner
from ..identity import node_labels
from ..placement import bytes_per_node, place_dataset
from ..registration import end as end_registration
from ..schedule import choose_nodes, colocated_shares
from ..service.cache_service import get_service, placement_keys, prepare
from ..service.records import settle_record
from ..service.routed import announce, open_on_node, route
from ..settings import FIELDS, ClusterOptions, cluster_door
from .gang import JobRefs, gather, node_slots, release, reserve, stamp_failure, task_options
from .rendezvous import ProcessGroup, check_backend

log = logging.getLogger(__name__)


class WorkerContext:
    """What ``train_fn`` gets on its rank.

    ``rank``/``world_size``; ``node_id``; ``dataset``: the :class:`stoker.store.dataset.Dataset`
    read through the cluster (node cache → peer → origin: a view with this rank's reader, whose
    router is ``dataset.reader.router``, :mod:`stoker.store.blocks`); ``counters``: this rank's
    :class:`ByteCounters`; ``epochs``: per-epoch records (see :meth:`measure`), returned to the
    driver. :meth:`loader` builds a :class:`ClusterLoader`; :meth:`plan` gives this rank's
    sample ids of an epoch; :meth:`init_process_group` sets up ``torch.distributed`` over the
    job's ranks (``process_group``: the one open, else None).
    """

    def __init__(self, spec: dict, dataset, counters: ByteCounters):
        self.rank, self.world_size = spec["rank"], spec["world_size"]
        self.node_id, self.job, self.placement = spec["node_id"], spec["job"], spec["placement"]
        self.dataset, self.counters = dataset, counters
        self._rank_nodes = spec["rank_nodes"]  # node index (in the members) per rank; -1 - r if none
        self._sample_node = np.asarray(spec["owner"])[dataset.blocks.sample_block] if len(dataset.blocks) else None
        self._plans: dict = {}
        self.epochs: list[dict] = []
        self._node_ids, self._token = spec["rank_node_ids"], spec["token"]
        self.process_group: ProcessGroup | None = None

    def init_process_group(self, backend: str = "gloo", timeout_s: float = 1800.0) -> ProcessGroup:
        """Set up the default ``torch.distributed`` process group over the job's ranks: sets
        ``MASTER_ADDR`` (rank 0's node address), ``MASTER_PORT`` (a free port rank 0 binds on its
        node), ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` (this job's ranks
        on this node) and calls ``torch.distributed.init_process_group`` (every rank must call
        it). Returns the :class:`stoker.cluster.jobs.rendezvous.ProcessGroup`, also a context manager
        that closes it; a group still open when ``train_fn`` returns, raises or is cancelled is
        destroyed then. ``timeout_s``: seconds to wait for rank 0's address, and torch's limit per
        collective. Raises ValueError for a backend other than ``"gloo"``/``"nccl"`` and
        :class:`stoker.errors.ProcessGroupError` for ``nccl`` without a GPU, a group already
        open on this rank, or rank 0's address not there within ``timeout_s``."""
        if self.process_group is not None:
            raise ProcessGroupError(
                f"rank {self.rank}: a {self.process_group.backend!r} process group is already open for this job "
                f"(run(cluster=ClusterOptions(process_group=...)) opens one before train_fn)"
            )
        group = ProcessGroup(self.rank, self.world_size, self._node_ids, f"stoker-pg-{self._token}", backend, timeout_s)
        group.open()
        self.process_group = group
        return group

    def close_process_group(self) -> None:
        """Destroy the process group of :meth:`init_process_group`, if one is open (the rank's
        end does it too)."""
        group, self.process_group = self.process_group, None
        if group is not None:
            group.close()

    def peer_samples(self) -> np.ndarray:
        """Ids (int64, ascending) of the samples whose block a peer owns, not this rank's node:
        each read of one goes to that peer (when this node has no copy of its own)."""
        if self._sample_node is None:
            return np.zeros(0, dtype=np.int64)
        return np.flatnonzero(self._sample_node != self._rank_nodes[self.rank]).astype(np.int64)

    def local_samples(self) -> np.ndarray:
        """Ids (int64, ascending) of the samples whose block this rank's node owns (read from its
        own node cache once cached); empty when the node owns none."""
        if self._sample_node is None:
            return np.zeros(0, dtype=np.int64)
        return np.flatnonzero(self._sample_node == self._rank_nodes[self.rank]).astype(np.int64)

    def plan(
        self, epoch: int, seed: int = 0, order: str = "blockwise", window: int = 16, even: str = "pad"
    ) -> np.ndarray:
        """This rank's sample ids (int64) for ``epoch``: the permutation ``order`` of (seed, epoch)
        split over the ranks, co-located (``placement="colocated"``) or plain (``"random"``)."""
        return self.shares(epoch, seed, order, window, even).plan(self.rank)

    def shares(
        self,
        epoch: int,
        seed: int = 0,
        order: str = "blockwise",
        window: int = 16,
        even: str = "pad",
        served: np.ndarray | None = None,
        selection: np.ndarray | None = None,
    ) -> EpochShares:
        """Every rank's share of ``epoch`` (:class:`stoker.order.EpochShares`; :meth:`plan` is this
        rank's): the permutation ``order`` of (seed, epoch) split over the job's ranks,
        co-located (:func:`stoker.cluster.schedule.colocated_shares`) or plain (``"random"``:
        :func:`stoker.order.interleaved_shares`). ``served``: samples already served (bool by
        sample id; a resumed epoch), only the rest is split. Every rank computes the same shares
        (from the job's layout), so any rank can say what all of them have served.
        ``selection``: the samples of a subset (``Dataset.selection``, the packed ids): the
        shares are then of its own samples, ``0..len(selection)-1`` (``selection[i]`` the packed
        id), each placed by its block's owner as in the whole dataset."""
        digest = None if served is None else hashlib.blake2b(np.packbits(served).tobytes(), digest_size=16).digest()
        which = None if selection is None else hashlib.blake2b(np.asarray(selection).tobytes(), digest_size=16).digest()
        key = (epoch, seed, order, window, even, digest, which)
        if key not in self._plans:
            ds = self.dataset
            groups = ds.blocks.sample_block if selection is None else ds.blocks.sample_block[selection]
            perm = permutation(len(groups), seed, epoch, order, groups=groups, window=window)
            if self.placement == "colocated":
                # no blocks (no samples): none is cached anywhere (-1)
                sample_node = self._sample_node if self._sample_node is not None else np.full(len(ds.index), -1)
                if selection is not None:
                    sample_node = sample_node[selection]
                shares = colocated_shares(perm, sample_node, self._rank_nodes, even, served)
            else:
                shares = interleaved_shares(perm, self.world_size, even, served)
            self._plans = {key: shares}  # the last one only: a plan is asked for again and again
        return self._plans[key]

    @contextlib.contextmanager
    def measure(self, epoch: int, **extra):
        """Record one epoch: bytes read locally / from peers / from the origin / from blocks'
        previous owners by this rank (all of its processes; each byte read counted once, so
        ``local_bytes + peer_bytes + origin_bytes + handoff_bytes == read_bytes``,
        :mod:`stoker.cluster.counters`; ``handoff_bytes``: blocks whose owner changed when the
        dataset's members grew, read from the node that owned them before,
        :mod:`stoker.cluster.handoff`), the bytes received from the origin for it
        (``fetched_origin_bytes``: whole blocks, headers included; ``received_origin_bytes`` /
        ``received_peer_bytes``: what this rank's processes received over each link, the peer
        link's including ``received_handoff_bytes``), seconds, and ``extra`` fields
        (e.g. samples), ``started_at`` (unix seconds); appended to ``epochs``."""
        self.counters.clear_tags()  # blocks fetched before this epoch are local now
        before, t0 = self.counters.read(), time.perf_counter()
        rec = {
            "job": self.job,
            "placement": self.placement,
            "rank": self.rank,
            "node_id": self.node_id,
            "epoch": int(epoch),
            "started_at": time.time(),
        }
        try:
            yield rec
        finally:
            after = self.counters.read()
            d = {k: after[k] - before[k] for k in after}
            rec.update(
                seconds=time.perf_counter() - t0,
                local_bytes=d["local"],
                peer_bytes=d["peer"],
                origin_bytes=d["origin"] + d["peer_origin"],
                peer_origin_bytes=d["peer_origin"],
                handoff_bytes=d["handoff"],
                read_bytes=d["local"] + d["peer"] + d["origin"] + d["peer_origin"] + d["handoff"],
                fetched_origin_bytes=d["fetch_origin"] + d["fetch_peer_origin"],
                received_origin_bytes=d["fetch_origin"],
                received_peer_bytes=d["fetch_peer"] + d["fetch_peer_origin"] + d["fetch_handoff"],
                received_handoff_bytes=d["fetch_handoff"],
                fallbacks=d["fallbacks"],
                dataset_bytes=int(self.dataset.index.length.sum()),
                **fractions(d),
                **extra,
            )
            if rec.get("samples") and rec["seconds"] > 0:
                rec["samples_per_s"] = rec["samples"] / rec["seconds"]
            self.epochs.append(rec)

    def loader(self, batch_size: int, dataset=None, **kwargs) -> "ClusterLoader":
        """A :class:`stoker.Loader` over this rank's co-located plan (keyword arguments as
        Loader's); ``dataset``: a subset of :attr:`dataset` (``ctx.dataset.subset(...)`` or a
        part of ``ctx.dataset.split(...)``) to read instead of all of it."""
        return ClusterLoader(self, batch_size, dataset=dataset, **kwargs)


class ClusterLoader(Loader):
    """:class:`stoker.Loader` whose epoch plan is the rank's co-located plan
    (:meth:`WorkerContext.plan`) and whose epochs are recorded by :meth:`WorkerContext.measure`
    (with the loader's samples, samples/s, stall and exactly-once check)."""

    def __init__(self, ctx: WorkerContext, batch_size: int, dataset=None, **kwargs):
        """``dataset``: ``ctx.dataset`` (None) or a subset of it (ValueError for another dataset:
        its blocks are not the ones this job placed)."""
        self._cluster = ctx
        if dataset is None:
            dataset = ctx.dataset
        elif getattr(dataset, "index", None) is not ctx.dataset.index:
            raise ValueError(
                f"ctx.loader(dataset=...) takes ctx.dataset or a subset of it (ctx.dataset.subset / split), "
                f"not {dataset!r}: this job placed the blocks of {ctx.dataset.url} only"
            )
        super().__init__(dataset, batch_size, rank=ctx.rank, world_size=ctx.world_size, **kwargs)

    def _shares(self, epoch: int, served: np.ndarray | None, world_size: int | None = None) -> EpochShares:
        """The job's co-located shares of ``epoch`` (:meth:`WorkerContext.shares`), whole batches
        with ``drop_last``. For another world size (an old per-rank state's count of batches) the
        plain split's, whose counts are the same."""
        if world_size not in (None, self.world_size):
            return super()._shares(epoch, served, world_size)
        order, window, even = order_of(self.read, self.shuffle), self.read.order_window, self.read.even
        shares = self._cluster.shares(epoch, self.seed, order, window, even, served, self.cfg.sample_ids)
        return shares.whole_batches(self.batch_size) if self.drop_last else shares

    def __iter__(self):
        gen = super().__iter__()
        return self._recorded(gen, self.epoch - 1)

    def _recorded(self, gen, epoch):
        with self._cluster.measure(epoch) as rec:
            yield from gen
            st = self.stats
            assert st is not None  # the epoch's end recorded its stats (Loader._record)
            rec.update(
                samples=st.samples,
                loader_samples_per_s=st.samples_per_s,
                stall_fraction=st.stall_fraction,
                exactly_once=st.exactly_once,
            )


def _rank_main(train_fn, spec: dict):
    """One rank: open the dataset through the cluster, run ``train_fn(ctx)``; returns its records."""
    counters = ByteCounters()
    router = ds = ctx = None
    try:
        opts = spec["storage_options"]
        ds = open_on_node(spec["url"], opts, spec["service"], spec["block_bytes"])
        if ds.version != spec["version"]:
            raise RuntimeError(
                f"{spec['url']} changed during the job: version {ds.version}, the driver placed {spec['version']}"
            )
        counters.size_tags(len(ds.blocks))
        cluster = spec["cluster"]
        args = (spec["node_id"], counters, cluster.peer_timeout_s, cluster.retry_s)
        ds, router = route(ds, opts, spec["members"], spec["owner"], *args, spec.get("prior"), spec.get("names"))
        ctx = WorkerContext(spec, ds, counters)
        if cluster.process_group is not None:
            ctx.init_process_group(cluster.process_group)
        result = train_fn(ctx)
        return {"rank": ctx.rank, "node_id": ctx.node_id, "result": result, "epochs": ctx.epochs}
    except Exception as exc:
        stamp_failure(exc)  # before the group goes: the peers' errors that follow come later
        raise
    finally:
        if ctx is not None:
            ctx.close_process_group()
        if router is not None:
            router.close()
        end_registration(ds)  # this Ray worker lives on, pooled: the job's claim on the budget ends here
        counters.close()


def run(
    train_fn,
    dataset: str,
    num_workers: int,
    resources_per_worker: dict | None = None,
    *,
    storage_options: dict | None = None,
    cache_dir: str | None = None,
    cache_bytes: int | str | dict | None = None,
    cache: CacheOptions | None = None,
    block_bytes: int | str | None = None,
    cluster: ClusterOptions | None = None,
    **deprecated,
):
    """Run ``train_fn(ctx)`` (``ctx``: a :class:`WorkerContext`) on ``num_workers`` ranks placed
    next to the cached ``dataset`` (a packed dataset's URL).

    ``resources_per_worker``: Ray resources of one rank (default one CPU). ``cache``: the node
    caches of the services this call starts (:class:`stoker.CacheOptions`: default directory
    ``<default cache dir>/cluster``, 8 GiB per node, or ``{node id: size}``; running services keep
    theirs); ``cache_dir``/``cache_bytes``: its shortcut. ``block_bytes``: the cache block (default
    1 MiB; every job of a dataset must use the same). ``cluster``: the job's name, placement,
    timeouts and process group (:class:`stoker.cluster.settings.ClusterOptions`); their old flat
    keywords, and ``cache_root`` (of ``cache_dir``), still work with a DeprecationWarning.

    Co-location is a preference, capacity a limit: a node gets no more ranks than its free
    resources hold (:mod:`stoker.cluster.capacity`), and the ranks' resources are reserved on
    their nodes all at once (:func:`stoker.cluster.jobs.gang.reserve`), so they start together.

    Returns per rank ``{rank, node_id, result, epochs}`` (:meth:`WorkerContext.measure`'s
    records), or with ``wait=False`` the ranks' watched Ray refs
    (:class:`stoker.cluster.jobs.gang.JobRefs`). Needs ``ray.init()`` (RuntimeError). Raises,
    before any rank starts, ValueError / TypeError for a bad setting,
    :class:`stoker.errors.ProcessGroupError` for ``"nccl"`` without a GPU and
    :class:`stoker.errors.CapacityError` when the free resources cannot hold the ranks within
    ``start_timeout_s`` (nothing left queued); then the error of the first rank that fails after
    cancelling the others, or ``GetTimeoutError`` after ``timeout_s`` (:func:`gather`).
    """
    cache, cluster = cluster_door("run", cache, cache_dir, cache_bytes, cluster, deprecated, FIELDS)
    if num_workers < 1:
        raise ValueError("num_workers must be >= 1")
    request = rank_request(resources_per_worker)
    if cluster.process_group is not None:
        check_backend(cluster.process_group, request)
    opts = dict(storage_options or {})
    services, ds, dref = prepare(dataset, opts, cache, block_bytes)
    nodes = list(services)
    names = dict(zip(nodes, node_labels(nodes, services), strict=True))  # as `stoker cache status` names them
    slots = node_slots(nodes, request, num_workers, cluster.slots_per_node, cluster.start_timeout_s, names)
    layout = _place(services, ds, dref, num_workers, slots, cluster)
    rank_nodes, rank_names = layout["rank_node_ids"], [names[n] for n in layout["rank_node_ids"]]
    pg = reserve(rank_nodes, request, cluster.start_timeout_s, cluster.job or "job", rank_names)
    token = f"{cluster.job or 'job'}-{uuid.uuid4().hex[:12]}"
    if cluster.wait:  # the services' registrations of the dataset end with this call (release below)
        announce(nodes, "hold", dref, token)
    common = {
        **layout,
        "world_size": num_workers,
        "job": cluster.job or "job",
        "placement": cluster.placement,
        "url": dataset,
        "storage_options": opts,
        "version": ds.version,
        "block_bytes": ds.block_bytes,
        "token": token,
        "cluster": cluster,
    }
    refs = [
        ray.remote(_rank_main)
        .options(**task_options(r, node, request, pg))
        .remote(train_fn, {**common, "rank": r, "node_id": node, "service": services.get(node)})
        for r, node in enumerate(rank_nodes)
    ]
    if not cluster.wait:
        return JobRefs(refs, rank_names, pg)
    try:
        return gather(refs, rank_names, cluster.timeout_s)
    finally:
        release(pg)
        announce(nodes, "release", dref, token)


def _place(services: dict, ds, dref: dict, num_workers: int, slots: list[int], cluster: ClusterOptions) -> dict:
    """Steps (3) and (4) of the module doc: each rank's node, and the dataset's placement members
    and block owners. Returns the rank spec's ``members``, ``owner``, ``prior`` (each block's
    previous owner, :func:`stoker.cluster.handoff.prior_owner`), ``names`` (how messages name each
    member: :func:`stoker.cluster.identity.node_label`), ``rank_nodes`` (member index per rank,
    ``-1 - r`` for none) and ``rank_node_ids`` (node id per rank)."""
    nodes = list(services)
    budgets = [services[n]["cache_bytes"] for n in nodes]
    cached = ray.get([get_service(n).cached_bytes.remote(dref) for n in nodes])
    if cluster.placement == "colocated":
        rank_nodes = choose_nodes(nodes, cached, budgets, num_workers, slots)
    else:
        rank_nodes = _random_nodes(nodes, slots, num_workers, cluster.seed)
    # the dataset's placement members: the record every service keeps, else (first claim wins)
    # the nodes holding it already, else the nodes of this job
    have = [n for n, c in zip(nodes, cached) if c > 0]
    proposal = have or sorted(set(rank_nodes))
    record = settle_record(services, ds.version, int(ds.index.total_bytes), proposal, rank_nodes)
    members = [m for m in record["members"] if m in services]
    if not members:  # every recorded member is gone: place on this job's nodes
        members = sorted(set(rank_nodes))
    owner = place_dataset(ds, placement_keys(services, members), [services[m]["cache_bytes"] for m in members])
    prior = prior_owner(ds, members, owner, previous_layout(services, members, record["previous"]))
    if cluster.placement == "colocated" and set(members) - set(have):  # members with room to fill: ranks go
        owned = bytes_per_node(ds, owner, len(members))  # where the data will be, not only where it is
        rank_nodes = choose_nodes(
            nodes, [int(owned[members.index(n)]) if n in members else 0 for n in nodes], budgets, num_workers, slots
        )
    index_of = {m: i for i, m in enumerate(members)}
    return {
        "members": members,
        "owner": owner,
        "prior": prior,
        "names": node_labels(members, services),
        "rank_nodes": [index_of.get(n, -1 - r) for r, n in enumerate(rank_nodes)],
        "rank_node_ids": rank_nodes,
    }


def _random_nodes(nodes: list[str], slots: list[int], num_workers: int, seed: int) -> list[str]:
    """``num_workers`` nodes drawn at random (seeded by ``seed``), each at most its slots times."""
    rng = np.random.default_rng(seed)
    first = rng.integers(0, len(nodes), num_workers)
    if all(np.sum(first == i) <= k for i, k in enumerate(slots)):  # fits: the draw without limits
        return [nodes[i] for i in first]
    rng = np.random.default_rng(seed)
    left = np.asarray(slots, dtype=np.int64).copy()
    out = []
    for _ in range(num_workers):
        i = int(rng.choice(np.flatnonzero(left > 0)))
        left[i] -= 1
        out.append(nodes[i])
    return out


def read_epochs(
    ctx: WorkerContext, epochs: int, seed: int = 0, keep_ids: bool = False, first_epoch: int = 0
) -> list[dict]:
    """A ``train_fn`` body that reads (and verifies) every sample of the rank's plan for
    epochs ``first_epoch .. first_epoch + epochs - 1`` without decoding; returns ``ctx.epochs``
    (with each epoch's sample ids under ``ids`` if ``keep_ids``). The ranks do not wait for each
    other between epochs (no collective, unlike a DDP job). For tests and ``stoker bench cluster``."""
    for e in range(first_epoch, first_epoch + epochs):
        ids = ctx.plan(e, seed)
        with ctx.measure(e, samples=len(ids)) as rec:
            for i in ids:
                ctx.dataset.read(int(i))
            if keep_ids:
                rec["ids"] = ids.tolist()
    return ctx.epochs
