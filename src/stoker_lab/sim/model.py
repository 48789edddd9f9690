"""The cluster model: ranks reading their plans through node caches, peers and the origin.

A discrete-event simulation on SimPy. Each rank walks its plan (from :mod:`stoker_lab.sim.decide`)
in chunks of ``chunk_samples`` consecutive samples. For a chunk it classifies every sample the
way stoker's read path serves it: a hit in the node cache (``local``); a block cached on its
owner, another node (``peer``, one request per sample, the sample's bytes); a block cached
nowhere (a fill: its owner, or with ``direct`` the rank's own node, fetches the whole block from
the origin, one request, the block's bytes); a block that does not fit in its cache (the sample's
range from the origin, one request). Blocks are never evicted (stoker's policy inside one
dataset; :mod:`stoker.cache.policy`).

A chunk costs request latency (``ceil(requests / concurrency) * latency`` per kind) and one
flow (:class:`stoker_lab.sim.network.FlowNetwork`) over the origin link, the NICs (each direction)
and the cache read bandwidths it touches: one after the other when a rank has one request in
flight at a time (concurrency 1: each request waits for its bytes), at the same time otherwise
(pipelined requests hide their latency behind earlier bytes); at most ``fetch_inflight`` chunks
of a rank are fetched at once. Then decode: the node's ``decode_cores x decode_rate`` samples/s
shared by the chunks of its ranks like a link (a rank's workers decode a chunk's samples in
parallel; its chunks one after the other, in order), then the accelerator (``chunk / gpu_rate`` seconds). At most
``prefetch_chunks`` chunks of a rank are in flight (fetching or decoding) ahead of its
accelerator. Ranks of a job start an epoch together, or each at its own offset (``Job.start_s``:
a measured run's start-up skew; a rank's fetches and CPU work begin at its start). A rank's
seconds run from its own start to its end, and the epoch's are the largest of them (the slowest
rank: DDP waits for it; a measured run times each rank's own loop the same way); GPU utilisation
= (samples per rank / gpu_rate) / epoch seconds.

CPU work is a flow of its own on the cores it runs on (never one flow with bytes: a flow's max-min
rate is in the unit of its largest part). Where every node shares one machine (the namespace
emulation), ``machine_cores`` cores that every peer request takes ``peer_cpu_s`` of; where the
origin and the prefetcher run on the decode cores' machine (``stoker demo``),
``fetch_cpu_s_per_byte`` of each fetched byte on those cores; a rank that starts late is being
started until then, ``starting_processes`` shares of the shared cores. Shaped links (the emulation's
``tbf``) can be token buckets (``link_peak_Bps``). Not modelled: TCP slow start and loss,
stragglers, the per-step all-reduce.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import simpy

from .decide import ClusterState, Placement, dataset_budget, epoch_plans, place_job
from .network import FlowNetwork
from .workload import Workload

INF = math.inf
#: The kinds of link the report counts bytes on.
LINK_KINDS = ("origin", "host_to_host", "local")


@dataclass
class Params:
    """The simulated cluster. Rates in bytes/s or samples/s, times in seconds, sizes in bytes.

    ``nodes``; ``slots_per_node``: ranks (accelerators) per node, None = no limit;
    ``gpu_rate``: samples/s one accelerator consumes (0 = takes no time); ``decode_cores`` and
    ``decode_rate`` (samples/s per core; 0 cores = no decode); ``cache_bytes`` per node;
    ``cache_read_Bps`` per node; ``nic_Bps`` per node and direction; ``origin_Bps``: the
    origin's aggregate bandwidth; ``origin_latency_s`` per request and ``origin_concurrency``
    requests in flight per rank; ``peer_latency_s``/``peer_concurrency`` the same for a peer
    read; ``local_latency_s`` per sample read from the node cache; ``prefetch_chunks`` and
    ``chunk_samples`` as in the module docstring; ``fetch_inflight``: chunks of a rank fetched
    at once (stoker's prefetcher fetches in order of need); ``order``/``window``/``seed``: the epoch
    order (:func:`stoker.order.permutation`). ``machine_cores`` (0 = none) and ``peer_cpu_s``: CPU
    seconds each peer request costs (client and serving process together) on cores that every
    node shares, as the namespace emulation's hosts share one machine: the requests in flight
    share the cores like a link (0 cores: no such term). ``node_keys``: each node's placement key
    (the name the cluster places blocks by; default ``node000``...), so that a model of a measured
    cluster places the blocks where that cluster did. ``nic_bucket_bytes``/``origin_bucket_bytes``
    with ``link_peak_Bps`` > 0: the NICs and the origin link are token buckets of those bytes
    (Linux ``tbf``, :class:`stoker_lab.sim.network.TokenBuckets`) passing ``link_peak_Bps`` while
    they hold tokens; 0: plain rate limits. ``fetch_cpu_s_per_byte``: CPU seconds each byte
    fetched from the origin costs on the fetching node's decode cores (the prefetcher's reads and
    cache writes, and an origin served from the same machine, as in ``stoker demo``): the fetch
    and the decode share those cores (0: fetching costs no decode time). ``starting_processes``:
    CPU-bound processes a rank's start-up keeps busy on the shared machine's cores (needs
    ``machine_cores``) from its epoch's first rank start until its own start (``Job.start_s``): a
    rank that starts late is still being started (a Ray worker process, its setup) while the
    others read, and takes that many shares of the cores from them (0: starting costs nothing).
    ``request_cores``: the most of the shared cores one rank's peer request can use at once (1:
    its client and its server code run one after the other, each on one core; 0: no limit, a
    lone request may take every core). ``local_cpu_s``: CPU seconds a cluster rank's read from
    its own node cache costs on the shared cores (the cluster read path: block router, byte
    counters; not in the ``direct`` setup, whose reads ``local_latency_s`` covers).
    ``decode_cpu_s``: CPU seconds each sample's decode costs on the shared cores (needs
    ``machine_cores``), in the rank's own process after the sample is fetched (its lane, as its
    requests: a rank decodes on one core at a time); 0: no such decode (the per-node decode
    cores, ``decode_cores``, are apart).
    """

    nodes: int
    cache_bytes: float
    origin_Bps: float
    nic_Bps: float = INF
    cache_read_Bps: float = INF
    slots_per_node: int | None = None
    gpu_rate: float = 0.0
    decode_cores: int = 0
    decode_rate: float = 0.0
    origin_latency_s: float = 0.0
    origin_concurrency: int = 1
    peer_latency_s: float = 0.0
    peer_concurrency: int = 1
    local_latency_s: float = 0.0
    prefetch_chunks: int = 1
    fetch_inflight: int = 1
    chunk_samples: int = 16
    order: str = "blockwise"
    window: int = 16
    seed: int = 0
    machine_cores: float = 0.0
    peer_cpu_s: float = 0.0
    node_keys: list[str] | None = None
    nic_bucket_bytes: float = 0.0
    origin_bucket_bytes: float = 0.0
    link_peak_Bps: float = 0.0
    fetch_cpu_s_per_byte: float = 0.0
    starting_processes: int = 0
    request_cores: float = 0.0
    local_cpu_s: float = 0.0
    decode_cpu_s: float = 0.0


@dataclass
class Job:
    """One job: ``world`` ranks; ``seed``: its random placement's seed; ``name``.

    ``rank_nodes``: the node (index) of each rank as a measured run placed them (None: the setup
    draws them, :func:`stoker_lab.sim.decide.place_job`). ``start_s``: ``{epoch: [seconds]}``, each
    rank's start after the epoch's first (a measured run's start-up skew, ``world`` values >= 0);
    an epoch not in it starts every rank at once. ``plans``: each rank's sample ids (``world``
    int arrays), read in every epoch instead of the setup's epoch plans (a measured probe's reads;
    None: :func:`stoker_lab.sim.decide.epoch_plans`). ``chunk_samples``: this job's chunk size
    (None: :class:`Params`' own; e.g. a coarse one for a job that only warms the caches)."""

    name: str
    world: int
    seed: int = 0
    rank_nodes: list[int] | None = None
    start_s: dict[int, list[float]] = field(default_factory=dict)
    plans: list | None = None
    chunk_samples: int | None = None

    def starts(self, epoch: int) -> list[float]:
        """Each rank's start offset in ``epoch``, seconds (zeros when not given). Raises
        ValueError for a list of the wrong length or a negative offset."""
        got = self.start_s.get(epoch)
        if got is None:
            return [0.0] * self.world
        if len(got) != self.world or min(got) < 0:
            raise ValueError(f"job {self.name!r} epoch {epoch}: start offsets {got} are not {self.world} values >= 0")
        return [float(x) for x in got]


@dataclass
class EpochResult:
    """One job's epoch: ``seconds`` (its slowest rank's), ``gpu_utilization`` (None without an
    accelerator rate), ``bytes`` per kind of link (:data:`LINK_KINDS`), ``samples``, ``link_bytes``
    per link, ``decode_s`` core-seconds of decode, ``rank_seconds``: each rank's own seconds (from
    its start to its end), in rank order."""

    job: str
    epoch: int
    seconds: float
    gpu_utilization: float | None
    bytes: dict
    samples: int
    link_bytes: dict = field(default_factory=dict)
    decode_s: float = 0.0
    rank_seconds: list[float] = field(default_factory=list)


def _links(p: Params, lanes: int = 0) -> dict[str, float]:
    caps = {"origin": p.origin_Bps}
    for v in range(p.nodes):
        caps |= {
            f"tx{v}": p.nic_Bps,
            f"rx{v}": p.nic_Bps,
            f"disk{v}": p.cache_read_Bps,
            f"cpu{v}": max(p.decode_cores, 1) * p.decode_rate if p.decode_rate > 0 else INF,
        }
    if p.machine_cores > 0:
        caps["machine_cpu"] = p.machine_cores  # CPU seconds per second
        if p.request_cores > 0:  # each rank's requests, one at a time: at most request_cores at once
            caps |= {f"lane{k}": p.request_cores for k in range(lanes)}
    return caps


def _buckets(p: Params, caps: dict[str, float]) -> dict[str, tuple[float, float]]:
    """The token buckets of the shaped links (``{link: (bytes, peak bytes/s)}``; none without a peak)."""
    if p.link_peak_Bps <= 0:
        return {}
    out = {}
    for link, cap in caps.items():
        size = p.origin_bucket_bytes if link == "origin" else p.nic_bucket_bytes if link[:2] in ("tx", "rx") else 0
        if size > 0 and math.isfinite(cap):
            out[link] = (size, max(p.link_peak_Bps, cap))
    return out


class _Run:
    """Shared state of one simulation: clock, network, caches, decode cores, byte counts."""

    def __init__(self, p: Params, wl: Workload, setup: str, jobs_reading: int, lanes: int = 0):
        self.p, self.wl, self.setup = p, wl, setup
        self.env = simpy.Environment()
        caps = _links(p, lanes)
        self.net = FlowNetwork(self.env, caps, buckets=_buckets(p, caps))
        self.state = ClusterState(p.nodes, wl, p.node_keys)
        self.budget = float(dataset_budget(p.cache_bytes, wl, jobs_reading))
        self.counts = dict.fromkeys(LINK_KINDS, 0.0)
        self.decode_s = 0.0
        self.filling: dict[int, simpy.Event] = {}  # a chunk's fills in flight -> fires when they land
        self.fill_of = np.zeros((p.nodes, wl.num_blocks), dtype=np.int64)  # (home, block) -> its key there, 0: none
        self._fills = 0
        ix = self.net.index
        self.rx, self.tx, self.disk = (
            np.array([ix[f"{k}{v}"] for v in range(p.nodes)], dtype=np.int64) for k in ("rx", "tx", "disk")
        )
        self.cpu = np.array([ix[f"cpu{v}"] for v in range(p.nodes)], dtype=np.int64)
        # the decode cores' unit is a sample decoded: a CPU second fetching is decode_rate of them
        self.fetch_cpu = p.fetch_cpu_s_per_byte * p.decode_rate if p.decode_cores > 0 else 0.0
        self.origin, self.machine_cpu = ix["origin"], ix.get("machine_cpu", -1)
        self.lanes = np.array([ix[f"lane{k}"] for k in range(lanes) if f"lane{k}" in ix], dtype=np.int64)

    def _admit(self, node: int, block: int) -> bool:
        """Cache ``block`` on ``node`` if its budget has room (no eviction); True if it did."""
        size = float(self.wl.block_bytes[block])
        if self.state.used_bytes[node] + size > self.budget:
            return False
        self.state.cached[node, block] = True
        self.state.used_bytes[node] += size
        return True

    def chunk_cost(
        self, node: int, ids: np.ndarray, owner: np.ndarray
    ) -> tuple[float, np.ndarray, np.ndarray, list, list, int]:
        """(latency seconds, bytes per link (float64 (links,), by ``self.net.index``), CPU work per
        link (the same shape: CPU seconds on the shared machine's cores, decoded-sample units on a
        node's decode cores), the events of other chunks' fills that these samples wait for, this
        chunk's fills as ``(home, block)``, their key in ``filling`` (0: none)) of reading samples
        ``ids`` on ``node``; updates the caches. A block admitted by another chunk whose bytes have
        not landed is read once they have (the cache fetches a block once; later readers wait)."""
        p, wl, st = self.p, self.wl, self.state
        blk = wl.sample_block[ids]
        size = wl.sample_bytes[ids].astype(np.float64)
        home = np.where(owner[blk] < 0, node, owner[blk])
        vec = np.zeros(len(self.net.names))
        cpu = np.zeros(len(self.net.names))
        miss = ~st.cached[home, blk]
        waits: list = []
        if self.filling:  # one event per chunk whose fills these samples wait for
            keys = self.fill_of[home[~miss], blk[~miss]]
            waits = [self.filling[k] for k in np.unique(keys[keys > 0]).tolist()]
        mine: list[tuple[int, int]] = []
        landed = 0
        if self.budget > 0 and miss.any():  # nothing is ever admitted without a budget: no fill to try
            nb = wl.num_blocks
            u, first = np.unique(home[miss] * nb + blk[miss], return_index=True)
            hs, bs = np.divmod(u[np.argsort(first)], nb)  # in order of need
            fits = wl.block_bytes[bs] <= self.budget - st.used_bytes[hs]  # room only shrinks below
            mine = [(h, b) for h, b in zip(hs[fits].tolist(), bs[fits].tolist(), strict=True) if self._admit(h, b)]
        if mine:  # fills: whole blocks to their homes, from the origin
            self._fills += 1
            landed = self._fills
            self.filling[landed] = self.env.event()
            mh, mb = (np.array(x, dtype=np.int64) for x in zip(*mine, strict=True))
            self.fill_of[mh, mb] = landed
            fill = wl.block_bytes[mb].astype(np.float64)
            vec[self.origin] += float(fill.sum())
            np.add.at(vec, self.rx[mh], fill)
            if self.fetch_cpu:
                np.add.at(cpu, self.cpu[mh], fill * self.fetch_cpu)
            self.counts["origin"] += float(fill.sum())
        nofit = ~st.cached[home, blk]  # no room: the sample's range straight from the origin
        if nofit.any():
            b_nofit = float(size[nofit].sum())
            vec[self.origin] += b_nofit
            vec[self.rx[node]] += b_nofit
            cpu[self.cpu[node]] += b_nofit * self.fetch_cpu
            self.counts["origin"] += b_nofit
        ok = ~nofit
        peer = ok & (home != node)
        local = ok & (home == node)
        n_peer, n_local = int(peer.sum()), int(local.sum())
        self.counts["local"] += float(size[local].sum())
        if n_peer:
            b_peer = float(size[peer].sum())
            self.counts["host_to_host"] += b_peer
            vec[self.rx[node]] += b_peer
            vec[self.tx] += np.bincount(home[peer], weights=size[peer], minlength=p.nodes)
        vec[self.disk] += np.bincount(home[ok], weights=size[ok], minlength=p.nodes)
        n_origin = len(mine) + int(nofit.sum())
        lat = (
            math.ceil(n_origin / p.origin_concurrency) * p.origin_latency_s
            + math.ceil(n_peer / p.peer_concurrency) * p.peer_latency_s
            + n_local * p.local_latency_s
        )
        if p.machine_cores > 0:
            cpu[self.machine_cpu] += n_peer * p.peer_cpu_s
            if self.setup != "direct":
                cpu[self.machine_cpu] += n_local * p.local_cpu_s
        return lat, vec, cpu, waits, mine, landed

    def _land(self, mine: list[tuple[int, int]], landed: int) -> None:
        """A chunk's fills (key ``landed`` in ``filling``) have landed: later readers of those
        blocks read them from now on."""
        if landed:
            mh, mb = (np.array(x, dtype=np.int64) for x in zip(*mine, strict=True))
            self.fill_of[mh, mb] = 0
            self.filling.pop(landed).succeed()

    def _cpu_flow(self, links: np.ndarray, work: np.ndarray, lane: int) -> simpy.Event:
        """A flow of CPU ``work`` on ``links`` (one link); on the shared cores it also takes the
        rank's ``lane`` (at most ``Params.request_cores`` at once), when there is one."""
        if lane >= 0 and len(self.lanes) and links[0] == self.machine_cpu:
            return self.net.transfer_at(np.array([self.machine_cpu, self.lanes[lane]]), np.repeat(work, 2))
        return self.net.transfer_at(links, work)

    def rank(
        self,
        node: int,
        plan: np.ndarray,
        owner: np.ndarray,
        seconds: list,
        index: int,
        start_s: float = 0.0,
        lane: int = -1,
        chunk_samples: int | None = None,
    ):
        """SimPy process of one rank's epoch, begun ``start_s`` seconds from now (nothing of it
        before); sets ``seconds[index]`` to its own seconds, from its start to its end. ``lane``:
        its slot among the ranks running together (its requests' core limit; -1: none);
        ``chunk_samples``: its chunk size (None: ``Params.chunk_samples``)."""
        p, env = self.p, self.env
        if start_s > 0:  # its start-up (a process started for it, its setup) runs until then, on
            starting = []  # the shared cores: never ending by itself (at most start_s x all cores)
            if p.starting_processes > 0 and self.machine_cpu >= 0:
                size = np.array([2 * start_s * p.machine_cores])
                starting = [
                    self.net.transfer_at(np.array([self.machine_cpu]), size) for _ in range(p.starting_processes)
                ]
            yield env.timeout(start_s)
            for flow in starting:
                self.net.stop(flow)
        t0 = env.now
        per_chunk = max(1, int(chunk_samples or p.chunk_samples))
        chunks = [plan[i : i + per_chunk] for i in range(0, len(plan), per_chunk)]
        ready = [env.event() for _ in chunks]
        tokens = simpy.Container(env, capacity=max(1, p.prefetch_chunks), init=max(1, p.prefetch_chunks))
        fetching = simpy.Resource(env, max(1, p.fetch_inflight))
        serial = p.origin_concurrency == 1 and p.peer_concurrency == 1
        decoding = simpy.Resource(env, 1)

        def fetch(c: np.ndarray, done: simpy.Event):
            with fetching.request() as slot:
                yield slot
                lat, vec, cpu, waits, mine, landed = self.chunk_cost(node, c, owner)
                # CPU work is a flow of its own on each set of cores (a flow's max-min rate is in
                # the unit of its largest part: bytes and CPU seconds in one flow would not share)
                on_cpu = np.flatnonzero(cpu)
                if serial:  # one request at a time: each waits for its bytes before the next goes
                    yield env.timeout(lat)
                    if waits:
                        yield env.all_of(waits)
                    if len(on_cpu):
                        yield env.all_of(
                            [
                                self._cpu_flow(on_cpu[k : k + 1], cpu[on_cpu[k : k + 1]], lane)
                                for k in range(len(on_cpu))
                            ]
                        )
                    nz = np.flatnonzero(vec)
                    yield self.net.transfer_at(nz, vec[nz])
                else:  # requests pipelined: the latency of later ones hides behind earlier bytes
                    nz = np.flatnonzero(vec)
                    yield env.all_of(
                        [
                            env.timeout(lat),
                            self.net.transfer_at(nz, vec[nz]),
                            *waits,
                            *(
                                self._cpu_flow(on_cpu[k : k + 1], cpu[on_cpu[k : k + 1]], lane)
                                for k in range(len(on_cpu))
                            ),
                        ]
                    )
                self._land(mine, landed)
            if p.decode_cpu_s > 0 and self.machine_cpu >= 0:  # decoded in the rank's process, on the shared cores
                self.decode_s += len(c) * p.decode_cpu_s
                yield self._cpu_flow(np.array([self.machine_cpu]), np.array([len(c) * p.decode_cpu_s]), lane)
            if p.decode_cores > 0 and p.decode_rate > 0:  # the node's cores, shared like a link;
                with decoding.request() as turn:  # a rank's chunks decode in order
                    yield turn
                    self.decode_s += len(c) / p.decode_rate
                    yield self.net.transfer_at(np.array([self.cpu[node]]), np.array([float(len(c))]))
            done.succeed()

        def feeder():
            for c, done in zip(chunks, ready, strict=True):
                yield tokens.get(1)
                env.process(fetch(c, done))

        env.process(feeder())
        for c, done in zip(chunks, ready, strict=True):
            yield done
            if p.gpu_rate > 0:
                yield env.timeout(len(c) / p.gpu_rate)
            yield tokens.put(1)
        seconds[index] = env.now - t0


def simulate(
    p: Params, wl: Workload, setup: str, jobs: list[Job], epochs: int, together: bool = True
) -> list[EpochResult]:
    """Simulate ``epochs`` epochs of ``jobs`` reading ``wl`` under ``setup`` (see
    :data:`stoker_lab.sim.decide.SETUPS`) on empty caches.

    ``together``: the jobs run each epoch at the same time (sharing links and caches); False:
    one after the other (as ``stoker bench cluster --netns`` runs them). Every job is placed
    once, before its first epoch (jobs placed in list order; on its ``rank_nodes`` when given).
    Each rank starts at its job's ``start_s`` offset for the epoch. Returns one
    :class:`EpochResult` per job and epoch, in run order; the ``bytes`` and ``link_bytes`` of
    jobs run together are those of the whole group in that epoch (the same in each of their
    rows). Raises ValueError for a setup or placement that cannot be made, or bad start offsets.
    """
    lanes = sum(j.world for j in jobs) if together else max((j.world for j in jobs), default=0)
    run = _Run(p, wl, setup, len(jobs), lanes)
    budgets = np.full(p.nodes, run.budget)
    placed: dict[str, Placement] = {}
    out: list[EpochResult] = []
    for e in range(epochs):
        groups = [jobs] if together else [[j] for j in jobs]
        for group in groups:
            marks, procs = {}, {}
            lane = 0  # each rank of the group its own lane
            for j in group:
                if j.name not in placed:
                    placed[j.name] = place_job(
                        setup, run.state, wl, j.world, budgets, j.seed, p.slots_per_node, j.rank_nodes
                    )
                pl = placed[j.name]
                if j.plans is None:
                    plans = epoch_plans(setup, wl, pl, e, p.seed, p.order, p.window)
                elif len(j.plans) != j.world:
                    raise ValueError(f"job {j.name!r}: {len(j.plans)} plans for {j.world} ranks")
                else:
                    plans = [np.asarray(x, dtype=np.int64) for x in j.plans]
                marks[j.name] = (dict(run.counts), dict(run.net.bytes_on), max(len(x) for x in plans), run.decode_s)
                secs_of = procs[j.name] = [0.0] * len(plans)
                for r, (plan, start) in enumerate(zip(plans, j.starts(e), strict=True)):
                    run.env.process(
                        run.rank(int(pl.rank_node[r]), plan, pl.owner, secs_of, r, start, lane, j.chunk_samples)
                    )
                    lane += 1
            run.env.run()  # until every rank of the group is done
            for j in group:
                c0, l0, q, d0 = marks[j.name]
                secs = max(procs[j.name])
                util = (q / p.gpu_rate) / secs if p.gpu_rate > 0 and secs > 0 else None
                out.append(
                    EpochResult(
                        j.name,
                        e,
                        secs,
                        util,
                        {k: run.counts[k] - c0[k] for k in LINK_KINDS},
                        q * j.world,
                        {k: run.net.bytes_on[k] - l0[k] for k in run.net.bytes_on},
                        run.decode_s - d0,
                        list(procs[j.name]),
                    )
                )
    return out
