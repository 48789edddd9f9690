"""The Ray driver of ``stoker bench cluster --netns``; it runs inside the first host namespace.

``python -m stoker_lab.bench.netcluster_driver SPEC OUT`` reads the spec (JSON, written by
:func:`stoker_lab.bench.netcluster_bench.run`), joins the Ray cluster of the namespaces, packs the
dataset into the origin, runs every placement and writes the report rows (JSON) to OUT.

Placements, each on empty caches, epochs ``0 .. epochs-1``, the two jobs one after the other so
that the kernel counters of each job are its own (3 ranks per job):

- ``direct``: rank ``r`` on host ``r`` reads the origin through its own node cache (a plain
  :func:`stoker.open_dataset` per host, no cluster service): the "remote storage" baseline of TDCS;
- ``random``: cluster mode, ranks on random hosts (seeded), the plain rank split (Alluxio-like);
- ``colocated``: cluster mode with TDCS co-located scheduling.

A rank reads and verifies every sample of its plan (checksums; no decode unless ``decode``). A
job's ranks start their clocks together, at a gate (:mod:`stoker_lab.bench.start_gate`), as the ranks
of synchronous training start an epoch together.
Each row: samples/s (samples / the slowest rank's seconds), exactly-once (every sample id of the
epoch read once over the job's ranks), kernel bytes (:func:`stoker_lab.bench.netcluster.kernel_delta`
of the counters read just before and after the job) and stoker's own byte counts. Before its
epochs, each placement runs a control probe (:func:`probe_control`: a job that reads no sample),
whose kernel bytes are the non-data traffic the byte check allows that placement's rows; then the
machine's busy cores at rest for 2 s (``idle_busy_cores``: the emulated cluster's own daemons and
services). Each row has ``machine_cpu_s``: the machine's busy CPU seconds over the job, and
``epoch_cpu`` (:func:`stoker_lab.bench.netcluster.epoch_cpu`): over the ranks' clocks, the machine's
CPU seconds split into the ranks', the cache services' and the rest, and ``host_cpu``
(:mod:`stoker_lab.bench.netcluster_hostcpu`): each host's ranks, cache service and raylet, their CPU
seconds over the bytes its link carried. After the
``random`` epochs, ``peer_probe`` (:func:`peer_probe`): every rank reads samples its peers hold,
all at once, on the warm caches (ranks' hosts, ids, seconds, bytes), and ``local_probe``: the
same with samples each rank's own node holds. The output also has
``phases_s``: seconds of packing, of each placement, fault run and the state check.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from functools import partial

import numpy as np

from . import netcluster_hostcpu as hostcpu
from .netcluster import busy_cores, cpu_marks, epoch_cpu, kernel_delta, machine_cpu_s, read_counters
from .start_gate import pass_gate, start_gate

PLACEMENTS = ("direct", "random", "colocated")
JOBS = ("job1", "job2")


def _decode(data: bytes, key: str) -> float:
    """Decode one sample as training would (:func:`stoker.decode.image.decode_image`); returns
    the CPU seconds this thread spent on it."""
    from stoker.decode.image import decode_image

    t0 = time.thread_time()
    decode_image(data, key)
    return time.thread_time() - t0


class Consumer:
    """The accelerator of one rank: it takes ``1 / rate`` seconds per sample (a training step's
    compute), one sample after the other, and the rank reads the next sample only once the step
    is over (no read-ahead: the driver's ranks read one sample at a time). ``rate`` 0: takes no
    time. ``seconds``: the time it actually spent (sleeps run late on a loaded machine)."""

    def __init__(self, rate: float) -> None:
        if rate < 0:
            raise ValueError(f"consumer rate must be >= 0 samples/s, got {rate!r}")
        self.step_s = 1.0 / rate if rate > 0 else 0.0
        self.seconds = 0.0

    def step(self) -> None:
        """One sample's step: sleeps ``1 / rate`` seconds (the accelerator's time, no CPU)."""
        if self.step_s:
            t0 = time.perf_counter()
            time.sleep(self.step_s)
            self.seconds += time.perf_counter() - t0


def consume(read, ids, decode: bool, consumer_rate: float, key) -> dict:
    """Read (``read(i)`` returns the sample's bytes) each of ``ids`` one after the other; with
    ``decode`` decode it (``key(i)``: its key), then let the rank's :class:`Consumer` take it.
    Returns ``{decode_cpu_s, consume_s}``: CPU seconds of decoding and seconds of consuming."""
    gpu, dec = Consumer(consumer_rate), 0.0
    for i in ids:
        data = read(int(i))
        if decode:
            dec += _decode(data, key(int(i)))
        gpu.step()
    return {"decode_cpu_s": dec, "consume_s": gpu.seconds}


def read_plan(
    ctx,
    epoch: int,
    decode: bool = False,
    gate=None,
    gate_key: str = "",
    gate_s: float = 600.0,
    consumer_rate: float = 0.0,
) -> list[dict]:
    """Cluster ``train_fn``: read (and verify, and with ``decode`` decode) every sample of the
    rank's plan for ``epoch``, each then taken by the rank's accelerator at ``consumer_rate``
    samples/s (:class:`Consumer`; 0: none); returns ``ctx.epochs`` with the sample ids under
    ``ids`` and :func:`consume`'s seconds. With a
    ``gate`` (:mod:`stoker_lab.bench.start_gate`) the rank starts its clock once every rank of the job
    has reached it (``gate_key``; waiting at most ``gate_s`` seconds)."""
    ids = ctx.plan(epoch, 0)
    pass_gate(gate, gate_key, ctx.world_size, gate_s)
    with ctx.measure(epoch, samples=len(ids)) as rec:
        c0 = cpu_marks()
        spent = consume(ctx.dataset.read, ids, decode, consumer_rate, ctx.dataset.key)
        rec["ids"], rec["cpu"] = ids.tolist(), [c0, cpu_marks()]
        rec.update(spent)
    return ctx.epochs


#: Samples each rank reads in the peer probe (:func:`peer_probe`).
PROBE_SAMPLES = 200


def peer_probe(
    ctx, samples: int = PROBE_SAMPLES, gate=None, gate_key: str = "", gate_s: float = 600.0, local: bool = False
) -> list[dict]:
    """Cluster ``train_fn`` of the peer probe, run on warm caches after a placement's epochs:
    every rank reads ``samples`` samples that a peer owns (:meth:`WorkerContext.peer_samples`,
    a seeded draw per rank), one request at a time, all ranks at once from the ``gate``. The
    probe measures what a peer request costs on this machine in this run, apart from the epochs
    (``stoker simulate --validate`` calibrates its peer CPU cost on it). With ``local`` it reads
    samples its own node holds instead (:meth:`WorkerContext.local_samples`: what a cluster
    rank's read from its node cache costs). Returns ``ctx.epochs`` with the ids read under
    ``ids`` (epoch -1)."""
    mine = ctx.local_samples() if local else ctx.peer_samples()
    ids = np.random.default_rng(1000 + ctx.rank).permutation(mine)[:samples]
    pass_gate(gate, gate_key, ctx.world_size, gate_s)
    with ctx.measure(-1, samples=len(ids)) as rec:
        c0 = cpu_marks()
        for i in ids:
            ctx.dataset.read(int(i))
        rec["ids"], rec["cpu"] = ids.tolist(), [c0, cpu_marks()]
    return ctx.epochs


def direct_rank(spec: dict) -> dict:
    """One rank of the ``direct`` placement: the dataset through this host's own node cache
    (``spec["cache_dir"]``), no peers; with ``spec["read"]`` false it opens the dataset (its
    index) and reads no sample (the placement's control probe). Returns ``{epoch, samples, seconds, ids, local_bytes,
    peer_bytes (0), origin_bytes}`` (origin bytes: what this process's origin client received)."""
    from stoker.order import permutation, rank_plan
    from stoker.store.dataset import open_dataset

    ds = open_dataset(
        spec["url"],
        spec["cache_dir"],
        spec["cache_bytes"],
        storage_options=spec["storage_options"],
        block_bytes=spec["block_bytes"],
        check=False,
    )
    perm = permutation(len(ds), 0, spec["epoch"], "blockwise", groups=ds.blocks.sample_block, window=16)
    ids = rank_plan(perm, spec["rank"], spec["world_size"])
    if not spec.get("read", True):
        ids = ids[:0]
    pass_gate(spec.get("gate"), spec.get("gate_key", ""), spec["world_size"], spec.get("gate_s", 600.0))
    origin0, local = ds.origin.counters.bytes, 0

    def read(i: int) -> bytes:
        nonlocal local
        hits = ds.read_stats.cache_hits
        data = ds.read(i)
        if ds.read_stats.cache_hits > hits:
            local += len(data)
        return data

    started, t0, c0 = time.time(), time.perf_counter(), cpu_marks()
    spent = consume(read, ids, spec["decode"], spec.get("consumer_rate", 0.0), ds.key)
    return spent | {
        "epoch": spec["epoch"],
        "samples": len(ids),
        "seconds": time.perf_counter() - t0,
        "ids": ids.tolist(),
        "started_at": started,
        "cpu": [c0, cpu_marks()],
        "local_bytes": local,
        "peer_bytes": 0,
        "origin_bytes": ds.origin.counters.bytes - origin0,
    }


def _service_origin(service) -> int:
    """Run inside a cache service actor (``__ray_call__``): bytes its origin clients received."""
    return int(sum(ds.origin.counters.bytes for ds in service.opened_datasets()))


def _service_cpu(service) -> float:
    """Run inside a cache service actor (``__ray_call__``): its process's CPU seconds so far."""
    del service
    return time.process_time()


def _services_sum(fn) -> float:
    """``fn(service)`` run in the cache service of every live node, summed (0 for a node without one)."""
    import ray

    from stoker.cluster.service.cache_service import alive_nodes, get_service

    refs = []
    for node in alive_nodes():
        try:
            refs.append(get_service(node["NodeID"]).__ray_call__.remote(fn))
        except ValueError:
            continue
    return float(sum(ray.get(refs, timeout=60)))


def services_origin_bytes() -> int:
    """Bytes the cache services of all live nodes received from the origin so far (block fills
    for their peers and for ``stoker warm``); 0 for a node without a service."""
    return int(_services_sum(_service_origin))


def services_cpu_s() -> float:
    """CPU seconds the cache services of all live nodes have used so far (their processes)."""
    return _services_sum(_service_cpu)


def _service_node_cpu(service) -> tuple[str, float]:
    """Run inside a cache service actor (``__ray_call__``): its node and its process's CPU seconds so far."""
    return service.node_id, time.process_time()


def services_cpu_by_node() -> dict[str, float]:
    """``{node id: CPU seconds its cache service has used so far}`` of every live node with one."""
    import ray

    from stoker.cluster.service.cache_service import alive_nodes, get_service

    refs = []
    for node in alive_nodes():
        try:
            refs.append(get_service(node["NodeID"]).__ray_call__.remote(_service_node_cpu))
        except ValueError:
            continue
    return dict(ray.get(refs, timeout=60))


def cluster_counts(recs: list[dict], service_origin_bytes: int) -> list[dict]:
    """Per rank record of cluster mode, the bytes by the link they crossed: ``origin_bytes``:
    what the rank's processes received from the origin themselves (``received_origin_bytes``:
    whole blocks and single samples) plus, on the first record, ``service_origin_bytes`` (what the
    services fetched: whole blocks, where the rank counts only the range it asked for);
    ``peer_bytes``: everything a peer sent (``received_peer_bytes``); ``local_bytes`` as counted."""
    out = []
    for k, r in enumerate(recs):
        out.append(
            dict(
                r,
                origin_bytes=r["received_origin_bytes"] + (service_origin_bytes if k == 0 else 0),
                peer_bytes=r["received_peer_bytes"],
            )
        )
    return out


def no_reads(ctx, gate=None, gate_key: str = "", gate_s: float = 600.0) -> list:
    """Cluster ``train_fn`` of a placement's control probe: passes the ``gate`` as
    :func:`read_plan` does and reads nothing."""
    pass_gate(gate, gate_key, ctx.world_size, gate_s)
    return []


def probe_control(placement: str, run_job, links: dict) -> dict:
    """The kernel bytes of a job that moves no data, measured: ``run_job()`` runs one such job of
    ``placement`` (every rank started as that placement starts them, nothing read) between two
    readings of the counters of ``links``. Run first in each placement, on the same cluster, it also
    takes that placement's start-up traffic (its cache services and their worker processes
    registering with the head, the dataset's index opened by each service) out of the first
    epoch's window. ``run_job`` returns the host (index) of each rank, or None. Returns
    :func:`stoker_lab.bench.netcluster.kernel_delta` with ``seconds`` and ``rank_hosts`` added (the
    first job of a cluster placement settles the dataset's members: ``stoker simulate`` places it)."""
    t0 = time.perf_counter()
    before = read_counters(links)
    hosts = run_job()
    out = dict(kernel_delta(before, read_counters(links)), placement=placement, seconds=time.perf_counter() - t0)
    if hosts is not None:  # the probe job is the placement's first: where it ran settles the members
        out["rank_hosts"] = [int(h) for h in hosts]
    return out


def start_offsets(recs: list[dict]) -> list[float]:
    """Each rank's start (``started_at``, unix seconds) after the first rank's, seconds."""
    first = min(r["started_at"] for r in recs)
    return [float(r["started_at"] - first) for r in recs]


def _row(placement, job, epoch, recs, n, kernel, served, rank_hosts: list[int] | None = None) -> dict:
    """One report row of a job's epoch from its ranks' records ``recs``; ``rank_hosts``: the host
    (index) each rank ran on. Besides the totals it keeps each rank's seconds and, where the records
    have ``started_at`` (unix seconds), each rank's start after the first rank's, so that a model
    can take the measured placement and start-up skew (``stoker simulate --validate``)."""
    ids = np.concatenate([np.asarray(r["ids"], dtype=np.int64) for r in recs])
    seconds = max(r["seconds"] for r in recs)
    samples = sum(r["samples"] for r in recs)
    stoker = {k: int(sum(r[k] for r in recs)) for k in ("local_bytes", "peer_bytes", "origin_bytes")}
    row = {
        "placement": placement,
        "job": job,
        "epoch": epoch,
        "ranks": len(recs),
        "samples": samples,
        "seconds": seconds,
        "samples_per_s": samples / seconds if seconds else 0.0,
        "exactly_once": bool(len(ids) == n and np.array_equal(np.sort(ids), np.arange(n))),
        "kernel": kernel,
        "stoker": stoker,
        "origin_served_bytes": served,
        "rank_seconds": [float(r["seconds"]) for r in recs],
    }
    if rank_hosts is not None:
        row["rank_hosts"] = [int(h) for h in rank_hosts]
    for key in ("consume_s", "decode_cpu_s"):  # each rank's accelerator seconds and decode CPU seconds
        if all(key in r for r in recs):
            row[f"rank_{key}"] = [float(r[key]) for r in recs]
    if all("started_at" in r for r in recs):
        row["rank_start_s"] = start_offsets(recs)
    return row


def state_check(spec: dict, url: str, opts: dict, host_nodes: list[str]) -> dict:
    """``stoker warm``, ``stoker cluster-state`` and the extender's prioritize on this cluster.

    Every host gets a cache service, but only ``holder`` (the second host) a budget that holds the
    dataset (the others' are below one block, so they own nothing); ``warm`` fills it, each
    host's cached fraction as its own service reports it; ``stoker cluster-state`` (the command,
    run here) writes the state file, and the extender (reading that file, as ``stoker extender
    --state`` does) scores the hosts for a pod that names the dataset. Returns ``{holder,
    warm: {host: {cached_bytes, cached_fraction}}, complete, state_datasets: {host: bytes},
    priorities: [{Host, Score}], holder_first}``."""
    import subprocess

    import ray

    from stoker.cluster.extender.scoring import DATASET_ANNOTATION, file_state, prioritize
    from stoker.cluster.service.cache_service import start_services, stop_services
    from stoker.cluster.service.warmup import warm

    by_ip = {n["NodeManagerAddress"]: n["NodeID"] for n in ray.nodes() if n.get("Alive")}
    host_nodes = [by_ip.get(ip, nid) for ip, nid in zip(spec["host_ips"], host_nodes, strict=True)]
    # (a host restarted since the start has a new node id)
    holder = min(1, len(host_nodes) - 1)
    root = os.path.join(spec["workdir"], "cache-state")
    stop_services()
    budgets = {nid: (spec["cache_bytes"] if i == holder else 1024) for i, nid in enumerate(host_nodes)}
    start_services(root, budgets)
    rep = warm(
        url,
        opts,
        cache_dir=root,
        cache_bytes=budgets,
        block_bytes=spec["block_bytes"],  # type: ignore[arg-type]
        progress=False,
    )
    host_of = {nid: f"h{i}" for i, nid in enumerate(host_nodes)}
    names = {nid: n["node_name"] for nid, n in rep["nodes"].items()}
    path = os.path.join(spec["workdir"], "state.json")
    cmd = [
        sys.executable,
        "-m",
        "stoker.cli",
        "cluster-state",
        url,
        "--ray-address",
        spec["address"],
        "--storage-options",
        json.dumps(opts),
        "--block-size",
        str(spec["block_bytes"]),
        "--out",
        path,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=spec["job_timeout_s"])
    if proc.returncode != 0:
        raise RuntimeError(f"stoker cluster-state exited with code {proc.returncode}: {proc.stderr[-2000:]}")
    state = file_state(path)()
    pod = {"Pod": {"metadata": {"annotations": {DATASET_ANNOTATION: url}}}, "NodeNames": sorted(state["nodes"])}
    prio = prioritize(pod, state)
    score = {p["Host"]: p["Score"] for p in prio}
    mine = score.get(names.get(host_nodes[holder], ""), -1)
    stop_services()
    shutil.rmtree(root, ignore_errors=True)
    return {
        "holder": f"h{holder}",
        "warm": {
            host_of.get(nid, nid): {"cached_bytes": n["cached_bytes"], "cached_fraction": n["cached_fraction"]}
            for nid, n in rep["nodes"].items()
        },
        "complete": rep["complete"],
        "state_datasets": {name: n["datasets"].get(url, 0) for name, n in state["nodes"].items()},
        "priorities": prio,
        "holder_first": len(score) == len(host_nodes)
        and all(v < mine for v in score.values() if v != mine)
        and sum(v == mine for v in score.values()) == 1,
    }


def run_placements(
    spec, repeat, mine, out, phases, url, opts, n, host_nodes, host_of, gate, served, direct_refs
) -> None:
    """One repeat of every placement (the body of :func:`main`'s loop): each placement on empty
    caches, its control probe and idle cores into ``mine`` (with the random placement's peer
    and local probes), its rows (``repeat`` set) appended to ``out["runs"]``, its seconds added
    to ``phases``."""
    import ray

    from stoker.cluster.jobs.job import run as cluster_run
    from stoker.cluster.service.cache_service import stop_services
    from stoker.cluster.settings import ClusterOptions

    links = spec["links"]
    gate_s = spec["job_timeout_s"]
    for placement in spec["placements"]:
        t_phase = time.perf_counter()
        root = os.path.join(spec["workdir"], f"cache-{placement}")
        shutil.rmtree(root, ignore_errors=True)
        stop_services()

        def probe_job(placement=placement, root=root) -> list[int]:
            served()  # as every job's window holds one stats request
            key = f"{repeat}/{placement}/control"
            if placement == "direct":
                ray.get(direct_refs(root, 0, read=False, key=key), timeout=spec["job_timeout_s"])
                return list(range(len(host_nodes)))
            res = cluster_run(
                partial(no_reads, gate=gate, gate_key=key, gate_s=gate_s),
                url,
                len(host_nodes),
                {"CPU": 0.5},
                storage_options=opts,
                cache_dir=root,
                cache_bytes=spec["cache_bytes"],
                block_bytes=spec["block_bytes"],
                cluster=ClusterOptions(
                    placement=placement, seed=spec["seed"] + 1, job="control", timeout_s=spec["job_timeout_s"]
                ),
            )
            return [host_of.get(r["node_id"], -1) for r in res]

        mine.setdefault("control", {})[placement] = probe_control(placement, probe_job, links)
        mine.setdefault("idle_busy_cores", {})[placement] = busy_cores(2.0)  # the cluster at rest
        for epoch in range(spec["epochs"]):
            for j, job in enumerate(JOBS):
                before, s0 = read_counters(links), served()
                cpu0 = machine_cpu_s()
                hc0 = hostcpu.marks(links, services_cpu_by_node(), host_of)
                key = f"{repeat}/{placement}/{job}/{epoch}"
                if placement == "direct":
                    recs = ray.get(direct_refs(root, epoch, key=key), timeout=spec["job_timeout_s"])
                    hosts = list(range(len(recs)))  # rank r on host r
                    svc_cpu = 0.0  # no cache service
                else:
                    svc0, scpu0 = services_origin_bytes(), services_cpu_s()
                    fn = partial(
                        read_plan,
                        epoch=epoch,
                        decode=spec["decode"],
                        gate=gate,
                        gate_key=key,
                        gate_s=gate_s,
                        consumer_rate=spec.get("consumer_rate", 0.0),
                    )
                    res = cluster_run(
                        fn,
                        url,
                        len(host_nodes),
                        {"CPU": 0.5},
                        storage_options=opts,
                        cache_dir=root,
                        cache_bytes=spec["cache_bytes"],
                        block_bytes=spec["block_bytes"],
                        cluster=ClusterOptions(
                            placement=placement, seed=spec["seed"] + 1 + j, job=job, timeout_s=spec["job_timeout_s"]
                        ),
                    )
                    recs = cluster_counts([r["epochs"][-1] for r in res], services_origin_bytes() - svc0)
                    hosts = [host_of.get(r["node_id"], -1) for r in res]
                    svc_cpu = services_cpu_s() - scpu0
                cpu_s = machine_cpu_s() - cpu0
                hc1 = hostcpu.marks(links, services_cpu_by_node(), host_of)
                kernel = kernel_delta(before, read_counters(links))
                row = _row(placement, job, epoch, recs, n, kernel, served() - s0, hosts)
                row["host_cpu"] = hostcpu.host_rows(hc0, hc1, recs, hosts, kernel["links"])
                row["repeat"] = repeat
                row["machine_cpu_s"] = cpu_s  # the whole machine's busy CPU seconds, job start to end
                row["epoch_cpu"] = epoch_cpu([tuple(r["cpu"]) for r in recs], svc_cpu, os.cpu_count() or 1)
                out["runs"].append(row)
                print(
                    json.dumps(
                        {k: row[k] for k in ("repeat", "placement", "job", "epoch", "seconds", "exactly_once")}
                        | {"origin_link": kernel["origin_link_bytes"], "host_link": kernel["host_link_bytes"]}
                        | row["stoker"]
                    ),
                    flush=True,
                )
        for kind in ("peer", "local") if placement == "random" else ():  # probes, on the warmed caches
            scpu0 = services_cpu_s()
            res = cluster_run(
                partial(
                    peer_probe,
                    gate=gate,
                    gate_key=f"{repeat}/{placement}/{kind}-probe",
                    gate_s=gate_s,
                    local=kind == "local",
                ),
                url,
                len(host_nodes),
                {"CPU": 0.5},
                storage_options=opts,
                cache_dir=root,
                cache_bytes=spec["cache_bytes"],
                block_bytes=spec["block_bytes"],
                cluster=ClusterOptions(
                    placement=placement, seed=spec["seed"] + 1 + len(JOBS), job="probe", timeout_s=spec["job_timeout_s"]
                ),
            )
            recs = [r["epochs"][-1] for r in res]
            mine[f"{kind}_probe"] = {
                "placement": placement,
                "rank_hosts": [host_of.get(r["node_id"], -1) for r in res],
                "ids": [r["ids"] for r in recs],
                "seconds": max(r["seconds"] for r in recs),
                "rank_seconds": [r["seconds"] for r in recs],
                "rank_start_s": start_offsets(recs),
                "peer_bytes": int(sum(r["received_peer_bytes"] for r in recs)),
                "origin_bytes": int(sum(r["received_origin_bytes"] for r in recs)),
                "samples_per_rank": PROBE_SAMPLES,
                "epoch_cpu": epoch_cpu([tuple(r["cpu"]) for r in recs], services_cpu_s() - scpu0, os.cpu_count() or 1),
            }
            print(
                json.dumps(
                    {
                        f"{kind}_probe_s": mine[f"{kind}_probe"]["seconds"],
                        "peer_bytes": mine[f"{kind}_probe"]["peer_bytes"],
                    }
                ),
                flush=True,
            )
        stop_services()
        shutil.rmtree(root, ignore_errors=True)
        phases[placement] = phases.get(placement, 0.0) + time.perf_counter() - t_phase


#: Samples the driver decodes in its decode probe (:func:`decode_probe`).
DECODE_PROBE_SAMPLES = 200


def decode_probe(ds, samples: int = DECODE_PROBE_SAMPLES) -> dict:
    """CPU seconds per sample of decoding the dataset's samples as the ranks do
    (:func:`_decode`), measured once in the driver's own process, apart from every epoch: the
    first ``samples`` samples (evenly spaced over the dataset) are read into memory first, then
    decoded one after the other. Returns ``{samples, cpu_s, seconds, cpu_s_per_sample}``
    (``stoker simulate --validate`` takes a decode run's decode cost from the calibration run's
    probe)."""
    ids = np.linspace(0, len(ds) - 1, min(samples, len(ds))).astype(np.int64)
    data = [(ds.read(int(i)), ds.key(int(i))) for i in ids]
    t0, cpu = time.perf_counter(), 0.0
    for blob, key in data:
        cpu += _decode(blob, key)
    return {
        "samples": len(data),
        "cpu_s": cpu,
        "seconds": time.perf_counter() - t0,
        "cpu_s_per_sample": cpu / len(data),
    }


def main(spec_path: str, out_path: str) -> int:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from stoker.store.dataset import open_dataset
    from stoker.store.pack import pack

    from .origin import endpoint_options, upload_tree

    with open(spec_path) as f:
        spec = json.load(f)
    opts = endpoint_options(spec["endpoint_url"])
    ray.init(address=spec["address"], logging_level="ERROR", log_to_driver=False)
    t0 = time.perf_counter()
    upload_tree(spec["data_dir"], "s3://stoker/raw", opts)
    url = "s3://stoker/packed"
    pack("s3://stoker/raw", url, storage_options=opts, shard_bytes=spec["shard_bytes"], progress=False)
    ds = open_dataset(url, storage_options=opts, cache=False, block_bytes=spec["block_bytes"])
    n = len(ds)
    out = {
        "dataset": {"samples": n, "bytes": int(ds.index.length.sum()), "blocks": len(ds.blocks), "version": ds.version},
        "setup_s": time.perf_counter() - t0,
        "runs": [],
    }
    phases = out["phases_s"] = {"upload_pack": out["setup_s"]}
    by_ip = {node["NodeManagerAddress"]: node["NodeID"] for node in ray.nodes() if node.get("Alive")}
    host_nodes = [by_ip[ip] for ip in spec["host_ips"]]
    host_of = {nid: i for i, nid in enumerate(host_nodes)}

    def served() -> int:  # the origin server's own count of body bytes sent
        import urllib.request

        with urllib.request.urlopen(f"{spec['direct_url']}/__stoker__/stats", timeout=10) as r:
            return int(json.loads(r.read())["bytes_served"])

    gate = start_gate()  # every rank of a job starts its clock together (bench/start_gate.py)
    gate_s = spec["job_timeout_s"]

    def direct_refs(root: str, epoch: int, read: bool = True, key: str = "") -> list:  # one direct rank per host
        return [
            ray.remote(direct_rank)
            .options(num_cpus=0.5, max_retries=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False))
            .remote(
                {
                    "url": url,
                    "storage_options": opts,
                    "cache_dir": os.path.join(root, f"h{r}"),
                    "cache_bytes": spec["cache_bytes"],
                    "block_bytes": spec["block_bytes"],
                    "epoch": epoch,
                    "rank": r,
                    "world_size": len(host_nodes),
                    "decode": spec["decode"],
                    "consumer_rate": spec.get("consumer_rate", 0.0),
                    "read": read,
                    "gate": gate,
                    "gate_key": key,
                    "gate_s": gate_s,
                }
            )
            for r, node in enumerate(host_nodes)
        ]

    out["decode_probe"] = decode_probe(ds)
    repeats = int(spec.get("repeats", 1))
    out["repeat_probes"] = []
    for repeat in range(repeats):
        mine: dict = {"repeat": repeat}
        out["repeat_probes"].append(mine)
        run_placements(spec, repeat, mine, out, phases, url, opts, n, host_nodes, host_of, gate, served, direct_refs)
        if repeat == 0:  # the first repeat's probes where reports without repeats have them
            out.update({k: v for k, v in mine.items() if k != "repeat"})
    if spec.get("faults"):
        from .netcluster_faults import fault_run

        out["faults"] = []
        for kind in spec["faults"]:
            t_phase = time.perf_counter()
            row = fault_run(kind, spec, url, opts, n)
            phases[f"fault_{kind}"] = time.perf_counter() - t_phase
            out["faults"].append(row)
            print(
                json.dumps(
                    {k: row[k] for k in ("fault", "host", "finished", "exactly_once", "seconds")}
                    | {"dead_host_blocks": row["dead_host_blocks"], "rejoin": row["rejoin"]}
                ),
                flush=True,
            )
    if spec.get("state_check", True):
        t_phase = time.perf_counter()
        out["state"] = state_check(spec, url, opts, host_nodes)
        phases["state_check"] = time.perf_counter() - t_phase
        print(json.dumps(out["state"]), flush=True)
    from stoker._atomic import umask_mode, write_atomic

    write_atomic(out_path, json.dumps(out).encode(), mode=umask_mode())
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
