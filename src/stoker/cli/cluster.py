"""The cluster-mode commands: ``stoker warm``, ``stoker cluster-state``, ``stoker extender``.

Ray is imported only when ``warm`` or ``cluster-state`` runs; ``extender`` never imports it (with
``--dataset`` it runs ``cluster-state`` in a child process per refresh; with ``--state`` it needs
no Ray at all, and can run beside kube-scheduler).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time

from .._atomic import umask_mode, write_atomic
from ..cluster.extender.live_state import REFRESH_EVERY_S, REFRESH_TIMEOUT_S, live_state
from ..cluster.extender.scoring import MAX_BODY_BYTES, file_state, serve
from ..cluster.freshness import MAX_AGE_S
from ..metrics import metrics_port_from_env, serve_extender_metrics
from .args import Renamed, show_progress, size_arg


def _ray_init(address: str | None):
    """Join the Ray cluster at ``address`` (default: the local one, ``auto``) unless joined already."""
    import ray

    if not ray.is_initialized():
        try:
            ray.init(address=address or "auto", logging_level=logging.ERROR, log_to_driver=False)
        except ConnectionError as exc:
            raise ValueError(
                f"no Ray cluster at {address or 'auto'} ({exc}); start one with `ray start --head`, "
                "or pass --ray-address local to run one inside this command"
            ) from None
    return ray


def cmd_warm(a) -> int:
    """``stoker warm``: the report as JSON on stdout, a summary per node on stderr.

    Exit 0 when every block is cached and every node's service answered, 1 when the warm-up is
    partial (budget too small, shards that failed, a node whose cache service is down: named with
    the reason; running it again fetches only what is missing).
    """
    from ..cluster.service.warmup import warm  # imports ray: the cluster extra

    _ray_init(a.ray_address)
    r = warm(
        a.url,
        json.loads(a.storage_options) if a.storage_options else None,
        cache_dir=a.cache_dir,
        cache_bytes=a.cache_bytes,
        block_bytes=a.block_size,
        progress=show_progress(a),
        fill_timeout_s=a.fill_timeout,
    )
    print(json.dumps(r, indent=2))
    for n in r["nodes"].values():
        print(
            f"{(n.get('cache_key') or n['node_name'])[:40]:<24} owned {n['owned_bytes'] / 1e6:9.1f} MB  cached "
            f"{n['cached_bytes'] / 1e6:9.1f} MB  ({n['cached_fraction']:.0%})"
            + (f"  {n['refused']} block(s) over the budget" if n["refused"] else "")
            + (f"  {n['failed']} block(s) failed" if n["failed"] else ""),
            file=sys.stderr,
        )
        if n.get("error"):
            print(f"  {n['error']}", file=sys.stderr)
        for shard, why in n["failed_shards"].items():
            print(f"  failed: {shard}: {why}", file=sys.stderr)
    down = [n for n in r["nodes"].values() if n.get("error")]
    if r["complete"] and not down:
        return 0
    why = []
    if any(n["refused"] for n in r["nodes"].values()):
        why.append("cache budget too small (--cache-bytes)")
    if r["failed_shards"]:
        why.append(f"{len(r['failed_shards'])} shard(s) failed")
    if down:
        why.append(f"the cache service of {len(down)} node(s) did not answer")
    print(
        f"stoker warm: partial: {r['cached_fraction']:.1%} of {a.url} cached"
        + (f" ({'; '.join(why)})" if why else "")
        + "; run it again to fetch only what is missing",
        file=sys.stderr,
    )
    return 1


def _give_up_after(seconds: float, what: str) -> None:
    """End this process with exit code 124 (as coreutils ``timeout`` does) after ``seconds``,
    from a daemon thread: it fires even while the main thread waits inside Ray for a cluster
    that is not there, and even when the parent that would have stopped this process is gone."""

    def fire():
        try:
            print(f"{what}: no answer within {seconds:g} s; giving up", file=sys.stderr, flush=True)
        finally:  # a parent that is gone closed the pipe: the print fails, the exit must not
            os._exit(124)

    t = threading.Timer(seconds, fire)
    t.daemon = True
    t.start()


def cmd_state(a) -> int:
    """``stoker cluster-state``: what every node caches, as JSON (written atomically with ``--out``)."""
    from ..cluster.service.warmup import cluster_state  # imports ray: the cluster extra

    if a.timeout:
        _give_up_after(a.timeout, "stoker cluster-state")
    _ray_init(a.ray_address)
    state = cluster_state(
        a.urls, json.loads(a.storage_options) if a.storage_options else None, block_bytes=a.block_size
    )
    text = json.dumps(state, indent=2)
    if a.out:
        write_atomic(a.out, text.encode(), mode=umask_mode())  # the extender never reads half a file
    else:
        print(text)
    return 0


def cmd_extender(a) -> int:
    """``stoker extender``: serve the kube-scheduler extender until interrupted; exit 0 on Ctrl-C."""
    if bool(a.state) == bool(a.dataset):
        raise ValueError("give either --state FILE or --dataset URL (with Ray)")
    if a.state:
        state = file_state(a.state)
        state()  # fail now, not at the first request, on a missing or bad file
    else:  # this process never joins Ray: Ray ends a driver whose cluster has gone (see extender_live)
        state = live_state(
            a.dataset,
            a.ray_address,
            json.loads(a.storage_options) if a.storage_options else None,
            block_bytes=a.block_size,
            every_s=a.refresh_every,
            timeout_s=a.refresh_timeout,
        )
    metrics_port = a.metrics_port if a.metrics_port is not None else metrics_port_from_env()
    if metrics_port is not None:  # before serving: no request goes uncounted
        metrics_port = serve_extender_metrics(metrics_port, a.metrics_addr)
    srv = serve(state, host=a.host, port=a.port, max_body_bytes=a.max_body_size, max_age_s=a.max_age or None)
    host, port = srv.server_address[:2]
    print(
        f"stoker extender on http://{host}:{port}/ (verbs: filter, prioritize); "
        f"state {a.state or 'from the cache services'}"
        + (f"; metrics on port {metrics_port}" if metrics_port is not None else ""),
        file=sys.stderr,
    )
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        srv.shutdown()
    return 0


def add_parsers(sub) -> None:
    """Register ``warm``, ``cluster-state`` and ``extender`` on the top-level subparsers ``sub``."""
    s = sub.add_parser("warm", help="fill the cluster cache (Ray) with a dataset, every node in parallel")
    s.add_argument("url", help="the packed dataset to place in the node caches")
    s.add_argument("--ray-address", help="Ray cluster address (default: auto)")
    s.add_argument("--cache-dir", help="node cache directory, when the services are not running yet")
    s.add_argument(
        "--cache-bytes",
        "--cache-size",  # the old spelling: one deprecation line on stderr
        dest="cache_bytes",
        type=size_arg,
        action=Renamed,
        help="cache budget per node (default 8GiB), for services started now: running ones keep theirs",
    )
    s.add_argument("--block-size", type=size_arg, help="cache block (default 1MiB)")
    s.add_argument("--storage-options", help="fsspec storage options, as JSON")
    s.add_argument(
        "--fill-timeout",
        type=float,
        metavar="S",
        help="give a node up when none of its fills answered for S seconds, plus 1 s per MiB in flight (default 120)",
    )
    s.add_argument("--no-progress", action="store_true")
    s.set_defaults(fn=cmd_warm)

    s = sub.add_parser("cluster-state", help="write what every node caches (input of `stoker extender`)")
    s.add_argument("urls", nargs="+")
    s.add_argument("--out", help="write here (atomically); default stdout")
    s.add_argument("--ray-address")
    s.add_argument("--block-size", type=size_arg)
    s.add_argument("--storage-options")
    s.add_argument("--timeout", type=float, help="give up after this many seconds (exit 124)")
    s.set_defaults(fn=cmd_state)

    s = sub.add_parser("extender", help="kube-scheduler extender (HTTP JSON filter/prioritize)")
    s.add_argument("--state", help="cache state JSON (from `stoker cluster-state`), re-read when it changes")
    s.add_argument(
        "--dataset",
        action="append",
        help="instead of --state: ask the cache services (Ray) about "
        "this dataset URL (repeatable), from a child per refresh",
    )
    s.add_argument("--ray-address")
    s.add_argument("--block-size", type=size_arg)
    s.add_argument("--storage-options")
    s.add_argument(
        "--refresh-every",
        type=float,
        default=REFRESH_EVERY_S,
        help=f"with --dataset: seconds between refreshes (default {REFRESH_EVERY_S:g})",
    )
    s.add_argument(
        "--refresh-timeout",
        type=float,
        default=REFRESH_TIMEOUT_S,
        help=f"with --dataset: seconds one refresh may take (default {REFRESH_TIMEOUT_S:g})",
    )
    s.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=8888)
    s.add_argument(
        "--metrics-port",
        type=int,
        help="serve Prometheus metrics (requests, latency, errors) on this "
        "port (default $STOKER_METRICS_PORT; none when unset); needs stoker[metrics]",
    )
    s.add_argument("--metrics-addr", help="address of the metrics port (default $STOKER_METRICS_ADDR or 127.0.0.1)")
    s.add_argument(
        "--max-body-size",
        type=size_arg,
        default=MAX_BODY_BYTES,
        help="refuse larger requests with 413 (default 8MiB: about a thousand full Node objects)",
    )
    s.add_argument(
        "--max-age",
        type=float,
        default=MAX_AGE_S,
        help=f"seconds after which the cache state is not trusted: no preference, and an error for "
        f"require-cache pods (default {MAX_AGE_S:g}; 0: any age)",
    )
    s.set_defaults(fn=cmd_extender)
