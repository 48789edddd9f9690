"""A test cluster of Linux network namespaces: hosts and an origin on one bridge, with shaped links.

:class:`NetCluster` (a context manager) makes, on this machine, as root:

- ``hosts`` host namespaces ``<run>-h0 .. <run>-h<N-1>`` and one origin namespace ``<run>-origin``,
  each with loopback up and one veth link ``eth0`` to a Linux bridge ``br0`` that lives in a
  switch namespace ``<run>-sw`` of its own (nothing is added to the machine's own namespace);
- addresses ``<subnet>.<1+i>/24`` for host ``i`` and ``<subnet>.254`` for the origin;
- ``tbf`` token-bucket shaping on both ends of every link, so each direction is capped:
  ``host_mbit`` megabits (1e6 bits) per second for host links, ``origin_mbit`` for the origin's.

``<run>`` is ``stoknc<pid>``: every name carries the id of the process that made it. On start,
namespaces with the prefix whose process is gone (a killed run) are removed, with every process
still in them. :meth:`close` (also on error, on Ctrl-C through ``__exit__``, and at interpreter
exit) ends every process inside the namespaces it made (by id, ``ip netns pids``: SIGTERM, then
SIGKILL after ``kill_wait_s`` seconds) and deletes the namespaces (their veth links go with them).

Kernel byte counters: :meth:`counters` reads ``/sys/class/net/eth0/statistics/{rx,tx}_bytes``
inside each namespace (``ip netns exec`` mounts that namespace's sysfs). The counts include the
Ethernet, IP and TCP headers (about 66 bytes per 1448-byte segment, 4.6%) and everything Ray sends.

Needs CAP_NET_ADMIN and the ``ip`` and ``tc`` tools (iproute2); without them
:func:`check_capability` raises :class:`NetnsUnavailable` with one line saying why.
The Ray processes and the origin server are started by :mod:`stoker_lab.bench.netcluster_ray`.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
import time

#: Every namespace this module makes starts with this, followed by the maker's process id.
PREFIX = "stoknc"
#: The capability bit of CAP_NET_ADMIN in /proc/self/status CapEff (linux/capability.h).
_CAP_NET_ADMIN = 12


from stoker._procs import pid_alive  # noqa: E402

from ..errors import NetnsUnavailable  # noqa: E402,F401 - raised here, defined with the other errors

#: Where this process's capabilities are read from (a test points it at a fake file).
_STATUS_PATH = "/proc/self/status"


def has_cap_net_admin() -> bool:
    """Whether CAP_NET_ADMIN is in this process's effective capability set. Raises
    :class:`NetnsUnavailable` when the set cannot be read."""
    try:
        with open(_STATUS_PATH) as f:
            caps = next(int(line.split()[1], 16) for line in f if line.startswith("CapEff:"))
    except (OSError, StopIteration, ValueError, IndexError) as exc:
        raise NetnsUnavailable(f"cannot read this process's capabilities from {_STATUS_PATH}: {exc}") from exc
    return bool(caps >> _CAP_NET_ADMIN & 1)


def check_capability() -> None:
    """Raise :class:`NetnsUnavailable` unless this process can make namespaces, veth links and
    ``tc`` qdiscs: CAP_NET_ADMIN is in the effective set and the ``ip`` and ``tc`` tools exist."""
    if not has_cap_net_admin():
        raise NetnsUnavailable("CAP_NET_ADMIN is missing (run as root or with that capability)")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise NetnsUnavailable(f"the '{tool}' tool (iproute2) is not installed")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {proc.stderr.strip()}")
    return proc


def list_namespaces(prefix: str = PREFIX) -> list[str]:
    """Names of the network namespaces starting with ``prefix``."""
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(prefix)]


def _owner_pid(name: str) -> int | None:
    head = name[len(PREFIX) :].split("-", 1)[0]
    return int(head) if head.isdigit() else None


def kill_namespace(name: str, kill_wait_s: float = 5.0) -> int:
    """End every process in namespace ``name`` (SIGTERM, SIGKILL after ``kill_wait_s`` seconds)
    and delete the namespace. Returns how many processes were in it. Never raises for a namespace
    that is already gone."""

    def pids() -> list[int]:
        out = _ip("netns", "pids", name, check=False).stdout
        return [int(p) for p in out.split() if p.isdigit() and int(p) != os.getpid()]

    found = pids()
    for sig, wait_s in ((signal.SIGTERM, kill_wait_s), (signal.SIGKILL, 2.0)):
        left = pids()
        for pid in left:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait_s
        while left and time.monotonic() < deadline:
            time.sleep(0.1)
            left = pids()
        if not left:
            break
    _ip("netns", "delete", name, check=False)
    return len(found)


def remove_stale(prefix: str = PREFIX) -> list[str]:
    """Delete the namespaces named ``<prefix><pid>-...`` whose process ``pid`` is gone (a killed
    run), with the processes still inside them. Returns their names."""
    stale = [n for n in list_namespaces(prefix) if (pid := _owner_pid(n)) is None or not pid_alive(pid)]
    for name in stale:
        kill_namespace(name, kill_wait_s=1.0)
    return stale


def burst_bytes(mbit: float) -> int:
    """The ``tbf`` bucket (bytes) of a link shaped to ``mbit`` Mbit/s: 10 ms of the rate, at least
    64 KiB (tbf needs at least rate / HZ; 10 ms covers any HZ)."""
    return max(64 << 10, int(mbit * 1e6 / 8 / 100))


class NetCluster:
    """Host and origin namespaces on one bridge (see the module doc); a context manager.

    ``hosts``: host namespaces (1..6, default 3); ``host_mbit`` / ``origin_mbit``: link caps in
    megabits (1e6 bits) per second, each direction (defaults 400 and 200); ``subnet``: the first
    three octets of the /24 the links use. After :meth:`start`: ``host_ns`` (names), ``host_ip``,
    ``origin_ns``, ``origin_ip``. Raises :class:`NetnsUnavailable` without CAP_NET_ADMIN,
    ValueError for a bad size, RuntimeError (with ``ip``'s or ``tc``'s message) when a step fails.
    """

    def __init__(
        self,
        hosts: int = 3,
        host_mbit: float = 400.0,
        origin_mbit: float = 200.0,
        subnet: str = "10.231.0",
        kill_wait_s: float = 5.0,
    ):
        if not 1 <= hosts <= 6:
            raise ValueError(f"hosts must be 1..6, got {hosts}")
        if host_mbit <= 0 or origin_mbit <= 0:
            raise ValueError(f"link rates must be > 0 Mbit/s, got {host_mbit} and {origin_mbit}")
        self.hosts, self.host_mbit, self.origin_mbit = int(hosts), float(host_mbit), float(origin_mbit)
        self.subnet, self.kill_wait_s = subnet, kill_wait_s
        self.run = f"{PREFIX}{os.getpid()}"
        self.switch_ns = f"{self.run}-sw"
        self.host_ns = [f"{self.run}-h{i}" for i in range(self.hosts)]
        self.host_ip = [f"{subnet}.{1 + i}" for i in range(self.hosts)]
        self.origin_ns, self.origin_ip = f"{self.run}-origin", f"{subnet}.254"
        self.made: list[str] = []

    # -- set-up ----------------------------------------------------------------------------
    def start(self) -> NetCluster:
        """Check the capability, remove stale namespaces, make the namespaces and links; returns
        self. On a failure everything made so far is removed before the error propagates."""
        check_capability()
        remove_stale()
        atexit.register(self.close)
        try:
            self._add_ns(self.switch_ns)
            _ip("-n", self.switch_ns, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch_ns, "link", "set", "br0", "up")
            for i, (ns, ip) in enumerate(zip(self.host_ns, self.host_ip, strict=True)):
                self._add_host(ns, f"h{i}", ip, self.host_mbit)
            self._add_host(self.origin_ns, "origin", self.origin_ip, self.origin_mbit)
        except BaseException:
            self.close()
            raise
        return self

    def _add_ns(self, ns: str) -> None:
        _ip("netns", "add", ns)
        self.made.append(ns)
        _ip("-n", ns, "link", "set", "lo", "up")

    def _add_host(self, ns: str, port: str, ip: str, mbit: float) -> None:
        self._add_ns(ns)
        _ip("-n", self.switch_ns, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _ip("-n", self.switch_ns, "link", "set", port, "master", "br0")
        _ip("-n", self.switch_ns, "link", "set", port, "up")
        _ip("-n", ns, "addr", "add", f"{ip}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        for where, dev in ((ns, "eth0"), (self.switch_ns, port)):  # both directions
            _tc(
                where,
                "qdisc",
                "add",
                "dev",
                dev,
                "root",
                "tbf",
                "rate",
                f"{mbit}mbit",
                "burst",
                str(burst_bytes(mbit)),
                "latency",
                "100ms",
            )

    # -- use ---------------------------------------------------------------------------------
    def exec_prefix(self, ns: str) -> list[str]:
        """The argv prefix that runs a command inside namespace ``ns``."""
        return ["ip", "netns", "exec", ns]

    def links(self) -> dict:
        """Each link's shaping, for reports: ``{name: {ns, ip, mbit, qdisc}}``."""
        out = {
            f"h{i}": {"ns": ns, "ip": ip, "mbit": self.host_mbit, "qdisc": "tbf"}
            for i, (ns, ip) in enumerate(zip(self.host_ns, self.host_ip, strict=True))
        }
        out["origin"] = {"ns": self.origin_ns, "ip": self.origin_ip, "mbit": self.origin_mbit, "qdisc": "tbf"}
        return out

    def counters(self) -> dict[str, dict[str, int]]:
        """Kernel byte counters of every link (:func:`read_counters` over :meth:`links`)."""
        return read_counters(self.links())

    def set_link(self, name: str, up: bool) -> None:
        """Take link ``name`` (``"h1"``, ``"origin"``) down or up, on the switch side."""
        _ip("-n", self.switch_ns, "link", "set", name, "up" if up else "down")

    def kill_host(self, i: int) -> int:
        """SIGKILL every process in host ``i``'s namespace (its raylet, its cache service, its
        workers: the host dies at once, nothing is told); the namespace and link stay, so the host
        can be started again. Returns how many processes were killed."""
        out = _ip("netns", "pids", self.host_ns[i], check=False).stdout
        n = 0
        for pid in (int(p) for p in out.split() if p.isdigit() and int(p) != os.getpid()):
            try:
                os.kill(pid, signal.SIGKILL)
                n += 1
            except ProcessLookupError:
                pass
        return n

    # -- tear-down -----------------------------------------------------------------------------
    def close(self) -> None:
        """End every process in the namespaces made, delete them. Idempotent; never raises."""
        atexit.unregister(self.close)
        made, self.made = self.made, []
        for ns in reversed(made):
            try:
                kill_namespace(ns, self.kill_wait_s)
            except Exception:  # noqa: BLE001 - keep removing the others
                pass

    def __enter__(self) -> NetCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


def read_counters(links: dict) -> dict[str, dict[str, int]]:
    """Kernel byte counters of links ``{name: {"ns": namespace, ...}}`` read from inside each
    namespace: ``{name: {"rx_bytes", "tx_bytes"}}`` of its ``eth0`` (bytes since the link was made).
    Works from any namespace (root can enter the others). Raises RuntimeError naming the namespace."""
    out = {}
    stat = "/sys/class/net/eth0/statistics"
    for name, info in links.items():
        proc = subprocess.run(
            ["ip", "netns", "exec", info["ns"], "cat", f"{stat}/rx_bytes", f"{stat}/tx_bytes"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"reading the link counters in namespace {info['ns']}: {proc.stderr.strip()}")
        rx, tx = (int(v) for v in proc.stdout.split())
        out[name] = {"rx_bytes": rx, "tx_bytes": tx}
    return out


def _tc(ns: str, *args: str) -> None:
    proc = subprocess.run(["tc", "-n", ns, *args], capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        raise RuntimeError(f"tc -n {ns} {' '.join(args)}: {proc.stderr.strip()}")


def kernel_delta(before: dict, after: dict) -> dict:
    """Bytes that crossed the links between two :meth:`NetCluster.counters` readings:
    ``{origin_link_bytes, host_link_bytes, links: {name: {rx_bytes, tx_bytes}}}``.

    ``origin_link_bytes``: both directions of the origin's link. ``host_link_bytes``: bytes sent
    from host to host: every such byte crosses two host links (sent on one, received on another)
    and every origin byte crosses one, so it is (sum over host links of rx + tx - origin link) / 2.
    """
    links = {n: {k: after[n][k] - before[n][k] for k in ("rx_bytes", "tx_bytes")} for n in after}
    origin = links["origin"]["rx_bytes"] + links["origin"]["tx_bytes"]
    hosts = sum(v["rx_bytes"] + v["tx_bytes"] for n, v in links.items() if n != "origin")
    return {"origin_link_bytes": origin, "host_link_bytes": max(0, (hosts - origin) // 2), "links": links}


def machine_cpu_s(stat_path: str = "/proc/stat") -> float:
    """CPU seconds the whole machine has been busy since boot, all cores together (user, nice,
    system, irq, softirq and steal time of ``/proc/stat``'s ``cpu`` line; idle and iowait are not
    busy). The namespaces share one kernel, so this counts every emulated host's processes.
    Raises RuntimeError when the file has no ``cpu`` line."""
    with open(stat_path) as f:
        for line in f:
            parts = line.split()
            if parts and parts[0] == "cpu":
                ticks = [int(v) for v in parts[1:9]]
                busy = ticks[0] + ticks[1] + ticks[2] + ticks[5] + ticks[6] + ticks[7]
                return busy / os.sysconf("SC_CLK_TCK")
    raise RuntimeError(f"{stat_path} has no cpu line")


def busy_cores(seconds: float = 2.0) -> float:
    """The machine's mean busy cores over the next ``seconds`` (:func:`machine_cpu_s`), e.g. the
    background load of an idle emulated cluster (its Ray daemons, its cache services)."""
    c0, t0 = machine_cpu_s(), time.perf_counter()
    time.sleep(seconds)
    return (machine_cpu_s() - c0) / (time.perf_counter() - t0)


def cpu_marks() -> dict[str, float]:
    """Now, for a rank's epoch: ``machine_cpu_s`` (:func:`machine_cpu_s`), ``process_cpu_s``
    (this process's CPU seconds, all its threads: ``time.process_time``) and ``at`` (unix s)."""
    return {"machine_cpu_s": machine_cpu_s(), "process_cpu_s": time.process_time(), "at": time.time()}


def epoch_cpu(marks: list[tuple[dict, dict]], services_cpu_s: float, cores: float) -> dict[str, float]:
    """Where the machine's CPU went during one job's epoch, from each rank's :func:`cpu_marks` at
    its start and end (``marks``) and the CPU seconds the cache services used over the job
    (``services_cpu_s``): ``window_s`` (first rank's start to last rank's end), ``machine_s`` (the
    machine's busy CPU seconds in it), ``ranks_s`` (the ranks' own processes), ``services_s``,
    ``other_s`` (the rest: Ray's daemons, the kernel's own threads, anything else on the machine)
    and ``other_cores`` (``other_s / window_s``, at most ``cores``)."""
    t0, t1 = min(a["at"] for a, _ in marks), max(b["at"] for _, b in marks)
    machine = max(b["machine_cpu_s"] for _, b in marks) - min(a["machine_cpu_s"] for a, _ in marks)
    ranks = sum(b["process_cpu_s"] - a["process_cpu_s"] for a, b in marks)
    other = max(0.0, machine - ranks - services_cpu_s)
    window = max(t1 - t0, 1e-9)
    return {
        "window_s": window,
        "machine_s": machine,
        "ranks_s": ranks,
        "services_s": services_cpu_s,
        "other_s": other,
        "other_cores": min(cores, other / window),
    }
