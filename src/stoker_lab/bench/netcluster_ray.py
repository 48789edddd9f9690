"""The processes of a namespace cluster: the emulated S3 origin and the Ray nodes.

:class:`NetRay` starts, inside the namespaces of a :class:`stoker_lab.bench.netcluster.NetCluster`:

- the origin server (moto behind the throttling proxy, ``latency_ms`` per request, no bandwidth
  cap of its own: the origin link's ``tbf`` is the cap) in the origin namespace, listening on the
  origin's address;
- a Ray head (``ray start --head``) in the first host namespace and ``ray start --address``
  worker nodes in the others, each with its own temp directory and sockets, and ``NODE_NAME`` set
  to its host's name so that each node's cache service takes its own cache directory
  (:mod:`stoker.cluster.identity`);
- :meth:`driver`: a Python command run in the first host namespace (the Ray driver).

Ray runs with token authentication (``RAY_AUTH_MODE=token``): :meth:`NetRay.start_ray` makes a
token for the cluster (``ray-auth-token`` in the work directory, mode 0600) and every process
started here finds it through ``RAY_AUTH_TOKEN_PATH``, so no ``~/.ray/auth_token`` is needed or
touched. Nothing here stops a process: the processes stay inside the namespaces,
and :meth:`stoker_lab.bench.netcluster.NetCluster.close` ends them by id with the namespaces.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from .netcluster import NetCluster

#: Ray's GCS port on the head host (each host has its own network stack: no clash with others).
GCS_PORT = 6379

#: Ray's node health check for this cluster (Ray's ``RayConfig`` names, read from ``RAY_<name>``
#: by every process ``ray start`` runs; the GCS on the head uses them). Ray's defaults (a check every
#: 3 s, 10 s timeout, 5 failures) take 15 s to find a SIGKILLed host dead, and the fault runs wait
#: for that. Here a dead host (connection refused: each check fails at once) is found in
#: 5 x 1 s = 5 s, while a link that drops packets fails a check only after its 3 s timeout, so a
#: host whose link is down for the fault runs' 5 s is not taken for dead (5 x (1 + 3) = 20 s).
HEALTH_CHECK_ENV = {
    "RAY_health_check_period_ms": "1000",
    "RAY_health_check_timeout_ms": "3000",
    "RAY_health_check_failure_threshold": "5",
    "RAY_health_check_initial_delay_ms": "1000",
}


def _src_dir() -> str:
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def node_env(node_name: str | None = None, token_path: str | None = None) -> dict:
    """The environment of every process started here: this stoker on ``PYTHONPATH``, Ray's token
    authentication on (the token read from ``token_path`` when given), usage stats off,
    ``NODE_NAME`` (the cache identity) if given."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [_src_dir(), env.get("PYTHONPATH")]))
    env.update(RAY_AUTH_MODE="token", RAY_USAGE_STATS_ENABLED="0", PYTHONUNBUFFERED="1")
    # RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 (the tests' loopback Ray) would stop a worker node's
    # ``ray start`` and take 127.0.0.1 for the namespaces' own addresses
    for k in ("RAY_ADDRESS", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"):
        env.pop(k, None)
    if token_path:
        env["RAY_AUTH_TOKEN_PATH"] = token_path
        env.pop("RAY_AUTH_TOKEN", None)  # it would win over the file
    if node_name:
        env["NODE_NAME"] = node_name
    return env


def write_token(path: str) -> str:
    """Write a new random Ray authentication token (64 hex digits) to ``path``, readable by its
    owner only (mode 0600, replacing any file there); returns ``path``."""
    import secrets

    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    os.replace(tmp, path)
    return path


class NetRay:
    """Origin and Ray processes on ``net`` (a started :class:`NetCluster`), files under ``workdir``.

    ``cpus_per_host``: Ray CPUs each node offers; ``object_store_bytes``: each node's object
    store (bytes); ``start_timeout_s``: seconds to wait for the origin and for each Ray node.
    Every host but the last offers the resource
    :data:`stoker_lab.bench.netcluster_faults.STEADY` (the last is the fault runs' victim).
    Raises RuntimeError (with the process's log tail) when a process fails or is not ready in time.
    """

    def __init__(
        self,
        net: NetCluster,
        workdir: str,
        cpus_per_host: int = 2,
        object_store_bytes: int = 100 << 20,
        start_timeout_s: float = 120.0,
    ):
        self.net, self.workdir = net, workdir
        self.cpus_per_host, self.object_store_bytes = cpus_per_host, object_store_bytes
        self.start_timeout_s = start_timeout_s
        self.endpoint_url = self.direct_url = ""
        self.address = f"{net.host_ip[0]}:{GCS_PORT}"
        self.token_path = os.path.join(os.path.abspath(workdir), "ray-auth-token")  # made by start_ray
        os.makedirs(workdir, exist_ok=True)

    def _log(self, name: str) -> str:
        return os.path.join(self.workdir, f"{name}.log")

    def _tail(self, name: str) -> str:
        try:
            with open(self._log(name), errors="replace") as f:
                return f.read()[-3000:]
        except OSError:
            return ""

    def start_origin(self, latency_ms: float = 20.0, bucket: str = "stoker") -> str:
        """Start the origin server in the origin namespace; returns its S3 endpoint URL."""
        ready = os.path.join(self.workdir, "origin-ready.json")
        if os.path.exists(ready):  # left by an earlier run in this directory
            os.remove(ready)
        cmd = [
            *self.net.exec_prefix(self.net.origin_ns),
            sys.executable,
            "-m",
            "stoker.cli",
            "origin-server",
            "--host",
            self.net.origin_ip,
            "--latency-ms",
            str(latency_ms),
            "--bandwidth-mbps",
            "0",
            "--bucket",
            bucket,
            "--ready-file",
            ready,
            "--port",
            "0",
        ]
        env = node_env()
        env.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1")
        with open(self._log("origin"), "wb") as log:
            proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        deadline = time.monotonic() + self.start_timeout_s
        while not os.path.exists(ready):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"origin server in namespace {self.net.origin_ns} "
                    f"{'exited' if proc.poll() is not None else 'not ready in time'}:\n"
                    f"{self._tail('origin')}"
                )
            time.sleep(0.1)
        with open(ready) as f:
            info = json.load(f)
        self.endpoint_url, self.direct_url = info["endpoint_url"], info["direct_url"]
        return self.endpoint_url

    def _ray_start(self, i: int, head: bool) -> subprocess.Popen:
        """Run ``ray start`` for host ``i`` (output to ``ray-h<i>.log``); returns the process."""
        ns, ip = self.net.host_ns[i], self.net.host_ip[i]
        d = os.path.join(self.workdir, f"r{i}")
        os.makedirs(d, exist_ok=True)
        ray = os.path.join(os.path.dirname(sys.executable), "ray")
        cmd = [
            *self.net.exec_prefix(ns),
            ray,
            "start",
            "--node-ip-address",
            ip,
            "--num-cpus",
            str(self.cpus_per_host),
            "--object-store-memory",
            str(self.object_store_bytes),
            "--temp-dir",
            d,
            "--disable-usage-stats",
        ]
        cmd += ["--head", "--port", str(GCS_PORT), "--include-dashboard=false"] if head else ["--address", self.address]
        if i < self.net.hosts - 1 or self.net.hosts == 1:
            from .netcluster_faults import STEADY

            cmd += ["--resources", json.dumps({STEADY: 100})]
        env = node_env(ns, self.token_path)
        env.update(HEALTH_CHECK_ENV)
        with open(self._log(f"ray-h{i}"), "wb") as log:
            return subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log)

    def _wait_started(self, procs: dict[int, subprocess.Popen]) -> None:
        """Wait for the ``ray start`` processes ``{host: process}``; RuntimeError (with the log
        tail of the first that failed) when one exits non-zero or runs past ``start_timeout_s``
        (``ray start`` timeout; the late ones are killed)."""
        deadline = time.monotonic() + self.start_timeout_s
        failed = []
        for i, proc in procs.items():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                failed.append((i, f"not started in {self.start_timeout_s} s (ray start timeout)"))
                continue
            if proc.returncode != 0:
                failed.append((i, f"exited with code {proc.returncode}"))
        if failed:
            i, why = failed[0]
            raise RuntimeError(f"ray start in namespace {self.net.host_ns[i]} {why}:\n{self._tail(f'ray-h{i}')}")

    def start_ray(self) -> str:
        """Start the head on host 0, then a worker node on every other host (those at the same
        time: each ``ray start`` mostly waits); returns the GCS address. A new authentication
        token is written first (:attr:`token_path`)."""
        write_token(self.token_path)
        self._wait_started({0: self._ray_start(0, head=True)})
        self._wait_started({i: self._ray_start(i, head=False) for i in range(1, self.net.hosts)})
        return self.address

    def restart_node(self, i: int) -> None:
        """``ray start --address`` on host ``i`` again (after its processes were killed)."""
        self._wait_started({i: self._ray_start(i, head=False)})

    def driver(self, module: str, *args: str, timeout_s: float = 900.0, poll=None) -> int:
        """Run ``python -m module args...`` in the first host namespace (output to ``driver.log``);
        ``poll``: called every 0.1 s while it runs (the fault handler). Returns its exit code 0;
        raises RuntimeError with its log tail when it fails, ``subprocess.TimeoutExpired`` after
        ``timeout_s`` seconds (the process is killed)."""
        cmd = [*self.net.exec_prefix(self.net.host_ns[0]), sys.executable, "-m", module, *args]
        deadline = time.monotonic() + timeout_s
        with open(self._log("driver"), "wb") as log:
            proc = subprocess.Popen(
                cmd, env=node_env(token_path=self.token_path), stdin=subprocess.DEVNULL, stdout=log, stderr=log
            )
            try:
                while proc.poll() is None:
                    if time.monotonic() > deadline:
                        raise subprocess.TimeoutExpired(cmd, timeout_s)
                    if poll is not None:
                        poll()
                    time.sleep(0.1)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        if proc.returncode != 0:
            raise RuntimeError(f"driver {module} exited with code {proc.returncode}:\n{self._tail('driver')}")
        return proc.returncode
