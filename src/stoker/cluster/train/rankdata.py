"""A rank's cluster reads in a job that stoker did not start: a Ray Train worker, any Ray task.

:func:`stoker.cluster.run` places the ranks itself and hands each one a
:class:`~stoker.cluster.jobs.job.WorkerContext`. Here the ranks are already placed (Ray Train put
them, best with :func:`stoker.cluster.placement_hint`), and :func:`rank_context` builds the same
context from inside a rank:

1. the rank and world size: the arguments, else ``ray.train.get_context()``, else the
   ``torch.distributed`` group or ``$RANK``/``$WORLD_SIZE`` (:mod:`stoker.loader.world`);
2. every rank's node, all-gathered (:mod:`stoker.cluster.train.allgather`: the process group when one
   is up, else a named Ray actor keyed by ``job``);
3. rank 0 starts or finds the cache services (:func:`stoker.cluster.service.cache_service.prepare`), settles
   the dataset's placement members with the ranks' nodes as the job's
   (:func:`stoker.cluster.service.records.settle_record`) and sends every rank the same layout, so
   every rank computes the same block owners and the same co-located plans
   (:func:`stoker.cluster.schedule.colocated_plans`: exactly once per epoch, equal counts);
4. each rank opens the dataset through its node cache with a :class:`BlockRouter` (node cache
   → owning peer → origin; a block whose owner changed when the members last grew from its
   previous owner first, :mod:`stoker.cluster.handoff`) with its connections to the peers' data endpoints.

The context owns what step 4 made and ends it (:meth:`RankContext.close`; this folder's README.md).
"""

from __future__ import annotations

import logging
import sys
import uuid
import weakref

import ray

from ...cache.spec import CacheOptions
from ...errors import RankSetupError
from ..counters import ByteCounters
from ..handoff import previous_layout, prior_owner
from ..identity import node_labels
from ..jobs.job import ClusterLoader, WorkerContext
from ..placement import place_dataset
from ..registration import end as end_registration
from ..service.cache_service import dataset_ref, get_service, placement_keys, prepare
from ..service.records import settle_record
from ..service.routed import announce, open_on_node, route
from ..settings import ClusterOptions, cluster_door
from .allgather import Exchange

log = logging.getLogger(__name__)

#: The old keywords of :func:`rank_context` that moved into :class:`ClusterOptions`.
MOVED = ("job", "timeout_s", "peer_timeout_s", "retry_s")


def _ray_train_context():
    """``ray.train.get_context()`` inside a Ray Train worker, else None (Ray Train not imported in
    this process, or not a training worker)."""
    if "ray.train" not in sys.modules:
        return None
    try:
        import ray.train

        return ray.train.get_context()
    except Exception:  # noqa: BLE001 - outside a training worker get_context raises RuntimeError
        return None


def rank_and_world(rank: int | None = None, world_size: int | None = None) -> tuple[int, int]:
    """``(rank, world_size)``: each argument given wins; one left None comes from the Ray Train
    context (``get_world_rank()``, ``get_world_size()``), else from the ``torch.distributed``
    group or ``$RANK``/``$WORLD_SIZE`` (:func:`stoker.loader.world.from_environment`), else rank 0
    of 1. ValueError for a rank outside ``[0, world_size)``."""
    from ...loader.world import from_environment

    env: tuple[int, int] | None = None
    if rank is None or world_size is None:
        train = _ray_train_context()
        env = (int(train.get_world_rank()), int(train.get_world_size())) if train is not None else from_environment()
    env = env or (0, 1)
    r = int(env[0] if rank is None else rank)
    w = int(env[1] if world_size is None else world_size)
    if w < 1 or not 0 <= r < w:
        raise ValueError(f"rank must be in [0, world_size), got rank={r}, world_size={w}")
    return r, w


def _job_name(job: str | None) -> str | None:
    """``job``, else the Ray Train experiment name, else None."""
    if job is not None:
        return str(job)
    train = _ray_train_context()
    return None if train is None else str(train.get_experiment_name())


def _layout(url, opts, cache: CacheOptions, block_bytes, rank_nodes: list[str], job: str) -> dict:
    """Rank 0's part: the services (started where missing), the dataset's placement members with
    the ranks' nodes as the job's nodes, and what every rank needs to place the blocks alike.
    Announces the job on every service (``hold``); the token is in the layout."""
    services, ds, dref = prepare(url, opts, cache, block_bytes)
    nodes = list(services)
    cached = ray.get([get_service(n).cached_bytes.remote(dref) for n in nodes])
    job_nodes = [n for n in rank_nodes if n in services]
    have = [n for n, c in zip(nodes, cached, strict=True) if c > 0]
    proposal = have or sorted(set(job_nodes)) or nodes
    record = settle_record(services, ds.version, int(ds.index.total_bytes), proposal, job_nodes or nodes)
    members = [m for m in record["members"] if m in services] or sorted(set(job_nodes)) or nodes
    token = f"{job}-{uuid.uuid4().hex[:12]}"
    announce(nodes, "hold", dref, token)
    return {
        "version": ds.version,
        "block_bytes": ds.block_bytes,
        "members": members,
        "keys": placement_keys(services, members),
        "names": node_labels(members, services),
        "budgets": [int(services[m]["cache_bytes"]) for m in members],
        "previous": previous_layout(services, members, record["previous"]),
        "services": {n: services[n] for n in set(rank_nodes) if n in services},
        "nodes": nodes,
        "token": token,
    }


def rank_context(
    url: str,
    rank: int | None = None,
    world_size: int | None = None,
    *,
    storage_options: dict | None = None,
    cache_dir: str | None = None,
    cache_bytes: int | str | dict | None = None,
    cache: CacheOptions | None = None,
    block_bytes: int | str | None = None,
    cluster: ClusterOptions | None = None,
    **deprecated,
) -> RankContext:
    """This rank's :class:`RankContext`: the dataset at ``url`` read through the cluster (node
    cache → owning peer → origin) and the rank's co-located plans (module doc). Every rank of the
    job must call it, with the same arguments but ``rank``.

    ``rank``/``world_size``: as :func:`rank_and_world`. ``storage_options``, ``cache_dir``,
    ``cache_bytes``, ``cache`` and ``block_bytes``: as :func:`stoker.cluster.run` (they apply to
    cache services started now). ``cluster``: :class:`stoker.cluster.settings.ClusterOptions`, of
    which ``job`` (the job's name: needed only without a ``torch.distributed`` group of the job's
    size; default the Ray Train experiment name), ``timeout_s`` (the longest wait for the other
    ranks, default 120 s), ``peer_timeout_s`` and ``retry_s`` apply. ``job=``, ``timeout_s=``,
    ``peer_timeout_s=`` and ``retry_s=`` themselves are still taken, with a DeprecationWarning.

    Needs a Ray worker or ``ray.init()`` first (RuntimeError otherwise). Raises ValueError for a
    bad rank or a missing ``job``; :class:`stoker.errors.RankSetupError` when the ranks do not all
    report within ``timeout_s`` (through the Ray actor; over a process group the group's own
    timeout applies, and Ray Train ends the other workers when one fails), when rank 0 could not
    place the dataset (its error quoted; rank 0 raises the error itself), or when the dataset at
    ``url`` changed between the ranks; rank 0 raises what :func:`stoker.cluster.service.cache_service.prepare`
    raises.
    """
    cache, cluster = cluster_door("rank_context", cache, cache_dir, cache_bytes, cluster, deprecated, MOVED)
    if not ray.is_initialized():
        raise RuntimeError("stoker.cluster.rank_context runs in a Ray worker or after ray.init()")
    r, w = rank_and_world(rank, world_size)
    name = _job_name(cluster.job)
    ex = Exchange(r, w, name or "job", 120.0 if cluster.timeout_s is None else cluster.timeout_s)
    if ex.via == "ray" and w > 1 and name is None:
        raise ValueError(
            "stoker.cluster.rank_context without a torch.distributed group needs ClusterOptions(job=...) (the "
            "same name on every rank of the job, unique among the jobs running at once)"
        )
    opts = dict(storage_options or {})
    node = ray.get_runtime_context().get_node_id()
    rank_nodes = ex.all_gather(node)
    layout: dict | None = None
    if r == 0:
        try:
            layout = _layout(url, opts, cache, block_bytes, rank_nodes, name or "job")
        except BaseException as exc:
            ex.all_gather({"error": f"{type(exc).__name__}: {exc}"}, last=True)
            raise
    layout = ex.all_gather(layout, last=True)[0]
    if "error" in layout:
        raise RankSetupError(f"rank 0 could not place {url} for job {name!r}: {layout['error']}")
    return _open(url, opts, r, w, node, rank_nodes, layout, name or "job", cluster)


def _open(url, opts, rank, world, node, rank_nodes, layout, job, cluster: ClusterOptions) -> RankContext:
    """Step 4 of the module doc: the rank's routed dataset and its context."""
    ds = open_on_node(url, opts, layout["services"].get(node), layout["block_bytes"])
    counters = router = None
    try:
        if ds.version != layout["version"]:
            raise RankSetupError(
                f"{url} changed between the ranks of job {job!r}: rank {rank} opened version {ds.version}, "
                f"rank 0 placed {layout['version']}"
            )
        counters = ByteCounters()
        counters.size_tags(len(ds.blocks))
        members = layout["members"]
        owner = place_dataset(ds, layout["keys"], layout["budgets"])
        prior = prior_owner(ds, members, owner, layout.get("previous"))  # blocks to hand off
        args = (counters, cluster.peer_timeout_s, cluster.retry_s, prior, layout.get("names"))
        routed, router = route(ds, opts, members, owner, node, *args)
        index_of = {m: i for i, m in enumerate(members)}
        spec = {
            "rank": rank,
            "world_size": world,
            "node_id": node,
            "job": job,
            "placement": "colocated",
            "rank_nodes": [index_of.get(n, -1 - k) for k, n in enumerate(rank_nodes)],
            "rank_node_ids": list(rank_nodes),
            "token": layout["token"],
            "owner": owner,
        }
        hold = (layout["nodes"], dataset_ref(ds, opts), layout["token"]) if rank == 0 else None
        return RankContext(spec, routed, counters, router, hold)
    except BaseException:
        if router is not None:
            router.close()
        if counters is not None:
            counters.close()
        end_registration(ds)
        raise


def _close_parts(router, ds, counters, hold) -> None:
    """End what a :class:`RankContext` owns (its finalizer: no reference to the context)."""
    try:
        router.close()
        end_registration(ds)
        counters.close()
    finally:
        if hold is not None and ray.is_initialized():
            nodes, dref, token = hold
            announce(nodes, "release", dref, token)


class RankContext(WorkerContext):
    """A :class:`stoker.cluster.jobs.job.WorkerContext` made by a rank itself (:func:`rank_context`):
    ``rank``, ``world_size``, ``node_id``, ``dataset`` (read through the cluster), ``counters``,
    :meth:`plan`, :meth:`measure`, ``epochs``, :meth:`loader` (a :class:`RankLoader`), and
    :meth:`init_process_group` for ranks that have no ``torch.distributed`` group yet (plain Ray
    tasks; a Ray Train ``TorchTrainer`` worker has one).

    :meth:`close` (or leaving a ``with`` block, dropping the context, the end of the process) ends
    its connections to the peers, its byte counters, its registration on the node cache and, on rank 0, the job's
    hold on the cache services. Its loaders cannot start an epoch after that
    (:class:`stoker.errors.RankSetupError`).
    """

    def __init__(self, spec: dict, dataset, counters: ByteCounters, router, hold):
        super().__init__(spec, dataset, counters)
        self._finalizer = weakref.finalize(self, _close_parts, router, dataset, counters, hold)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran."""
        return not self._finalizer.alive

    def close(self) -> None:
        """End the rank's cluster reads (class doc) and the process group of
        :meth:`init_process_group` if one is open. Idempotent."""
        try:
            self.close_process_group()
        finally:
            self._finalizer()

    def __enter__(self) -> RankContext:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def loader(self, batch_size: int, dataset=None, **kwargs) -> RankLoader:
        """A :class:`RankLoader` over this rank's co-located plan (keyword arguments as Loader's,
        and ``dataset=``: a subset of :attr:`dataset`, as :meth:`WorkerContext.loader`); closing
        it leaves this context open."""
        return RankLoader(self, batch_size, dataset=dataset, **kwargs)


class RankLoader(ClusterLoader):
    """:class:`stoker.cluster.jobs.job.ClusterLoader` of a :class:`RankContext`: a :class:`stoker.Loader`
    whose epochs follow the rank's co-located plan and are recorded in ``context.epochs``.

    ``owns_context``: :meth:`close` closes the context too (:func:`rank_loader`), after which the
    loader cannot start another epoch (:class:`stoker.errors.RankSetupError`).
    """

    def __init__(self, ctx: RankContext, batch_size: int, owns_context: bool = False, **kwargs):
        super().__init__(ctx, batch_size, **kwargs)
        self.context, self.owns_context = ctx, bool(owns_context)

    def __iter__(self):
        if self.context.closed:
            raise RankSetupError(
                f"rank {self.rank}'s cluster reads of {self.dataset.url} are closed: make a new "
                "stoker.cluster.rank_loader to read again"
            )
        return super().__iter__()

    def close(self) -> None:
        """Stop the loader's processes (as :meth:`stoker.Loader.close`) and, with
        ``owns_context``, end the rank's cluster reads (:meth:`RankContext.close`)."""
        super().close()
        if getattr(self, "owns_context", False):
            self.context.close()


def rank_loader(url: str, batch_size: int, rank: int | None = None, world_size: int | None = None, **kwargs):
    """A :class:`RankLoader` over this rank's co-located plan of the dataset at ``url``, read
    through the cluster: :func:`rank_context` (its keyword arguments: ``storage_options``,
    ``cache_dir``, ``cache_bytes``, ``cache``, ``block_bytes``, ``cluster``, and its old ones)
    then :meth:`RankContext.loader` (every other keyword argument goes to :class:`stoker.Loader`:
    ``num_workers``, ``seed``, ``read=`` ...). Its :meth:`RankLoader.close` ends the rank's
    cluster reads too; ``loader.context`` holds the per-epoch byte records. Raises what both
    raise."""
    names = ("storage_options", "cache_dir", "cache_bytes", "cache", "block_bytes", "cluster", "cache_root", *MOVED)
    ctx = rank_context(url, rank, world_size, **{k: kwargs.pop(k) for k in names if k in kwargs})
    try:
        return RankLoader(ctx, batch_size, owns_context=True, **kwargs)
    except BaseException:
        ctx.close()
        raise
