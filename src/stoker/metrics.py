"""Prometheus metrics of the loader, the cluster cache services and the scheduler extender.

Exposition goes through ``prometheus-client`` (the ``metrics`` extra, ``pip install
'stoker[metrics]'``), imported only when metrics are asked for: without it the loader works and
only ``metrics_port=`` raises ImportError. Names follow Prometheus' conventions: the ``stoker_``
prefix, base units (``_bytes``, ``_seconds``), ``_total`` on counters.

**Loader** (``Loader(run=RunOptions(metrics_port=...))`` or ``$STOKER_METRICS_PORT``; address
``$STOKER_METRICS_ADDR``, default 127.0.0.1): the counters are read at scrape time from the
loader's :class:`stoker.loader.live.LiveTotals`, which sums the counters the pipeline already
gathers from its processes (each decode worker's cumulative counters travel with its replies,
the prefetcher's live in a shared array). prometheus-client's multiprocess mode is not used:
the training process holds every count, and a replaced worker's counts are kept there, so the
totals add up without a metrics directory shared by the processes. Labels: ``dataset`` (the
dataset's URL, a local path made absolute: the name ``stoker top`` and ``stoker cache status``
show), ``job`` (``$STOKER_JOB``, default ``default``), ``node`` (host name), ``rank``. The content
version is on one series of its own, ``stoker_dataset_info{dataset, ..., version} 1`` (the
Prometheus "info" idiom: join it on ``dataset`` where the version matters), so a rewritten
dataset adds one series, not a second copy of every counter.

===========================================  =====================================================
``stoker_samples_total``                     samples yielded
``stoker_batches_total``                     batches yielded
``stoker_skipped_samples_total``             samples skipped (``on_error="skip"``)
``stoker_padded_samples_total``              substitutes for batches whose every sample was skipped
``stoker_data_stall_seconds_total``          seconds the consumer was blocked in ``next()``
``stoker_loader_seconds_total``              wall seconds of the epochs (stall fraction =
                                             rate(stall) / rate(loader seconds))
``stoker_first_batch_seconds``               gauge: ``iter()`` to the first batch, last epoch
``stoker_origin_bytes_total``                bytes received from the origin
``stoker_origin_requests_total``             requests to the origin
``stoker_origin_retries_total``              origin requests retried (workers and prefetcher)
``stoker_cache_hits_total{tier}``            sample reads served by the ``memory``/``disk`` tier
                                             or by blocks ``staged`` just in time
``stoker_cache_misses_total``                sample reads the node cache did not hold
``stoker_process_restarts_total{process}``   ``worker`` / ``prefetcher`` processes replaced
``stoker_prefetch_depth_bytes``              gauge: mean bytes ready ahead of the consumer
``stoker_epochs_total``                      epochs ended
``stoker_dataset_info{version}``             1; ``version``: the dataset's content version
===========================================  =====================================================

**Cluster cache services** use Ray's own metrics export (``ray.util.metrics``), scraped from
each Ray node's metrics agent (``ray start --metrics-export-port``); Ray prefixes user metrics
with ``ray_``: ``ray_stoker_cache_held_bytes{dataset,version,node}`` (``dataset``: the URL),
``ray_stoker_peer_served_bytes_total{node,source}``, ``ray_stoker_cache_fills_total{node,outcome}``,
``ray_stoker_cache_fill_failures_total{node}`` (:class:`ServiceMetrics`).

**Extender** (``stoker extender --metrics-port``): ``stoker_extender_requests_total{verb,code}``,
``stoker_extender_request_duration_seconds{verb}`` (histogram), ``stoker_extender_errors_total{verb}``
(answers with a status >= 400), recorded through :func:`observe_extender`.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import threading
from collections.abc import Callable
from typing import Any

from .storage import absolute_url

PORT_ENV = "STOKER_METRICS_PORT"
ADDR_ENV = "STOKER_METRICS_ADDR"
JOB_ENV = "STOKER_JOB"

__all__ = [
    "LoaderExport",
    "ServiceMetrics",
    "export_loader",
    "loader_ports",
    "local_rank_from_env",
    "metrics_port_from_env",
    "observe_extender",
    "serve_extender_metrics",
]


def _client():
    """The ``prometheus_client`` module; ImportError naming the extra when it is missing."""
    try:
        import prometheus_client
    except ImportError as exc:
        raise ImportError(
            "Prometheus metrics need prometheus-client, the stoker[metrics] extra: "
            "pip install -e '.[metrics]' in the stoker checkout"
        ) from exc
    return prometheus_client


def metrics_port_from_env() -> int | None:
    """``$STOKER_METRICS_PORT`` as a port number (None when unset or empty), plus ``$LOCAL_RANK``
    when that is set (torchrun and ``torch.distributed`` launchers set it: the ranks of one node
    then serve on consecutive ports instead of all asking for one). ValueError naming the
    variable for text that is not a port (0..65535; 0 = any free port, whatever the rank) or a
    ``$LOCAL_RANK`` that is not a non-negative integer."""
    text = os.environ.get(PORT_ENV, "").strip()
    if not text:
        return None
    try:
        port = int(text)
    except ValueError:
        raise ValueError(f"${PORT_ENV} must be a port number, got {text!r}") from None
    if not 0 <= port <= 65535:
        raise ValueError(f"${PORT_ENV} must be a port number in 0..65535, got {port}")
    local = os.environ.get("LOCAL_RANK", "").strip()
    if port and local:
        if not local.isdigit():
            raise ValueError(f"$LOCAL_RANK must be a non-negative integer, got {local!r}")
        port += int(local)
        if port > 65535:
            raise ValueError(f"${PORT_ENV} + $LOCAL_RANK = {port} is not a port number")
    return port


#: Ports a loader tries above a taken one before it goes on without metrics.
PORT_TRIES = 32


def loader_ports(port: int, local_rank: int | None = None, tries: int | None = None) -> list[int]:
    """The ports a loader that asks for ``port`` tries, in order: ``port``; then, where another
    program holds it, ``port + local_rank`` (the port of this rank of the node, when
    ``local_rank`` is given: what ``$STOKER_METRICS_PORT`` would give it) and the next ``tries``
    ports up (default :data:`PORT_TRIES`; none above 65535). ``[0]`` for 0 (any free port)."""
    if not port:
        return [0]
    tries = PORT_TRIES if tries is None else tries
    out = [port]
    if local_rank:
        out.append(port + local_rank)
    out += range(port + 1, port + tries + 1)
    return [p for i, p in enumerate(out) if p <= 65535 and p not in out[:i]]


def local_rank_from_env() -> int | None:
    """``$LOCAL_RANK`` as an int, or None when unset or not a non-negative integer."""
    text = os.environ.get("LOCAL_RANK", "").strip()
    return int(text) if text.isdigit() else None


# -- one HTTP server per (address, port) in a process ----------------------------------------
_SERVERS: dict[tuple[str, int], tuple[Any, Any, int]] = {}  # (addr, asked port) -> (registry, server, port)
_SERVERS_LOCK = threading.Lock()


def _server(port: int, addr: str | None) -> tuple[Any, int]:
    """The registry served on ``addr:port`` (started now if not yet; port 0: a free port, new
    each call) and the port it listens on. OSError when the address is taken."""
    pc = _client()
    addr = addr or os.environ.get(ADDR_ENV) or "127.0.0.1"
    with _SERVERS_LOCK:
        if port and (addr, port) in _SERVERS:
            reg, _, real = _SERVERS[(addr, port)]
            return reg, real
        reg = pc.CollectorRegistry(auto_describe=False)
        server, _thread = pc.start_http_server(port, addr=addr, registry=reg)
        real = server.server_address[1]
        _SERVERS[(addr, port or real)] = (reg, server, real)
        return reg, real


class LoaderExport:
    """The metrics of one loader on a Prometheus endpoint: ``port`` (the one listened on),
    ``url`` (``http://addr:port/metrics``), ``taken`` (the ports tried first, which another
    program held: ``{port: why}``); :meth:`close` stops reporting this loader (the server stays
    for others of the process)."""

    def __init__(self, registry, collector, port: int, addr: str, taken: dict[int, str] | None = None):
        self.registry, self.collector, self.port = registry, collector, port
        self.url = f"http://{addr}:{port}/metrics"
        self.taken = dict(taken or {})

    def close(self) -> None:
        """Unregister this loader's collector; idempotent."""
        coll, self.collector = self.collector, None
        if coll is not None:
            with contextlib.suppress(KeyError):
                self.registry.unregister(coll)


class _LoaderCollector:
    """A prometheus-client collector reading ``snapshot()`` (:meth:`stoker.loader.live.LiveTotals.snapshot`)
    at each scrape."""

    def __init__(self, snapshot: Callable[[], dict], labels: dict[str, str], version: str | None = None):
        self.snapshot, self.labels, self.version = snapshot, labels, version

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily

        s = self.snapshot()
        names, values = list(self.labels), list(self.labels.values())

        def family(kind, name: str, doc: str, value, label: str | None = None):
            """One metric family of this loader: ``value``, or with ``label`` one series per
            ``{label's value: value}``."""
            fam = kind(name, doc, labels=names + ([label] if label else []))
            for extra, v in value.items() if label else [(None, value)]:
                fam.add_metric(values + ([extra] if label else []), v)
            return fam

        def counter(name: str, doc: str, value, label: str | None = None):
            return family(CounterMetricFamily, name, doc, value, label)

        yield counter("stoker_samples", "Samples yielded to the consumer.", s["samples"])
        yield counter("stoker_batches", "Batches yielded to the consumer.", s["batches"])
        yield counter("stoker_skipped_samples", "Samples skipped (on_error='skip').", s["skipped"])
        yield counter(
            "stoker_padded_samples",
            "Substitute samples yielded for batches whose every sample was skipped (on_error='skip').",
            s["padded"],
        )
        yield counter("stoker_data_stall_seconds", "Seconds the consumer was blocked in next().", s["wait_s"])
        yield counter("stoker_loader_seconds", "Wall seconds of the loader's epochs.", s["seconds"])
        yield counter("stoker_origin_bytes", "Bytes received from the origin.", s["origin_bytes"])
        yield counter("stoker_origin_requests", "Requests to the origin.", s["origin_requests"])
        yield counter("stoker_origin_retries", "Origin requests retried.", s["origin_retries"])
        hits = {
            "memory": s["cache_memory_hits"],
            "disk": max(0, s["cache_hits"] - s["cache_memory_hits"]),
            "staged": s["read_staged_hits"],
        }
        yield counter("stoker_cache_hits", "Sample reads served by a cache tier.", hits, "tier")
        yield counter("stoker_cache_misses", "Sample reads the node cache did not hold.", s["cache_misses"])
        restarts = {"worker": s["worker_restarts"], "prefetcher": s["prefetcher_restarts"]}
        yield counter("stoker_process_restarts", "Loader processes replaced after dying.", restarts, "process")
        yield counter("stoker_epochs", "Epochs ended.", s["epochs"])
        if self.version is not None:
            yield family(
                InfoMetricFamily, "stoker_dataset", "The dataset's content version.", {"version": self.version}
            )
        depth_doc = "Mean bytes fetched and ready ahead of the consumer in the current epoch."
        yield family(GaugeMetricFamily, "stoker_prefetch_depth_bytes", depth_doc, s["prefetch_depth_bytes"])
        if s.get("first_batch_s") is not None:
            first_doc = "Seconds from iter() to the first batch of the current (or last) epoch."
            yield family(GaugeMetricFamily, "stoker_first_batch_seconds", first_doc, s["first_batch_s"])


def export_loader(
    snapshot: Callable[[], dict],
    port: int,
    *,
    dataset: str,
    version: str | None = None,
    rank: int = 0,
    job: str | None = None,
    addr: str | None = None,
    local_rank: int | None = None,
) -> LoaderExport:
    """Serve a loader's metrics on ``addr:port`` (default ``$STOKER_METRICS_ADDR`` or
    127.0.0.1; port 0: any free port) from ``snapshot`` (see :class:`stoker.loader.live.LiveTotals`).
    Several loaders of one process may share a port (their ``dataset``/``rank`` labels tell
    them apart). ``dataset``: its URL (the ``dataset`` label, made absolute for a local path);
    ``version``: its content version (``stoker_dataset_info``). Where another program holds
    ``port`` (the second training process of a node given the same one), the next of
    :func:`loader_ports` is taken (``local_rank``: this process's rank on the node, tried first;
    the caller says so: :attr:`LoaderExport.taken`).
    Raises ImportError without prometheus-client; OSError (``EADDRINUSE``) when every port
    tried is taken, or another OSError (an address that is not this host's)."""
    taken: dict[int, str] = {}
    for candidate in loader_ports(int(port), local_rank):
        try:
            reg, real = _server(candidate, addr)
            break
        except OSError as exc:
            if exc.errno not in (errno.EADDRINUSE, errno.EACCES):
                raise
            taken[candidate] = exc.strerror or str(exc)
    else:
        tried = list(taken)
        if not tried:
            raise ValueError(f"metrics port {port} is not a port number (0..65535)")
        raise OSError(
            errno.EADDRINUSE,
            f"ports {tried[0]}..{tried[-1]} are all taken" if len(tried) > 1 else f"port {tried[0]} is taken",
        )
    labels = {
        "dataset": absolute_url(str(dataset)),
        "job": job or os.environ.get(JOB_ENV) or "default",
        "node": socket.gethostname(),
        "rank": str(rank),
    }
    coll = _LoaderCollector(snapshot, labels, version)
    reg.register(coll)
    return LoaderExport(reg, coll, real, addr or os.environ.get(ADDR_ENV) or "127.0.0.1", taken)


# -- the extender ----------------------------------------------------------------------------
_EXTENDER: dict[str, Any] = {}  # "requests", "latency", "errors" once enabled


def serve_extender_metrics(port: int, addr: str | None = None) -> int:
    """Record the extender's requests from now on and serve them on ``addr:port`` (default
    ``$STOKER_METRICS_ADDR`` or 127.0.0.1; 0: any free port); returns the port. Once per
    process: a later call returns the port of the first. ImportError without prometheus-client,
    OSError when the port is taken."""
    pc = _client()
    if _EXTENDER:
        return _EXTENDER["port"]
    reg, real = _server(int(port), addr)
    if not _EXTENDER:
        _EXTENDER["port"] = real
        _EXTENDER["requests"] = pc.Counter(
            "stoker_extender_requests", "Extender requests answered.", ["verb", "code"], registry=reg
        )
        _EXTENDER["latency"] = pc.Histogram(
            "stoker_extender_request_duration_seconds",
            "Seconds from a request's arrival to its answer.",
            ["verb"],
            registry=reg,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
        )
        _EXTENDER["errors"] = pc.Counter(
            "stoker_extender_errors", "Extender answers with a status >= 400.", ["verb"], registry=reg
        )
    return real


def observe_extender(verb: str, code: int, seconds: float) -> None:
    """Count one extender answer: ``verb`` (``filter``, ``prioritize``; anything else is
    counted as ``other``), HTTP status ``code``, ``seconds`` it took. Does nothing until
    :func:`serve_extender_metrics` was called, so the extender needs no metrics library."""
    if not _EXTENDER:
        return
    verb = verb if verb in ("filter", "prioritize", "healthz") else "other"
    _EXTENDER["requests"].labels(verb, str(code)).inc()
    _EXTENDER["latency"].labels(verb).observe(seconds)
    if code >= 400:
        _EXTENDER["errors"].labels(verb).inc()


# -- the cluster cache services (Ray's metrics) ----------------------------------------------
class ServiceMetrics:
    """The metrics of one cluster cache service, through Ray's metrics export (``ray.util.metrics``,
    which Ray's metrics agent on each node serves to Prometheus with a ``ray_`` prefix).

    ``node``: the node's name (a label); ``backend``: the module that has ``Counter`` and
    ``Gauge`` with Ray's signature (default ``ray.util.metrics``; tests pass another). A
    backend that cannot be had leaves the service without metrics, never without service.
    ``flush_s``: the served bytes of each request are added up here and handed to the backend at
    most that many seconds later, in one ``inc`` per source (a timer thread; 0: at once). A Ray
    counter's ``inc`` costs tens of microseconds under the GIL, a fifth of the service's CPU per
    1 MiB block served when it ran once per request; Ray's agent exports every few seconds anyway.
    """

    def __init__(self, node: str, backend=None, flush_s: float = 1.0):
        self.node, self.flush_s = node, float(flush_s)
        self._pending: dict[str, int] = {}
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None
        try:
            if backend is None:
                from ray.util import metrics as backend
            tags = ("node",)
            self.held = backend.Gauge(
                "stoker_cache_held_bytes",
                "Bytes of a dataset (its URL, and its content version) this node's cache holds.",
                tag_keys=("dataset", "version", "node"),
            )
            self.served = backend.Counter(
                "stoker_peer_served_bytes",
                "Bytes this node's service handed to readers, by source (cache, origin, handoff).",
                tag_keys=("node", "source"),
            )
            self.fills = backend.Counter(
                "stoker_cache_fills",
                "Blocks the warm-up asked this node to fill, by outcome.",
                tag_keys=("node", "outcome"),
            )
            self.failures = backend.Counter("stoker_cache_fill_failures", "Blocks whose fill failed.", tag_keys=tags)
            self.ok = True
        except Exception:  # noqa: BLE001 - metrics are optional; the service must run
            self.ok = False

    def served_bytes(self, n: int, source: str = "cache") -> None:
        """``n`` bytes handed to a reader, read from ``source`` (``cache``, ``origin``, or ``handoff``:
        filled from the block's previous owner, :mod:`stoker.cluster.handoff`); handed to the
        backend within ``flush_s`` seconds (:meth:`flush`)."""
        if not (self.ok and n):
            return
        if self.flush_s <= 0:
            self.served.inc(n, tags={"node": self.node, "source": source})
            return
        with self._lock:
            self._pending[source] = self._pending.get(source, 0) + int(n)
            if self._timer is None:
                self._timer = threading.Timer(self.flush_s, self.flush)
                self._timer.daemon = True
                self._timer.start()

    def flush(self) -> None:
        """Hand the served bytes added up so far to the backend now."""
        with self._lock:
            pending, self._pending = self._pending, {}
            timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()  # when called from outside the timer
        for source, n in pending.items():
            self.served.inc(n, tags={"node": self.node, "source": source})

    def filled(self, outcome: dict) -> None:
        """The result of one :meth:`stoker.cluster.service.cache_service.CacheService.fill` call."""
        if not self.ok:
            return
        for key in ("filled", "cached", "refused", "busy", "failed"):
            if outcome.get(key):
                self.fills.inc(outcome[key], tags={"node": self.node, "outcome": key})
        if outcome.get("failed"):
            self.failures.inc(outcome["failed"], tags={"node": self.node})

    def held_bytes(self, dataset: str, version: str, n: int) -> None:
        """This node's cache holds ``n`` bytes of the dataset at URL ``dataset`` (content ``version``)."""
        if self.ok:
            self.held.set(n, tags={"dataset": absolute_url(dataset), "version": version, "node": self.node})
