"""``stoker extender``: a kube-scheduler extender (HTTP JSON) that places pods next to their cached data.

Kubernetes calls an extender with ``ExtenderArgs`` (``k8s.io/kube-scheduler/extender/v1``:
``{"Pod": {...}, "Nodes": {"items": [...]} | null, "NodeNames": [...] | null}``) and expects,
from ``filterVerb``, an ``ExtenderFilterResult`` (``Nodes``/``NodeNames``, ``FailedNodes``,
``FailedAndUnresolvableNodes``, ``Error``) and, from ``prioritizeVerb``, a ``HostPriorityList``
(``[{"Host": name, "Score": 0..10}]``, 10 = ``MaxExtenderPriority``).

The rule is the one :func:`stoker.cluster.schedule.choose_nodes` uses (drawn in this folder's
README.md). Cache state comes from a JSON file (re-read when it changes; written by ``stoker
cluster-state``, see :func:`stoker.cluster.service.warmup.cluster_state`) or any callable returning
the same form. The HTTP answers, errors included, are :mod:`stoker.cluster.extender.server`'s.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from typing import Any

from ...errors import ExtenderRequestError
from ..freshness import MAX_AGE_S, check_time, is_stale, state_age_s

log = logging.getLogger(__name__)

DATASET_ANNOTATION = "stoker.io/dataset"
REQUIRE_ANNOTATION = "stoker.io/require-cache"
MAX_PRIORITY = 10  # k8s.io/kube-scheduler/extender/v1 MaxExtenderPriority
#: Default cap on a request body, bytes. kube-scheduler sends full Node objects (a few KB each)
#: when ``nodeCacheCapable`` is false, so this holds about a thousand nodes; names only (true)
#: are some tens of bytes a node. Raise it with ``serve(max_body_bytes=...)`` / ``--max-body-size``.
MAX_BODY_BYTES = 8 << 20
#: A connection with no request in progress that sends nothing for this long is closed (seconds).
REQUEST_TIMEOUT_S = 30.0
#: How often idle connections are looked for (seconds).
CLEANUP_INTERVAL_S = 5.0


BadRequest = ExtenderRequestError  # the name used here and in older code


def _kind(value) -> str:
    """The JSON type name of a decoded value, for messages."""
    if value is None:
        return "null"
    return {bool: "boolean", int: "number", float: "number", str: "string", list: "array", dict: "object"}.get(
        type(value), type(value).__name__
    )


def _object(value, where: str, error=BadRequest) -> dict:
    """``value`` if it is a JSON object, ``{}`` if null; else ``error`` naming ``where``."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise error(f"{where} must be an object or null, got {_kind(value)}")
    return value


def check_state(state, source: str = "cache state") -> dict:
    """``state`` if it has the form :func:`scores` reads, else ValueError naming ``source`` and the entry.

    Form: ``{"nodes": {name: {"cache_bytes": int >= 0, "datasets": {url: int >= 0}}}, "time": t}``;
    ``cache_bytes``, ``datasets`` and ``time`` may be left out, other keys are ignored. ``time``
    (Unix seconds, when the state was gathered) must be a finite number no more than
    :data:`stoker.cluster.freshness.FUTURE_SKEW_S` ahead of this clock: a state from the future
    would never grow old.
    """
    if not isinstance(state, dict) or not isinstance(state.get("nodes"), dict):
        raise ValueError(f"{source}: cache state must be a JSON object with a 'nodes' object")
    check_time(state.get("time"), source)

    def count(v, where):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{source}: {where} must be a whole number of bytes >= 0, got {v!r:.60}")

    for name, node in state["nodes"].items():
        where = f"nodes[{name!r}]"
        if not isinstance(node, dict):
            raise ValueError(f"{source}: {where} must be an object, got {_kind(node)}")
        if "cache_bytes" in node:
            count(node["cache_bytes"], f"{where}.cache_bytes")
        datasets = _object(node.get("datasets"), f"{source}: {where}.datasets", ValueError)
        for url, n in datasets.items():
            count(n, f"{where}.datasets[{url!r}]")
    return state


def file_state(path: str):
    """A state source reading ``path`` (JSON ``{"nodes": {name: {"cache_bytes", "datasets": {url: bytes}}}}``),
    re-read when it changes (modification time, size or inode). A state without ``"time"`` is
    given the file's modification time (see :mod:`stoker.cluster.freshness`). Raises OSError on a
    missing file, ValueError (naming
    ``path`` and the entry) on a file that is not JSON or not of that form (:func:`check_state`)."""
    box: dict[str, Any] = {"mtime": None, "state": None}  # the file's (mtime_ns, size, inode) and state
    lock = threading.Lock()

    def get() -> dict:
        with lock:
            st = os.stat(path)  # a file replaced (new inode) or rewritten within one clock tick counts too
            m = (st.st_mtime_ns, st.st_size, st.st_ino)
            if m != box["mtime"]:
                with open(path, "rb") as f:
                    data = f.read()
                try:
                    state = json.loads(data)
                except (ValueError, RecursionError) as exc:
                    raise ValueError(f"{path}: cache state is not JSON ({type(exc).__name__}: {exc})") from None
                state = check_state(state, path)
                if state_age_s(state) is None:  # as old as the file
                    state = {**state, "time": st.st_mtime}
                box["mtime"], box["state"] = m, state
            return box["state"]

    return get


def parse_args(args) -> tuple[dict, list[str], list | None]:
    """Check decoded ExtenderArgs; return ``(annotations, node names, Node objects or None)``.

    ``args``: ``{"Pod": {...} | null, "Nodes": {"items": [...] | null} | null, "NodeNames": [str] | null}``
    (missing keys count as null; one of ``Nodes.items`` and ``NodeNames`` is required: a request
    naming no nodes, such as ``{}``, is a client's mistake, not an empty cluster; a null ``Pod``
    has no annotations).
    Node objects are returned when ``Nodes.items`` is sent (then it
    wins over ``NodeNames``), so that filter can answer in the same form. Raises :class:`BadRequest`
    naming the field, e.g. ``NodeNames[1] must be a string, got number``.
    """
    if not isinstance(args, dict):
        raise BadRequest(f"ExtenderArgs must be an object, got {_kind(args)}")
    if args.get("NodeNames") is None and _object(args.get("Nodes"), "Nodes").get("items") is None:
        raise BadRequest("ExtenderArgs names no nodes: send Nodes.items or NodeNames")
    meta = _object(_object(args.get("Pod"), "Pod").get("metadata"), "Pod.metadata")
    ann = _object(meta.get("annotations"), "Pod.metadata.annotations")
    for key in (DATASET_ANNOTATION, REQUIRE_ANNOTATION):
        if ann.get(key) is not None and not isinstance(ann[key], str):
            raise BadRequest(f"Pod.metadata.annotations[{key!r}] must be a string, got {_kind(ann[key])}")
    items = _object(args.get("Nodes"), "Nodes").get("items")
    if items is not None:
        if not isinstance(items, list):
            raise BadRequest(f"Nodes.items must be an array or null, got {_kind(items)}")
        names = []
        for k, item in enumerate(items):
            name = _object(_object(item, f"Nodes.items[{k}]").get("metadata"), f"Nodes.items[{k}].metadata").get("name")
            if not isinstance(name, str) or not name:
                raise BadRequest(f"Nodes.items[{k}].metadata.name must be a non-empty string, got {_kind(name)}")
            names.append(name)
        return ann, names, items
    given = args.get("NodeNames")
    if given is None:
        return ann, [], None
    if not isinstance(given, list):
        raise BadRequest(f"NodeNames must be an array or null, got {_kind(given)}")
    for k, name in enumerate(given):
        if not isinstance(name, str) or not name:
            raise BadRequest(f"NodeNames[{k}] must be a non-empty string, got {_kind(name)}")
    return ann, list(given), None


def scores(dataset: str | None, names: list[str], state: dict) -> dict[str, int]:
    """Score 0..10 per node name for a pod reading ``dataset`` (None: 0 everywhere).

    Bytes of the dataset cached on the node, scaled so the node holding most gets 10 (integer
    division rounds down: a node holding half gets 5); if no node holds any, cache budgets
    scaled the same way. Nodes unknown to ``state`` score 0.
    """
    if not dataset:
        return {n: 0 for n in names}
    nodes = state.get("nodes", {})
    cached = {n: int(((nodes.get(n) or {}).get("datasets") or {}).get(dataset, 0)) for n in names}
    base = cached if any(cached.values()) else {n: int((nodes.get(n) or {}).get("cache_bytes", 0)) for n in names}
    top = max(base.values(), default=0)
    return {n: (MAX_PRIORITY * base[n] // top if top else 0) for n in names}


def filter_nodes(args: dict, state: dict, max_age_s: float | None = None) -> dict:
    """ExtenderFilterResult for ExtenderArgs ``args`` (:class:`BadRequest` if malformed, see
    :func:`parse_args`); ``state`` as :func:`check_state` accepts. A ``require-cache`` pod gets
    an ``Error`` (no node passes) when ``state`` is older than ``max_age_s`` seconds: nothing is
    known about the caches then."""
    ann, names, items = parse_args(args)
    failed = {}
    required = (ann.get(REQUIRE_ANNOTATION) or "").lower() == "true"
    if required and is_stale(state, max_age_s):
        why = (
            (
                f"stoker cache state is {state_age_s(state):.0f} s old (over {max_age_s:g} s): "
                "no node is known to hold a cache"
            )
            if state.get("time")
            else "no stoker cache state yet (the first refresh has not answered): no node is known to hold a cache"
        )
        return {
            "Nodes": {"items": []} if items is not None else None,
            "NodeNames": None if items is not None else [],
            "FailedNodes": {n: why for n in names},
            "FailedAndUnresolvableNodes": {},
            "Error": why,
        }
    if required:
        have = state.get("nodes", {})
        failed = {n: f"no stoker cache service on node {n}" for n in names if n not in have}
    keep = [n for n in names if n not in failed]
    out: dict[str, Any] = {"FailedNodes": failed, "FailedAndUnresolvableNodes": {}, "Error": ""}
    if items is not None:
        out["Nodes"] = {"items": [it for it, n in zip(items, names) if n not in failed]}
        out["NodeNames"] = None
    else:
        out["Nodes"] = None
        out["NodeNames"] = keep
    return out


def prioritize(args: dict, state: dict, max_age_s: float | None = None) -> list[dict]:
    """HostPriorityList for ExtenderArgs ``args`` (:class:`BadRequest` if malformed); every node
    scores 0 (no preference) when ``state`` is older than ``max_age_s`` seconds."""
    ann, names, _ = parse_args(args)
    s = scores(None if is_stale(state, max_age_s) else ann.get(DATASET_ANNOTATION), names, state)
    return [{"Host": n, "Score": s[n]} for n in names]


def json_loads(data: bytes, what: str):
    """``json.loads`` with :class:`BadRequest` (naming ``what``) for bytes that are not UTF-8 JSON."""
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise BadRequest(f"{what} is not JSON: {type(exc).__name__}: {exc}") from None


def serve(
    state,
    host: str = "127.0.0.1",
    port: int = 8888,
    max_body_bytes: int = MAX_BODY_BYTES,
    max_age_s: float | None = MAX_AGE_S,
    idle_timeout_s: float = REQUEST_TIMEOUT_S,
    cleanup_interval_s: float = CLEANUP_INTERVAL_S,
):
    """Start the extender on ``host:port`` (port 0: any free port) in a background thread.

    Served by waitress (:mod:`stoker.cluster.extender.server`). ``state``: a callable returning
    the cache state (e.g. :func:`file_state`); ``max_body_bytes``: larger request bodies are
    refused with 413, unread; ``max_age_s``: a state older than this (seconds, by its ``"time"``;
    None: any age) gives no preference and fails ``require-cache`` pods
    (:mod:`stoker.cluster.freshness`); ``idle_timeout_s``: a connection without a request in
    progress and without traffic for this long is closed, checked every ``cleanup_interval_s``
    seconds. ``state`` is called on every request: it must answer at once
    (:func:`stoker.cluster.freshness.refreshing` wraps a slow source). Returns an
    :class:`~stoker.cluster.extender.server.ExtenderServer` (``server_address``;
    ``shutdown()`` stops it). Raises OSError if the address is taken.
    """
    from .server import ExtenderServer, _StateUnavailable  # waitress: the cluster extra

    def answer(verb: str, body: bytes):
        if verb not in ("filter", "prioritize"):
            raise BadRequest(f"unknown verb {verb!r} (use filter or prioritize)", 404)
        args = json_loads(body or b"{}", "request body")
        try:
            now = check_state(state(), "cache state")
        except Exception as exc:  # noqa: BLE001 - any failure of the source is the server's, not the request's
            raise _StateUnavailable(f"cache state unavailable: {type(exc).__name__}: {exc}") from exc
        out = filter_nodes(args, now, max_age_s) if verb == "filter" else prioritize(args, now, max_age_s)
        return out, state_age_s(now)

    return ExtenderServer(answer, host, port, max_body_bytes, idle_timeout_s, cleanup_interval_s)
