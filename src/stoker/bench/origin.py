"""An emulated remote origin: moto's S3 server behind a throttling TCP proxy.

The server runs in its own process (``python -m stoker.bench.origin serve``) so that
it never competes with the caller for the GIL.  Inside that process:

* moto's WSGI application, wrapped in :class:`_Middleware`, which serves single
  ``Range: bytes=a-b`` / ``bytes=a-`` object GETs straight from the key's buffer
  (moto itself copies the whole object on every GET), answers the control
  endpoints under ``/__stoker__/`` and injects faults;
* an asyncio TCP proxy (:class:`_Proxy`) in front of it that adds a per-request
  latency and caps bandwidth with one token bucket shared by all connections.

Only path-style requests (``http://127.0.0.1:PORT/<bucket>/<key>``, what botocore sends
to a custom endpoint) get the fast path and fault injection. Werkzeug's server answers
every request with ``Connection: close``, so each request is a new TCP connection.

:class:`LocalS3Origin` starts and stops that process from Python.
"""
from __future__ import annotations

import argparse
import asyncio
import atexit
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from http import HTTPStatus

_BUF = 1 << 20  # proxy read / write buffer, bytes
_RANGE_RE = re.compile(r"bytes=(\d+)-(\d*)")
# Requests with any of these need moto's full semantics: no fast path.
_SLOW_HEADERS = ("HTTP_IF_MATCH", "HTTP_IF_NONE_MATCH", "HTTP_IF_MODIFIED_SINCE",
                 "HTTP_IF_UNMODIFIED_SINCE",
                 "HTTP_X_AMZ_SERVER_SIDE_ENCRYPTION_CUSTOMER_ALGORITHM")
_FAST_STORAGE = (None, "STANDARD", "STANDARD_IA", "ONEZONE_IA", "INTELLIGENT_TIERING",
                 "REDUCED_REDUNDANCY")
_ERROR_CODES = {400: "BadRequest", 403: "AccessDenied", 404: "NoSuchKey",
                416: "InvalidRange", 500: "InternalError", 503: "SlowDown"}
_CREDS = {"key": "testing", "secret": "testing"}
_REGION = "us-east-1"


def _xml_error(code: str, message: str, **extra: object) -> bytes:
    rest = "".join(f"<{k}>{v}</{k}>" for k, v in extra.items())
    return (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
            f"<Message>{message}</Message>{rest}<RequestId>{uuid.uuid4().hex}</RequestId>"
            "</Error>").encode()


def _reply(start_response, status: int, body: bytes, content_type: str) -> list[bytes]:
    try:
        line = f"{status} {HTTPStatus(status).phrase}"
    except ValueError:
        line = f"{status} Error"
    start_response(line, [("Content-Type", content_type), ("Content-Length", str(len(body)))])
    return [body]


class _Middleware:
    """WSGI wrapper around moto: fast ranged GETs, faults, control endpoints, counters."""

    def __init__(self, app, fast_range: bool = True):
        self.app = app
        self.fast_range = fast_range
        self.proxy = None  # set to the _Proxy once it runs, for its counters
        self._lock = threading.Lock()
        self._fault: tuple[int, int | None] | None = None  # (status, remaining or None)
        self.counters = dict(requests=0, object_gets=0, ranged_gets=0, passthrough=0,
                             bytes_served=0, faults_served=0)

    def _add(self, **delta: int) -> None:
        with self._lock:
            for name, n in delta.items():
                self.counters[name] += n

    def __call__(self, environ, start_response):
        path = environ.get("PATH_INFO", "")
        if path.startswith("/__stoker__/"):
            return self._control(environ, start_response, path)
        self._add(requests=1)
        bucket, key = self._bucket_key(environ)
        if environ["REQUEST_METHOD"] == "GET" and key:
            self._add(object_gets=1)
            status = self._take_fault()
            if status is not None:
                body = _xml_error(_ERROR_CODES.get(status, "InternalError"), "Injected fault")
                self._add(faults_served=1, bytes_served=len(body))
                return _reply(start_response, status, body, "application/xml")
            if self.fast_range:
                resp = self._fast_range(environ, start_response, bucket, key)
                if resp is not None:
                    return resp
        self._add(passthrough=1)
        return self._counted(self.app(environ, start_response))

    def _counted(self, chunks):
        n = 0
        try:
            for chunk in chunks:
                n += len(chunk)
                yield chunk
        finally:
            if hasattr(chunks, "close"):
                chunks.close()
            self._add(bytes_served=n)

    @staticmethod
    def _bucket_key(environ) -> tuple[str, str]:
        """(bucket, key) of a path-style request, or ("", "") for virtual-host style."""
        host = environ.get("HTTP_HOST", "").split(":")[0]
        if host != "localhost" and not re.fullmatch(r"[\d.]+", host):
            return "", ""
        raw = environ.get("RAW_URI") or environ.get("REQUEST_URI") or \
            urllib.parse.quote(environ.get("PATH_INFO", ""))
        path = urllib.parse.unquote(raw.split("?", 1)[0])
        bucket, _, key = path.lstrip("/").partition("/")
        return bucket, key

    def _take_fault(self) -> int | None:
        with self._lock:
            if self._fault is None:
                return None
            status, left = self._fault
            if left is not None:
                self._fault = (status, left - 1) if left > 1 else None
            return status

    def _fast_range(self, environ, start_response, bucket: str, key_name: str):
        """Serve a single-range GET from the key's buffer; None means 'let moto do it'."""
        if environ.get("QUERY_STRING") or any(h in environ for h in _SLOW_HEADERS):
            return None
        m = _RANGE_RE.fullmatch(environ.get("HTTP_RANGE", "").strip())
        if m is None:
            return None
        start, end = int(m[1]), (int(m[2]) if m[2] else None)
        if end is not None and end < start:
            return None  # S3 ignores such a range: moto answers with the whole object
        key = _lookup_key(bucket, key_name)
        if key is None:
            return None
        with key.lock:
            size, etag = key.size, key.etag
            if start < size:
                stop = size - 1 if end is None else min(end, size - 1)
                if (start == 0 and stop == size - 1 and key.checksum_algorithm
                        and environ.get("HTTP_X_AMZ_CHECKSUM_MODE") == "ENABLED"):
                    return None  # full-object read with checksums: moto adds the headers
                try:
                    key._value_buffer.seek(start)
                    body = key._value_buffer.read(stop - start + 1)
                except ValueError:  # buffer closed: the key was just deleted or replaced
                    return None
        if start >= size:
            body = _xml_error("InvalidRange", "The requested range is not satisfiable",
                              RangeRequested=m[0], ActualObjectSize=size)
            self._add(bytes_served=len(body))
            return _reply(start_response, 416, body, "application/xml")
        headers = [(k.title() if not k.startswith("x-amz-") else k, str(v))
                   for k, v in key.metadata.items()]
        if not any(k.lower() == "content-type" for k, _ in headers):
            headers.append(("Content-Type", "binary/octet-stream"))
        headers += [("Content-Length", str(len(body))),
                    ("Content-Range", f"bytes {start}-{stop}/{size}"),
                    ("Accept-Ranges", "bytes"), ("ETag", etag),
                    ("Last-Modified", key.last_modified_RFC1123),
                    ("x-amz-request-id", uuid.uuid4().hex)]
        if key.version_id != "null":
            headers.append(("x-amz-version-id", str(key.version_id)))
        start_response("206 Partial Content", headers)
        self._add(ranged_gets=1, bytes_served=len(body))
        return [body]

    def _control(self, environ, start_response, path: str):
        method, status, out = environ["REQUEST_METHOD"], 200, {"ok": True}
        if path == "/__stoker__/faults" and method == "POST":
            n = int(environ.get("CONTENT_LENGTH") or 0)
            spec = json.loads(environ["wsgi.input"].read(n) or b"{}")
            count = spec.get("count")
            with self._lock:
                self._fault = None if count == 0 else (int(spec.get("status", 503)), count)
        elif path == "/__stoker__/faults" and method == "DELETE":
            with self._lock:
                self._fault = None
        elif path == "/__stoker__/stats" and method == "GET":
            with self._lock:
                out = dict(self.counters)
            if self.proxy is not None:
                out.update({f"proxy_{k}": v for k, v in self.proxy.stats.items()})
        else:
            status, out = 404, {"error": f"no control endpoint {method} {path}"}
        return _reply(start_response, status, json.dumps(out).encode(), "application/json")


def _lookup_key(bucket: str, key_name: str):
    """The latest plain, unencrypted FakeKey for bucket/key in moto's backend, or None."""
    from moto.s3.models import FakeKey, s3_backends

    where = s3_backends.bucket_accounts.get(bucket)
    if where is None:
        return None
    partition, account = where
    found = s3_backends[account][partition].buckets.get(bucket)
    if found is None or key_name not in found.keys:
        return None
    key = found.keys[key_name]
    if (not isinstance(key, FakeKey) or key.encryption is not None
            or key.storage_class not in _FAST_STORAGE):
        return None
    return key


class _TokenBucket:
    """Aggregate rate limit (bytes/s) shared by all connections of one event loop."""

    def __init__(self, rate_Bps: float | None):
        self.rate = rate_Bps if rate_Bps and rate_Bps > 0 else None
        self.capacity = max(256 * 1024, self.rate * 0.01) if self.rate else 0.0
        self.tokens, self.t = self.capacity, time.monotonic()

    async def take(self, n: int) -> None:
        if self.rate is None:
            return
        now = time.monotonic()
        self.tokens = min(self.capacity, self.tokens + (now - self.t) * self.rate) - n
        self.t = now
        if self.tokens < 0:  # in debt: wait until our bytes would have been sent
            await asyncio.sleep(-self.tokens / self.rate)


class _Proxy:
    """TCP proxy adding ``latency_s`` per client request burst and a bandwidth cap."""

    def __init__(self, target_port: int, latency_s: float, bandwidth_Bps: float | None):
        self.target_port, self.latency_s = target_port, latency_s
        self.down, self.up = _TokenBucket(bandwidth_Bps), _TokenBucket(bandwidth_Bps)
        self.stats = dict(connections=0, requests=0, bytes_down=0, bytes_up=0)

    async def handle(self, creader, cwriter) -> None:
        self.stats["connections"] += 1
        try:
            sreader, swriter = await asyncio.open_connection(
                "127.0.0.1", self.target_port, limit=_BUF)
        except OSError:
            cwriter.close()
            return
        for w in (cwriter, swriter):
            w.transport.set_write_buffer_limits(high=_BUF)
        new_request = [True]
        await asyncio.gather(self._pump(creader, swriter, True, new_request),
                             self._pump(sreader, cwriter, False, new_request),
                             return_exceptions=True)

    async def _pump(self, reader, writer, upstream: bool, new_request: list) -> None:
        try:
            while data := await reader.read(_BUF):
                if upstream:
                    if new_request[0]:  # first bytes of a new HTTP request
                        new_request[0] = False
                        self.stats["requests"] += 1
                        if self.latency_s > 0:
                            await asyncio.sleep(self.latency_s)
                    await self.up.take(len(data))
                    self.stats["bytes_up"] += len(data)
                else:
                    new_request[0] = True
                    await self.down.take(len(data))
                    self.stats["bytes_down"] += len(data)
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()  # ends the other direction's pump too


def serve(latency_ms: float, bandwidth_MBps: float, ready_file: str | None = None,
          buckets: tuple[str, ...] = (), fast_range: bool = True,
          parent_pid: int | None = None) -> None:
    """Run moto plus the throttling proxy until killed (or until ``parent_pid`` exits).

    ``bandwidth_MBps`` is in megabytes per second (1e6 bytes/s; 0 = unlimited), latency in
    milliseconds. Writes ``{endpoint_url, direct_url, pid}`` as JSON to ``ready_file``
    (atomically) once both listen. Raises whatever moto or werkzeug raise on start-up.
    """
    from moto.moto_server.werkzeug_app import MotoRequestHandler
    from moto.server import DomainDispatcherApplication, create_backend_app
    from werkzeug.serving import make_server

    class QuietHandler(MotoRequestHandler):
        def log_request(self, *args, **kwargs):  # one line per request is too slow
            pass

    mw = _Middleware(DomainDispatcherApplication(create_backend_app), fast_range)
    server = make_server("127.0.0.1", 0, mw, threaded=True, request_handler=QuietHandler)
    threading.Thread(target=server.serve_forever, daemon=True, name="moto").start()
    if buckets:
        from moto.core import DEFAULT_ACCOUNT_ID
        from moto.s3.models import s3_backends
        for name in buckets:
            s3_backends[DEFAULT_ACCOUNT_ID]["aws"].create_bucket(name, _REGION)

    proxy = _Proxy(server.port, latency_ms / 1e3, bandwidth_MBps * 1e6)
    loop = asyncio.new_event_loop()
    listener = loop.run_until_complete(
        asyncio.start_server(proxy.handle, "127.0.0.1", 0, limit=_BUF))
    threading.Thread(target=loop.run_forever, daemon=True, name="proxy").start()
    mw.proxy = proxy
    info = {"endpoint_url": f"http://127.0.0.1:{listener.sockets[0].getsockname()[1]}",
            "direct_url": f"http://127.0.0.1:{server.port}", "pid": os.getpid()}
    if ready_file:
        with open(ready_file + ".tmp", "w") as f:
            json.dump(info, f)
        os.replace(ready_file + ".tmp", ready_file)
    else:
        print(json.dumps(info), flush=True)
    while parent_pid is None or os.getppid() == parent_pid:
        time.sleep(0.5)


class LocalS3Origin:
    """A local S3-compatible origin that behaves like a remote one (context manager).

    ``latency_ms``: added to every request (milliseconds); ``bandwidth_MBps``: aggregate cap,
    megabytes (1e6 bytes) per second, each direction (0 = unlimited); ``bucket``: created on
    start; ``start_timeout_s``: seconds to wait for the server; ``fast_range``: serve ranged
    GETs without moto's whole-object copy (False = moto's own path, for comparisons).
    """

    def __init__(self, latency_ms: float = 20.0, bandwidth_MBps: float = 100.0,
                 bucket: str = "stoker", start_timeout_s: float = 30.0,
                 fast_range: bool = True):
        self.latency_ms, self.bandwidth_MBps = latency_ms, bandwidth_MBps
        self.bucket, self.start_timeout_s, self.fast_range = bucket, start_timeout_s, fast_range
        self.endpoint_url = self.direct_url = ""
        self._proc: subprocess.Popen | None = None
        self._tmp: str | None = None
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def start(self) -> "LocalS3Origin":
        """Spawn the server process and wait until it is ready; returns self.

        Raises RuntimeError (with the server's stderr) if it exits or is not ready within
        ``start_timeout_s`` seconds.
        """
        if self._proc is not None:
            return self
        self._tmp = tempfile.mkdtemp(prefix="stoker-origin-")
        ready = os.path.join(self._tmp, "ready.json")
        err_path = os.path.join(self._tmp, "stderr.log")
        src_dir = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        env.update(AWS_ACCESS_KEY_ID=_CREDS["key"], AWS_SECRET_ACCESS_KEY=_CREDS["secret"],
                   AWS_DEFAULT_REGION=_REGION, AWS_CONFIG_FILE=os.devnull,
                   AWS_SHARED_CREDENTIALS_FILE=os.devnull,
                   PYTHONPATH=os.pathsep.join(filter(None, [src_dir, env.get("PYTHONPATH")])))
        cmd = [sys.executable, "-m", "stoker.bench.origin", "serve",
               "--latency-ms", str(self.latency_ms), "--bandwidth-mbps", str(self.bandwidth_MBps),
               "--ready-file", ready, "--bucket", self.bucket, "--parent-pid", str(os.getpid())]
        if not self.fast_range:
            cmd.append("--no-fast-range")
        with open(err_path, "wb") as err:
            self._proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL,
                                          stdout=subprocess.DEVNULL, stderr=err)
        atexit.register(self.stop)
        deadline = time.monotonic() + self.start_timeout_s
        while not os.path.exists(ready):
            failed = self._proc.poll() is not None
            if failed or time.monotonic() > deadline:
                with open(err_path, errors="replace") as f:
                    log = f.read()[-4000:]
                why = (f"exited with code {self._proc.returncode}" if failed
                       else f"not ready after {self.start_timeout_s} s")
                self.stop()
                raise RuntimeError(f"stoker origin server {why}; stderr:\n{log}")
            time.sleep(0.02)
        with open(ready) as f:
            info = json.load(f)
        self.endpoint_url, self.direct_url = info["endpoint_url"], info["direct_url"]
        return self

    def stop(self) -> None:
        """Terminate the server (kill after 5 s). Idempotent; never raises."""
        proc, self._proc = self._proc, None
        atexit.unregister(self.stop)
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    @property
    def pid(self) -> int | None:
        """Process id of the server, or None when not running."""
        return self._proc.pid if self._proc is not None else None

    def __enter__(self) -> "LocalS3Origin":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def url(self, path: str = "") -> str:
        """``s3://<bucket>/<path>``."""
        return f"s3://{self.bucket}/{path.lstrip('/')}"

    def storage_options(self, throttled: bool = True) -> dict:
        """Plain, picklable kwargs for s3fs / fsspec (through the proxy if ``throttled``)."""
        return {"endpoint_url": self.endpoint_url if throttled else self.direct_url,
                **_CREDS, "client_kwargs": {"region_name": _REGION}}

    def _control(self, method: str, path: str, payload: dict | None = None) -> dict:
        if not self.direct_url:
            raise RuntimeError("LocalS3Origin is not started")
        data = json.dumps(payload).encode() if payload is not None else None
        req = urllib.request.Request(f"{self.direct_url}/__stoker__/{path}", data=data,
                                     method=method,
                                     headers={"Content-Type": "application/json"})
        with self._opener.open(req, timeout=10) as resp:
            return json.loads(resp.read())

    def inject_faults(self, status: int = 503, count: int | None = None) -> None:
        """Answer the next ``count`` object GETs (all, if None) with HTTP ``status``.

        Raises RuntimeError if not started, urllib.error.URLError if the server is gone.
        """
        self._control("POST", "faults", {"status": int(status), "count": count})

    def clear_faults(self) -> None:
        """Stop injecting faults. Raises like :meth:`inject_faults`."""
        self._control("DELETE", "faults")

    def stats(self) -> dict:
        """Server counters: requests, object_gets, ranged_gets (fast path), passthrough,
        bytes_served (bytes), faults_served, proxy_{connections,requests,bytes_down,bytes_up}.
        Raises like :meth:`inject_faults`."""
        return self._control("GET", "stats")


def upload_tree(local_dir: str, dst_url: str, storage_options: dict | None = None,
                max_workers: int = 8) -> dict:
    """Upload every file under ``local_dir`` to ``dst_url`` (same relative paths), in parallel.

    Returns ``{"files", "bytes", "seconds"}``. Raises FileNotFoundError if ``local_dir`` is not
    a directory, and whatever the fsspec backend raises on a failed upload.
    """
    import fsspec

    if not os.path.isdir(local_dir):
        raise FileNotFoundError(f"not a directory: {local_dir}")
    t0 = time.perf_counter()
    fs, root = fsspec.core.url_to_fs(dst_url, **(storage_options or {}))
    jobs = []
    for dirpath, _, names in os.walk(local_dir):
        for name in names:
            src = os.path.join(dirpath, name)
            rel = os.path.relpath(src, local_dir).replace(os.sep, "/")
            jobs.append((src, f"{root.rstrip('/')}/{rel}", os.path.getsize(src)))
    with ThreadPoolExecutor(max(1, max_workers)) as pool:
        list(pool.map(lambda job: fs.put_file(job[0], job[1]), jobs))
    return {"files": len(jobs), "bytes": sum(j[2] for j in jobs),
            "seconds": time.perf_counter() - t0}


def main(argv: list[str] | None = None) -> None:
    """``python -m stoker.bench.origin serve [...]``."""
    p = argparse.ArgumentParser(prog="python -m stoker.bench.origin")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="run moto behind a throttling proxy")
    s.add_argument("--latency-ms", type=float, default=20.0)
    s.add_argument("--bandwidth-mbps", "--bandwidth-MBps", dest="bandwidth", type=float,
                   default=100.0, help="megabytes (1e6 bytes) per second; 0 = unlimited")
    s.add_argument("--ready-file")
    s.add_argument("--bucket", action="append", default=[])
    s.add_argument("--no-fast-range", action="store_true")
    s.add_argument("--parent-pid", type=int)
    a = p.parse_args(argv)
    os.environ.setdefault("AWS_ACCESS_KEY_ID", _CREDS["key"])
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", _CREDS["secret"])
    serve(a.latency_ms, a.bandwidth, a.ready_file, tuple(a.bucket), not a.no_fast_range,
          a.parent_pid)


if __name__ == "__main__":
    main()
