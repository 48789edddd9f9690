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

Every answer is JSON, errors included (``{"Error": message}``): 400 for a request that is not
JSON or not of the ExtenderArgs shape (the message names the field, e.g. ``NodeNames[2]``), 404 for
an unknown verb, 411 for a body without a length, 413 for a body over ``max_body_bytes``, 500 when
the cache state cannot be read or has the wrong shape (the message names the file and the entry)
or on any other fault. The connection is never dropped without an answer, and one bad request
or state file never stops the server.
"""
from __future__ import annotations

import json
import logging
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from ..errors import ExtenderRequestError
from .freshness import MAX_AGE_S, is_stale, state_age_s

log = logging.getLogger(__name__)

DATASET_ANNOTATION = "stoker.io/dataset"
REQUIRE_ANNOTATION = "stoker.io/require-cache"
MAX_PRIORITY = 10  # k8s.io/kube-scheduler/extender/v1 MaxExtenderPriority
#: Default cap on a request body, bytes. kube-scheduler sends full Node objects (a few KB each)
#: when ``nodeCacheCapable`` is false, so this holds about a thousand nodes; names only (true)
#: are some tens of bytes a node. Raise it with ``serve(max_body_bytes=...)`` / ``--max-body-size``.
MAX_BODY_BYTES = 8 << 20
MAX_BODY = MAX_BODY_BYTES  # the former name
#: A client that sends nothing for this long gets its connection closed (seconds).
REQUEST_TIMEOUT_S = 30.0


BadRequest = ExtenderRequestError  # the name used here and in older code


def _kind(value) -> str:
    """The JSON type name of a decoded value, for messages."""
    if value is None:
        return "null"
    return {bool: "boolean", int: "number", float: "number", str: "string", list: "array",
            dict: "object"}.get(type(value), type(value).__name__)


def _object(value, where: str, error=BadRequest) -> dict:
    """``value`` if it is a JSON object, ``{}`` if null; else ``error`` naming ``where``."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise error(f"{where} must be an object or null, got {_kind(value)}")
    return value


def check_state(state, source: str = "cache state") -> dict:
    """``state`` if it has the form :func:`scores` reads, else ValueError naming ``source`` and the entry.

    Form: ``{"nodes": {name: {"cache_bytes": int >= 0, "datasets": {url: int >= 0}}}}``;
    ``cache_bytes`` and ``datasets`` may be left out, other keys are ignored.
    """
    if not isinstance(state, dict) or not isinstance(state.get("nodes"), dict):
        raise ValueError(f"{source}: cache state must be a JSON object with a 'nodes' object")

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
    box = {"mtime": None, "state": None}
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
    (missing keys count as null). Node objects are returned when ``Nodes.items`` is sent (then it
    wins over ``NodeNames``), so that filter can answer in the same form. Raises :class:`BadRequest`
    naming the field, e.g. ``NodeNames[1] must be a string, got number``.
    """
    if not isinstance(args, dict):
        raise BadRequest(f"ExtenderArgs must be an object, got {_kind(args)}")
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
            name = _object(_object(item, f"Nodes.items[{k}]").get("metadata"),
                           f"Nodes.items[{k}].metadata").get("name")
            if not isinstance(name, str) or not name:
                raise BadRequest(f"Nodes.items[{k}].metadata.name must be a non-empty string, got {_kind(name)}")
            names.append(name)
        return ann, names, items
    names = args.get("NodeNames")
    if names is None:
        return ann, [], None
    if not isinstance(names, list):
        raise BadRequest(f"NodeNames must be an array or null, got {_kind(names)}")
    for k, name in enumerate(names):
        if not isinstance(name, str) or not name:
            raise BadRequest(f"NodeNames[{k}] must be a non-empty string, got {_kind(name)}")
    return ann, list(names), None


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
        why = (f"stoker cache state is {state_age_s(state):.0f} s old (over {max_age_s:g} s): "
               "no node is known to hold a cache")
        return {"Nodes": {"items": []} if items is not None else None, "NodeNames": None if items is not None else [],
                "FailedNodes": {n: why for n in names}, "FailedAndUnresolvableNodes": {}, "Error": why}
    if required:
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


def prioritize(args: dict, state: dict, max_age_s: float | None = None) -> list[dict]:
    """HostPriorityList for ExtenderArgs ``args`` (:class:`BadRequest` if malformed); every node
    scores 0 (no preference) when ``state`` is older than ``max_age_s`` seconds."""
    ann, names, _ = parse_args(args)
    s = scores(None if is_stale(state, max_age_s) else ann.get(DATASET_ANNOTATION), names, state)
    return [{"Host": n, "Score": s[n]} for n in names]


class _Handler(BaseHTTPRequestHandler):
    server_version = "stoker-extender"
    timeout = REQUEST_TIMEOUT_S  # socket timeout: a stalled client cannot hold a thread for ever

    def do_POST(self):  # noqa: N802 - http.server's naming
        try:
            body, code = self._answer(), 200
            data = json.dumps(body).encode()
        except BadRequest as exc:
            log.warning("extender %s: %s", self.path, exc)
            body, code = {"Error": str(exc)}, exc.code
        except _StateError as exc:
            log.error("extender %s: %s", self.path, exc)
            body, code = {"Error": str(exc)}, 500
        except Exception as exc:  # noqa: BLE001 - answer, never drop the connection
            log.exception("extender %s failed", self.path)
            body, code = {"Error": f"internal error: {type(exc).__name__}: {exc}"}, 500
        self._reply(code, body if code != 200 else data)

    def _answer(self):
        verb = self.path.rstrip("/").rsplit("/", 1)[-1]
        if verb not in ("filter", "prioritize"):
            self._discard_body()
            raise BadRequest(f"unknown verb {verb!r} (use filter or prioritize)", 404)
        args = json_loads(self._body(), "request body")
        try:
            state = check_state(self.server.state(), "cache state")
        except Exception as exc:  # noqa: BLE001 - any failure of the source is the server's, not the request's
            raise _StateError(f"cache state unavailable: {type(exc).__name__}: {exc}") from exc
        age = self.server.max_age_s
        return filter_nodes(args, state, age) if verb == "filter" else prioritize(args, state, age)

    def _length(self) -> int:
        if self.headers.get("Transfer-Encoding"):
            raise BadRequest("send the body with a Content-Length (no Transfer-Encoding)", 411)
        text = self.headers.get("Content-Length")
        try:
            n = int(text or 0)
        except ValueError:
            raise BadRequest(f"Content-Length {text!r:.40} is not a number") from None
        if n < 0:
            raise BadRequest(f"Content-Length {n} is negative")
        return n

    def _body(self) -> bytes:
        n = self._length()
        if n > self.server.max_body_bytes:
            self._discard_body(n)
            raise BadRequest(f"request body of {n} bytes is over the limit of {self.server.max_body_bytes} "
                             "bytes (see --max-body-size)", 413)
        data = self.rfile.read(n)
        if len(data) < n:
            raise BadRequest(f"request body ended after {len(data)} of {n} bytes")
        return data or b"{}"

    def _discard_body(self, n: int | None = None):
        """Read and drop up to ``n`` body bytes (at most 16 caps), so that the client, still
        sending, reads the answer instead of a reset connection."""
        try:
            n = self._length() if n is None else n
            left = min(n, 16 * self.server.max_body_bytes)
            while left > 0:
                got = self.rfile.read(min(left, 1 << 16))
                if not got:
                    break
                left -= len(got)
        except (BadRequest, OSError):
            pass
        self.close_connection = True

    def _reply(self, code: int, body) -> None:
        """Send ``body`` (a JSON value, or its encoding as bytes) with status ``code``."""
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        try:
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            if code >= 400:
                self.send_header("Connection", "close")
                self.close_connection = True
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)
        except OSError as exc:  # the client left: nobody to answer
            log.debug("extender: client gone before the answer: %s", exc)

    def send_error(self, code, message=None, explain=None):
        """http.server's own errors (bad request line, unknown method, ...) as JSON too."""
        phrase = self.responses.get(code, ("error",))[0]
        self._reply(code, {"Error": f"{code} {phrase}" + (f": {message}" if message else "")})

    def do_GET(self):  # noqa: N802 - health check
        self._reply(200, {"ok": True})

    def log_message(self, fmt, *args):
        log.debug("extender: " + fmt, *args)


class _StateError(RuntimeError):
    """The cache state could not be had or has the wrong shape (answered with 500)."""


def json_loads(data: bytes, what: str):
    """``json.loads`` with :class:`BadRequest` (naming ``what``) for bytes that are not UTF-8 JSON."""
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise BadRequest(f"{what} is not JSON: {type(exc).__name__}: {exc}") from None


def serve(state, host: str = "127.0.0.1", port: int = 8888,
          max_body_bytes: int = MAX_BODY_BYTES, max_age_s: float | None = MAX_AGE_S) -> ThreadingHTTPServer:
    """Start the extender on ``host:port`` (port 0: any free port) in a background thread.

    ``state``: a callable returning the cache state (e.g. :func:`file_state`); ``max_body_bytes``:
    larger request bodies are refused with 413; ``max_age_s``: a state older than this (seconds,
    by its ``"time"``; None: any age) gives no preference and fails ``require-cache`` pods
    (:mod:`stoker.cluster.freshness`). ``state`` is called on every request: it must answer at
    once (:func:`stoker.cluster.freshness.refreshing` wraps a slow source). Returns the server
    (``server.server_address``; ``server.shutdown()`` stops it). Raises OSError if the address
    is taken.
    """
    srv = ThreadingHTTPServer((host, port), _Handler)
    srv.daemon_threads = True
    srv.state = state
    srv.max_body_bytes = int(max_body_bytes)
    srv.max_age_s = max_age_s
    threading.Thread(target=srv.serve_forever, name="stoker-extender", daemon=True).start()
    return srv
