"""The peer stage of ``stoker bench io``: a peer's cache service serving a rank, beside bare TCP.

Two Ray nodes: node A runs the dataset's cache service (:class:`stoker.cluster.service.CacheService`),
warmed with its own :meth:`~stoker.cluster.service.CacheService.fill` from the origin; node B runs
a rank (:class:`PeerRank`, a Ray actor) that owns no block (``me = -1``) and reads every block of
the dataset, whole, through a :class:`stoker.cluster.reader.BlockRouter` (``router.read(...,
block=True)``: the read of a cluster-mode Loader's block fetch, which in a Loader the prefetcher
sends through the rank's relay to this same call), ``concurrency`` blocks at a time (a Loader's
fill threads), each block one call of the service's ``read`` through Ray's object transfer.

The CPU counted is the ``/proc`` user + system time (``utime + stime``, 10 ms ticks) of every
process on the path, over one pass: the rank's Ray worker, the cache service's Ray worker and
both nodes' raylets (each raylet holds its node's object store and object manager, which move
the bytes between the nodes). The GCS and the driver (which only calls the rank once per pass)
are reported apart (``apart_cpu_s``), not counted. The pass is repeated ``reps`` times and the
pass with the least CPU is kept, as the other stages do; GB/s is that pass's bytes over its wall
time inside the rank.

The floor (:mod:`stoker_lab.bench.peer_floor`) sends the same block files, read from the
service's cache directory, over one TCP connection between the same two places (loopback, or
two network namespaces); its CPU is both ends'. The ratio is stoker's CPU-s/GB over the floor's.
Over 2x, the row's ``exception`` says where the CPU went (per process) with the top frames of a
profile of one more pass (:func:`profile`: py-spy of the two Python processes, ``perf`` of the
raylets), or why no profile could be taken.

:func:`loopback` runs it on a 2-node ``ray.cluster_utils.Cluster`` on 127.0.0.1;
:mod:`stoker_lab.bench.peer_netns` on two network namespaces with a shaped link.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

GB = 1e9
STAGE = "peer cache service->rank"
#: Processes whose CPU is counted, by role (keys of the ``pids`` given to :func:`measure`).
COUNTED = ("rank", "service", "raylet A", "raylet B")
#: Seconds the counted processes are watched with no pass running (their background CPU).
IDLE_S = 1.0
#: Seconds of passes a profile covers.
PROFILE_S = 2


class PeerRank:
    """A rank on node B: the dataset opened without a cache, a :class:`BlockRouter` whose every
    block is owned by the one member node (node A's cache service), its byte counters, and on
    first use of :meth:`read_blocks_relay` the router's :class:`stoker.cluster.reader.Relay` and
    a child process that reads through it (as a Loader's prefetcher does).

    ``url`` / ``storage_options`` / ``block_bytes``: the dataset; ``member``: node A's Ray node id;
    ``concurrency``: reads in flight. Raises RuntimeError when node A's service does not answer."""

    def __init__(self, url: str, storage_options: dict, block_bytes: int, member: str, concurrency: int):
        import numpy as np

        from stoker.cluster.counters import ByteCounters
        from stoker.cluster.reader import BlockRouter
        from stoker.cluster.service import dataset_ref
        from stoker.store.dataset import open_dataset

        ds = open_dataset(url, storage_options=storage_options, cache=False, check=False, block_bytes=block_bytes)
        self.counters = ByteCounters()
        self.counters.size_tags(ds.num_blocks)
        self.router = BlockRouter(
            dataset_ref(ds, storage_options),
            [member],
            np.zeros(ds.num_blocks, dtype=np.int64),
            -1,
            self.counters,
        )
        failed = self.router.connect()
        if failed:
            raise RuntimeError(f"the cache service of node {member} does not answer")
        self.ds, self.concurrency = ds, max(1, int(concurrency))
        self.pool = _Reader(ds, self.router, self.concurrency)
        self.relay = self.child = self.conn = None

    def pids(self) -> dict:
        """``{"rank": this process, "relay child": the relay's reader (once started)}``."""
        out = {"rank": os.getpid()}
        if self.child is not None:
            out["relay child"] = self.child.pid
        return out

    def read_blocks(self) -> dict:
        """Read every block once through the router in this process (:meth:`_Reader.run`), with
        the pass's ByteCounters deltas under ``counters``."""
        before = self.counters.read()
        out = self.pool.run()
        after = self.counters.read()
        out["counters"] = {k: after[k] - before[k] for k in after}
        return out

    def read_heads(self, nbytes: int = 1024) -> dict:
        """Read the first ``nbytes`` bytes of every block through the router, as :meth:`read_blocks`
        (a value that small travels inside Ray's reply, not through the object stores): what one
        call costs apart from moving the block."""
        before = self.counters.read()
        out = self.pool.run(nbytes)
        after = self.counters.read()
        out["counters"] = {k: after[k] - before[k] for k in after}
        return out

    def start_relay(self) -> int:
        """Start the relay and its reader child (a spawned process with a copy of the router,
        which therefore reads through the relay); returns the child's pid."""
        import multiprocessing as mp

        if self.child is None:
            self.relay = self.router.start_relay()
            ctx = mp.get_context("spawn")
            self.conn, child_conn = ctx.Pipe()
            self.child = ctx.Process(
                target=_relay_child, args=(self.ds, self.router, self.concurrency, child_conn), daemon=True
            )
            self.child.start()
            child_conn.close()
            if not self.conn.poll(120):
                raise RuntimeError("the relay's reader child did not start in 120 s")
            self.conn.recv()
        return self.child.pid

    def read_blocks_relay(self) -> dict:
        """Read every block once in the child, through the relay (as :meth:`read_blocks`)."""
        self.start_relay()
        before = self.counters.read()
        self.conn.send("go")
        if not self.conn.poll(600):
            raise RuntimeError("the relay's reader child did not answer in 600 s")
        out = self.conn.recv()
        if isinstance(out, str):
            raise RuntimeError(f"the relay's reader child failed: {out}")
        after = self.counters.read()
        out["counters"] = {k: after[k] - before[k] for k in after}
        return out

    def close(self) -> None:
        if self.child is not None:
            try:
                self.conn.send("stop")
            except OSError:
                pass
            self.child.join(10)
            if self.child.is_alive():
                self.child.kill()
                self.child.join()
        if self.relay is not None:
            self.relay.close()
        self.pool.close()
        self.counters.close()


class _Reader:
    """Every block of ``ds`` read whole through ``router``, ``concurrency`` at a time, on threads
    made before the first pass (a Loader's fill threads exist before its fills too)."""

    def __init__(self, ds, router, concurrency: int):
        self.ds, self.router = ds, router
        self.ranges = [(b, int(ds.block_start[b]), int(ds.block_end[b])) for b in range(ds.num_blocks)]
        self.pool = ThreadPoolExecutor(concurrency, thread_name_prefix="peer-read")
        list(self.pool.map(lambda _: None, range(concurrency)))

    def run(self, head: int | None = None) -> dict:
        """One pass: ``{bytes, wall_s, digest}`` (xxh3-64 of the blocks in order, after the clock);
        ``head``: only the first ``head`` bytes of each block."""
        import xxhash

        ds, router = self.ds, self.router
        ranges = self.ranges if head is None else [(b, s, min(e, s + head)) for b, s, e in self.ranges]
        t0 = time.perf_counter()
        got = list(self.pool.map(lambda r: router.read(ds, r[0], r[1], r[2], block=True), ranges))
        wall = time.perf_counter() - t0
        h = xxhash.xxh3_64()
        for d in got:
            h.update(d)
        return {"bytes": sum(len(d) for d in got), "wall_s": wall, "digest": h.hexdigest()}

    def close(self) -> None:
        self.pool.shutdown()


def _relay_child(ds, router, concurrency: int, conn) -> None:
    """The relay's reader: one :meth:`_Reader.run` per ``"go"`` on ``conn``, until ``"stop"``."""
    import traceback

    reader = _Reader(ds, router, concurrency)
    conn.send("ready")
    try:
        while True:
            try:
                cmd = conn.recv()
            except EOFError:
                return
            if cmd != "go":
                return
            try:
                conn.send(reader.run())
            except Exception:  # noqa: BLE001 - reported to the rank
                conn.send(traceback.format_exc())
    finally:
        reader.close()


def block_files(cache_dir: str, ds) -> list[str]:
    """Paths of the block files of ``ds`` in the node cache at ``cache_dir`` (disk tier), in block order."""
    from stoker.cache.layout import ns_dir

    root = ns_dir(cache_dir, ds.version)
    return [os.path.join(root, ds.block_name(b)) for b in range(ds.num_blocks)]


def threads_cpu_ns(pid: int) -> dict[int, int]:
    """``{thread id: nanoseconds on a CPU}`` of every thread of ``pid`` now (the first field of
    ``/proc/<pid>/task/<tid>/schedstat``: user and system time, and softirq work done in the
    thread's context on a kernel without IRQ time accounting); {} for a process that is gone."""
    out = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for t in tids:
        try:
            with open(f"/proc/{pid}/task/{t}/schedstat") as f:
                out[int(t)] = int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            continue
    return out


def cpu_marks(pids: dict) -> dict:
    """``{role: threads_cpu_ns(pid)}`` of ``pids`` (``{role: pid}``)."""
    return {k: threads_cpu_ns(p) for k, p in pids.items()}


def cpu_between(before: dict, after: dict) -> dict:
    """``{role: CPU seconds}`` between two :func:`cpu_marks`: each thread's time since the first
    mark (a thread started in between counts whole; one that ended in between is lost)."""
    return {k: sum(ns - before.get(k, {}).get(t, 0) for t, ns in v.items()) / 1e9 for k, v in after.items()}


#: The two ways a rank reads from the peer: in its Ray worker (the BlockRouter's call), or from a
#: child process through the rank's relay (a Loader's prefetcher and decode workers).
VIAS = {"direct": "read_blocks", "relay": "read_blocks_relay"}


def measure(
    url: str,
    storage_options: dict,
    block_bytes: int,
    node_a: str,
    node_b: str,
    cache_root: str,
    pids: dict,
    concurrency: int,
    reps: int,
    vias: tuple[str, ...] = ("direct", "relay"),
    holder: dict | None = None,
) -> dict:
    """The stoker side of the stage, on a Ray cluster this process has joined: start node A's
    cache service (budget: twice the dataset), fill it from the origin, start :class:`PeerRank`
    on node B, then for each of ``vias`` (:data:`VIAS`) one untimed pass and ``reps`` timed ones.

    ``pids``: ``{role: pid}`` of the raylets (``"raylet A"``, ``"raylet B"``) and of processes to
    report apart (``"gcs"``, ...); the rank's, the service's and the relay child's are added.
    ``holder``: a dict that gets ``rank`` (the actor) at once, so the caller can stop it with
    :func:`stop` even when this raises. Returns ``{"files", "fill", "blocks", "bytes",
    "concurrency", "pids", "idle_cpu_s_per_s" (each process's CPU-s per second over :data:`IDLE_S`
    seconds with no pass running), via: {cpu_s, wall_s, cpu_s_per_GB, GBps, by_process (CPU-s of each counted
    process in the kept pass), apart_cpu_s, passes, digest, counters}}``. RuntimeError when the
    fill or a read fails or a byte came from elsewhere than the peer's cache."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from stoker.cluster.service import dataset_ref, find_services, get_service, start_services
    from stoker.store.dataset import open_dataset

    holder = {} if holder is None else holder
    ds = open_dataset(url, storage_options=storage_options, cache=False, check=False, block_bytes=block_bytes)
    nbytes = int(sum(int(ds.block_end[b]) - int(ds.block_start[b]) for b in range(ds.num_blocks)))
    start_services(cache_root, {node_a: 2 * nbytes + (64 << 20)})
    service = get_service(node_a)
    info = find_services()[node_a]
    dref = dataset_ref(ds, storage_options)
    t0 = time.perf_counter()
    fill = ray.get(service.fill.remote(dref, list(range(ds.num_blocks)), concurrency), timeout=600)
    fill["seconds"] = time.perf_counter() - t0
    if fill["failed"] or fill["refused"] or fill["filled"] + fill["cached"] != ds.num_blocks:
        raise RuntimeError(f"the cache service of node {node_a} did not take every block: {fill}")
    rank = holder["rank"] = (
        ray.remote(num_cpus=0)(PeerRank)
        .options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_b, soft=False), max_restarts=0)
        .remote(url, storage_options, block_bytes, node_a, concurrency)
    )
    if "relay" in vias:
        ray.get(rank.start_relay.remote(), timeout=180)
    pids = dict(pids, service=int(info["pid"]), **ray.get(rank.pids.remote(), timeout=120))
    out: dict = {
        "files": block_files(info["cache_dir"], ds),
        "fill": fill,
        "blocks": ds.num_blocks,
        "bytes": nbytes,
        "concurrency": concurrency,
        "pids": pids,
    }
    idle = {k: pids[k] for k in COUNTED + ("relay child",) if k in pids}
    i0, t0 = cpu_marks(idle), time.perf_counter()
    time.sleep(IDLE_S)
    out["idle_cpu_s_per_s"] = {k: v / (time.perf_counter() - t0) for k, v in cpu_between(i0, cpu_marks(idle)).items()}
    for via in vias:
        counted = {k: pids[k] for k in counted_roles(via)}
        apart = {k: p for k, p in pids.items() if k not in counted and k != "relay child"}
        method = getattr(rank, VIAS[via])
        ray.get(method.remote(), timeout=600)  # connections, first objects, thread start: not measured
        passes = []
        for _ in range(max(1, reps)):
            c0, a0 = cpu_marks(counted), cpu_marks(apart)
            r = ray.get(method.remote(), timeout=600)
            c1, a1 = cpu_marks(counted), cpu_marks(apart)
            if r["bytes"] != nbytes or r["counters"]["fetch_peer"] != nbytes:
                raise RuntimeError(
                    f"a pass ({via}) moved {r['bytes']} bytes, {r['counters']['fetch_peer']} from the peer's "
                    f"cache, expected {nbytes} (counters {r['counters']})"
                )
            by = cpu_between(c0, c1)
            passes.append(
                {
                    "cpu_s": sum(by.values()),
                    "wall_s": r["wall_s"],
                    "by_process": by,
                    "apart_cpu_s": cpu_between(a0, a1),
                    "digest": r["digest"],
                    "counters": r["counters"],
                }
            )
        best = min(passes, key=lambda p: p["cpu_s"])
        if via == "direct":
            out["calls"] = _calls(rank, counted, reps, ds.num_blocks)
        out[via] = {
            "cpu_s": best["cpu_s"],
            "wall_s": best["wall_s"],
            "cpu_s_per_GB": best["cpu_s"] / (nbytes / GB),
            "GBps": nbytes / GB / best["wall_s"] if best["wall_s"] > 0 else 0.0,
            "by_process": best["by_process"],
            "apart_cpu_s": best["apart_cpu_s"],
            "passes": [{k: p[k] for k in ("cpu_s", "wall_s")} for p in passes],
            "digest": best["digest"],
            "counters": best["counters"],
        }
    return out


def _calls(rank, counted: dict, reps: int, blocks: int) -> dict:
    """What a call costs apart from the bytes: ``reps`` passes of :meth:`PeerRank.read_heads`
    (1 KiB of each block); ``{bytes, cpu_s_per_call, by_process (CPU-s per call), wall_s}`` of
    the pass with the least CPU."""
    import ray

    ray.get(rank.read_heads.remote(), timeout=600)
    best = None
    for _ in range(max(1, reps)):
        c0 = cpu_marks(counted)
        r = ray.get(rank.read_heads.remote(), timeout=600)
        by = cpu_between(c0, cpu_marks(counted))
        if best is None or sum(by.values()) < sum(best[0].values()):
            best = (by, r)
    by, r = best
    return {
        "bytes": r["bytes"],
        "head_bytes": 1024,
        "cpu_s_per_call": sum(by.values()) / blocks,
        "by_process": {k: v / blocks for k, v in by.items()},
        "wall_s": r["wall_s"],
    }


def counted_roles(via: str) -> tuple[str, ...]:
    """The processes whose CPU a pass ``via`` counts: :data:`COUNTED`, and the relay's reader."""
    return COUNTED + (("relay child",) if via == "relay" else ())


def profile_pass(rank, via: str):
    """A function that runs one more pass ``via`` on ``rank`` (for :func:`profile`)."""
    import ray

    method = getattr(rank, VIAS[via])
    return lambda: ray.get(method.remote(), timeout=600)


def stop(holder: dict | None) -> None:
    """Stop what :func:`measure` started: the rank (``holder["rank"]``: its relay and child too)
    and every cache service. Never raises."""
    import ray

    from stoker.cluster.service import stop_services

    rank = (holder or {}).get("rank")
    if rank is not None:
        try:
            ray.get(rank.close.remote(), timeout=30)
        except Exception:  # noqa: BLE001 - killed next
            pass
        try:
            ray.kill(rank, no_restart=True)
        except Exception:  # noqa: BLE001 - gone already
            pass
    try:
        stop_services()
    except Exception:  # noqa: BLE001 - tear-down: the cluster goes next anyway
        pass


# -- the profile ---------------------------------------------------------------
def _tool(name: str) -> str | None:
    import sys

    here = os.path.join(os.path.dirname(sys.executable), name)
    return here if os.path.exists(here) else shutil.which(name)


def profile(pids: dict, one_pass, seconds: float = PROFILE_S, top: int = 6) -> dict:
    """Profile ``pids`` (``{role: pid}``) while ``one_pass()`` runs again and again for ``seconds``:
    py-spy (``record --native``, 100 Hz; it pauses the process for each sample) of the Python
    processes (:data:`PYTHON_ROLES`) and ``perf record`` (499 Hz) of every process, at the same
    time. Returns ``{role: {"py-spy": [[share, frame], ...] | why not, "perf": [...] | why not}}``:
    the ``top`` frames by their own samples (py-spy: the innermost frame of each stack; perf:
    ``dso symbol``, ``--no-children``), each with its share of that process's samples in percent."""
    pyspy, perf = _tool("py-spy"), _tool("perf")
    out: dict = {k: {} for k in pids}
    with tempfile.TemporaryDirectory(prefix="stoker-peer-prof-") as d:
        procs = []
        for role, pid in pids.items():
            tag = role.replace(" ", "_")
            if role in PYTHON_ROLES:
                if pyspy is None:
                    out[role]["py-spy"] = "py-spy not installed"
                else:
                    f = os.path.join(d, f"{tag}.py-spy")
                    cmd = [pyspy, "record", "--pid", str(pid), "--duration", str(int(seconds)), "--rate", "100"]
                    cmd += ["--format", "raw", "--output", f, "--gil"]
                    procs.append((role, "py-spy", f, _bg(cmd, d, f"{tag}-py-spy")))
            if perf is None:
                out[role]["perf"] = "perf not installed"
            else:
                f = os.path.join(d, f"{tag}.perf")
                cmd = [perf, "record", "-F", "499", "-p", str(pid), "-o", f, "--", "sleep", str(int(seconds))]
                procs.append((role, "perf", f, _bg(cmd, d, f"{tag}-perf")))
        time.sleep(0.5)  # the profilers attach
        t_end = time.monotonic() + seconds
        while time.monotonic() < t_end:
            one_pass()
        for role, kind, f, p in procs:
            try:
                p.wait(timeout=seconds + 60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            if p.returncode != 0 or not os.path.exists(f):
                out[role][kind] = f"{kind} failed (exit code {p.returncode}): {_tail(d, f'{role}-{kind}')}"
                continue
            try:
                out[role][kind] = _pyspy_top(f, top) if kind == "py-spy" else _perf_top(perf, f, top)
            except Exception as exc:  # noqa: BLE001 - a profile is an explanation, not a result
                out[role][kind] = f"{kind} output unreadable: {type(exc).__name__}: {exc}"
    return out


def _bg(cmd: list[str], d: str, name: str) -> subprocess.Popen:
    with open(os.path.join(d, f"{name}.log"), "wb") as log:
        return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log)


def _tail(d: str, name: str) -> str:
    try:
        with open(os.path.join(d, f"{name.replace(' ', '_')}.log"), errors="replace") as f:
            return " ".join(f.read()[-400:].split())
    except OSError:
        return ""


def _pyspy_top(path: str, top: int) -> list:
    """The ``top`` innermost frames of a py-spy raw file (``frame;frame;... count`` per line)."""
    counts: dict[str, int] = {}
    total = 0
    with open(path) as f:
        for line in f:
            stack, _, n = line.rstrip("\n").rpartition(" ")
            if not stack or not n.isdigit():
                continue
            leaf = stack.rsplit(";", 1)[-1]
            counts[leaf] = counts.get(leaf, 0) + int(n)
            total += int(n)
    ranked = sorted(counts.items(), key=lambda kv: -kv[1])[:top]
    return [[round(100.0 * n / total, 1), frame] for frame, n in ranked] if total else []


def _perf_top(perf: str, path: str, top: int) -> list:
    """The ``top`` symbols of a ``perf record`` file by their own samples (``--no-children``)."""
    proc = subprocess.run(
        [perf, "report", "-i", path, "--stdio", "--no-children", "--sort", "dso,sym", "-q"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    rows = []
    for line in proc.stdout.splitlines():
        parts = line.split(None, 1)
        if len(parts) == 2 and parts[0].endswith("%"):
            try:
                share = float(parts[0][:-1])
            except ValueError:
                continue
            rows.append([share, " ".join(parts[1].split())])
        if len(rows) >= top:
            break
    if not rows:
        raise RuntimeError(proc.stderr.strip()[-300:] or "no samples")
    return rows


# -- the rows -------------------------------------------------------------------
def peer_rows(
    link: str, m: dict, floor: dict, floor_what: str, rank=None, profile_s: float = PROFILE_S, **extra
) -> list:
    """The report rows of the stage over ``link`` (``"loopback"``, ``"netns, 1000 Mbit/s"``), one
    per way of reading measured in ``m`` (:func:`measure`): stoker's figures, the floor's
    (:func:`stoker_lab.bench.peer_floor.transfer`), their ratio; over 2x a profile of
    ``profile_s`` seconds of passes on ``rank`` (:func:`profile`; none without ``rank`` or with
    ``profile_s`` 0) and an ``exception`` built from it and the CPU of each process."""
    nbytes = m["bytes"]
    fcpu = floor["cpu_s"] / (nbytes / GB)
    rows = []
    for via in VIAS:
        side = m.get(via)
        if side is None:
            continue
        ratio = side["cpu_s_per_GB"] / fcpu if fcpu > 0 else None
        prof: dict | str | None = None
        exception = None
        if ratio is not None and ratio > 2:
            if rank is None or profile_s <= 0:
                prof = "no profile taken (profile_s=0)" if rank is not None else "no profile taken"
            else:
                # the relay row: the processes it adds to the direct path (the rest is the direct row's)
                roles = ("rank", "relay child") if via == "relay" and "direct" in m else counted_roles(via)
                prof = profile({k: m["pids"][k] for k in roles}, profile_pass(rank, via), profile_s)
            exception = explain(via, side, ratio, prof, m.get("calls"), m["blocks"])
        rows.append(
            {
                "stage": f"{STAGE} ({link}{', via the relay' if via == 'relay' else ''})",
                "bytes": nbytes,
                "cpu_s": side["cpu_s"],
                "wall_s": side["wall_s"],
                "cpu_s_per_GB": side["cpu_s_per_GB"],
                "GBps": side["GBps"],
                "floor": {
                    "what": floor_what,
                    "cpu_s": floor["cpu_s"],
                    "cpu_s_per_GB": fcpu,
                    "GBps": nbytes / GB / floor["wall_s"] if floor["wall_s"] > 0 else 0.0,
                    "server_cpu_s": floor["server_cpu_s"],
                    "client_cpu_s": floor["client_cpu_s"],
                },
                "ratio": ratio,
                "exception": exception,
                "read": READ[via].format(blocks=m["blocks"], concurrency=m["concurrency"]),
                "counted": COUNTED_TEXT
                + (" and the relay's reader child" if via == "relay" else "")
                + "; the GCS and the driver apart (apart_cpu_s)",
                "cpu_s_by_process": side["by_process"],
                "idle_cpu_s_per_s": m["idle_cpu_s_per_s"],
                "cpu_s_per_block": side["cpu_s"] / m["blocks"],
                "calls": m.get("calls"),
                "apart_cpu_s": side["apart_cpu_s"],
                "passes": side["passes"],
                "digest": side["digest"],
                "digest_matches_floor": side["digest"] == floor["digest"],
                "peer_bytes": side["counters"].get("fetch_peer", 0),
                "fallbacks": side["counters"].get("fallbacks", 0),
                "fill": {k: m["fill"][k] for k in ("filled", "cached", "origin_bytes", "seconds")},
                "profile": prof,
                **extra,
            }
        )
    return rows


#: What a pass reads, per way (:data:`VIAS`).
READ = {
    "direct": "every block of the dataset, whole ({blocks} blocks), {concurrency} at a time, by "
    "BlockRouter.read(block=True) in the rank's Ray worker (one call of the cache service's read per block)",
    "relay": "every block of the dataset, whole ({blocks} blocks), {concurrency} at a time, by "
    "BlockRouter.read(block=True) in a child process of the rank, through the rank's relay (a Unix "
    "socket to the Ray worker, which makes the call): a cluster-mode Loader's prefetcher path",
}
COUNTED_TEXT = (
    "CPU time (/proc/<pid>/task/*/schedstat) of the rank's Ray worker, the cache service's Ray worker and "
    "both raylets (each holds its node's object store and object manager)"
)
#: The roles that run Python (profiled with py-spy as well as perf).
PYTHON_ROLES = ("rank", "service", "relay child")


def explain(via: str, side: dict, ratio: float, prof: dict | str | None, calls: dict | None, blocks: int) -> str:
    """Why the stage is over 2x its floor: what each block costs on the way, the share of each
    counted process, what a call costs without the bytes (``calls``, :func:`_calls`), and the top
    frames of the profile (``prof``: :func:`profile`'s result, or why there is none)."""
    by, total = side["by_process"], side["cpu_s"] or 1e-9
    shares = ", ".join(f"{k} {100 * v / total:.0f}%" for k, v in sorted(by.items(), key=lambda kv: -kv[1]))
    text = (
        f"{ratio:.1f}x its floor: each block is one Ray actor call; the service copies it out of the cache "
        f"into a bytes object, Ray pickles it into node A's object store, the raylets' object managers "
        f"move it in gRPC chunks into node B's object store and the rank unpickles it into a new bytes "
        f"object"
        + (", which the relay copies again over a Unix socket to the child" if via == "relay" else "")
        + f"; {1e3 * total / blocks:.1f} ms CPU per block, by process: {shares}"
    )
    if calls:
        text += (
            f"; the same call for 1 KiB (inline in Ray's reply, no object store) costs "
            f"{1e3 * calls['cpu_s_per_call']:.1f} ms CPU"
        )
    if isinstance(prof, str) or prof is None:
        return text + f"; {prof or 'no profile taken'}"
    parts = []
    for role in sorted(prof, key=lambda r: -by.get(r, 0)):
        for kind in ("perf", "py-spy"):
            v = prof[role].get(kind)
            if isinstance(v, list) and v:
                parts.append(f"{role} {kind}: " + "; ".join(f"{s:g}% {f}" for s, f in v[:3]))
            elif isinstance(v, str):
                parts.append(f"{role} {kind}: {v}")
    if not parts:
        return text + "; the profile caught no frames"
    which = " of the processes the relay adds (the others as in the direct row)" if "raylet A" not in prof else ""
    return text + f"; top frames{which} (own samples; " + PERF_NOTE + "): " + " | ".join(parts)


#: How to read perf's kernel frames when it samples on the cpu-clock timer (no hardware counters).
PERF_NOTE = (
    "perf on the cpu-clock timer: a sample taken while interrupts are off lands where they come back on, so "
    "finish_task_switch and _raw_spin_unlock_irq* stand for context switches and wake-ups; clear_page_erms "
    "is the zeroing of fresh pages, a new buffer per block; py-spy: Python stacks holding the GIL"
)


# -- loopback -------------------------------------------------------------------
def loopback(
    url: str,
    storage_options: dict,
    block_bytes: int,
    workdir: str,
    concurrency: int = 8,
    reps: int = 3,
    object_store_bytes: int = 200 << 20,
    profile_s: float = PROFILE_S,
) -> list:
    """The stage over loopback: a 2-node ``ray.cluster_utils.Cluster`` on 127.0.0.1 (node A the
    head, node B added; one CPU each), joined by this process, :func:`measure`, the floor
    between two processes on 127.0.0.1, and over 2x a profile of ``profile_s`` seconds of passes
    (0: none). Everything started is stopped on every exit path (the rank and its relay child,
    the services, the cluster and its session files, the node cache under ``workdir``); if this
    process is killed, Ray's processes end with it (they share its fate). Returns the rows
    (:func:`peer_rows`). RuntimeError when this process has joined a Ray cluster already."""
    import ray
    from ray.cluster_utils import Cluster

    from stoker.store.dataset import open_dataset

    from . import peer_floor

    if ray.is_initialized():
        raise RuntimeError("the loopback peer stage starts its own Ray cluster; this process has joined one")
    open_dataset(url, storage_options=storage_options, cache=False, check=False, block_bytes=block_bytes)  # fail fast
    cache_root = os.path.join(workdir, "peer-cache-loopback")
    shutil.rmtree(cache_root, ignore_errors=True)
    # Ray's session files (logs, sockets) in a directory of this run, removed with it; a short
    # path under the system's temporary directory keeps the sockets' paths under 108 bytes
    ray_tmp = tempfile.mkdtemp(prefix="stoker-ray-")
    node_args = {"num_cpus": 1, "object_store_memory": object_store_bytes, "temp_dir": ray_tmp}
    holder: dict = {}
    cluster = None
    try:
        cluster = Cluster(initialize_head=True, head_node_args=dict(node_args, include_dashboard=False))
        node_b = cluster.add_node(**node_args)
        ray.init(address=cluster.address, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
        cluster.wait_for_nodes()
        head = cluster.head_node
        pids = {
            "raylet A": _pid(head, "raylet"),
            "raylet B": _pid(node_b, "raylet"),
            "gcs": _pid(head, "gcs_server"),
            "driver": os.getpid(),
        }
        m = measure(
            url,
            storage_options,
            block_bytes,
            head.node_id,
            node_b.node_id,
            cache_root,
            pids,
            concurrency,
            reps,
            holder=holder,
        )
        floor = peer_floor.transfer(m["files"], "127.0.0.1", reps)
        return peer_rows(
            "loopback",
            m,
            floor,
            "a bare TCP transfer of the same block files over 127.0.0.1 (Python socket sendall of each block "
            "buffer; the client recv_into one preallocated buffer), CPU of both ends",
            holder.get("rank"),
            profile_s,
            network={"kind": "loopback", "host": "127.0.0.1"},
        )
    finally:
        stop(holder)
        if ray.is_initialized():
            ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
        shutil.rmtree(cache_root, ignore_errors=True)
        shutil.rmtree(ray_tmp, ignore_errors=True)


def loopback_process(
    url: str,
    storage_options: dict,
    block_bytes: int,
    workdir: str,
    concurrency: int = 8,
    reps: int = 3,
    profile_s: float = PROFILE_S,
    timeout_s: float = 600.0,
) -> list:
    """:func:`loopback` in a new Python process (``python -m stoker_lab.bench.peer_stage``), for a
    caller that must not start Ray itself: one that has read through obstore (Ray forks its daemons
    with a ``preexec_fn``, which a tokio runtime does not survive) or has joined another cluster.
    Returns its rows; RuntimeError with the process's error output when it fails or runs past
    ``timeout_s`` seconds (it is killed, and Ray's processes with it)."""
    import json
    import sys

    os.makedirs(workdir, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="stoker-peer-", dir=workdir) as d:
        spec, out = os.path.join(d, "spec.json"), os.path.join(d, "rows.json")
        with open(spec, "w") as f:
            json.dump(
                {
                    "url": url,
                    "storage_options": storage_options,
                    "block_bytes": block_bytes,
                    "workdir": workdir,
                    "concurrency": concurrency,
                    "reps": reps,
                    "profile_s": profile_s,
                },
                f,
            )
        env = dict(os.environ)
        src = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [src, env.get("PYTHONPATH")]))
        with open(os.path.join(d, "log"), "wb") as log:
            p = subprocess.Popen(
                [sys.executable, "-m", __name__, spec, out], stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env
            )
            try:
                p.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if p.returncode != 0 or not os.path.exists(out):
            with open(os.path.join(d, "log"), errors="replace") as f:
                tail = f.read()[-3000:]
            why = f"ran past {timeout_s} s" if p.returncode == -9 else f"exited with code {p.returncode}"
            raise RuntimeError(f"the loopback peer stage {why}:\n{tail}")
        with open(out) as f:
            return json.load(f)


def main(spec_path: str, out_path: str) -> int:
    """:func:`loopback` with the arguments in the JSON file ``spec_path``; writes its rows to ``out_path``."""
    import json

    with open(spec_path) as f:
        spec = json.load(f)
    rows = loopback(
        spec["url"],
        spec["storage_options"],
        spec["block_bytes"],
        spec["workdir"],
        spec["concurrency"],
        spec["reps"],
        profile_s=spec["profile_s"],
    )
    with open(out_path, "w") as f:
        json.dump(rows, f)
    return 0


def _pid(node, kind: str) -> int:
    """The pid of the ``kind`` process (``"raylet"``, ``"gcs_server"``) of a ``cluster_utils`` node."""
    return int(node.all_processes[kind][0].process.pid)


def not_measured(why: str, link: str | None = None) -> dict:
    """The row of a peer stage (over ``link``, if given) that was not measured, ``exception`` saying why."""
    return {
        "stage": STAGE if link is None else f"{STAGE} ({link})",
        "bytes": 0,
        "cpu_s_per_GB": None,
        "GBps": None,
        "floor": {"what": "a bare TCP transfer of the same bytes", "cpu_s_per_GB": None, "GBps": None},
        "ratio": None,
        "exception": why,
    }


if __name__ == "__main__":
    import sys

    # through the module's own name: Ray and multiprocessing pickle PeerRank and _relay_child by it
    from stoker_lab.bench.peer_stage import main as _main

    sys.exit(_main(*sys.argv[1:]))
