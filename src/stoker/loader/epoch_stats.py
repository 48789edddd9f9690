"""Per-epoch statistics of the loader: what one epoch of one rank did, from the counters of
its processes (workers, prefetcher) and its own clock."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from .._procs import stat_fields

log = logging.getLogger(__name__)


@dataclass
class EpochStats:
    """What one epoch of one rank did. Times in seconds, bytes in bytes; ``as_dict()`` gives a dict.

    ``epoch`` (index); ``seconds`` (s, wall time from the epoch's ``iter()`` to its last batch);
    ``wait_s`` (s blocked in ``next()``); ``samples_per_s`` (samples/s); ``origin_bytes`` (bytes
    received from the origin by every process of the loader), ``origin_requests`` (ranged GETs)
    and ``origin_retries`` (requests that failed and were sent again); ``cache_hits`` /
    ``cache_misses`` (sample reads served by the node cache / not), ``cache_hit_ratio`` (0-1),
    ``memory_hits`` (hits served by the shared-memory tier), ``memory_promotions`` (blocks read
    from the disk tier and copied into the memory tier, :mod:`stoker.cache.promote`); ``prefetch_fills`` (blocks the
    prefetcher admitted to the cache), ``prefetch_staged`` (blocks it fetched just in time into
    staging), ``staged_reused`` (blocks still staged for the previous epoch's last batches, used
    instead of fetched again), ``prefetch_depth_bytes`` (mean bytes ready ahead of the consumer),
    ``staged_hits`` (samples read from staged blocks), ``direct_reads`` (samples read from the
    origin one by one); ``evictions`` (blocks), ``corrupt_blocks`` (cached blocks that failed a
    checksum, dropped and fetched again); ``skipped`` (samples) and ``skipped_keys`` (their keys,
    the first 100); ``padded`` (samples) and ``padded_keys`` (their keys, the first 100): the
    substitutes decoded in place of a batch whose every sample was skipped, so that every rank
    yields the same number of batches (:mod:`stoker.loader.workers.padding`); ``order_displacement``
    (mean move in positions of the cache-aware order, ``ReadOptions.cache_aware_window``);
    ``derived_hits`` / ``derived_fills`` (samples decoded from / written to the derived-sample
    cache) and ``derived_same`` (samples whose entry says "use the raw sample");
    ``shm_batches`` / ``pickled_batches`` (user-collated batches whose arrays moved
    through shared memory / pickled whole, having no array) and ``pickled_bytes`` (bytes pickled).
    ``sources``: for a loader over a mixture (:func:`stoker.mix`), per source name a dict of that
    source's ``samples``, ``batches``, ``origin_bytes``, ``cache_hits``, ``cache_misses``,
    ``cache_hit_ratio`` and ``skipped`` this epoch (the fields above are their sums); empty otherwise.

    ``samples`` / ``batches``: the planned samples and the batches yielded to the consumer (a
    sample skipped with ``on_error="skip"`` is counted in ``skipped`` instead, and a substitute in
    ``padded``: ``samples + skipped`` is the rank's plan; with several ranks a batch whose samples
    were all skipped is yielded with substitutes, so ``batches`` is the planned count under any
    ``on_error``; a loader of one rank yields no such batch, so ``batches`` is short by them).

    ``stall_fraction`` = time blocked in ``next()`` / wall time of the epoch (data stall): the
    share of time the training step waits for data. A loop that does nothing between batches
    waits for every one, so its stall is near 1 whatever the loader's speed (docs/stats.md).
    ``exactly_once``: the delivered sample ids equal the rank's plan less the samples skipped as
    undecodable (``skipped``), as a multiset (for world_size 1: every decodable sample exactly
    once; substitutes are not delivered samples); False for an epoch that delivers no sample of
    a dataset that has some, whose ``empty_reason`` says why (:func:`why_empty`: ``drop_last``
    with fewer samples than a batch, more ranks than samples with ``even="drop"``; "" otherwise).
    ``cpu_s``: CPU seconds used in the epoch by the training process (``main``), the decode ``workers`` and the
    ``prefetch`` process (Linux /proc; empty elsewhere; a replaced process's CPU time is not
    counted). ``decode_cpu_s``: CPU seconds inside the decode (the built-in decode + transform, or the
    user's per-sample ``decode=``), summed over the processes that decode (``time.thread_time``
    around each sample's decode: threads the decode hands work to are not counted).
    ``worker_restarts`` / ``prefetcher_restarts``: processes that died (a signal, a
    crash) and were replaced, within the bounds of :mod:`stoker.loader.workers.pool` and
    :mod:`stoker.loader.prefetch.prefetcher`.

    Origin bytes, requests, fills and staged blocks of the prefetcher are charged to the epoch
    whose samples they serve first (its work for the next epoch while this one drains counts
    there: :mod:`stoker.loader.prefetch.inflight`), so a warm epoch shows only what it read itself.

    Cold-start and overlap figures (names kept stable for metrics exporters):

    - ``first_batch_s``: seconds from ``iter()`` to the first batch delivered (0.0 when none was),
      not counting the pipeline's one-time start: ``pipeline_start_s`` (processes, shared memory,
      torch's import; 0.0 for every epoch after the first of a started pipeline).
    - ``origin_busy_fraction``: share of the epoch's wall time with at least one prefetch request
      in flight to the origin (the prefetcher's own clock; 0.0 without one).
    - ``inflight_requests``: mean prefetch requests in flight while any was (request-seconds /
      busy seconds); ``inflight_target``: the requests the prefetcher keeps in flight at the end
      of the epoch, from the measured bandwidth-delay product; ``origin_latency_s`` and
      ``origin_bandwidth_Bps``: the estimates it came from (0 before any was measured).
    - ``overlap_efficiency`` = max(origin_bytes / origin_bandwidth_Bps, decode seconds) /
      ``seconds``: how close the epoch came to the slower of its two limits (the design notes'
      definition). Here the decode seconds are the workers' CPU seconds / ``num_workers`` (the
      time decoding needs with every worker busy) and the bandwidth is the measured estimate;
      benchmarks recompute it with calibrated limits.
    """

    epoch: int
    samples: int = 0
    batches: int = 0
    seconds: float = 0.0
    wait_s: float = 0.0
    stall_fraction: float = 0.0
    samples_per_s: float = 0.0
    origin_bytes: int = 0
    origin_requests: int = 0
    origin_retries: int = 0  # origin requests that failed and were sent again (every process)
    cache_hits: int = 0
    cache_misses: int = 0
    cache_hit_ratio: float = 0.0
    prefetch_fills: int = 0  # blocks the prefetcher admitted to the cache
    prefetch_staged: int = 0  # blocks it fetched from the origin into staging (not admitted)
    staged_reused: int = 0  # blocks still staged for the previous epoch's last batches, used again
    prefetch_depth_bytes: float = 0.0  # mean bytes fetched and ready ahead of the consumer
    staged_hits: int = 0  # samples read from staged blocks
    memory_hits: int = 0  # cache hits served by the shared-memory tier (when there is one)
    memory_promotions: int = 0  # blocks read from the disk tier and copied into the memory tier
    direct_reads: int = 0  # samples read from the origin one by one (nothing ahead of them)
    evictions: int = 0
    corrupt_blocks: int = 0
    skipped: int = 0
    skipped_keys: list = field(default_factory=list)
    padded: int = 0  # substitutes yielded for batches whose every sample was skipped (not in samples)
    padded_keys: list = field(default_factory=list)  # their keys, the first 100
    exactly_once: bool = False
    empty_reason: str = ""  # why the epoch delivered no sample of a dataset that has some ("" otherwise)
    cpu_s: dict = field(default_factory=dict)  # CPU seconds this epoch: main, workers, prefetch
    decode_cpu_s: float = 0.0  # CPU seconds inside the decode (built-in or the user's per-sample decode=)
    order_displacement: float = 0.0  # mean move (positions) of the cache-aware order
    derived_hits: int = 0  # samples decoded from their derived form (cache_form)
    derived_fills: int = 0  # derived entries written this epoch
    derived_same: int = 0  # samples whose derived entry says "use the raw sample" (within the cap)
    worker_restarts: int = 0  # dead decode workers replaced this epoch (their batches decoded again)
    prefetcher_restarts: int = 0  # dead prefetch processes replaced this epoch
    shm_batches: int = 0  # user-collated batches whose arrays/tensors moved through shared memory
    pickled_batches: int = 0  # user-collated batches pickled whole through a pipe (no array in them)
    pickled_bytes: int = 0  # bytes pickled: those batches + the non-array leaves of shm_batches
    sources: dict = field(default_factory=dict)  # a mixture's loader: per source name, its own figures
    first_batch_s: float = 0.0  # iter() to the first batch delivered (pipeline start excluded)
    pipeline_start_s: float = 0.0  # seconds iter() spent starting the pipeline (its first epoch only)
    overlap_efficiency: float = 0.0
    origin_busy_fraction: float = 0.0
    inflight_requests: float = 0.0  # mean prefetch requests in flight while busy
    inflight_target: int = 0  # requests in flight the prefetcher aims for (bandwidth-delay product)
    origin_latency_s: float = 0.0  # shortest prefetch request seen (an estimate of the origin's latency)
    origin_bandwidth_Bps: float = 0.0  # highest aggregate prefetch rate measured

    def as_dict(self) -> dict:
        return asdict(self)


def why_empty(num_samples: int, world_size: int, even: str, batch_size: int, drop_last: bool) -> str:
    """Why every epoch of a rank delivers no sample of a dataset of ``num_samples`` samples
    (rank split ``even`` over ``world_size`` ranks, :func:`stoker.order.rank_plan`; then
    ``drop_last`` with ``batch_size``), or "" when it delivers some (or the dataset has none)."""
    if num_samples <= 0:
        return ""
    per_rank = -(-num_samples // world_size) if even == "pad" else num_samples // world_size
    if per_rank == 0:
        return (
            f'even="drop" splits {num_samples} sample(s) over {world_size} ranks: every rank gets '
            f'{per_rank} (use even="pad", or fewer ranks)'
        )
    if drop_last and per_rank < batch_size:
        where = "the dataset's" if world_size == 1 else "this rank's"
        return (
            f"drop_last=True drops {where} only batch: {per_rank} sample(s), fewer than batch_size "
            f"{batch_size} (use drop_last=False, or a smaller batch_size)"
        )
    return ""


def account(stats: EpochStats, bids, skipped, skipped_keys, delivered: list, padded=()) -> None:
    """Count one finished batch: ``bids`` its planned sample ids, ``skipped`` the ids a
    worker skipped (``on_error="skip"``) with their keys, each a key or ``(key, reason)``; a
    reason is logged here, when the batch is delivered, so a batch decoded ahead for an epoch
    that never runs logs nothing. ``padded``: the ``(sample id, key)`` of the substitutes
    decoded because every sample of the batch was skipped (:mod:`stoker.loader.workers.padding`):
    counted in ``padded`` and logged, not delivered. The ids actually delivered are appended to
    ``delivered`` (a list of int64 arrays, counted once at the epoch's end: this runs in
    ``next()`` for every batch), and the skipped ids ``i`` as ``-1 - i`` (no longer owed:
    :func:`fill_from_counters`)."""
    if skipped_keys and any(isinstance(k, tuple) for k in skipped_keys):
        for k in skipped_keys:
            if isinstance(k, tuple):
                log.warning("skipping sample (epoch %d): %s", stats.epoch, k[1])
        skipped_keys = [k[0] if isinstance(k, tuple) else k for k in skipped_keys]
    if skipped:
        left, kept = list(skipped), []
        for i in bids.tolist():  # drop one occurrence per skip (a padded plan may repeat an id)
            if i in left:
                left.remove(i)
            else:
                kept.append(i)
        keep = np.asarray(kept, dtype=np.int64)
        stats.skipped += len(skipped)
        stats.skipped_keys.extend(skipped_keys[: max(0, 100 - len(stats.skipped_keys))])
    else:
        keep = bids
    if padded:
        keys = [k for _, k in padded]
        stats.padded += len(padded)
        stats.padded_keys.extend(keys[: max(0, 100 - len(stats.padded_keys))])
        log.warning(
            "every sample of a batch of epoch %d was skipped (%s): %d substitutes decoded in its place, so that "
            "every rank yields the same number of batches (%s%s)",
            stats.epoch,
            ", ".join(map(str, skipped_keys[:4])) + (", ..." if len(skipped_keys) > 4 else ""),
            len(padded),
            ", ".join(map(str, keys[:4])),
            ", ..." if len(keys) > 4 else "",
        )
    delivered.append(np.asarray(keep, dtype=np.int64))
    if skipped:  # owed no more: exactly_once is over the samples that decode (fill_from_counters)
        delivered.append(-1 - np.asarray(skipped, dtype=np.int64))
    stats.samples += len(keep)
    stats.batches += 1 if len(keep) or len(padded) else 0


def fill_from_counters(
    stats: EpochStats, d: dict, wait_s: float, ids: np.ndarray, delivered: list, num_samples: int
) -> None:
    """Set the counter-derived fields of ``stats`` from ``d`` (the epoch's change of the
    summed process counters: origin_*, cache_*, read_*, prefetch_*, derived_*), the
    seconds blocked in ``next()`` and the plan ``ids`` less the skipped ones against the
    ``delivered`` ids (the arrays :func:`account` collected: ``exactly_once``).
    ``stats.seconds`` must be set already."""
    stats.wait_s = wait_s
    stats.origin_bytes = d.get("origin_bytes", 0)
    stats.origin_requests = d.get("origin_requests", 0)
    stats.origin_retries = d.get("origin_retries", 0)
    stats.cache_hits = d.get("cache_hits", 0)
    stats.memory_hits = d.get("cache_memory_hits", 0)
    stats.memory_promotions = d.get("cache_promotions", 0)
    stats.cache_misses = d.get("cache_misses", 0)
    stats.prefetch_fills = d.get("prefetch_fills", 0)
    stats.prefetch_staged = d.get("prefetch_staged", 0)
    stats.staged_reused = d.get("staged_reused", 0)
    n_depth = d.get("prefetch_depth_n", 0)
    stats.prefetch_depth_bytes = d.get("prefetch_depth_sum", 0) / n_depth if n_depth else 0.0
    stats.staged_hits = d.get("read_staged_hits", 0)
    stats.direct_reads = d.get("read_direct_reads", 0)
    stats.evictions = d.get("cache_evictions", 0)
    stats.corrupt_blocks = d.get("cache_corrupt", 0)
    stats.derived_hits, stats.derived_fills = d.get("derived_hits", 0), d.get("derived_fills", 0)
    stats.derived_same = d.get("derived_same", 0)
    stats.decode_cpu_s = d.get("decode_cpu_us", 0) / 1e6
    reads = stats.cache_hits + stats.cache_misses
    stats.cache_hit_ratio = stats.cache_hits / reads if reads else 0.0
    stats.stall_fraction = wait_s / stats.seconds if stats.seconds else 0.0
    stats.samples_per_s = stats.samples / stats.seconds if stats.seconds else 0.0
    every = np.concatenate(delivered) if delivered else np.zeros(0, np.int64)
    got = np.bincount(every[every >= 0], minlength=num_samples)
    expected = np.bincount(ids, minlength=num_samples) if len(ids) else np.zeros(num_samples, np.int64)
    expected -= np.bincount(-1 - every[every < 0], minlength=num_samples)  # skipped: not decodable
    stats.exactly_once = bool(np.array_equal(got, expected))


def fill_origin_figures(stats: EpochStats, d: dict, ledger: dict, num_workers: int) -> None:
    """Set the busy fraction, requests in flight and overlap efficiency of ``stats`` from the
    epoch's counter changes ``d`` (``origin_busy_us``, ``origin_request_us``) and the prefetcher's
    ``ledger`` figures (``inflight_target``, ``origin_latency_us``, ``origin_bandwidth_Bps``).
    ``stats.seconds`` and ``stats.cpu_s`` must be set already."""
    busy_s, request_s = d.get("origin_busy_us", 0) / 1e6, d.get("origin_request_us", 0) / 1e6
    stats.origin_busy_fraction = min(1.0, busy_s / stats.seconds) if stats.seconds else 0.0
    stats.inflight_requests = request_s / busy_s if busy_s else 0.0
    stats.inflight_target = int(ledger.get("inflight_target", 0))
    stats.origin_latency_s = ledger.get("origin_latency_us", 0) / 1e6
    stats.origin_bandwidth_Bps = float(ledger.get("origin_bandwidth_Bps", 0))
    stats.overlap_efficiency = overlap_efficiency(
        stats.seconds,
        stats.origin_bytes,
        stats.origin_bandwidth_Bps,
        stats.cpu_s.get("workers", stats.cpu_s.get("main", 0.0)) / max(1, num_workers),
    )


def overlap_efficiency(seconds: float, origin_bytes: int, bandwidth_Bps: float, decode_s: float) -> float:
    """max(origin_bytes / bandwidth_Bps, decode_s) / seconds: how close a pipeline that moved
    ``origin_bytes`` bytes at ``bandwidth_Bps`` bytes/s and needed ``decode_s`` seconds of decoding
    (samples / decode bound) came to the slower of the two limits in ``seconds`` of wall time
    (stoker's design notes, "Measuring"). 0.0 when ``seconds`` is 0; a term with no bandwidth
    counts as 0."""
    if not seconds:
        return 0.0
    transfer_s = origin_bytes / bandwidth_Bps if bandwidth_Bps else 0.0
    return max(transfer_s, decode_s) / seconds


def process_cpu_s(pid: int | None) -> float:
    """User+system CPU seconds of a process (None = this one); 0.0 where /proc is missing."""
    if pid is None:
        return time.process_time()
    fields = stat_fields(pid)
    try:
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK") if fields else 0.0
    except (IndexError, ValueError):
        return 0.0
