"""Token buckets on the links of a :class:`stoker_lab.sim.network.FlowNetwork` (Linux ``tbf``).

The namespace cluster of ``stoker bench cluster --netns`` shapes every link with ``tbf`` and a
bucket of 10 ms of its rate (:func:`stoker_lab.bench.netcluster.burst_bytes`). A link that is busy
less than its rate on average thus passes a short transfer (a 65 KB sample) at once instead of at
the rate; a plain rate limit would charge every sample ``bytes / rate``.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np


class _Links(Protocol):
    """What the buckets use of a :class:`stoker_lab.sim.network.FlowNetwork` (named structurally, so
    this module does not import the network module that imports it)."""

    index: dict[str, int]
    capacity: np.ndarray

    def link_use(self, links: np.ndarray) -> np.ndarray: ...


class TokenBuckets:
    """The token buckets of a :class:`FlowNetwork`'s shaped links (its ``buckets`` argument).

    A fluid token bucket (the Linux ``tbf`` qdisc without a peak rate, whose packets leave at the
    device's speed while tokens last): link ``l`` with token rate ``r`` (its capacity) and bucket
    ``B`` bytes holds ``T`` tokens, ``dT/dt = r - use`` kept in ``[0, B]``; its capacity is the
    peak while ``T > 0`` and ``r`` once ``T = 0``. Over any interval of ``t`` seconds the link thus
    passes at most ``B + r t`` bytes, as a token bucket does. A bucket that fills again raises the
    capacity at the next recomputation: a link not full at ``r`` is no flow's bottleneck, so its
    larger capacity changes no max-min rate until then (exact, not an approximation).
    """

    #: A bucket holding at most this fraction of its bytes is empty (rounding of the clock).
    EMPTY = 1e-9

    def __init__(self, net: _Links, buckets: dict[str, tuple[float, float]]):
        """``net``: the network whose links ``buckets`` (``{link: (bytes, peak bytes/s)}``) shape;
        their capacities become the peaks (the buckets start full). Raises ValueError for a
        bucket of no bytes, a peak under the link's rate or an unlimited link."""
        self.net = net
        self.links = np.array([net.index[k] for k in buckets], dtype=np.int64)
        self.size = np.array([float(b) for b, _ in buckets.values()])
        self.peak = np.array([float(p) for _, p in buckets.values()])
        self.rate = net.capacity[self.links].copy()
        if (self.size <= 0).any() or (self.peak < self.rate).any() or not np.isfinite(self.rate).all():
            raise ValueError(
                f"token buckets {list(buckets)}: need bytes > 0, a peak >= the link's rate and a finite rate"
            )
        self.tokens = self.size.copy()  # full at the start
        self.use = np.zeros(len(self.links))
        net.capacity[self.links] = self.peak

    def advance(self, dt: float) -> None:
        """``dt`` seconds at the current use: tokens accrue at ``rate - use``, kept in [0, size]."""
        self.tokens = np.clip(self.tokens + (self.rate - self.use) * dt, 0.0, self.size)

    def set_capacities(self) -> list[int]:
        """Each link's capacity from its tokens (peak, or the rate once empty); returns the indices
        of the links whose capacity changed."""
        want = np.where(self.tokens > self.EMPTY * self.size, self.peak, self.rate)
        changed = want != self.net.capacity[self.links]
        self.net.capacity[self.links] = want
        return self.links[changed].tolist()

    def rates_changed(self) -> None:
        """Take the links' use at the new rates (bytes/s)."""
        self.use = self.net.link_use(self.links)

    def _draining(self) -> np.ndarray:
        return (self.net.capacity[self.links] > self.rate) & (self.use > self.rate * (1 + 1e-12))

    def next_dry_s(self) -> float:
        """Seconds until the first draining bucket is empty at the current use (inf: none drains)."""
        d = self._draining()
        if not d.any():
            return np.inf
        return float((self.tokens[d] / (self.use[d] - self.rate[d])).min())

    def empty_the_draining(self, within_s: float) -> None:
        """Empty every bucket that runs dry within ``within_s`` seconds (below the clock's resolution)."""
        d = self._draining()
        soon = np.zeros(len(d), dtype=bool)
        soon[d] = self.tokens[d] / (self.use[d] - self.rate[d]) <= within_s
        self.tokens[soon] = 0.0
