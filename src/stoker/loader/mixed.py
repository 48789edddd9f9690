"""A Loader over a weighted mixture of datasets (:func:`stoker.mix`): what ``stoker.Loader(mixture,
...)`` returns.

The epoch is the mixture's plan (:func:`stoker.loader.mixture.mix_epoch`): a sequence of chunks, each one
batch of one source, the same on every rank. The ranks split the chunks as a Loader splits
samples (:func:`stoker.order.interleaved_shares`: rank r takes chunks r, r + world_size, ...;
``read.even`` pads with early chunks or drops the last few), so every rank yields the same number
of batches. Each source is read by a Loader of its own (its dataset, node cache, prefetcher and
workers, as when read alone), whose plan is the chunks of that source this rank serves; this
loader yields their batches in the mixture's order.

Resume: the state is :class:`stoker.loader.state.LoaderState` counted in chunks (one chunk is one
"sample" of its split, and a batch of one chunk), so a mid-epoch state resumes the identical rest
of the epoch at the world size that saved it, and at another one splits the chunks not yet
served again (the elastic resume of a Loader). The mixture (sources' URLs, versions and subsets,
weights, rule, epoch size) is part of the state's identity.
"""

from __future__ import annotations

import functools
import json
import time
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import xxhash

from ..order import EpochShares, interleaved_shares
from .epoch_stats import EpochStats
from .mixture import MixEpoch, Mixture, epoch_chunks, mix_epoch
from .options import ReadOptions, RunOptions, order_of
from .state import IDENTITY_KEYS, LoaderState
from .world import resolve

__all__ = ["MixLoader"]

#: Per-source figures of ``stats.sources`` taken from each source's own epoch stats.
SOURCE_FIELDS = ("samples", "batches", "origin_bytes", "cache_hits", "cache_misses", "cache_hit_ratio", "skipped")


def _feed(ref: weakref.ref, source: int, epoch: int) -> np.ndarray:
    """The packed sample ids a source's loader serves in ``epoch`` (empty once its MixLoader is gone)."""
    mix = ref()
    return np.zeros(0, np.int64) if mix is None else mix.source_plan(source, epoch)


@functools.cache
def _source_loader(base: type) -> type:
    """A subclass of the Loader class ``base`` whose plan is fed by a :class:`MixLoader`."""

    class SourceLoader(base):  # type: ignore[valid-type,misc]
        """The Loader of one source of a mixture: its plan is ``feed(epoch)`` (packed sample ids)."""

        feed: Callable[[int], np.ndarray] = staticmethod(lambda epoch: np.zeros(0, np.int64))

        def plan(self, epoch: int | None = None) -> np.ndarray:
            return self.feed(self.epoch if epoch is None else epoch)

        def epoch_plan(self, epoch: int) -> tuple[np.ndarray, float]:
            return self.feed(epoch), 0.0

    return SourceLoader


def _workers(num_workers: int, weights: tuple[float, ...]) -> list[int]:
    """Decode workers of each source's loader: ``num_workers`` dealt by weight, at least one each
    (none when ``num_workers`` is 0)."""
    if num_workers <= 0:
        return [0] * len(weights)
    return [max(1, round(num_workers * w)) for w in weights]


class MixLoader:
    """Batches of a :class:`stoker.loader.mixture.Mixture`; made by ``stoker.Loader(mixture, ...)`` with
    the Loader's arguments (the same meaning; ``num_workers`` is dealt to the sources by weight,
    at least one each). Each batch holds ``batch_size`` samples of one source; the sources'
    batches interleave by weight (:mod:`stoker.loader.mixture`). ``drop_last`` changes nothing (every
    batch is whole).

    Attributes: ``mixture``, ``loaders`` (one :class:`stoker.Loader` per source, in the mixture's
    order), ``state`` (:class:`~stoker.loader.state.LoaderState` in chunks), ``stats`` (the last
    epoch's :class:`~stoker.loader.epoch_stats.EpochStats`, the sources summed, with
    ``stats.sources``: per source name, its ``samples``, ``batches``, ``origin_bytes``,
    ``cache_hits``, ``cache_misses``, ``cache_hit_ratio``, ``skipped``) and ``history``.

    Raises:
        ValueError: as :class:`stoker.Loader`, and for ``read.cache_aware_window`` > 0 or a
            streaming collate (``pack_tokens``): their per-rank state does not follow a mixture.
        RuntimeWarning (warned): a source cut to what it has (``small="take"``), naming it and
            its samples wanted and held.
    """

    def __init__(self, base: type, mixture: Mixture, batch_size: int, **kwargs: Any) -> None:
        read = kwargs.get("read") or ReadOptions()
        run = kwargs.get("run") or RunOptions()
        collate = kwargs.get("collate")
        if read.cache_aware_window > 0:
            raise ValueError("a Loader over a mixture does not take read.cache_aware_window > 0")
        if hasattr(collate, "cut"):
            raise ValueError("a Loader over a mixture does not take a streaming collate (pack_tokens)")
        self.mixture, self.read = mixture, read
        self.shuffle, self.seed = bool(kwargs.get("shuffle", True)), int(kwargs.get("seed", 0))
        self.transform = kwargs.get("transform", "train")
        self.rank, self.world_size = resolve(kwargs.get("rank"), kwargs.get("world_size"))
        workers = _workers(int(kwargs.pop("num_workers", 2)), mixture.weights)
        cls = _source_loader(base)
        kw = {**kwargs, "rank": self.rank, "world_size": self.world_size, "drop_last": False, "run": run}
        self.loaders = [
            cls(ds, batch_size, num_workers=n, **kw) for ds, n in zip(mixture.sources, workers, strict=True)
        ]
        ref = weakref.ref(self)
        for s, child in enumerate(self.loaders):
            child.feed = functools.partial(_feed, ref, s)
        self.state = LoaderState(epoch=self.loaders[0].epoch, position=(self.loaders[0].epoch, 0))
        self.stats: EpochStats | None = None
        self.history: list[EpochStats] = []
        self._plans: dict[int, MixEpoch] = {}
        self._from = (-1, 0)  # (epoch, chunk) the rank's current epoch started at
        self._warn_short(batch_size)

    @property
    def batch_size(self) -> int:
        """Samples per batch: the source Loaders' (stored once, in their ``cfg``)."""
        return self.loaders[0].batch_size

    def _warn_short(self, batch_size: int) -> None:
        m = self.mixture
        _, short = epoch_chunks(m.sizes(), m.weights, batch_size, m.samples_per_epoch, m.small)
        for s, want, has in short:
            warnings.warn(
                f"mixture source {m.names[s]!r} ({getattr(m.sources[s], 'url', '?')}) has {has} samples, under its "
                f"share of {want} per epoch: small='take' serves {has // batch_size * batch_size} of them (whole "
                "batches) and the epoch is shorter; small='repeat' repeats it instead",
                RuntimeWarning,
                stacklevel=4,
            )

    # -- the plan ---------------------------------------------------------
    def epoch_mix(self, epoch: int) -> MixEpoch:
        """The mixture's plan of ``epoch`` (every rank's; :func:`stoker.loader.mixture.mix_epoch`)."""
        plan = self._plans.get(epoch)
        if plan is None:
            m = self.mixture
            groups = []
            for ds in m.sources:
                g = ds.blocks.sample_block
                sel = getattr(ds, "selection", None)
                groups.append(g if sel is None else g[sel])
            plan = mix_epoch(
                m.sizes(),
                m.weights,
                self.batch_size,
                self.seed,
                epoch,
                samples_per_epoch=m.samples_per_epoch,
                small=m.small,
                order=order_of(self.read, self.shuffle),
                groups=groups,
                window=self.read.order_window,
            )
            self._plans = {e: p for e, p in self._plans.items() if abs(e - epoch) <= 2}
            self._plans[epoch] = plan
        return plan

    def _shares(self, epoch: int, served: np.ndarray | None, world_size: int | None = None) -> EpochShares:
        """Every rank's chunks of ``epoch`` (the resume state's :data:`~stoker.loader.state.SharesFn`)."""
        chunks = np.arange(len(self.epoch_mix(epoch).source), dtype=np.int64)
        return interleaved_shares(chunks, world_size or self.world_size, self.read.even, served)

    def chunks(self, epoch: int | None = None) -> np.ndarray:
        """This rank's chunks of ``epoch`` (default: the next), in order (after a resume at another
        split: its share of the rest), int64 indices into :meth:`epoch_mix`'s chunks."""
        e = self.epoch if epoch is None else epoch
        return self._shares(e, self.state.served_before(e)).plan(self.rank)

    def plan(self, epoch: int | None = None) -> list[tuple[int, np.ndarray]]:
        """This rank's batches of ``epoch`` (default: the next): ``(source, packed sample ids of
        that source's dataset)`` each, in order."""
        e = self.epoch if epoch is None else epoch
        mix = self.epoch_mix(e)
        out = []
        for j in self.chunks(e).tolist():
            s, ids = mix.chunk(j)
            out.append((s, self._packed(s, ids)))
        return out

    def _packed(self, source: int, ids: np.ndarray) -> np.ndarray:
        sel = getattr(self.mixture.sources[source], "selection", None)
        return ids if sel is None else sel[ids]

    def source_plan(self, source: int, epoch: int) -> np.ndarray:
        """The packed sample ids ``source``'s loader serves in ``epoch``: its chunks among this
        rank's, from the chunk the epoch's ``iter()`` started at."""
        mix = self.epoch_mix(epoch)
        mine = self.chunks(epoch)
        if self._from[0] == epoch:
            mine = mine[self._from[1] :]
        parts = [mix.chunk(j)[1] for j in mine.tolist() if mix.source[j] == source]
        ids = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        return self._packed(source, ids)

    def __len__(self) -> int:
        return len(self.chunks())

    # -- epochs -----------------------------------------------------------
    @property
    def epoch(self) -> int:
        """The epoch the next ``iter()`` runs (as :attr:`stoker.Loader.epoch`)."""
        return self.state.epoch

    def set_epoch(self, epoch: int) -> None:
        """As :meth:`stoker.Loader.set_epoch` (the same ValueError after a resume)."""
        self.state.set_epoch(epoch)

    def __iter__(self):
        epoch, start = self.state.open_epoch()
        self._from = (epoch, start)
        chunks = self.chunks(epoch)[start:]
        its = []
        for child in self.loaders:
            if child.epoch != epoch:
                child.set_epoch(epoch)
            its.append(iter(child))
        return self._serve(epoch, start, chunks, its)

    def _serve(self, epoch: int, start: int, chunks: np.ndarray, its: list):
        t0 = time.perf_counter()
        self.state.begin()
        self.state.position = (epoch, start)
        mix, wait = self.epoch_mix(epoch), 0.0
        try:
            for k, j in enumerate(chunks.tolist()):
                t = time.perf_counter()
                batch = next(its[int(mix.source[j])], None)
                wait += time.perf_counter() - t
                self.state.position = (epoch, start + k + 1)
                if batch is not None:  # (None: a one-rank loader that skipped every sample of it)
                    yield batch
            for it in its:  # each source's epoch ends: its stats are recorded
                for _ in it:
                    pass
            self._record(epoch, time.perf_counter() - t0, wait)
        finally:
            if self.state.position[0] == epoch and self.state.epoch == epoch + 1:
                self.state.position = (epoch + 1, 0)

    def _record(self, epoch: int, seconds: float, wait_s: float) -> None:
        """The epoch's stats: the sources' own, summed, and per source in ``sources``."""
        st = EpochStats(epoch=epoch, seconds=seconds, wait_s=wait_s, exactly_once=True)
        for name, child in zip(self.mixture.names, self.loaders, strict=True):
            cs = child.stats if child.stats is not None and child.stats.epoch == epoch else EpochStats(epoch=epoch)
            st.sources[name] = {f: getattr(cs, f) for f in SOURCE_FIELDS}
            for f in ("samples", "batches", "origin_bytes", "origin_requests", "cache_hits", "cache_misses", "skipped"):
                setattr(st, f, getattr(st, f) + getattr(cs, f))
            st.exactly_once = st.exactly_once and cs.exactly_once
        reads = st.cache_hits + st.cache_misses
        st.cache_hit_ratio = st.cache_hits / reads if reads else 0.0
        st.stall_fraction = wait_s / seconds if seconds else 0.0
        st.samples_per_s = st.samples / seconds if seconds else 0.0
        self.stats = st
        self.history.append(st)

    # -- resume -----------------------------------------------------------
    def _identity(self) -> dict:
        """The state's identity: a Loader's keys (the mixture's digest as its ``dataset_version``)."""
        digest = xxhash.xxh3_64_hexdigest(json.dumps(self.mixture.identity(), sort_keys=True).encode())
        ident = {
            "seed": self.seed,
            "order": order_of(self.read, self.shuffle),
            "order_window": self.read.order_window,
            "batch_size": self.batch_size,
            "even": self.read.even,
            "drop_last": False,
            "transform": self.transform,
            "dataset_version": f"mix:{digest}",
            "num_samples": len(self.mixture),
            "subset": None,
            "cache_aware_window": 0,
            "carry_from": None,
        }
        assert tuple(ident) == IDENTITY_KEYS
        return ident

    def state_dict(self) -> dict:
        """Where the job's stream stands, as :meth:`stoker.Loader.state_dict` counted in chunks
        (``samples_done``: chunks all ranks have served; ``batches_done``: per rank), with
        ``mixture``: the mixture it belongs to (:meth:`stoker.loader.mixture.Mixture.identity`)."""
        out = self.state.to_dict(
            self._identity(), rank=self.rank, world_size=self.world_size, batch_size=1, shares=self._shares
        )
        out["mixture"] = self.mixture.identity()
        return out

    def load_state_dict(self, state: dict, strict: bool = True) -> None:
        """Resume from :meth:`state_dict`, saved at any world size (as
        :meth:`stoker.Loader.load_state_dict`: the identical rest at the same world size, the
        chunks not yet served split again at another).

        Raises:
            ValueError: a state of another mixture (another source, version, subset, weight, rule or
                epoch size: the message names what differs) or of a loader over one dataset, and as
                :meth:`stoker.Loader.load_state_dict`. Nothing is changed then.
        """
        if not isinstance(state, dict) or "mixture" not in state:
            raise ValueError(
                "cannot resume: this state was not saved by a loader over a mixture (it has no 'mixture'); "
                "resume it with a Loader over the dataset that saved it"
            )
        why = _mixture_mismatch(state["mixture"], self.mixture.identity())
        if why:
            raise ValueError(f"cannot resume: the state belongs to another mixture: {why}")
        self.state.load(
            state,
            self._identity(),
            rank=self.rank,
            world_size=self.world_size,
            batch_size=1,
            num_blocks=0,
            shares=self._shares,
            strict=strict,
        )

    def close(self) -> None:
        """Close every source's loader (idempotent)."""
        for child in self.loaders:
            child.close()

    def __enter__(self) -> MixLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"Loader({self.mixture!r}, batch_size={self.batch_size}, epoch={self.epoch}, rank={self.rank}, "
            f"world_size={self.world_size})"
        )


def _mixture_mismatch(saved: Any, mine: dict) -> str:
    """What differs between a saved mixture identity and this one, in words ("" when the same)."""
    if not isinstance(saved, dict):
        return f"'mixture' is {saved!r}"
    a, b = saved.get("sources") or [], mine["sources"]
    if len(a) != len(b):
        return f"it has {len(a)} sources, this loader {len(b)}"
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        for key in ("url", "version", "subset", "samples", "name"):
            if x.get(key) != y.get(key):
                return f"source {i} has {key}={x.get(key)!r} in the state, {y.get(key)!r} here"
    for key in ("weights", "small", "samples_per_epoch"):
        if saved.get(key) != mine[key]:
            return f"{key}={saved.get(key)!r} in the state, {mine[key]!r} here"
    return ""
