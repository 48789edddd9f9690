"""``stoker warm URL``: fill the cluster cache with a dataset, all nodes in parallel (Fluid's DataLoad).

What a fault costs and what a rerun fetches: this folder's README.md, "Invariants" (a node's
cache directory and placement are stable across Ray restarts on the same host:
:mod:`stoker.cluster.identity`).
"""

from __future__ import annotations

import logging
import time
import warnings

import numpy as np
import ray
from tqdm import tqdm

from ...cache.spec import CacheOptions
from ...store.dataset import DEFAULT_BLOCK_BYTES, open_dataset
from ..freshness import refreshing
from ..handoff import previous_layout, prior_owner
from ..identity import node_label, node_labels
from ..placement import bytes_per_node, place_dataset
from ..settings import cluster_door
from .cache_service import dataset_ref, error_line, find_services, get_service, placement_keys, prepare
from .records import RETRY_PAUSE_S, SERVICE_TRIES, settle_record
from .records import call as _call

log = logging.getLogger(__name__)

#: Tries of one chunk of blocks whose fill met a dead or restarting cache service, and the pause
#: before each retry (seconds, times the try number): the same as for any call to a service.
FILL_TRIES = SERVICE_TRIES
#: How long a node's fills may go without one answering before its service counts as hung (and the
#: node as down): this many seconds plus the bytes of its requests in flight at ``FILL_MIN_BPS``.
FILL_TIMEOUT_S = 120.0
#: The slowest fill rate (bytes/s) that still counts as progress: 1 MiB/s per node.
FILL_MIN_BPS = float(1 << 20)
#: Seconds a service has to tell, at the end of a warm-up, how much of the dataset it holds.
REPORT_TIMEOUT_S = 30.0


def warm(
    url: str,
    storage_options: dict | None = None,
    *,
    cache_dir: str | None = None,
    cache_bytes: int | str | dict | None = None,
    cache: CacheOptions | None = None,
    block_bytes: int | str | None = None,
    chunk_blocks: int = 16,
    concurrency: int = 8,
    progress: bool = False,
    fill_timeout_s: float | None = None,
    **deprecated,
) -> dict:
    """Fill every node cache with the blocks of ``url`` placed on it; returns a report.

    Services are started where missing (``cache_dir``, ``cache_bytes``, ``cache`` and
    ``block_bytes`` as in :func:`stoker.cluster.run`; ``cache_root=`` and ``detached=``, which
    changed nothing, still work with a DeprecationWarning). The members are the recorded ones (see
    ``run``), else every node with a service. ``chunk_blocks`` blocks per request, ``concurrency``
    ranged GETs per node; a block whose owner changed when the members last grew comes from its
    previous owner's cache when it holds it (:mod:`stoker.cluster.handoff`), else the origin.

    Report: ``{url, version, dataset_bytes, seconds, origin_bytes, handoff_bytes,
    cached_fraction, complete, failed_shards, nodes: {node id: {node_name, cache_key, cache_dir,
    cache_bytes, owned_bytes, cached_bytes, cached_fraction, filled, refused, failed,
    failed_shards, error}}}`` (bytes; ``cached_fraction`` = cached / owned, 1.0 when the node owns
    nothing; ``filled``/``refused``/``failed``: blocks; ``failed_shards``: ``{shard name: reason}``;
    ``complete``: every block cached; ``cache_key``: the name of the node's cache directory,
    ``node-<host>-<slot>``, as ``stoker cache status`` and the warnings name the node, None for a
    node whose service did not start; a node's ``error``: why its service filled nothing more or
    did not answer at the end, else None). Nothing is raised for a block refused by a budget or
    one that fails: the report may be partial. A dead, restarting or hung service is retried and
    then given up as *down* (``FILL_TRIES``, ``RETRY_PAUSE_S``; hung: no fill answered in
    ``fill_timeout_s``, default ``FILL_TIMEOUT_S``, plus its requests' bytes at ``FILL_MIN_BPS``),
    and the rest of its blocks fail, named with the reason; a node whose service cannot start is
    listed with its ``error``, nothing cached. Needs ``ray.init()``; raises what
    :func:`stoker.cluster.service.cache_service.prepare` raises. ``progress``: a tqdm bar on
    stderr (off by default: a library call prints nothing).
    """
    if deprecated.pop("detached", None) is not None:
        warnings.warn("detached= is deprecated; cache services are always detached", DeprecationWarning, stacklevel=2)
    cache, _ = cluster_door("warm", cache, cache_dir, cache_bytes, None, deprecated)
    opts = dict(storage_options or {})
    t0 = time.perf_counter()
    down_at_start: dict[str, str] = {}  # node id -> why its service did not start
    services, ds, dref = prepare(url, opts, cache, block_bytes, down=down_at_start)
    nodes = list(services)
    record = settle_record(services, ds.version, int(ds.index.total_bytes), nodes, [])
    members = [m for m in record["members"] if m in services] or nodes
    owner = place_dataset(ds, placement_keys(services, members), [services[m]["cache_bytes"] for m in members])
    prior = prior_owner(ds, members, owner, previous_layout(services, members, record["previous"]))
    sizes = ds.blocks.nbytes(np.arange(len(ds.blocks)))
    queues = {
        i: [
            np.flatnonzero(owner == i)[k : k + chunk_blocks].tolist()
            for k in range(0, int((owner == i).sum()), chunk_blocks)
        ]
        for i in range(len(members))
    }
    bar = tqdm(total=int(sizes.sum()), unit="B", unit_scale=True, desc=f"warm {url}") if progress else None
    timeout_s = FILL_TIMEOUT_S if fill_timeout_s is None else float(fill_timeout_s)
    fills = _Fills(ds, dref, members, queues, concurrency, bar, timeout_s, prior, node_labels(members, services))
    fills.run()
    if bar is not None:
        bar.close()
    report = {"url": url, "version": ds.version, "dataset_bytes": int(sizes.sum())}
    report.update(_report(fills, services, bytes_per_node(ds, owner, len(members)), dref, down_at_start))
    report["seconds"] = time.perf_counter() - t0
    return report


def _report(fills: _Fills, services: dict, owned: np.ndarray, dref: dict, down_at_start: dict[str, str]) -> dict:
    """The report of a warm-up whose ``fills`` ran (:func:`warm`), but for its ``url``,
    ``version``, ``dataset_bytes`` and ``seconds``: what each member holds now (asked, each
    service given ``REPORT_TIMEOUT_S``), and the nodes whose service did not start."""
    members, dataset_bytes = fills.members, int(owned.sum())
    cached, node_errors = [], {}
    for i, m in enumerate(members):
        try:
            # a hung service must not hang the report: the question is cheap, so it gets a limit
            cached.append(int(_call(get_service(m).cached_bytes, dref, timeout_s=REPORT_TIMEOUT_S)))
        except (ray.exceptions.RayError, ValueError) as exc:  # gone: nothing of it counts as cached
            cached.append(0)
            node_errors[i] = f"cache service did not answer: {error_line(exc)}"
        if i in fills.down:  # why the node's blocks were not filled comes first
            node_errors[i] = fills.down[i]
    totals, errors = fills.totals, fills.errors
    report: dict = {
        "origin_bytes": int(sum(t["origin_bytes"] for t in totals.values())),
        "handoff_bytes": int(sum(t["handoff_bytes"] for t in totals.values())),
        "cached_fraction": float(sum(cached) / dataset_bytes) if dataset_bytes else 1.0,
        "complete": bool(sum(cached) >= dataset_bytes),
        "failed_shards": {sh: why for e in errors.values() for sh, why in e.items()},
        "nodes": {},
    }
    for i, m in enumerate(members):
        report["nodes"][m] = {
            "node_name": services[m]["node_name"],
            "cache_key": services[m].get("cache_key"),
            "cache_dir": services[m].get("cache_dir"),
            "cache_bytes": services[m]["cache_bytes"],
            "owned_bytes": int(owned[i]),
            "cached_bytes": int(cached[i]),
            "cached_fraction": float(cached[i] / owned[i]) if owned[i] else 1.0,
            "filled": totals[i]["filled"],
            "refused": totals[i]["refused"],
            "failed": totals[i]["failed"],
            "failed_shards": dict(sorted(errors[i].items())),
            "error": node_errors.get(i),
        }
    for m, why in down_at_start.items():  # no service: given no blocks, filled nothing
        report["nodes"][m] = {
            **dict.fromkeys(("cache_bytes", "owned_bytes", "cached_bytes", "filled", "refused", "failed"), 0),
            "node_name": m,
            "cache_key": None,
            "cache_dir": None,
            "cached_fraction": 0.0,
            "failed_shards": {},
            "error": why,
        }
    return report


class _Fills:
    """The fill requests of one warm-up: per member node (index ``i`` into ``members``) a queue of
    block chunks, two requests in flight per node (one filling, one queued behind it).

    A request that meets a dead or restarting service (``RayActorError``) is sent again after a
    pause (``RETRY_PAUSE_S`` times the try number; the other nodes' requests go on meanwhile),
    ``FILL_TRIES`` tries in all. A node whose service is gone for good (no service by its name,
    or a request that failed every try) is *down*: its chunk and every chunk still queued for
    it fail at once, named with the reason (``down``: ``{i: reason}``), so a service that stays
    down costs one round of retries, not one per chunk. A node none of whose requests has answered
    for ``timeout_s`` plus their bytes at ``FILL_MIN_BPS`` (since it last answered, or since the
    first was sent) is down too: its service hangs. ``totals``: per node block counts and
    origin bytes; ``errors``: per node ``{shard name: reason}``."""

    def __init__(
        self,
        ds,
        dref: dict,
        members: list[str],
        queues: dict[int, list[list[int]]],
        concurrency: int,
        bar=None,
        timeout_s: float = FILL_TIMEOUT_S,
        prior: np.ndarray | None = None,
        names: list[str] | None = None,
    ):
        self.ds, self.dref, self.members, self.queues = ds, dref, members, queues
        self.names = list(members) if names is None else names  # how messages name each member
        self.prior = prior  # each block's previous owner (index into members, -1: none)
        self.concurrency, self.bar, self.timeout_s = concurrency, bar, timeout_s
        self._progress: dict[int, float] = {}  # node -> when it last answered (or was first sent to)
        self.totals = {
            i: {"filled": 0, "refused": 0, "failed": 0, "origin_bytes": 0, "handoff_bytes": 0} for i in queues
        }
        self.errors: dict[int, dict[str, str]] = {i: {} for i in queues}
        self.down: dict[int, str] = {}
        self._pending: dict = {}  # ref -> (node index, chunk)
        self._later: list[tuple[float, int, list[int]]] = []  # (when, node index, chunk): retries
        self._tries: dict[tuple, int] = {}

    def run(self) -> None:
        """Send every chunk; returns when each is filled or failed."""
        for i in self.queues:
            self._submit(i)
            self._submit(i)
        while self._pending or self._later:
            now = time.monotonic()
            for item in [x for x in self._later if x[0] <= now]:
                self._later.remove(item)
                self._submit(item[1], item[2])
            wakes = [x[0] for x in self._later] + list(self._deadlines().values())
            wait_s = max(0.0, min(wakes) - now) if wakes else None
            if not self._pending:
                time.sleep(wait_s or 0.0)
                continue
            done, _ = ray.wait(list(self._pending), num_returns=1, timeout=wait_s)
            if done:
                self._done(done[0])
            self._give_up_hung()  # also while other nodes' fills keep answering

    def _deadlines(self) -> dict[int, float]:
        """Per node with requests in flight: when it counts as hung if none of them answers."""
        nbytes: dict[int, int] = {}
        for i, chunk in self._pending.values():
            nbytes[i] = nbytes.get(i, 0) + int(self.ds.blocks.nbytes(np.asarray(chunk)).sum())
        return {i: self._progress[i] + self.timeout_s + n / FILL_MIN_BPS for i, n in nbytes.items()}

    def _give_up_hung(self) -> None:
        now = time.monotonic()
        for i, deadline in self._deadlines().items():
            if now < deadline:
                continue
            refs = [ref for ref, (j, _) in self._pending.items() if j == i]
            self._go_down(
                i, f"cache service of {self.names[i]} hangs: no fill answered in {now - self._progress[i]:.0f} s"
            )
            for ref in refs:
                _, chunk = self._pending.pop(ref)
                try:
                    ray.cancel(ref)
                except Exception as exc:  # noqa: BLE001 - the answer is ignored either way
                    log.debug("cancelling a hung fill: %s", exc)
                self._fail(i, chunk, self.down[i])

    def _submit(self, i: int, chunk: list[int] | None = None) -> None:
        if chunk is None:
            if not self.queues[i]:
                return
            chunk = self.queues[i].pop(0)
        if i in self.down:
            self._fail(i, chunk, self.down[i])
            return
        try:
            ref = get_service(self.members[i]).fill.remote(self.dref, chunk, self.concurrency, self._prior_of(chunk))
        except ValueError as exc:  # no service by that name: killed for good, or its node is gone
            self._go_down(i, f"no cache service on {self.names[i]} ({exc})")
            self._fail(i, chunk, self.down[i])
            return
        if not any(j == i for j, _ in self._pending.values()):
            self._progress[i] = time.monotonic()  # the clock of a node with nothing in flight starts now
        self._pending[ref] = (i, chunk)

    def _prior_of(self, chunk: list[int]) -> dict[int, str] | None:
        """``{block: node id}`` of the blocks of ``chunk`` that have a previous owner (None: none)."""
        if self.prior is None:
            return None
        got = {int(b): self.members[int(self.prior[b])] for b in chunk if int(self.prior[b]) >= 0}
        return got or None

    def _done(self, ref) -> None:
        i, chunk = self._pending.pop(ref)
        self._progress[i] = time.monotonic()
        try:
            r = ray.get(ref)
        except ray.exceptions.RayActorError as exc:  # the service died or is restarting: try again
            k = self._tries[tuple(chunk)] = self._tries.get(tuple(chunk), 1) + 1
            if k <= FILL_TRIES and i not in self.down:
                self._later.append((time.monotonic() + RETRY_PAUSE_S * (k - 1), i, chunk))
                return
            if i not in self.down:
                self._go_down(
                    i,
                    f"cache service of {self.names[i]} did not answer in {FILL_TRIES} tries: {error_line(exc)}",
                )
            self._fail(i, chunk, self.down[i])
            return
        except ray.exceptions.RayError as exc:  # the call failed: these blocks only
            self._fail(i, chunk, error_line(exc))
            self._submit(i)
            return
        self._count(i, chunk, r)
        self._submit(i)

    def _go_down(self, i: int, reason: str) -> None:
        self.down[i] = reason
        log.warning("stoker warm: %s; its %d queued chunk(s) are not filled", reason, len(self.queues[i]))
        while self.queues[i]:
            self._fail(i, self.queues[i].pop(0), reason)

    def _fail(self, i: int, chunk: list[int], reason: str) -> None:
        shard = self.ds.index.shard_name
        self._count(i, chunk, {"failed": len(chunk), "errors": {shard(self.ds.blocks.shard[b]): reason for b in chunk}})

    def _count(self, i: int, chunk: list[int], r: dict) -> None:
        for k in self.totals[i]:
            self.totals[i][k] += r.get(k, 0)
        for shard, reason in r.get("errors", {}).items():
            self.errors[i].setdefault(shard, reason)
        if self.bar is not None:
            self.bar.update(int(self.ds.blocks.nbytes(np.asarray(chunk)).sum()))


def cluster_state(
    urls: list[str], storage_options: dict | None = None, block_bytes: int | None = None, timeout_s: float = 10.0
) -> dict:
    """What every node caches of each dataset in ``urls``, in the form :mod:`stoker.cluster.extender.scoring`
    reads: ``{"time": Unix seconds, "nodes": {node name: {"cache_bytes": int, "used_bytes": int,
    "datasets": {url: bytes}}}}`` (``time``: when it was gathered, so that a reader can tell how
    old it is). Needs ``ray.init()``; only services that answer within ``timeout_s`` seconds are
    listed."""
    opts = dict(storage_options or {})
    t = time.time()
    services = find_services(timeout_s)
    nodes: dict[str, dict] = {}
    out = {"time": t, "nodes": nodes}
    refs = {
        u: dataset_ref(
            open_dataset(
                u, storage_options=opts, cache=False, check=False, block_bytes=block_bytes or DEFAULT_BLOCK_BYTES
            ),
            opts,
        )
        for u in urls
    }
    for nid, info in services.items():
        h = get_service(nid)
        try:
            got = ray.get([h.cached_bytes.remote(refs[u]) for u in urls], timeout=timeout_s)
        except (ray.exceptions.RayError, ValueError) as exc:  # gone since it answered: not listed
            log.warning("cache service of %s did not answer: %s", node_label(nid, services), exc)
            continue
        nodes[info["node_name"]] = {
            "node_id": nid,
            "cache_bytes": info["cache_bytes"],
            "used_bytes": info["used_bytes"],
            "datasets": {u: int(b) for u, b in zip(urls, got)},
        }
    return out


def ray_state(
    urls: list[str],
    storage_options: dict | None = None,
    block_bytes: int | None = None,
    ttl_s: float = 10.0,
    timeout_s: float = 10.0,
):
    """A state source for :func:`stoker.cluster.extender.scoring.serve` that asks the cache services
    (:func:`cluster_state`, each call given ``timeout_s`` seconds) every ``ttl_s`` seconds in a
    background thread (:func:`stoker.cluster.freshness.refreshing`): a request never waits for
    Ray. When the services cannot be reached (the error is logged) it answers with the last state
    it had, whose ``"time"`` then ages until the extender stops trusting it (``max_age_s``)."""
    return refreshing(lambda: cluster_state(urls, storage_options, block_bytes, timeout_s=timeout_s), ttl_s)
