"""``stoker.cluster.run``: training workers placed next to their cached data (TDCS on Ray).

The driver (1) starts or finds one cache service per node, (2) asks them how many bytes of the
dataset each holds, (3) places the ranks on the nodes that hold the most
(:func:`stoker.cluster.schedule.choose_nodes`), (4) fixes the dataset's placement members (the
first job's nodes, recorded by one service: a new dataset's cache goes to the nodes where its
jobs run) and (5) runs ``train_fn(ctx)`` in one Ray task per rank, pinned to its node. Each rank
reads through its node cache, then the owning peer, then the origin, and gets the samples cached
on its node as far as exactly-once and equal counts allow (:func:`colocated_plans`).
``placement="random"`` (for comparison) puts ranks on random nodes with the plain rank split.
"""
from __future__ import annotations

import contextlib
import time

import numpy as np
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ..loader import Loader
from ..order import permutation
from .counters import ByteCounters, fractions
from .membership import widen
from .placement import bytes_per_node, place_dataset
from .reader import BlockRouter
from .registration import end as end_registration
from .schedule import choose_nodes, colocated_plans
from .service import dataset_ref, get_service, placement_keys, prepare

PLACEMENTS = ("colocated", "random")


class WorkerContext:
    """What ``train_fn`` gets on its rank.

    ``rank``/``world_size``; ``node_id``; ``dataset``: the :class:`stoker.store.dataset.Dataset`
    read through the cluster (node cache → peer → origin); ``counters``: this rank's
    :class:`ByteCounters`; ``epochs``: per-epoch records (see :meth:`measure`), returned to the
    driver. :meth:`loader` builds a :class:`ClusterLoader`; :meth:`plan` gives this rank's
    sample ids of an epoch.
    """

    def __init__(self, spec: dict, dataset, counters: ByteCounters):
        self.rank, self.world_size = spec["rank"], spec["world_size"]
        self.node_id, self.job, self.placement = spec["node_id"], spec["job"], spec["placement"]
        self.dataset, self.counters = dataset, counters
        self._rank_nodes = spec["rank_nodes"]  # node index (in the members) per rank; -1 - r if none
        self._sample_node = np.asarray(spec["owner"])[dataset.sample_block] if dataset.num_blocks else None
        self._plans: dict = {}
        self.epochs: list[dict] = []

    def plan(self, epoch: int, seed: int = 0, order: str = "blockwise", window: int = 16,
             even: str = "pad") -> np.ndarray:
        """This rank's sample ids (int64) for ``epoch``: the permutation ``order`` of (seed, epoch)
        split over the ranks, co-located (``placement="colocated"``) or plain (``"random"``)."""
        key = (epoch, seed, order, window, even)
        if key not in self._plans:
            ds = self.dataset
            perm = permutation(len(ds), seed, epoch, order, groups=ds.sample_block, window=window)
            if self.placement == "colocated":
                plans = colocated_plans(perm, self._sample_node, self._rank_nodes, even)
                self._plans = {key: plans[self.rank]}
            else:
                from ..order import rank_plan
                self._plans = {key: rank_plan(perm, self.rank, self.world_size, even)}
        return self._plans[key]

    @contextlib.contextmanager
    def measure(self, epoch: int, **extra):
        """Record one epoch: bytes read locally / from peers / from the origin by this rank (all of
        its processes), seconds, and ``extra`` fields (e.g. samples); appended to ``epochs``."""
        before, t0 = self.counters.read(), time.perf_counter()
        rec = {"job": self.job, "placement": self.placement, "rank": self.rank, "node_id": self.node_id,
               "epoch": int(epoch)}
        try:
            yield rec
        finally:
            after = self.counters.read()
            d = {k: after[k] - before[k] for k in after}
            rec.update(seconds=time.perf_counter() - t0, local_bytes=d["local"], peer_bytes=d["peer"],
                       origin_bytes=d["origin"] + d["peer_origin"], peer_origin_bytes=d["peer_origin"],
                       fallbacks=d["fallbacks"], dataset_bytes=int(self.dataset.index.length.sum()),
                       **fractions(d), **extra)
            if rec.get("samples") and rec["seconds"] > 0:
                rec["samples_per_s"] = rec["samples"] / rec["seconds"]
            self.epochs.append(rec)

    def loader(self, batch_size: int, **kwargs) -> "ClusterLoader":
        """A :class:`stoker.Loader` over this rank's co-located plan (keyword arguments as Loader's)."""
        return ClusterLoader(self, batch_size, **kwargs)


class ClusterLoader(Loader):
    """:class:`stoker.Loader` whose epoch plan is the rank's co-located plan
    (:meth:`WorkerContext.plan`) and whose epochs are recorded by :meth:`WorkerContext.measure`
    (with the loader's samples, samples/s, stall and exactly-once check)."""

    def __init__(self, ctx: WorkerContext, batch_size: int, **kwargs):
        self._cluster = ctx
        super().__init__(ctx.dataset, batch_size, rank=ctx.rank, world_size=ctx.world_size, **kwargs)

    def plan(self, epoch: int | None = None) -> np.ndarray:
        e = self.epoch if epoch is None else epoch
        ids = self._cluster.plan(e, self.seed, self.order, self.order_window, self.even)
        if self.drop_last:
            ids = ids[: len(ids) // self.batch_size * self.batch_size]
        return ids

    def __iter__(self):
        gen = super().__iter__()
        return self._recorded(gen, self.epoch - 1)

    def _recorded(self, gen, epoch):
        with self._cluster.measure(epoch) as rec:
            yield from gen
            st = self.stats
            rec.update(samples=st.samples, loader_samples_per_s=st.samples_per_s,
                       stall_fraction=st.stall_fraction, exactly_once=st.exactly_once)


def _rank_main(train_fn, spec: dict):
    """One rank: open the dataset through the cluster, run ``train_fn(ctx)``; returns its records."""
    from ..store.dataset import open_dataset
    counters = ByteCounters()
    relay = ds = None
    try:
        info = spec["service"]
        if info is not None:
            ds = open_dataset(spec["url"], info["cache_dir"], info["cache_bytes"], block_bytes=spec["block_bytes"],
                              storage_options=spec["storage_options"], check=False)
        else:
            ds = open_dataset(spec["url"], storage_options=spec["storage_options"], cache=False, check=False,
                              block_bytes=spec["block_bytes"])
        if ds.version != spec["version"]:
            raise RuntimeError(f"{spec['url']} changed during the job: version {ds.version}, "
                               f"the driver placed {spec['version']}")
        members = spec["members"]
        me = members.index(spec["node_id"]) if spec["node_id"] in members else -1
        ds.router = BlockRouter(dataset_ref(ds, spec["storage_options"]), members,
                                np.asarray(spec["owner"]), me, counters, timeout_s=spec["peer_timeout_s"],
                                retry_s=spec["retry_s"])
        relay = ds.router.start_relay()
        ctx = WorkerContext(spec, ds, counters)
        result = train_fn(ctx)
        return {"rank": ctx.rank, "node_id": ctx.node_id, "result": result, "epochs": ctx.epochs}
    finally:
        if relay is not None:
            relay.close()
        end_registration(ds)  # this Ray worker lives on, pooled: the job's claim on the budget ends here
        counters.close()


def _task_options(node_id: str, resources_per_worker: dict | None) -> dict:
    res = dict(resources_per_worker or {"CPU": 1})
    opts = {"num_cpus": res.pop("CPU", 0), "num_gpus": res.pop("GPU", 0),
            "scheduling_strategy": NodeAffinitySchedulingStrategy(node_id, soft=False), "max_retries": 0}
    if res:
        opts["resources"] = res
    return opts


def run(train_fn, dataset: str, num_workers: int, resources_per_worker: dict | None = None, *,
        storage_options: dict | None = None, placement: str = "colocated", cache_root: str | None = None,
        cache_bytes: int | None = None, block_bytes: int | None = None, seed: int = 0, job: str = "job", slots_per_node: int | None = None,
        peer_timeout_s: float = 30.0, retry_s: float = 1.0, timeout_s: float | None = None,
        wait: bool = True):
    """Run ``train_fn(ctx)`` on ``num_workers`` ranks placed next to the cached ``dataset``.

    ``dataset``: URL of a packed dataset; ``resources_per_worker``: Ray resources of one rank
    (``{"CPU": 1, "GPU": 1, ...}``, default one CPU); ``placement``: ``"colocated"`` (TDCS) or
    ``"random"`` (seeded by ``seed``, for comparison); ``cache_root``/``cache_bytes``: where and
    how big the node caches are when this call starts the services (default
    ``$STOKER_CACHE_DIR/cluster``, 8 GiB; services already running keep theirs);
    ``block_bytes``: the cache block (default 1 MiB; every job of a dataset must use the same);
    ``slots_per_node``: most ranks per node. ``ctx`` is a :class:`WorkerContext`.
    Returns, per rank, ``{rank, node_id, result, epochs}`` (``epochs``: the records of
    :meth:`WorkerContext.measure`), or with ``wait=False`` the Ray object refs.
    Needs ``ray.init()`` first. Raises ValueError for a bad placement, the error of the first
    rank that fails (``ray.exceptions.RayTaskError``, ``NodeDiedError`` ...) after cancelling the
    others, ``GetTimeoutError`` after ``timeout_s`` (the ranks cancelled): see :func:`gather`.
    With ``wait=False`` the caller waits, best with :func:`gather`.
    """
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
    if num_workers < 1:
        raise ValueError("num_workers must be >= 1")
    opts = dict(storage_options or {})
    services, ds, dref = prepare(dataset, opts, cache_root, cache_bytes, block_bytes)
    nodes = list(services)
    budgets = [services[n]["cache_bytes"] for n in nodes]
    cached = ray.get([get_service(n).cached_bytes.remote(dref) for n in nodes])
    if placement == "colocated":
        rank_nodes = choose_nodes(nodes, cached, budgets, num_workers,
                                  None if slots_per_node is None else [slots_per_node] * len(nodes))
    else:
        rng = np.random.default_rng(seed)
        rank_nodes = [nodes[i] for i in rng.integers(0, len(nodes), num_workers)]
    # the dataset's placement members: recorded by the first service (first claim wins), from the
    # nodes holding it already, else the nodes of this job
    have = [n for n, c in zip(nodes, cached) if c > 0]
    proposal = have or sorted(set(rank_nodes))
    keeper = get_service(nodes[0])
    recorded = ray.get(keeper.claim.remote(ds.version, proposal, nodes))
    grown = widen(recorded, ray.get(keeper.known.remote(ds.version)),
                  {n: b for n, b in zip(nodes, budgets)}, int(ds.index.total_bytes), rank_nodes)
    if grown != sorted(recorded):  # a node joined, or the members cannot hold the dataset
        recorded = ray.get(keeper.widen.remote(ds.version, grown, nodes))
    members = [m for m in recorded if m in services]
    if not members:  # every recorded member is gone: place on this job's nodes
        members = sorted(set(rank_nodes))
    owner = place_dataset(ds, placement_keys(services, members), [services[m]["cache_bytes"] for m in members])
    if placement == "colocated" and set(members) - set(have):  # members with room to fill: ranks go
        owned = bytes_per_node(ds, owner, len(members))     # where the data will be, not only where it is
        rank_nodes = choose_nodes(nodes, [int(owned[members.index(n)]) if n in members else 0 for n in nodes],
                                  budgets, num_workers, None if slots_per_node is None else [slots_per_node] * len(nodes))
    index_of = {m: i for i, m in enumerate(members)}
    spec_rank_nodes = [index_of.get(n, -1 - r) for r, n in enumerate(rank_nodes)]
    refs = []
    for r, node in enumerate(rank_nodes):
        spec = {"rank": r, "world_size": num_workers, "node_id": node, "job": job, "placement": placement,
                "url": dataset, "storage_options": opts, "version": ds.version, "members": members,
                "block_bytes": ds.block_bytes,
                "owner": owner, "rank_nodes": spec_rank_nodes, "service": services.get(node),
                "peer_timeout_s": peer_timeout_s, "retry_s": retry_s}
        refs.append(ray.remote(_rank_main).options(**_task_options(node, resources_per_worker)).remote(train_fn, spec))
    if not wait:
        return refs
    return gather(refs, rank_nodes, timeout_s)


def gather(refs: list, rank_nodes: list[str] | None = None, timeout_s: float | None = None,
           grace_s: float = 10.0) -> list:
    """The results of a job's ranks (``refs``: one Ray object ref per rank, as ``run(wait=False)``
    returns), in rank order; a job whose ranks are not all there is over.

    The first rank that fails (its error, a ``ray.exceptions.RayTaskError``, or
    ``NodeDiedError``/``WorkerCrashedError`` when its node or process died) ends the job: the other
    ranks are cancelled (``ray.cancel``: a ``KeyboardInterrupt`` in ``train_fn``, so its
    ``finally`` blocks run; a rank still running ``grace_s`` seconds later is stopped with
    ``force=True``) and that error is raised, with a note naming the rank and its node
    (``rank_nodes``: node id per rank). After ``timeout_s`` seconds (None: no limit) the ranks are
    cancelled the same way and ``ray.exceptions.GetTimeoutError`` is raised. Nobody is left
    running with no one waiting for it (a DDP job without one rank waits for it forever).
    """
    index = {ref: r for r, ref in enumerate(refs)}
    pending = list(refs)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while pending:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        done, pending = ray.wait(pending, num_returns=1, timeout=left)
        if not done:
            _cancel(pending, grace_s)
            raise ray.exceptions.GetTimeoutError(
                f"{len(pending)} of {len(refs)} ranks still running after {timeout_s} s; cancelled")
        try:
            ray.get(done[0])
        except Exception as exc:
            r = index[done[0]]
            _cancel(pending, grace_s)
            where = f" on node {rank_nodes[r]}" if rank_nodes else ""
            exc.add_note(f"stoker.cluster: rank {r}{where} failed; the other {len(pending)} running "
                         f"rank(s) of the job were cancelled")
            raise
    return ray.get(refs)


def _cancel(refs: list, grace_s: float) -> None:
    """Cancel the tasks of ``refs``: politely first (KeyboardInterrupt in the task), then, for the
    ones still running after ``grace_s`` seconds, by force."""
    for ref in refs:
        ray.cancel(ref, force=False)
    if not refs:
        return
    _, still = ray.wait(refs, num_returns=len(refs), timeout=grace_s)
    for ref in still:
        ray.cancel(ref, force=True)


def read_epochs(ctx: WorkerContext, epochs: int, seed: int = 0, keep_ids: bool = False,
                first_epoch: int = 0) -> list[dict]:
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
