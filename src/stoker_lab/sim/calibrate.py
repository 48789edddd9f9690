"""Model parameters from measurements, each with where it came from.

A :class:`Calibrated` value carries its ``source`` (a file and field, or a measurement made
now), so every table the model prints can say where its numbers came from. Nothing here is
tuned to the result being predicted: the namespace cluster's per-request peer time is fitted on
each run's own *peer probe* (a job apart from its epochs, :func:`fit_probe_cpu`); for an older
report without one, it and the processes a late rank's start-up keeps busy are fitted on the
*calibration run* (one ``stoker bench cluster --netns`` report; never per row). The validation
reports which rows are in sample and which are not.
"""

from __future__ import annotations

import math
import os
import tempfile
import time
from dataclasses import dataclass, field, replace

import numpy as np

from .model import Job, Params, simulate
from .workload import Workload, synthetic

#: 1 Mbit/s in bytes/s.
MBIT_BPS = 1e6 / 8


@dataclass
class Calibrated:
    """A parameter value (unit in its name) and the measurement it comes from."""

    value: float
    source: str


def measure_cache_read_Bps(
    directory: str | None = None, size_bytes: int = 64 << 20, block_bytes: int = 1 << 20
) -> Calibrated:
    """Read rate of a warm node cache, bytes/s: a ``size_bytes`` file written under ``directory``
    (default: the temporary directory) and read back in ``block_bytes`` reads (the page cache
    serves it, as it serves a cache that fits in memory). The file is removed."""
    fd, path = tempfile.mkstemp(prefix="stoker-sim-read-", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(os.urandom(block_bytes) * (size_bytes // block_bytes))
        t0 = time.perf_counter()
        with open(path, "rb", buffering=0) as f:
            while f.read(block_bytes):
                pass
        secs = time.perf_counter() - t0
    finally:
        os.unlink(path)
    return Calibrated(
        size_bytes / secs,
        f"measured now: {size_bytes >> 20} MiB read back in "
        f"{block_bytes >> 20} MiB reads from {directory or tempfile.gettempdir()}",
    )


def netns_workload(report: dict) -> Workload:
    """The dataset of a ``stoker bench cluster --netns`` report (its samples and bytes, its shard
    and block sizes) laid out by :func:`stoker_lab.sim.workload.synthetic` (made-up sizes and block
    keys; :func:`netns_setup` has the run's own)."""
    ds, cfg = report["dataset"], report["config"]
    return synthetic(ds["samples"], ds["bytes"], cfg["shard_bytes"], cfg["block_bytes"], name="netns")


@dataclass
class NetnsSetup:
    """What the model of one ``--netns`` report reads and where it places it: ``workload``;
    ``node_keys``: model node i's placement key (None: made-up names); ``sources``: where each
    came from (``{"dataset", "host order", "rank starts": Calibrated}``); ``peak_Bps``: what a
    shaped link passes while its token bucket holds tokens (0: no buckets, plain rate limits);
    ``ranks``: ``{(placement, job): model node of each rank}`` as the run placed them, and
    ``starts``: ``{(placement, job): {epoch: each rank's start offset, s}}`` as they started
    (:func:`stoker_lab.sim.measured.recorded_ranks`, :func:`~stoker_lab.sim.measured.recorded_starts`;
    empty: the model draws the ranks and starts them together); ``order``: the host of model
    node i (empty with made-up node names)."""

    workload: Workload
    node_keys: list[str] | None
    sources: dict[str, Calibrated]
    peak_Bps: float = 0.0
    ranks: dict[tuple[str, str], list[int]] = field(default_factory=dict)
    starts: dict[tuple[str, str], dict[int, list[float]]] = field(default_factory=dict)
    order: list[int] = field(default_factory=list)

    def jobs(self, report: dict, placement: str) -> list[Job]:
        """The report's jobs (:func:`netns_jobs`) under ``placement``, each on its recorded rank
        nodes and with its ranks' recorded start offsets where this setup has them. A cluster
        placement whose control probe recorded its ranks' hosts (``control.<placement>.rank_hosts``)
        starts with that probe as a job named ``control`` that reads nothing: it ran first, so its
        nodes settled the dataset's members (``stoker.cluster.service.records``) and hence the owners."""
        jobs = [
            Job(
                j.name,
                j.world,
                j.seed,
                self.ranks.get((placement, j.name)),
                dict(self.starts.get((placement, j.name), {})),
            )
            for j in netns_jobs(report)
        ]
        hosts = ((report.get("control") or {}).get(placement) or {}).get("rank_hosts")
        if placement != "direct" and hosts and self.node_keys is not None and min(hosts) >= 0:
            nodes = [self.order.index(int(h)) for h in hosts]
            jobs.insert(
                0, Job("control", len(nodes), rank_nodes=nodes, plans=[np.zeros(0, dtype=np.int64) for _ in nodes])
            )
        return jobs


def netns_setup(report: dict, path: str, measured: bool = True, peak_Bps: float = 0.0) -> NetnsSetup:
    """The report's own dataset, node keys, rank hosts and rank starts (:mod:`stoker_lab.sim.measured`),
    so the model places its blocks and ranks where the run did and starts each rank when it
    started; a report without ``rank_hosts`` gets the host order read off its kernel counters
    (:func:`stoker_lab.sim.measured.host_order`) and the setup's own rank draw. With ``measured``
    False, or when the dataset cannot be made again, :func:`netns_workload` on made-up node names,
    ranks drawn and started together (said in the sources). ``peak_Bps``: as in
    :class:`NetnsSetup`. Raises ValueError for inconsistent ``rank_hosts`` or ``rank_start_s``."""
    from .measured import host_order, netns_dataset, netns_node_keys, recorded_ranks, recorded_starts

    wl, why = netns_dataset(report, path) if measured else (None, "not asked for")
    if wl is None:
        fallback = netns_workload(report)
        return NetnsSetup(
            fallback,
            None,
            {
                "dataset": Calibrated(fallback.num_blocks, f"synthetic: {why}"),
                "host order": Calibrated(0, "made-up node names node000..."),
            },
            peak_Bps,
        )
    keys, ranks = netns_node_keys(report), recorded_ranks(report, path)
    if ranks is not None:
        order, src = (
            list(range(int(report["hosts"]))),
            (f"{path}: rank_hosts of every row: model node i is host h<i>, each job's ranks on their recorded hosts"),
        )
    else:
        order, src = host_order(report, path, wl, netns_jobs(report))
    starts = recorded_starts(report, path)
    skew = max((max(v) for by_epoch in starts.values() for v in by_epoch.values()), default=0.0)
    return NetnsSetup(
        wl,
        [keys[h] for h in order],
        {
            "dataset": Calibrated(wl.num_blocks, why),
            "host order": Calibrated(len(order), src),
            "rank starts": Calibrated(
                skew,
                f"{path}: rank_start_s of {sum(map(len, starts.values()))} "
                "rows (value: the largest offset, s); each rank starts "
                "at its own"
                if starts
                else f"{path}: not recorded; every rank starts at once",
            ),
        },
        peak_Bps,
        {k: [order.index(h) for h in v] for k, v in (ranks or {}).items()},
        starts,
        order,
    )


def consumer_step_s(report: dict) -> float:
    """Seconds a rank's accelerator takes per sample in a ``--netns`` report
    (``config.consumer_rate``, samples/s; 0 for none and for reports made before the option)."""
    rate = float(report["config"].get("consumer_rate", 0.0))
    return 1.0 / rate if rate > 0 else 0.0


def local_latency(report: dict, path: str, decode_cpu_s: float = 0.0) -> Calibrated:
    """Seconds per sample read from a warm node cache: the ``direct`` rows with no origin bytes
    (warm), seconds of the slowest rank / samples per rank, averaged, less the accelerator's
    step (:func:`consumer_step_s`) and, in a run that decodes (``config.decode``), ``decode_cpu_s``
    (each a per-sample time the model adds apart). The report's first repeat (rows without
    ``repeat`` are repeat 0) only: the calibration run. Raises ValueError without such rows."""
    rows = [
        r
        for r in report["runs"]
        if r["placement"] == "direct" and r["stoker"]["origin_bytes"] == 0 and int(r.get("repeat", 0)) == 0
    ]
    if not rows:
        raise ValueError(f"{path}: no warm direct epoch to calibrate the local read time from")
    less = consumer_step_s(report) + (decode_cpu_s if report["config"].get("decode") else 0.0)
    vals = [max(r["seconds"] / (r["samples"] / r["ranks"]) - less, 0.0) for r in rows]
    return Calibrated(
        sum(vals) / len(vals),
        f"{path}: warm direct epochs of its first repeat, seconds / samples per rank (mean of {len(vals)})"
        + (f", less {less * 1e3:.2f} ms a sample of accelerator step and decode" if less else ""),
    )


def probe_local_latency(report: dict, path: str) -> Calibrated | None:
    """Seconds per sample read from a warm node cache in a run that looks like training (an
    accelerator, ``config.consumer_rate`` > 0, or ``config.decode``): its own local probe's
    seconds over the most samples a rank read in it (every rank reading samples its own node
    holds, all at once, apart from the epochs). Its warm epochs are mostly the accelerator's steps
    and decoding, so what :func:`local_latency` would leave of them after subtracting those is
    how late the accelerator's sleeps ran on the loaded machine, not a read. None for any other
    run, or one without a local probe."""
    cfg = report["config"]
    probe = report.get("local_probe")
    if not (float(cfg.get("consumer_rate", 0.0)) > 0 or cfg.get("decode")) or not probe:
        return None
    per_rank = max(len(ids) for ids in probe["ids"])
    return Calibrated(
        float(probe["seconds"]) / per_rank,
        f"{path}: its own local probe ({per_rank} samples a rank in {probe['seconds']:.3f} s, after the epochs)",
    )


def decode_cpu(report: dict, path: str) -> Calibrated | None:
    """CPU seconds of decoding one sample as the ranks do, from the report's ``decode_probe``
    (``stoker_lab.bench.netcluster_driver.decode_probe``: the driver decodes 200 samples in one
    process, apart from every epoch); None for a report without one (made before the probe)."""
    probe = report.get("decode_probe")
    if not probe:
        return None
    return Calibrated(
        float(probe["cpu_s_per_sample"]),
        f"{path}: decode_probe ({probe['samples']} samples decoded in one process, "
        f"{probe['cpu_s'] * 1e3 / probe['samples']:.2f} ms CPU each, apart from every epoch)",
    )


#: The model reads a rank's plan in at most this many chunks (consecutive samples read one at a
#: time: their latencies, CPU and bytes one after the other). The runs before the training-like
#: ones (300 samples a rank or fewer) keep one sample a chunk; on the 3-host training run
#: (``benchmarks/bench_cluster_netns_train_3hosts.json``, 1,100 samples a rank) chunks of 4 gave
#: every epoch within 4% of one sample a chunk, 3x faster (its token buckets pass a lone
#: sample at their peak rate, a chunk of several at the link's rate).
MODEL_CHUNKS_PER_RANK = 300


def model_chunk(report: dict) -> int:
    """Samples per model chunk for a ``--netns`` report (:data:`MODEL_CHUNKS_PER_RANK`); 1 for a
    report that does not say its samples and ranks per job."""
    samples, ranks = (report.get("dataset") or {}).get("samples"), report["config"].get("ranks_per_job")
    if not samples or not ranks:
        return 1
    per_rank = math.ceil(int(samples) / int(ranks))
    return max(1, math.ceil(per_rank / MODEL_CHUNKS_PER_RANK))


#: Cores one peer request can use at once: the rank's client code, then the owner's service code,
#: one after the other, each in one Python process on one core.
REQUEST_CORES = 1.0


def netns_params(
    report: dict,
    local_s: float,
    peer_cpu_s: float = 0.0,
    link_factor: float = 1.0,
    node_keys: list[str] | None = None,
    peak_Bps: float = 0.0,
    starting_processes: int = 0,
    local_cpu_s: float = 0.0,
    decode_cpu_s: float = 0.0,
    training: bool = True,
) -> Params:
    """:class:`Params` of a namespace-cluster report: its hosts, tbf link rates (Mbit/s per
    direction) times ``link_factor`` (the fraction of its rate a link delivers,
    :func:`fit_link_factor`), origin latency and cache bytes; one rank per host reading
    synchronously (the driver's ``read_plan``: one request at a time, no decode, no accelerator);
    ``peer_cpu_s`` CPU seconds per peer request on the report's ``machine.cores`` cores, which all
    the emulated hosts share (:func:`fit_peer_cpu`); ``node_keys``: the nodes' placement keys
    (:class:`NetnsSetup`). With ``peak_Bps`` > 0 the links are the bench's token buckets
    (:func:`stoker_lab.bench.netcluster.burst_bytes` of their configured rate) passing ``peak_Bps``
    while they hold tokens. One sample per request: the driver's ``read_plan`` reads one sample
    at a time; the epochs in chunks of :func:`model_chunk` such samples, a probe one a chunk.
    ``starting_processes``: shares of the shared cores a rank takes until its recorded start
    (:class:`stoker_lab.sim.model.Params`, :func:`fit_starting`). A
    request uses at most :data:`REQUEST_CORES` of the shared cores at once. ``local_cpu_s``: CPU
    seconds of a cluster rank's read from its own node cache (:func:`fit_probe_cpu`, ``local``).
    With ``training`` (the epochs; False: a probe, which only reads), each rank's accelerator takes
    the report's ``config.consumer_rate`` samples/s after each read (the model's ``gpu_rate``, one
    sample in flight) and, where the run decodes (``config.decode``), each sample costs
    ``decode_cpu_s`` CPU seconds on the shared cores in the rank's process (:func:`decode_cpu`)."""
    from ..bench.netcluster import burst_bytes

    links, cfg = report["links"], report["config"]
    hosts = [v for k, v in links.items() if k != "origin"]
    step = consumer_step_s(report) if training else 0.0
    decode = decode_cpu_s if training and cfg.get("decode") else 0.0
    shared = peer_cpu_s > 0 or decode > 0  # the shared cores are modelled
    return Params(
        nodes=report["hosts"],
        cache_bytes=cfg["cache_bytes_per_node"],
        origin_Bps=links["origin"]["mbit"] * MBIT_BPS * link_factor,
        nic_Bps=min(h["mbit"] for h in hosts) * MBIT_BPS * link_factor,
        origin_latency_s=report["origin"]["latency_ms"] / 1e3,
        local_latency_s=local_s,
        machine_cores=float(report["machine"]["cores"]) if shared else 0.0,
        peer_cpu_s=peer_cpu_s,
        prefetch_chunks=1,
        fetch_inflight=1,
        chunk_samples=model_chunk(report) if training else 1,
        node_keys=node_keys,
        link_peak_Bps=peak_Bps,
        nic_bucket_bytes=burst_bytes(min(h["mbit"] for h in hosts)),
        origin_bucket_bytes=burst_bytes(links["origin"]["mbit"]),
        starting_processes=starting_processes if peer_cpu_s > 0 else 0,
        request_cores=REQUEST_CORES if shared else 0.0,
        local_cpu_s=local_cpu_s if peer_cpu_s > 0 else 0.0,
        gpu_rate=1.0 / step if step > 0 else 0.0,
        decode_cpu_s=decode,
    )


def netns_jobs(report: dict) -> list[Job]:
    """The driver's two jobs (random placement seeded ``seed + 1 + j``)."""
    return [Job(f"job{j + 1}", report["config"]["ranks_per_job"], 1 + j) for j in range(report["config"]["jobs"])]


def _solve(f, target: float, lo: float, hi: float, rtol: float = 1e-4, steps: int = 40) -> float:
    """x in [lo, hi] where the monotone ``f(x)`` meets ``target``: regula falsi with the Illinois
    rule (the bracket kept; a few model runs where ``f`` is nearly linear, as epoch seconds are in
    a rate or a per-request cost), until ``f`` is within ``rtol`` of the target or the bracket is
    ``rtol`` of ``hi`` wide. A target outside ``[f(lo), f(hi)]`` gives the nearer end."""
    flo, fhi = f(lo) - target, f(hi) - target
    if flo * fhi > 0:
        return lo if abs(flo) < abs(fhi) else hi
    side = 0
    x = lo
    for _ in range(steps):
        x = (lo * fhi - hi * flo) / (fhi - flo) if fhi != flo else (lo + hi) / 2
        fx = f(x) - target
        if abs(fx) <= rtol * abs(target) or hi - lo <= rtol * abs(hi):
            break
        if fx * fhi > 0:  # x replaces hi
            hi, fhi = x, fx
            if side == -1:
                flo /= 2
            side = -1
        else:
            lo, flo = x, fx
            if side == 1:
                fhi /= 2
            side = 1
    return x


def cold_direct_row(report: dict, path: str) -> dict:
    """The first job's cold ``direct`` epoch: every host reads the whole dataset from the origin
    through the one origin link, so its time is the origin link's delivered rate (plus the
    per-request latency the model adds). Raises ValueError without one."""
    rows = [
        r for r in report["runs"] if r["placement"] == "direct" and r["epoch"] == 0 and r["stoker"]["origin_bytes"] > 0
    ]
    if not rows:
        raise ValueError(f"{path}: no cold direct epoch to measure the links' delivered rate on")
    return rows[0]


def fit_link_factor(
    report: dict, path: str, local_s: float, setup: NetnsSetup | None = None, decode_cpu_s: float = 0.0
) -> Calibrated:
    """The fraction of their configured rate the report's tbf links deliver, fitted (:func:`_solve`)
    so the model's cold ``direct`` epoch (:func:`cold_direct_row`, a bandwidth-bound epoch)
    takes its measured seconds. Applied to the host links too: they are shaped by the same
    rule (tbf with a bucket of 10 ms of the rate, ``stoker_lab.bench.netcluster``). The kernel's
    count of the epoch's origin-link bytes over its seconds is given beside it. ``decode_cpu_s``:
    as in :func:`netns_params` (the epoch's ranks decode in a run that does)."""
    row = cold_direct_row(report, path)
    setup = setup or netns_setup(report, path, measured=False)
    wl, jobs = setup.workload, setup.jobs(report, "direct")

    def cold_s(factor: float) -> float:
        res = simulate(
            netns_params(
                report,
                local_s,
                link_factor=factor,
                node_keys=setup.node_keys,
                peak_Bps=setup.peak_Bps,
                decode_cpu_s=decode_cpu_s,
            ),
            wl,
            "direct",
            jobs[:1],
            1,
        )
        return res[0].seconds

    factor = _solve(cold_s, row["seconds"], 0.2, 2.0)
    raw = row["kernel"]["origin_link_bytes"] * 8 / row["seconds"] / 1e6
    return Calibrated(
        factor,
        f"{path}: fitted to its cold direct epoch ({row['seconds']:.2f} s; the kernel "
        f"counted {raw:.1f} Mbit/s on the {report['links']['origin']['mbit']:g} Mbit/s origin "
        "link); that row is in sample",
    )


def _warm_random(report: dict) -> list[dict]:
    """The report's ``random`` rows after each job's first epoch (warm: the caches hold the data)."""
    return [r for r in report["runs"] if r["placement"] == "random" and r["epoch"] >= 1]


def fit_peer_cpu(
    report: dict,
    path: str,
    local_s: float,
    link_factor: float = 1.0,
    hi_s: float = 0.05,
    setup: NetnsSetup | None = None,
    starting_processes: int = 0,
) -> Calibrated:
    """CPU seconds per peer request (the rank's Ray call and the owning node's service, on the
    machine's ``machine.cores`` cores that every emulated host shares), fitted (:func:`_solve`) so
    the model's mean warm ``random`` epoch (:func:`_warm_random`) equals the report's (the placement whose
    warm time is mostly peer requests), each rank started when it started (``setup``) and its
    start-up taking ``starting_processes`` shares of the cores until then. Raises ValueError
    without such rows."""
    meas = [r["seconds"] for r in _warm_random(report)]
    if not meas:
        raise ValueError(f"{path}: no warm random epochs to fit the peer request time on")
    target = sum(meas) / len(meas)
    setup = setup or netns_setup(report, path, measured=False)
    cpu_s = _solve(
        lambda x: float(np.mean(_warm_random_s(report, local_s, x, link_factor, setup, starting_processes))),
        target,
        0.0,
        hi_s,
    )
    return Calibrated(
        cpu_s,
        f"{path}: fitted to its {len(meas)} warm random epochs (mean {target:.2f} s) with "
        f"{report['machine']['cores']} cores shared by all hosts and {starting_processes} "
        "starting processes per late rank; this run is the calibration run",
    )


def _warm_random_s(
    report: dict, local_s: float, cpu_s: float, link_factor: float, setup: NetnsSetup, starting_processes: int
) -> np.ndarray:
    """The model's seconds of the report's warm ``random`` epochs (in the order of :func:`_warm_random`)."""
    res = simulate(
        netns_params(
            report, local_s, max(cpu_s, 1e-9), link_factor, setup.node_keys, setup.peak_Bps, starting_processes
        ),
        setup.workload,
        "random",
        setup.jobs(report, "random"),
        report["config"]["epochs"],
        together=False,
    )
    by = {(r.job, r.epoch): r.seconds for r in res}
    return np.array([by[(r["job"], r["epoch"])] for r in _warm_random(report)])


def probe_job(report: dict, path: str, order: list[int] | None = None, kind: str = "peer") -> Job:
    """The report's peer probe (``peer_probe``, :func:`stoker_lab.bench.netcluster_driver.peer_probe`)
    as a model job: its ranks on their recorded hosts (model node i is host ``order[i]``, default
    h<i>), started at
    their recorded offsets, each reading its recorded ids. Raises ValueError when the report has
    no probe or the probe's ranks have no recorded host."""
    probe = report.get(f"{kind}_probe")
    if not probe:
        raise ValueError(f"{path}: no {kind}_probe (a report of an older stoker bench cluster --netns)")
    hosts = [int(h) for h in probe["rank_hosts"]]
    if min(hosts) < 0:
        raise ValueError(f"{path}: a {kind} probe rank ran on no recorded host: {hosts}")
    if order:
        hosts = [order.index(h) for h in hosts]
    return Job(
        f"{kind}-probe",
        len(hosts),
        rank_nodes=hosts,
        start_s={0: [float(x) for x in probe["rank_start_s"]]},
        plans=[np.asarray(ids, dtype=np.int64) for ids in probe["ids"]],
    )


def fit_probe_cpu(
    report: dict,
    path: str,
    local_s: float,
    link_factor: float,
    setup: NetnsSetup,
    hi_s: float = 0.05,
    kind: str = "peer",
    peer_cpu_s: float = 0.0,
) -> Calibrated:
    """CPU seconds per read on the machine's shared cores, fitted (:func:`_solve`) so that the
    model's probe of ``kind`` (:func:`probe_job`) takes the probe's measured seconds: ``"peer"``,
    every rank reading samples its peers hold (the peer request's CPU), or ``"local"``, samples its
    own node holds (a cluster rank's node-cache read; ``peer_cpu_s``: the peer request's, for
    the model's other reads). Both run all ranks at once on warm caches, after the epochs, in the
    same run but none of its epochs, so every epoch stays out of sample; they take this run's own
    speed of the shared machine (which drifts by tens of percent between runs). The model warms
    the caches as the run did: the ``random`` jobs' first epoch on their recorded hosts (their
    placement decides the dataset's members and owners), then the probe. Raises ValueError
    without the probe (:func:`probe_job`) or with a setup made without the run's own dataset and
    node keys (the probe's ids are the run's)."""
    probe = probe_job(report, path, setup.order, kind)
    if setup.node_keys is None:
        raise ValueError(f"{path}: the {kind} probe needs the run's own dataset and node keys")
    # the random jobs only warm the caches for the probe (their time is not used): coarse chunks
    warm = [replace(j, chunk_samples=WARMUP_CHUNK) for j in setup.jobs(report, "random")]
    jobs = warm + [probe]

    def probe_s(cpu_s: float) -> float:
        cpu_s = max(cpu_s, 1e-9)
        peer, local = (cpu_s, 0.0) if kind == "peer" else (max(peer_cpu_s, 1e-9), cpu_s)
        res = simulate(
            netns_params(
                report, local_s, peer, link_factor, setup.node_keys, setup.peak_Bps, local_cpu_s=local, training=False
            ),
            setup.workload,
            "random",
            jobs,
            1,
            together=False,
        )
        return res[-1].seconds

    meas = float(report[f"{kind}_probe"]["seconds"])
    cpu_s = _solve(probe_s, meas, 0.0, hi_s)
    reads = sum(len(x) for x in probe.plans or [])
    return Calibrated(
        cpu_s,
        f"{path}: fitted to its {kind} probe ({probe.world} ranks, {reads} {kind} reads, "
        f"{meas:.2f} s, after the epochs) with {report['machine']['cores']} cores shared by "
        "all hosts; no epoch of the run is in it",
    )


#: Samples per model chunk of the jobs that only warm the caches before a probe (:func:`fit_probe_cpu`).
WARMUP_CHUNK = 64

#: The most processes a rank's start-up is taken to keep busy (:func:`fit_starting`).
MAX_STARTING_PROCESSES = 4


def fit_starting(
    report: dict, path: str, local_s: float, link_factor: float, setup: NetnsSetup, most: int = MAX_STARTING_PROCESSES
) -> tuple[Calibrated, Calibrated]:
    """``(starting processes, peer CPU s)`` fitted together on the report's warm ``random`` epochs:
    for k = 0, 1, ... ``most`` starting processes (:class:`stoker_lab.sim.model.Params`), the peer CPU
    cost that makes the mean epoch exact (:func:`fit_peer_cpu`), and of those the k whose epochs'
    log errors have the least sum of squares (k rises while that sum falls). A report without
    ``rank_start_s``, or whose ranks start at a gate (``config.rank_start``, bench/start_gate.py:
    every rank's start-up is over before any clock starts), gives k = 0. Raises ValueError
    without warm random epochs."""
    meas = np.array([r["seconds"] for r in _warm_random(report)])
    if not setup.starts or "gate" in str(report.get("config", {}).get("rank_start", "")):
        why = (
            "its ranks start their clocks together at a gate, after every rank has started"
            if setup.starts
            else "no rank_start_s (every rank starts at once)"
        )
        return (Calibrated(0, f"{path}: {why}"), fit_peer_cpu(report, path, local_s, link_factor, setup=setup))
    tried: list[tuple[float, int, Calibrated]] = []
    for k in range(most + 1):
        cpu = fit_peer_cpu(report, path, local_s, link_factor, setup=setup, starting_processes=k)
        pred = _warm_random_s(report, local_s, cpu.value, link_factor, setup, k)
        tried.append((float((np.log(pred / meas) ** 2).sum()), k, cpu))
        if len(tried) > 1 and tried[-1][0] >= tried[-2][0]:
            break
    score, k, cpu = min(tried, key=lambda t: t[0])
    rms = ", ".join(f"{kk}: {(sc / len(meas)) ** 0.5:.1%}" for sc, kk, _ in tried)
    return (
        Calibrated(
            k,
            f"{path}: fitted with the peer CPU on its {len(meas)} warm random epochs: of "
            f"0..{most} processes, the one with the least squared log errors (rms by k: {rms}); "
            "this run is the calibration run",
        ),
        cpu,
    )


#: The processes of a ``stoker demo`` run whose CPU time goes with the bytes fetched from the origin.
FETCH_PROCESSES = ("prefetch", "origin_emulator")


def demo_fetch_cpu(demo: dict, demo_path: str, consumer_rate: float) -> Calibrated:
    """CPU seconds per byte fetched from the origin in a ``stoker demo`` run, from its ``cpu_s``
    records: the prefetcher's and the local origin emulator's CPU seconds in a cold epoch, less
    their mean in the warm epochs (no origin bytes), over the cold epoch's origin bytes. Taken
    from the runs at the *other* consumer rates (out of sample for ``consumer_rate``; all runs if
    there are none); 0 when the report has no ``cpu_s``."""
    runs = [r for r in demo["runs"] if r["loader"] == "stoker" and "cpu_s" in r]
    others = [r for r in runs if r["consumer_rate"] != consumer_rate] or runs
    vals = []
    for rate in dict.fromkeys(r["consumer_rate"] for r in others):
        mine = [r for r in others if r["consumer_rate"] == rate]
        cold = [r for r in mine if r["origin_bytes"] > 0]
        warm = [r for r in mine if r["origin_bytes"] == 0]
        if not cold or not warm:
            continue
        base = sum(sum(r["cpu_s"].get(k, 0.0) for k in FETCH_PROCESSES) for r in warm) / len(warm)
        vals += [(sum(r["cpu_s"].get(k, 0.0) for k in FETCH_PROCESSES) - base) / r["origin_bytes"] for r in cold]
    if not vals:
        return Calibrated(0.0, f"{demo_path}: no cpu_s of a cold and a warm epoch (fetching costs no decode time)")
    rates = sorted({r["consumer_rate"] for r in others})
    return Calibrated(
        max(0.0, sum(vals) / len(vals)),
        f"{demo_path}: cpu_s of {' + '.join(FETCH_PROCESSES)} in the cold epoch less the warm epochs' "
        f"mean, per origin byte, runs at consumer rate {', '.join(f'{x:g}' for x in rates)} "
        f"(on the same {demo['machine']['cores']} cores as the decode workers)",
    )


def demo_params(
    demo: dict, decode_bench: dict | None, decode_path: str, demo_path: str, consumer_rate: float
) -> tuple[Params, dict[str, Calibrated]]:
    """:class:`Params` of a ``stoker demo`` report: one node, one rank with ``workers`` decode
    cores at the demo's own single-process decode rate times the pipeline efficiency of
    ``stoker bench decode`` (its loader rate / (workers x its per-core rate)); the origin's
    bandwidth and latency; Loader defaults for fetching (8 ranged GETs in flight, 512 MiB ahead);
    fetching's CPU on the same cores (:func:`demo_fetch_cpu`).
    Returns the parameters and the calibrated values they came from."""
    cfg, origin = demo["config"], demo["origin"]
    workers = int(cfg["workers"])
    per_core = Calibrated(
        demo["limits"]["decode_per_core"],
        f"{demo_path}: limits.decode_per_core (single process, from memory, same files)",
    )
    eff = Calibrated(1.0, "none (no stoker bench decode report)")
    if decode_bench:
        row = min(decode_bench["loader"], key=lambda r: abs(r["workers"] - workers))
        eff = Calibrated(
            row["samples_per_s"] / (row["workers"] * decode_bench["per_core"]["stoker"]),
            f"{decode_path}: loader samples/s with {row['workers']} workers / ({row['workers']} x per_core.stoker)",
        )
    mean = demo["dataset"]["bytes"] / demo["dataset"]["samples"]
    chunk = int(cfg["batch_size"])
    p = Params(
        nodes=1,
        cache_bytes=float(1 << 40),  # the demo's cache holds the dataset
        origin_Bps=origin["bandwidth_MBps"] * 1e6,
        origin_latency_s=origin["latency_ms"] / 1e3,
        decode_cores=workers,
        decode_rate=per_core.value * eff.value,
        gpu_rate=consumer_rate,
        origin_concurrency=8,
        prefetch_chunks=max(1, int((512 << 20) / (chunk * mean))),
        chunk_samples=chunk,
    )
    fetch = demo_fetch_cpu(demo, demo_path, consumer_rate)
    p.fetch_cpu_s_per_byte = fetch.value
    return p, {
        "decode_per_core": per_core,
        "pipeline_efficiency": eff,
        f"fetch CPU s per byte, consumer {consumer_rate:g}": fetch,
    }


def demo_workload(demo: dict) -> Workload:
    """The demo's dataset (samples, bytes; its shard and block sizes) by :func:`synthetic`."""
    ds, cfg = demo["dataset"], demo["config"]
    return synthetic(ds["samples"], ds["bytes"], cfg["shard_bytes"], cfg["block_bytes"], name="demo")
