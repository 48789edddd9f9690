"""Flows sharing links by max-min fairness, on a SimPy clock.

A *link* is any shared rate: a NIC direction, the origin's link, a node's cache read bandwidth
(bytes/s). A *flow* moves given bytes over one or more links at once: ``{link: bytes}``; a chunk
of samples read from the origin, two peers and the local cache is one flow whose bytes on each
link are those of its parts (they are read in parallel and finish together). Its rate ``x`` is
in bytes/s of its largest part, and it loads link ``l`` with ``x * bytes_l / max(bytes)``.

Rates are the max-min fair allocation (Bertsekas & Gallager, *Data Networks*, 2nd ed., 1992,
section 6.5.2, progressive filling): every unfrozen flow's rate grows at the same pace until a
link is full; the flows on it freeze; repeat. TCP flows sharing a bottleneck with equal round
trips approach this split. Rates are recomputed whenever a flow starts or ends (fluid model:
no slow start, no packet loss).

Identical flows are aggregated: flows with the same load on every link (the same path and the
same split of their bytes over it) get the same max-min rate (the allocation is unique, and
swapping two such flows leaves it unchanged), so the computation takes each such *class* once
with its multiplicity (``weights``); a link that only single-link classes use is solved in closed
form (capacity / summed load). The work per recomputation is linear in the nonzero loads of the
distinct classes times the number of distinct rate levels, not flows x links x levels.
"""

from __future__ import annotations

import functools

import numpy as np
import simpy

from .buckets import TokenBuckets

_EPS = 1e-9
#: A flow this close to its end (seconds at its rate) is done.
_DONE_S = 1e-9
#: A link is over its capacity when carrying more than (1 + this) times it.
_OVER = 1e-9
#: A link carrying at least (1 - this) times its capacity starts the next solve active.
_FULL = 1e-6


def max_min_rates(load: np.ndarray, capacity: np.ndarray, weights: np.ndarray | None = None) -> np.ndarray:
    """Max-min fair rates, float64 (F,), bytes/s of each flow's largest part.

    ``load``: (F, L) share of each flow's rate that each link carries (0..1; 0 = not on it);
    ``capacity``: (L,) bytes/s (``inf`` = never a bottleneck); ``weights``: (F,) how many
    identical flows each row stands for (default 1 each; each of them gets the row's rate). A
    flow on no finite link gets ``inf``. Raises ValueError on mismatched shapes, a capacity <= 0
    or a weight <= 0.
    """
    load = np.asarray(load, dtype=np.float64)
    cap = np.asarray(capacity, dtype=np.float64)
    if load.ndim != 2 or load.shape[1] != len(cap):
        raise ValueError(f"load {load.shape} does not match {len(cap)} links")
    row, col = np.nonzero(load)
    return max_min_sparse(row, col, load[row, col], len(load), cap, weights)


def max_min_sparse(
    row: np.ndarray,
    col: np.ndarray,
    val: np.ndarray,
    n_rows: int,
    capacity: np.ndarray,
    weights: np.ndarray | None = None,
) -> np.ndarray:
    """:func:`max_min_rates` on the nonzero loads only: ``val[k]`` is row ``row[k]``'s load on link
    ``col[k]`` (each (row, col) pair at most once). Returns float64 (n_rows,) bytes/s."""
    cap = np.asarray(capacity, dtype=np.float64)
    if (cap <= 0).any():
        raise ValueError("link capacities must be > 0")
    w = np.ones(n_rows) if weights is None else np.asarray(weights, dtype=np.float64)
    if len(w) != n_rows or (w <= 0).any():
        raise ValueError(f"weights must be {n_rows} values > 0")
    row, col = np.asarray(row, dtype=np.int64), np.asarray(col, dtype=np.int64)
    wval = np.asarray(val, dtype=np.float64) * w[row]
    on_finite = np.isfinite(cap)[col]
    if not on_finite.all():
        row, col, wval = row[on_finite], col[on_finite], wval[on_finite]
    return _fill(row, col, wval, n_rows, cap)


def _fill(row: np.ndarray, col: np.ndarray, wval: np.ndarray, n_rows: int, cap: np.ndarray) -> np.ndarray:
    """Progressive filling of rows ``row`` on finite links ``col`` with weighted loads ``wval``
    (load x multiplicity); float64 (n_rows,) bytes/s, ``inf`` for a row with no entry."""
    n_links = len(cap)
    rate = np.full(n_rows, np.inf)  # a row on no finite link keeps inf
    if not len(row):
        return rate
    per_link = np.bincount(col, weights=wval, minlength=n_links)
    # closed form: a link used only by classes on that one link shares its capacity equally
    single = np.bincount(row, minlength=n_rows) == 1
    if single.any():
        shared = np.bincount(col, weights=~single[row], minlength=n_links) > 0
        solo = single[row] & ~shared[col]
        rate[row[solo]] = cap[col[solo]] / per_link[col[solo]]
        if solo.any():
            keep = ~solo
            row, col, wval = row[keep], col[keep], wval[keep]
            per_link = np.bincount(col, weights=wval, minlength=n_links)
    left = cap.copy()
    level = 0.0
    frozen = np.zeros(n_rows, dtype=bool)
    while len(row):  # progressive filling over the rest
        used = np.flatnonzero(per_link > 0)
        ratio = left[used] / per_link[used]
        step = float(ratio.min())
        level += step
        left[used] -= step * per_link[used]
        full = np.zeros(n_links, dtype=bool)
        full[used[left[used] <= _EPS * cap[used]]] = True
        if not full.any():  # rounding: the tightest link is full
            full[used[np.argmin(ratio)]] = True
        frozen[row[full[col]]] = True
        done = frozen[row]
        rate[row[done]] = level
        if done.all():
            break
        keep = ~done
        row, col, wval = row[keep], col[keep], wval[keep]
        per_link = np.bincount(col, weights=wval, minlength=n_links)
    return rate


def _grown(arr: np.ndarray, n: int) -> np.ndarray:
    """``arr`` with room for at least ``n`` rows (doubling), its rows kept."""
    if n <= len(arr):
        return arr
    out = np.zeros((max(n, 2 * len(arr), 16), *arr.shape[1:]), dtype=arr.dtype)
    out[: len(arr)] = arr
    return out


class FlowNetwork:
    """Links of fixed capacity shared by flows, max-min fair (:func:`max_min_rates`).

    ``capacities``: ``{link name: bytes/s}`` (``inf``: never a bottleneck). :meth:`transfer`
    returns a SimPy event that fires when the flow's bytes have crossed every link it uses.
    ``bytes_on``: bytes carried so far per link (for the report). Flows with the same load on
    every link are one class in the rate computation (module docstring).

    ``incremental`` (default) computes the same rates with less work; False recomputes every
    class on every link at each change (the reference a test compares against):

    - a change on a link that only single-link classes use (a node's decode cores, a co-located
      rank's cache reads) is that link's own connected component: only its classes are solved
      again, in closed form;
    - otherwise the progressive filling runs on the *active* links only (those full in the last
      solution, and each class's tightest link alone: ``load / capacity`` largest), and every other
      link is checked against the result: a link over its capacity joins the active set and the
      filling runs again. The result is max-min fair on all links: it is feasible, and every flow
      has a full link on which no flow has a higher rate (the bottleneck property, which only the
      max-min fair allocation has; Bertsekas & Gallager, 6.5.2). A random-placement chunk reads
      from every node (~190 links at 64 nodes) but is held back by one or two of them.

    ``buckets``: token-bucket shaped links (Linux ``tbf``), ``{link: (bucket bytes, peak bytes/s)}``:
    such a link passes bytes at ``peak`` while its bucket holds tokens and at its capacity (the
    token rate) once the bucket is empty; tokens accrue at the capacity minus what the link
    carries, up to the bucket's bytes, and the bucket starts full. So a link busy less than its
    rate on average passes short transfers at once, as ``tbf`` does
    (:class:`stoker_lab.sim.buckets.TokenBuckets`).

    Raises ValueError for a capacity <= 0 (naming the link) or a bad bucket.
    """

    def __init__(
        self,
        env: simpy.Environment,
        capacities: dict[str, float],
        incremental: bool = True,
        buckets: dict[str, tuple[float, float]] | None = None,
    ):
        self.env = env
        self.names = list(capacities)
        self.index = {n: i for i, n in enumerate(self.names)}
        self.capacity = np.array([float(capacities[n]) for n in self.names])
        for n, c in zip(self.names, self.capacity.tolist(), strict=True):
            if not c > 0:
                raise ValueError(f"link {n!r}: capacity must be > 0 bytes/s, got {c}")
        self.buckets = TokenBuckets(self, buckets) if buckets else None
        self.incremental = incremental
        self._bytes_on = np.zeros(len(self.names))
        self._finite = np.isfinite(self.capacity)
        n_links = len(self.names)
        # classes, each in a slot (a freed slot is reused)
        self._class_of: dict[tuple, int] = {}  # (links, loads) -> slot
        self._key: list[tuple | None] = []  # slot -> its key; None = free
        self._free: list[int] = []
        self._count = np.zeros(0)  # slot -> flows in the class
        self._crate = np.zeros(0)  # slot -> bytes/s of each of its flows
        self._span = np.zeros((0, 2), dtype=np.int64)  # slot -> its entries in the pool, [start, end)
        self._solo_link = np.zeros(0, dtype=np.int64)  # slot -> its one link; -1: more than one
        self._tight = np.zeros(0, dtype=np.int64)  # slot -> the link that limits it alone
        # every class's (slot, link, load) on finite links, appended; a dropped class's are dead
        self._e_slot = np.zeros(0, dtype=np.int64)
        self._e_link = np.zeros(0, dtype=np.int64)
        self._e_load = np.zeros(0)
        self._e_wval = np.zeros(0)  # load x flows in the class; 0 for a dropped class's entries
        self._e_alive = np.zeros(0, dtype=bool)
        self._n_e = 0
        self._dead_e = 0
        # per link
        self._multi = np.zeros(n_links, dtype=np.int64)  # multi-link classes on it
        self._solo: list[set[int]] = [set() for _ in range(n_links)]  # its single-link classes
        self._dirty_links: set[int] = set()  # single-link classes changed on these since the last solve
        self._dirty_multi = False  # a multi-link class changed since the last solve
        self._active = np.zeros(n_links, dtype=bool)  # full in the last solution
        # flows
        self._left = np.zeros(0)  # per flow: bytes of its largest part still to move
        self._cls = np.zeros(0, dtype=np.int64)  # per flow: its class's slot
        self._events = np.zeros(0, dtype=object)  # per flow: its simpy.Event
        self._rates = np.zeros(0)  # per flow, bytes/s
        self._t = env.now
        self._generation = 0
        self._pending = False  # a recomputation is scheduled at this instant

    @property
    def bytes_on(self) -> dict[str, float]:
        """Bytes carried so far per link, ``{link name: bytes}``."""
        return dict(zip(self.names, self._bytes_on.tolist(), strict=True))

    def transfer(self, link_bytes: dict[str, float]) -> simpy.Event:
        """Start a flow of ``link_bytes`` (``{link: bytes}``); its event fires when it is done
        (at once for no bytes, or bytes on unlimited links only). Raises KeyError for an unknown link."""
        parts = {k: float(v) for k, v in link_bytes.items() if v > 0}
        links = np.fromiter((self.index[k] for k in parts), dtype=np.int64, count=len(parts))
        return self.transfer_at(links, np.fromiter(parts.values(), dtype=np.float64, count=len(parts)))

    def transfer_at(self, links: np.ndarray, nbytes: np.ndarray) -> simpy.Event:
        """:meth:`transfer` by link index (``self.index``): ``links`` int64 (K,) distinct indices,
        ``nbytes`` float64 (K,) bytes on each. Raises IndexError for an index out of range."""
        ev = self.env.event()
        pos = nbytes > 0
        links, nbytes = links[pos], nbytes[pos]
        self._bytes_on[links] += nbytes
        fin = self._finite[links]
        if not fin.any():  # no bytes, or only unlimited links: no time
            ev.succeed()
            return ev
        size = float(nbytes.max())  # the rate is of the largest part, on whatever link
        links, nbytes = links[fin], nbytes[fin]
        order = np.argsort(links)
        links, loads = links[order], nbytes[order] / size
        key = (links.tobytes(), loads.tobytes())
        slot = self._class_of.get(key)
        if slot is None:
            slot = self._new_class(key, links, loads)
        self._count[slot] += 1
        self._changed(slot)
        self._advance()
        self._left = np.append(self._left, size)
        self._cls = np.append(self._cls, slot)
        self._rates = np.append(self._rates, 0.0)  # until the recomputation at this instant
        self._events = np.append(self._events, np.array([ev], dtype=object))
        self._defer()
        return ev

    def stop(self, ev: simpy.Event) -> None:
        """End now the flow whose :meth:`transfer` event is ``ev``, however much it has left (work
        whose end is known and whose amount is not, e.g. a process starting up): its event fires,
        and ``bytes_on`` keeps only what it moved on its limited links (an unlimited one keeps the
        whole part, counted at the start). Raises ValueError if ``ev`` is no flow in progress."""
        hit = [i for i, e in enumerate(self._events.tolist()) if e is ev]
        if not hit:
            raise ValueError("stop: the event is no flow in progress")
        self._advance()
        i = hit[0]
        slot = int(self._cls[i])
        a, b = (int(x) for x in self._span[slot])
        left = max(float(self._left[i]), 0.0)
        self._bytes_on[self._e_link[a:b]] -= left * self._e_load[a:b]
        done = np.zeros(len(self._left), dtype=bool)
        done[i] = True
        self._finish(done)
        self._defer()

    def _new_class(self, key: tuple, links: np.ndarray, loads: np.ndarray) -> int:
        if self._free:
            slot = self._free.pop()
        else:
            slot = len(self._key)
            self._key.append(None)
            self._count, self._crate = _grown(self._count, slot + 1), _grown(self._crate, slot + 1)
            self._span, self._solo_link = _grown(self._span, slot + 1), _grown(self._solo_link, slot + 1)
            self._tight = _grown(self._tight, slot + 1)
        a, b = self._n_e, self._n_e + len(links)
        if b > len(self._e_slot):
            self._e_slot, self._e_link = _grown(self._e_slot, b), _grown(self._e_link, b)
            self._e_load, self._e_alive = _grown(self._e_load, b), _grown(self._e_alive, b)
            self._e_wval = _grown(self._e_wval, b)
        self._e_slot[a:b], self._e_link[a:b], self._e_load[a:b], self._e_alive[a:b] = slot, links, loads, True
        self._e_wval[a:b] = 0.0
        self._n_e = b
        self._span[slot] = (a, b)
        self._key[slot] = key
        self._class_of[key] = slot
        self._count[slot] = self._crate[slot] = 0.0
        self._tight[slot] = links[np.argmax(loads / self.capacity[links])]
        if len(links) == 1:
            self._solo_link[slot] = links[0]
            self._solo[int(links[0])].add(slot)
        else:
            self._solo_link[slot] = -1
            self._multi[links] += 1
        return slot

    def _drop_class(self, slot: int) -> None:
        a, b = (int(x) for x in self._span[slot])
        self._e_alive[a:b] = False
        self._e_wval[a:b] = 0.0
        self._dead_e += b - a
        link = int(self._solo_link[slot])
        if link >= 0:
            self._solo[link].discard(slot)
        else:
            self._multi[self._e_link[a:b]] -= 1
        key = self._key[slot]
        assert key is not None
        del self._class_of[key]
        self._key[slot] = None
        self._crate[slot] = 0.0
        self._free.append(slot)

    def _changed(self, slot: int) -> None:
        a, b = self._span[slot]
        self._e_wval[a:b] = self._e_load[a:b] * self._count[slot]
        link = int(self._solo_link[slot])
        if link >= 0:
            self._dirty_links.add(link)
        else:
            self._dirty_multi = True

    def _compact(self) -> None:
        """Drop the dead entries from the pool (the live classes' spans move with theirs)."""
        n = self._n_e
        keep = self._e_alive[:n]
        newpos = np.cumsum(keep) - 1
        live = np.flatnonzero(self._count[: len(self._key)] > 0)
        lens = self._span[live, 1] - self._span[live, 0]
        self._span[live, 0] = newpos[self._span[live, 0]]
        self._span[live, 1] = self._span[live, 0] + lens
        m = int(keep.sum())
        for arr in (self._e_slot, self._e_link, self._e_load, self._e_wval):
            arr[:m] = arr[:n][keep]
        self._e_alive[:m], self._e_alive[m:n] = True, False
        self._n_e, self._dead_e = m, 0

    def _advance(self) -> None:
        dt = self.env.now - self._t
        if dt > 0 and len(self._left):
            self._left -= self._rates * dt
        if dt > 0 and self.buckets is not None:
            self.buckets.advance(dt)
        self._t = self.env.now

    def link_use(self, links: np.ndarray) -> np.ndarray:
        """Bytes/s each of ``links`` (indices) carries at the current rates, float64."""
        n = self._n_e
        use = np.bincount(
            self._e_link[:n], weights=self._e_wval[:n] * self._crate[self._e_slot[:n]], minlength=len(self.capacity)
        )
        return use[links]

    def _compute_rates(self) -> None:
        if self.buckets is not None:
            for link in self.buckets.set_capacities():  # a bucket ran dry or holds tokens again
                self._dirty_links.add(link)
                if self._multi[link]:
                    self._dirty_multi = True
        dirty = list(self._dirty_links)
        if self.incremental and not self._dirty_multi and not self._multi[dirty].any():
            for link in dirty:  # each such link is a component of its own: closed form
                if self._solo[link]:
                    idx = np.fromiter(self._solo[link], dtype=np.int64, count=len(self._solo[link]))
                    self._crate[idx] = self.capacity[link] / self._e_wval[self._span[idx, 0]].sum()
        else:
            self._solve_all()
        self._dirty_links.clear()
        self._dirty_multi = False
        self._rates = self._crate[self._cls]
        if self.buckets is not None:
            self.buckets.rates_changed()

    def _solve_all(self) -> None:
        """Max-min rates of every class (class docstring: on the active links, checked on the rest)."""
        if self._dead_e > max(1024, self._n_e // 2):
            self._compact()
        n, n_slots, cap = self._n_e, len(self._key), self.capacity
        slot, link, wval = self._e_slot[:n], self._e_link[:n], self._e_wval[:n]  # dropped classes: wval 0
        live = self._count[:n_slots] > 0
        if not self.incremental:
            on = wval > 0
            rate = _fill(slot[on], link[on], wval[on], n_slots, cap)
        else:
            act = self._active.copy()
            act[self._tight[:n_slots][live]] = True
            while True:
                on = act[link] & (wval > 0)
                rate = _fill(slot[on], link[on], wval[on], n_slots, cap)
                rate[~live] = 0.0
                use = np.bincount(link, weights=wval * rate[slot], minlength=len(cap))
                over = use > cap * (1 + _OVER)
                if not over.any():
                    break
                act |= over
            self._active = use >= cap * (1 - _FULL)
        self._crate[:n_slots] = np.where(live, rate, 0.0)

    def _defer(self) -> None:
        """Recompute once at this instant, after every other event of it (flows that start or
        end together cost one recomputation; no time passes in between, so it is exact)."""
        self._generation += 1
        if not self._pending:
            self._pending = True
            self.env.timeout(0).callbacks.append(self._settle)

    def _settle(self, _ev: simpy.Event) -> None:
        if self.env.peek() <= self.env.now:  # more happens at this instant: after it
            self.env.timeout(0).callbacks.append(self._settle)
            return
        self._pending = False
        self._reschedule()

    def _finish(self, done: np.ndarray) -> None:
        """Fire the events of the flows marked ``done`` and drop them."""
        for ev, slot in zip(self._events[done].tolist(), self._cls[done].tolist(), strict=True):
            ev.succeed()
            self._count[slot] -= 1
            self._changed(slot)
            if self._count[slot] == 0:
                self._drop_class(slot)
        keep = ~done
        self._left, self._cls, self._rates = self._left[keep], self._cls[keep], self._rates[keep]
        self._events = self._events[keep]

    def _reschedule(self) -> None:
        """Recompute the rates and schedule the next completion; a flow done already (within a
        nanosecond of it: below the clock's resolution a wake-up would not advance time)
        finishes now, and the rest are settled again at this instant."""
        self._generation += 1
        if not len(self._left):
            if self.buckets is not None:  # nothing flows: every bucket fills from now on
                self.buckets.use[:] = 0.0
            return
        self._compute_rates()
        dry_s = np.inf
        if self.buckets is not None:
            while True:  # a bucket that runs dry below the clock's resolution is dry now
                dry_s = self.buckets.next_dry_s()
                if dry_s > _DONE_S:
                    break
                self.buckets.empty_the_draining(_DONE_S)
                self._compute_rates()
        left_s = self._left / self._rates
        done = left_s <= _DONE_S
        if done.any():
            self._finish(done)
            self._defer()
            return
        wake = self.env.timeout(max(0.0, min(float(left_s.min()), dry_s)))
        wake.callbacks.append(functools.partial(self._wake, self._generation))

    def _wake(self, generation: int, _ev: simpy.Event | None = None) -> None:
        """The next completion (or a bucket running dry) is due, unless flows started or ended
        since: finish what is done at the current rates; the rest are settled once this
        instant's events have run."""
        if generation == self._generation:
            self._advance()
            with np.errstate(divide="ignore"):
                done = self._left / self._rates <= _DONE_S
            self._finish(done)
            self._defer()
