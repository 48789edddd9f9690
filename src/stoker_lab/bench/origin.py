"""An emulated remote origin: moto's S3 server behind a throttling TCP proxy.

The server runs in its own process (``python -m stoker.cli origin-server``, which calls
:func:`serve_origin`, implemented in :mod:`stoker_lab.bench.origin_server`) so that it never competes with the caller for the
GIL. Inside that process, moto's WSGI application (plus a fast path for ranged GETs
and counters) is served by waitress with HTTP/1.1 keep-alive, behind an
asyncio TCP proxy that adds ``latency_ms`` once per HTTP request (also on reused
connections) and caps aggregate bandwidth; see :class:`stoker_lab.bench.throttle._Proxy`
for the exact model. The origin injects no faults of its own: put
:class:`stoker_lab.bench.faultproxy.FaultProxy` in front of its endpoint for that.

:class:`LocalS3Origin` starts and stops that process from Python.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

_CREDS = {"key": "testing", "secret": "testing"}
_REGION = "us-east-1"


#: Scheduling niceness of the emulated origin's server process (see :class:`LocalS3Origin`).
ORIGIN_NICE = 10


def endpoint_options(endpoint_url: str) -> dict:
    """s3fs / fsspec kwargs for the emulated origin at ``endpoint_url`` (its fixed test
    credentials and region): what a process that did not start the origin (a namespace driver)
    passes."""
    return {"endpoint_url": endpoint_url, **_CREDS, "client_kwargs": {"region_name": _REGION}}


class LocalS3Origin:
    """A local S3-compatible origin that behaves like a remote one (context manager).

    ``latency_ms``: added to every request (milliseconds); ``bandwidth_MBps``: aggregate cap,
    megabytes (1e6 bytes) per second, each direction (0 = unlimited); ``bucket``: created on
    start; ``start_timeout_s``: seconds to wait for the server; ``fast_range``: serve ranged
    GETs without moto's whole-object copy (False = moto's own path, for comparisons); ``nice``:
    the server's scheduling niceness (added to this process's; 0 = the same priority).

    The server runs at niceness :data:`ORIGIN_NICE` by default. A real object store spends none
    of the training node's CPU; the emulator, on the node's own cores, spends about 4 ms per MB
    served (moto and the throttling proxy). At equal priority it took CPU from the decode
    workers when they needed it most: with it at nice 10 the demo's cold first batch came in
    0.22-0.29 s instead of 0.33-0.49 s (three runs each, near origin, quiet machine). It still
    gets the CPU it needs whenever a core is idle, and its CPU time is still reported
    (``cpu_s["origin_emulator"]``).
    """

    def __init__(
        self,
        latency_ms: float = 20.0,
        bandwidth_MBps: float = 100.0,
        bucket: str = "stoker",
        start_timeout_s: float = 30.0,
        fast_range: bool = True,
        nice: int | None = None,
    ):
        self.latency_ms, self.bandwidth_MBps = latency_ms, bandwidth_MBps
        self.bucket, self.start_timeout_s, self.fast_range = bucket, start_timeout_s, fast_range
        self.nice = ORIGIN_NICE if nice is None else int(nice)
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
        env.update(
            AWS_ACCESS_KEY_ID=_CREDS["key"],
            AWS_SECRET_ACCESS_KEY=_CREDS["secret"],
            AWS_DEFAULT_REGION=_REGION,
            AWS_CONFIG_FILE=os.devnull,
            AWS_SHARED_CREDENTIALS_FILE=os.devnull,
            PYTHONPATH=os.pathsep.join(filter(None, [src_dir, env.get("PYTHONPATH")])),
        )
        cmd = [
            sys.executable,
            "-m",
            "stoker.cli",
            "origin-server",
            "--latency-ms",
            str(self.latency_ms),
            "--bandwidth-mbps",
            str(self.bandwidth_MBps),
            "--ready-file",
            ready,
            "--bucket",
            self.bucket,
            "--parent-pid",
            str(os.getpid()),
            "--port",
            "0",
        ]
        if not self.fast_range:
            cmd.append("--no-fast-range")
        with open(err_path, "wb") as err:
            self._proc = subprocess.Popen(
                cmd,
                env=env,
                stdin=subprocess.DEVNULL,
                preexec_fn=(lambda: os.nice(self.nice)) if self.nice else None,
                stdout=subprocess.DEVNULL,
                stderr=err,
            )
        atexit.register(self.stop)
        deadline = time.monotonic() + self.start_timeout_s
        while not os.path.exists(ready):
            failed = self._proc.poll() is not None
            if failed or time.monotonic() > deadline:
                with open(err_path, errors="replace") as f:
                    log = f.read()[-4000:]
                why = (
                    f"exited with code {self._proc.returncode}"
                    if failed
                    else f"not ready after {self.start_timeout_s} s"
                )
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
        return endpoint_options(self.endpoint_url if throttled else self.direct_url)

    def stats(self) -> dict:
        """Server counters: requests, object_gets, ranged_gets (fast path), passthrough,
        bytes_served (bytes), proxy_{connections,requests,bytes_down,bytes_up}.

        Raises RuntimeError if not started, urllib.error.URLError if the server is gone.
        """
        if not self.direct_url:
            raise RuntimeError("LocalS3Origin is not started")
        with self._opener.open(f"{self.direct_url}/__stoker__/stats", timeout=10) as resp:
            return json.loads(resp.read())


def upload_tree(local_dir: str, dst_url: str, storage_options: dict | None = None, max_workers: int = 8) -> dict:
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
    return {"files": len(jobs), "bytes": sum(j[2] for j in jobs), "seconds": time.perf_counter() - t0}


def serve_origin(
    *,
    latency_ms: float = 20.0,
    bandwidth_MBps: float = 100.0,
    ready_file: str | None = None,
    buckets: tuple[str, ...] = (),
    fast_range: bool = True,
    parent_pid: int | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    announce: bool = False,
) -> None:
    """Run the emulated origin in this process until Ctrl-C (SIGINT; or until ``parent_pid`` exits).

    ``latency_ms``: milliseconds added to every request; ``bandwidth_MBps``: megabytes (1e6 bytes)
    per second, 0 = unlimited; ``ready_file``: where ``{endpoint_url, direct_url, pid}`` is written
    as JSON once the server listens (removed when it stops); ``buckets``: created on start;
    ``fast_range``: see :class:`LocalS3Origin`; ``host``: the address to listen on (default
    loopback); ``port``: the endpoint's port (0: a free one); ``announce``: print the endpoint,
    the buckets and what a user pastes to reach them (:func:`usage_lines`) once it listens, and a
    line when it stops. Sets the test credentials unless AWS ones are set already. Raises
    OSError naming the port when it is taken, and whatever moto or waitress raise on start-up.
    This is what ``stoker origin-server`` runs.
    """
    from .origin_server import serve

    os.environ.setdefault("AWS_ACCESS_KEY_ID", _CREDS["key"])
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", _CREDS["secret"])

    def ready(info: dict) -> None:
        if announce:
            lines = usage_lines(info["endpoint_url"], buckets, latency_ms, bandwidth_MBps)
            print("\n".join(lines), flush=True)

    serve(latency_ms, bandwidth_MBps, ready_file, buckets, fast_range, parent_pid, host, port, ready)
    if announce:
        print("stoker origin-server: stopped (its objects were in memory and are gone)", flush=True)


def usage_lines(endpoint_url: str, buckets: tuple[str, ...], latency_ms: float, bandwidth_MBps: float) -> list[str]:
    """What ``stoker origin-server`` prints once it listens: the endpoint and buckets, the
    ``export`` line for the AWS environment and the same as ``storage_options=`` (JSON), with
    the credentials the server takes (any; these are the ones it documents)."""
    opts = endpoint_options(endpoint_url)
    env = {
        "AWS_ENDPOINT_URL": endpoint_url,
        "AWS_ACCESS_KEY_ID": _CREDS["key"],
        "AWS_SECRET_ACCESS_KEY": _CREDS["secret"],
        "AWS_DEFAULT_REGION": _REGION,
    }
    speed = f"{bandwidth_MBps:g} MB/s" if bandwidth_MBps else "no bandwidth cap"
    return [
        f"stoker origin-server: a local S3 (moto) at {endpoint_url}, "
        f"bucket{'s' if len(buckets) != 1 else ''} {', '.join(buckets) or '(none)'}; "
        f"{latency_ms:g} ms per request, {speed}",
        "the AWS environment (paste into a shell):",
        "  export " + " ".join(f"{k}={v}" for k, v in env.items()),
        "or storage_options= of stoker.pack / stoker.open_dataset:",
        "  " + json.dumps(opts),
        f"e.g. stoker.pack('raw/train', 's3://{buckets[0] if buckets else 'BUCKET'}/train'); serving until Ctrl-C",
    ]
