"""``stoker extender``: a kube-scheduler extender (HTTP JSON) that places pods next to their cached data.

Kubernetes calls an extender with ``ExtenderArgs`` (``k8s.io/kube-scheduler/extender/v1``:
``{"Pod": {...}, "Nodes": {"items": [...]} | null, "NodeNames": [...] | null}``) and expects,
from ``filterVerb``, an ``ExtenderFilterResult`` (``Nodes``/``NodeNames``, ``FailedNodes``,
``FailedAndUnresolvableNodes``, ``Error``) and, from ``prioritizeVerb``, a ``HostPriorityList``
(``[{"Host": name, "Score": 0..10}]``, 10 = ``MaxExtenderPriority``).

The rule is the one :func:`stoker.cluster.schedule.choose_nodes` uses: a pod that names a dataset
in the annotation ``stoker.io/dataset`` scores each node by the bytes of that dataset its cache
holds (the node holding most gets 10); a dataset cached nowhere scores nodes by cache budget (its
cache then goes where its jobs run). Pods without the annotation score 0 everywhere (no opinion).
``filter`` passes every node, except that a pod annotated ``stoker.io/require-cache: "true"``
fails nodes without a cache service. Cache state comes from a JSON file (re-read when it changes;
written by ``stoker cluster-state``, see :func:`stoker.cluster.warmup.cluster_state`) or any
callable returning the same form. Standard library only (http.server); listens on 127.0.0.1 unless
told otherwise. Nothing here unpickles anything: requests and state are JSON.
"""
from __future__ import annotations

import json
import logging
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

log = logging.getLogger(__name__)

DATASET_ANNOTATION = "stoker.io/dataset"
REQUIRE_ANNOTATION = "stoker.io/require-cache"
MAX_PRIORITY = 10  # k8s.io/kube-scheduler/extender/v1 MaxExtenderPriority
MAX_BODY = 64 << 20


def file_state(path: str):
    """A state source reading ``path`` (JSON ``{"nodes": {name: {"cache_bytes", "datasets": {url: bytes}}}}``),
    re-read when its modification time changes. Raises OSError/ValueError on a missing or bad file."""
    box = {"mtime": None, "state": None}
    lock = threading.Lock()

    def get() -> dict:
        with lock:
            m = os.stat(path).st_mtime_ns
            if m != box["mtime"]:
                with open(path) as f:
                    state = json.load(f)
                if not isinstance(state, dict) or not isinstance(state.get("nodes"), dict):
                    raise ValueError(f"{path}: cache state must be a JSON object with a 'nodes' object")
                box["mtime"], box["state"] = m, state
            return box["state"]
    return get


def _annotations(pod: dict) -> dict:
    return ((pod or {}).get("metadata") or {}).get("annotations") or {}


def _pod_name(pod: dict) -> str:
    meta = (pod or {}).get("metadata") or {}
    return f"{meta.get('namespace', 'default')}/{meta.get('name', '?')}"


def _candidates(args: dict) -> tuple[list[str], list | None]:
    """Node names of ExtenderArgs, and the Node objects when it sent them (nodeCacheCapable false)."""
    nodes = args.get("Nodes")
    if nodes and nodes.get("items") is not None:
        items = nodes["items"]
        return [((n.get("metadata") or {}).get("name", "")) for n in items], items
    return list(args.get("NodeNames") or []), None


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


def filter_nodes(args: dict, state: dict) -> dict:
    """ExtenderFilterResult for ExtenderArgs ``args``."""
    names, items = _candidates(args)
    pod = args.get("Pod") or {}
    ann = _annotations(pod)
    failed = {}
    if str(ann.get(REQUIRE_ANNOTATION, "")).lower() == "true":
        have = state.get("nodes", {})
        failed = {n: f"no stoker cache service on node {n}" for n in names if n not in have}
    keep = [n for n in names if n not in failed]
    out = {"FailedNodes": failed, "FailedAndUnresolvableNodes": {}, "Error": ""}
    if items is not None:
        out["Nodes"] = {"items": [it for it, n in zip(items, names) if n not in failed]}
        out["NodeNames"] = None
    else:
        out["Nodes"] = None
        out["NodeNames"] = keep
    return out


def prioritize(args: dict, state: dict) -> list[dict]:
    """HostPriorityList for ExtenderArgs ``args``."""
    names, _ = _candidates(args)
    s = scores(_annotations(args.get("Pod")).get(DATASET_ANNOTATION), names, state)
    return [{"Host": n, "Score": s[n]} for n in names]


class _Handler(BaseHTTPRequestHandler):
    server_version = "stoker-extender"

    def do_POST(self):  # noqa: N802 - http.server's naming
        verb = self.path.rstrip("/").rsplit("/", 1)[-1]
        try:
            n = int(self.headers.get("Content-Length") or 0)
            if n > MAX_BODY:
                raise ValueError(f"request body of {n} bytes is over {MAX_BODY}")
            args = json.loads(self.rfile.read(n) or b"{}")
            if not isinstance(args, dict):
                raise ValueError("ExtenderArgs must be a JSON object")
            state = self.server.state()
            if verb == "filter":
                body, code = filter_nodes(args, state), 200
            elif verb == "prioritize":
                body, code = prioritize(args, state), 200
            else:
                body, code = {"Error": f"unknown verb {verb!r} (use filter or prioritize)"}, 404
        except (ValueError, OSError) as exc:
            log.warning("extender %s: %s", self.path, exc)
            body, code = {"Error": f"{type(exc).__name__}: {exc}"}, 400
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):  # noqa: N802 - health check
        data = b'{"ok": true}'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, fmt, *args):
        log.debug("extender: " + fmt, *args)


def serve(state, host: str = "127.0.0.1", port: int = 8888) -> ThreadingHTTPServer:
    """Start the extender on ``host:port`` (port 0: any free port) in a background thread.

    ``state``: a callable returning the cache state (e.g. :func:`file_state`). Returns the server
    (``server.server_address``; ``server.shutdown()`` stops it). Raises OSError if the address
    is taken.
    """
    srv = ThreadingHTTPServer((host, port), _Handler)
    srv.daemon_threads = True
    srv.state = state
    threading.Thread(target=srv.serve_forever, name="stoker-extender", daemon=True).start()
    return srv
