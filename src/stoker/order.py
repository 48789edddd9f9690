"""Epoch order: permutations as pure functions of (seed, epoch), split evenly over ranks.

Every permutation is registered by name and is a pure function of
``(num_samples, seed, epoch, groups)`` (the Mosaic Streaming lesson: shuffles you
can test and reproduce). ``groups`` (int array, one group id per sample) is the
dataset's layout: the cache blocks, runs of consecutive samples in one shard.
:func:`rank_plan` splits one permutation over ``world_size`` ranks so that every
rank gets the same number of samples by construction (uneven counts hang DDP).
:class:`EpochShares` holds every rank's share of an epoch at once (this split, or the cluster's
co-located one) and says which samples the ranks together have served after k each: what a
resume state records, so that the rest of an epoch can be split again over other ranks.

Orders:

- ``uniform``: every permutation equally likely (PCG64). Reading it cold from an
  origin needs a block for almost every sample of the first batches, so the
  first batch waits for most of the dataset unless every sample is its own request.
- ``blockwise`` (default): the blocks in a uniformly random order, cut into windows
  of ``window`` blocks, the samples of each window uniformly shuffled. A window is
  a few MB, so a cold epoch streams window after window at origin bandwidth
  while the previous window decodes. This is the quasi-random order the field uses
  for remote data (FFCV's QUASI_RANDOM, Mosaic Streaming's windowed shuffles,
  WebDataset's shard shuffle + buffer); ``stoker pack`` shuffles samples across
  shards so that a window mixes classes. The first windows ramp up: 1, 2, 4, 8 blocks, then
  ``window`` (:func:`ramp_windows`), so the first batch of a cold epoch waits for a few blocks
  instead of ``window`` of them; the rest of the epoch is unchanged.
- ``sequential``: identity (``shuffle=False``).
"""

from __future__ import annotations

import base64
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

PermutationFn = Callable[..., np.ndarray]
#: Blocks per shuffle window of the ``blockwise`` order.
DEFAULT_WINDOW_BLOCKS = 16
PERMUTATIONS: dict[str, PermutationFn] = {}


def register_permutation(name: str) -> Callable[[PermutationFn], PermutationFn]:
    """Decorator: register ``fn(num_samples, seed, epoch, groups=None, **options) -> int64 array``."""

    def deco(fn: PermutationFn) -> PermutationFn:
        PERMUTATIONS[name] = fn
        return fn

    return deco


def _rng(seed: int, epoch: int, salt: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([int(seed), int(epoch), salt])))


@register_permutation("uniform")
def uniform_permutation(num_samples: int, seed: int, epoch: int, groups: Any = None, **_: Any) -> np.ndarray:
    """Uniform random permutation of ``range(num_samples)`` from PCG64 seeded by (seed, epoch)."""
    return _rng(seed, epoch, 0x570CE).permutation(num_samples).astype(np.int64, copy=False)


@register_permutation("sequential")
def sequential_permutation(num_samples: int, seed: int, epoch: int, groups: Any = None, **_: Any) -> np.ndarray:
    """Identity order (``shuffle=False``)."""
    return np.arange(num_samples, dtype=np.int64)


def ramp_windows(num_blocks: int, window: int, ramp: bool = True) -> np.ndarray:
    """The window of each block position ``0..num_blocks-1`` of the ``blockwise`` order, int64.

    Windows hold ``window`` blocks; with ``ramp`` the first ones hold 1, 2, 4, ... blocks
    (doubling while below ``window``), so the first samples of an epoch need few blocks.
    Raises ValueError if ``window < 1``.
    """
    if window < 1:
        raise ValueError("window must be >= 1")
    pos = np.arange(num_blocks, dtype=np.int64)
    if not ramp:
        return pos // window
    sizes = []
    size, total = 1, 0
    while size < window and total < num_blocks:
        sizes.append(size)
        total += size
        size *= 2
    starts = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])[:-1] if sizes else np.zeros(0, np.int64)
    out = np.searchsorted(starts, pos, side="right") - 1
    rest = pos >= total
    out[rest] = len(sizes) + (pos[rest] - total) // window
    return out.astype(np.int64)


@register_permutation("blockwise")
def blockwise_permutation(
    num_samples: int,
    seed: int,
    epoch: int,
    groups: Any = None,
    window: int = DEFAULT_WINDOW_BLOCKS,
    ramp: bool = True,
    **_: Any,
) -> np.ndarray:
    """Quasi-random order: random block order, samples shuffled within windows of ``window`` blocks.

    ``groups``: int array (num_samples,), the block of each sample (None = each sample its
    own block, which makes this a uniform permutation in windows of ``window`` samples).
    ``ramp``: the first windows hold 1, 2, 4, ... blocks (:func:`ramp_windows`).
    Raises ValueError if ``groups`` has the wrong length or ``window < 1``.
    """
    if window < 1:
        raise ValueError("window must be >= 1")
    if groups is None:
        groups = np.arange(num_samples)
    groups = np.asarray(groups)
    if len(groups) != num_samples:
        raise ValueError(f"groups has {len(groups)} entries for {num_samples} samples")
    rng = _rng(seed, epoch, 0xB10C)
    uniq, inverse = np.unique(groups, return_inverse=True)
    block_rank = rng.permutation(len(uniq))[inverse]  # position of each sample's block
    window_of = ramp_windows(len(uniq), window, ramp)[block_rank]  # window of each sample
    tie = rng.random(num_samples)  # uniform shuffle inside a window
    return np.lexsort((tie, window_of)).astype(np.int64)


#: Former name of the uniform order.
PERMUTATIONS["pcg64"] = uniform_permutation


def permutation(
    num_samples: int, seed: int, epoch: int, name: str = "uniform", groups: Any = None, **options: Any
) -> np.ndarray:
    """Return the epoch's permutation, int64 array of shape (num_samples,). KeyError for unknown names."""
    try:
        fn = PERMUTATIONS[name]
    except KeyError:
        raise KeyError(f"unknown permutation {name!r}; registered: {sorted(PERMUTATIONS)}") from None
    return fn(num_samples, seed, epoch, groups, **options)


def _even(rest: np.ndarray, fill: np.ndarray, world_size: int, even: str) -> np.ndarray:
    """``rest`` made a multiple of ``world_size`` long: ``even="pad"`` appends ``fill`` repeated
    cyclically (its first items first), ``"drop"`` cuts ``rest`` down. A view of ``rest`` when
    nothing is appended. ValueError for a bad ``even``."""
    n = len(rest)
    if even == "pad":
        total = -(-n // world_size) * world_size
        if total > n:  # cyclic: ``fill[: total - n]`` alone is too short when total - n > len(fill)
            rest = np.concatenate([rest, np.resize(fill, total - n)])
        return rest
    if even == "drop":
        return rest[: (n // world_size) * world_size]
    raise ValueError(f"even must be 'pad' or 'drop', got {even!r}")


def _owed_positions(
    num_samples: int, world_size: int, even: str, start: int = 0, done: np.ndarray | None = None
) -> tuple[np.ndarray, int]:
    """``(entries, owed)``: the positions of an epoch's permutation its ``world_size`` ranks serve
    together, in order, and how many of them are samples still owed. The owed ones are the
    positions from ``start`` on, or those not ``done`` (bool per position); ``even="pad"`` then
    repeats positions ``0, 1, 2, ...`` (cyclically) up to a multiple of ``world_size`` (entries
    ``owed`` and later), ``"drop"`` cuts the owed ones down to one. int64 array. ValueError for a
    bad ``even``."""
    if done is None:
        rest = np.arange(start, num_samples, dtype=np.int64)
    else:
        rest = np.flatnonzero(~done).astype(np.int64)
    return _even(rest, np.arange(num_samples, dtype=np.int64), world_size, even), len(rest)


def _check_split(perm: np.ndarray, rank: int, world_size: int, start: int, served: np.ndarray | None) -> None:
    """ValueError for a rank outside ``[0, world_size)``, a ``start`` outside ``[0, len(perm)]``,
    a ``served`` that is not one flag per sample, or both."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} not in [0, {world_size})")
    if not 0 <= start <= len(perm):
        raise ValueError(f"start {start} not in [0, {len(perm)}]")
    if served is not None and (start or len(served) != len(perm)):
        raise ValueError(f"served must be one flag per sample ({len(perm)}), without start; got {len(served)}")


def rank_plan(
    perm: np.ndarray, rank: int, world_size: int, even: str = "pad", start: int = 0, served: np.ndarray | None = None
) -> np.ndarray:
    """The sample ids of ``rank`` for one epoch, int64 array.

    Every rank gets exactly ``ceil(N / world_size)`` samples with ``even="pad"``: the
    permutation is repeated cyclically up to ``ceil(N / world_size) * world_size`` ids
    (``pad < world_size`` extra reads in all), so each sample is read at least once, and
    when ``N >= pad`` (always when ``N >= world_size / 2``) at most ``pad`` samples are
    read twice, as in PyTorch's DistributedSampler; with fewer samples than that (say 1
    sample on 4 ranks) some samples are read more than twice, never a rank short. With
    ``even="drop"`` every rank gets ``floor(N / world_size)`` (the last
    ``N mod world_size`` ids of this epoch's permutation are skipped; a different set
    each epoch; 0 for every rank when ``N < world_size``). With ``N % world_size == 0``
    both give every sample exactly once across ranks. ``N = 0`` gives every rank an
    empty plan.

    ``start``: ids of the permutation already served (by all ranks together, an elastic resume):
    only ``perm[start:]`` is split, N being its length, and the padding repeats ``perm`` from its
    beginning. The rank split interleaves (rank r takes positions r, r + world_size, ...), so
    after k samples per rank the ranks together have served exactly ``perm[:k * world_size]``,
    and ``rank_plan(perm, r, w, even, k * w)`` is ``rank_plan(perm, r, w, even)[k:]``.
    ``served``: instead of ``start``, a bool array by sample id (``perm`` holds the ids
    ``0..N-1``): the samples served already, wherever they were in ``perm`` (a resume of a split
    that is not this one, such as the cluster's co-located plan); the ids of ``perm`` not served,
    in ``perm``'s order, are split. Raises ValueError for a bad rank, mode, start or served.
    """
    _check_split(perm, rank, world_size, start, served)
    if served is not None:
        entries, _ = _owed_positions(len(perm), world_size, even, 0, np.asarray(served, dtype=bool)[perm])
        ids: np.ndarray = perm[entries[rank::world_size]]
        return ids
    rest = _even(perm[start:], perm, world_size, even)  # views, no copy of the permutation per rank
    ids = rest[rank::world_size]
    return ids


def rank_padding(
    num_samples: int,
    rank: int,
    world_size: int,
    even: str = "pad",
    start: int = 0,
    served: np.ndarray | None = None,
) -> np.ndarray:
    """Which positions of :func:`rank_plan` (same arguments, ``num_samples = len(perm)``) only
    repeat a sample to even the ranks: a bool array as long as that plan (all False with
    ``even="drop"``, or when the ``N`` samples owed divide by ``world_size``). Across ranks fewer
    than ``world_size`` positions are True, each the last of its rank's plan when
    ``N >= world_size / 2``. Raises ValueError as :func:`rank_plan`."""
    ids = np.arange(num_samples, dtype=np.int64)
    _check_split(ids, rank, world_size, start, served)
    done = None if served is None else np.asarray(served, dtype=bool)
    entries, owed = _owed_positions(num_samples, world_size, even, start, done)
    return np.arange(len(entries), dtype=np.int64)[rank::world_size] >= owed


@dataclass(frozen=True)
class EpochShares:
    """Every rank's share of one epoch, and what the ranks together have served after each took
    a number of its samples: what a resume state records (:mod:`stoker.loader.state`).

    Attributes:
        perm: the epoch's permutation, int64 ``(N,)`` (sample ids).
        entries: positions of ``perm`` the ranks serve, int64 ``(M,)``, ``M`` a multiple of
            ``world_size``: entries ``[0, owed)`` are the samples owed, in ``perm``'s order; the
            later ones repeat samples only to give every rank the same count (``even="pad"``).
        owed: how many entries are samples owed.
        world_size: ranks.
        owner: the rank each entry goes to, int64 ``(M,)``, each rank ``M / world_size`` of them;
            None: the interleaved split of :func:`rank_plan` (entry ``i`` to rank ``i % world_size``).
        before: samples served before this split (bool by sample id), or None.
        keep: entries each rank serves, in order (fewer than its share with ``drop_last``: whole
            batches); None: all of them.

    Each rank serves its entries in their order, so its plan keeps ``perm``'s order.
    """

    perm: np.ndarray
    entries: np.ndarray
    owed: int
    world_size: int
    owner: np.ndarray | None = None
    before: np.ndarray | None = None
    keep: int | None = None

    @property
    def share(self) -> int:
        """Entries each rank serves (the same for every rank, by construction)."""
        whole = len(self.entries) // self.world_size
        return whole if self.keep is None else min(self.keep, whole)

    def _mine(self, rank: int) -> np.ndarray:
        """Indices into ``entries`` of ``rank``'s share, in serving order."""
        if self.owner is None:
            return np.arange(rank, len(self.entries), self.world_size, dtype=np.int64)[: self.share]
        return np.flatnonzero(self.owner == rank)[: self.share]

    def plan(self, rank: int) -> np.ndarray:
        """``rank``'s sample ids, int64, in the order it serves them."""
        ids: np.ndarray = self.perm[self.entries[self._mine(rank)]]
        return ids

    def padding(self, rank: int) -> np.ndarray:
        """Which of :meth:`plan`'s samples (bool, aligned with it) only repeat one to even the ranks."""
        return self._mine(rank) >= self.owed

    def batches(self, batch_size: int) -> int:
        """Batches of ``batch_size`` each rank serves (the last one may be short)."""
        return -(-self.share // batch_size)

    def whole_batches(self, batch_size: int) -> EpochShares:
        """The same shares cut to whole batches of ``batch_size`` (``drop_last``)."""
        return replace(self, keep=len(self.entries) // self.world_size // batch_size * batch_size)

    def served(self, taken: int) -> np.ndarray:
        """Samples served (bool by sample id, ``(N,)``) once every rank has served the first
        ``taken`` entries of its share: :attr:`before` and the samples of those entries (their
        repeats that only even the ranks are not counted)."""
        out = np.zeros(len(self.perm), dtype=bool) if self.before is None else self.before.copy()
        m = len(self.entries)
        if self.owner is None:  # interleaved: the first ``taken`` of every rank are the first entries
            took = np.arange(m) < min(taken * self.world_size, self.owed)
        else:  # the entry's place in its rank's share (a stable sort by rank keeps each share's order)
            order = np.argsort(self.owner, kind="stable")
            counts = np.bincount(self.owner, minlength=self.world_size)
            place = np.empty(m, dtype=np.int64)
            place[order] = np.arange(m) - np.repeat(np.cumsum(counts) - counts, counts)
            took = (place < taken) & (np.arange(m) < self.owed)
        out[self.perm[self.entries[took]]] = True
        return out


def interleaved_shares(
    perm: np.ndarray, world_size: int, even: str = "pad", served: np.ndarray | None = None
) -> EpochShares:
    """The split of :func:`rank_plan` as :class:`EpochShares`: the ids of ``perm`` not ``served``
    (bool by sample id; None: none) made even as ``even`` says, rank r taking entries r,
    r + world_size, ... ValueError for a bad world size, mode or ``served``."""
    perm = np.asarray(perm, dtype=np.int64)
    _check_split(perm, 0, world_size, 0, served)
    before = None if served is None else np.asarray(served, dtype=bool)
    entries, owed = _owed_positions(len(perm), world_size, even, 0, None if before is None else before[perm])
    return EpochShares(perm, entries, owed, int(world_size), before=before)


def sample_seed(seed: int, epoch: int, sample_id: int) -> np.random.SeedSequence:
    """Seed for one sample's augmentation: pure in (seed, epoch, sample id), so the
    pixels of a sample do not depend on which worker decodes it or on resume."""
    return np.random.SeedSequence([int(seed), int(epoch), int(sample_id), 0xA06])


def cache_aware(plan: np.ndarray, hit: np.ndarray, window: int) -> np.ndarray:
    """Serve cached samples first within each window of ``window`` plan positions.

    ``plan``: sample ids in order (K,); ``hit``: bool (K,), whether each position's sample is
    cached now. Within every window the hits keep their relative order and come first, the
    misses follow in their relative order, so each miss gets up to a window more time to be
    prefetched (Quiver's substitutable hits, FAST'20). The result is a permutation of ``plan``
    (every sample exactly as often as in the plan) and no sample moves more than ``window - 1``
    positions. Raises ValueError for ``window < 1`` or mismatched lengths.
    """
    if window < 1:
        raise ValueError("window must be >= 1")
    if len(hit) != len(plan):
        raise ValueError("hit and plan differ in length")
    pos = np.arange(len(plan))
    key = (pos // window) * 2 + (~np.asarray(hit, dtype=bool)).astype(np.int64)
    return plan[np.argsort(key, kind="stable")]


def mean_displacement(plan: np.ndarray, reordered: np.ndarray) -> float:
    """Mean |new position - old position| over samples (plan positions); 0.0 for the same order.
    Assumes each sample id appears once in ``plan``."""
    if len(plan) == 0:
        return 0.0
    where = np.empty(int(plan.max()) + 1, dtype=np.int64)
    where[plan] = np.arange(len(plan))
    return float(np.mean(np.abs(where[reordered] - np.arange(len(plan)))))


def pack_bitmap(bits: np.ndarray | None) -> str | None:
    """A bool array as base64 text (None stays None): for JSON-serialisable states."""
    return None if bits is None else base64.b64encode(np.packbits(bits).tobytes()).decode()


def unpack_bitmap(text: str | None, n: int) -> np.ndarray | None:
    """Inverse of :func:`pack_bitmap`: a bool array of length ``n`` (None for empty text)."""
    if not text:
        return None
    return np.unpackbits(np.frombuffer(base64.b64decode(text), dtype=np.uint8))[:n].astype(bool)


def check_identity_keys(
    state: dict[str, Any], keys: tuple[str, ...], strict: bool, what: str = "loader", stacklevel: int = 3
) -> None:
    """Refuse (``strict``) or warn about a saved state that lacks some of ``keys``, the
    configuration that says whether it was saved by a ``what`` like the one resuming it (a
    trainer that kept only the epoch and the position). Without them a state of another seed,
    order, rank split or batch size would be resumed silently, repeating and skipping samples.

    Raises ValueError naming the missing keys with ``strict``; otherwise warns once per call
    (``RuntimeWarning``, naming them; ``stacklevel`` as :func:`warnings.warn`'s, counted from the
    caller of this function's caller) and returns."""
    missing = [k for k in keys if k not in state]
    if not missing:
        return
    why = (
        f"the state lacks {', '.join(missing)}, which say whether it was saved by a {what} like this one "
        "(the same data, seed, order and rank split)"
    )
    if strict:
        raise ValueError(
            f"cannot resume: {why}; another one would repeat and skip samples. Save the whole "
            "state_dict(), or pass strict=False to resume anyway (with a warning)"
        )
    warnings.warn(
        f"resuming a state that may not be this {what}'s: {why}; taken to be this {what}'s",
        RuntimeWarning,
        stacklevel=stacklevel,
    )


class SampleStream:
    """This rank's sample ids, epoch after epoch: a resumable sampler.

    Iterating yields int sample ids of epoch ``epoch`` from position ``position`` to the
    end of the epoch, then advances to the next epoch (like the Loader, each ``iter()`` is
    one epoch). The order is ``permutation(num_samples, seed, epoch, order, groups)`` split
    by :func:`rank_plan`, so the whole stream is a pure function of the constructor
    arguments and :meth:`state_dict`. Usable as a ``torch.utils.data.Sampler`` for another
    loader (``sampler=SampleStream(...)``) with stoker's order and resume.
    ``groups``: int array (num_samples,), the dataset's block of each sample (needed by
    the ``blockwise`` order; :attr:`stoker.store.blockmap.BlockMap.sample_block`).
    """

    def __init__(
        self,
        num_samples: int,
        seed: int = 0,
        *,
        order: str = "blockwise",
        groups: Any = None,
        window: int = DEFAULT_WINDOW_BLOCKS,
        rank: int = 0,
        world_size: int = 1,
        even: str = "pad",
        epoch: int = 0,
    ) -> None:
        if order not in PERMUTATIONS:
            raise KeyError(f"unknown permutation {order!r}; registered: {sorted(PERMUTATIONS)}")
        self.num_samples, self.seed, self.order = int(num_samples), int(seed), order
        self.groups, self.window = groups, int(window)
        self.rank, self.world_size, self.even = int(rank), int(world_size), even
        self.epoch, self.position = int(epoch), 0
        rank_plan(np.arange(1), 0, 1, even)  # validates ``even``
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {rank} not in [0, {world_size})")

    def plan(self, epoch: int) -> np.ndarray:
        """This rank's ids of ``epoch`` in order (int64)."""
        perm = permutation(self.num_samples, self.seed, epoch, self.order, groups=self.groups, window=self.window)
        return rank_plan(perm, self.rank, self.world_size, self.even)

    def __len__(self) -> int:
        return len(self.plan(self.epoch)) - self.position

    def __iter__(self) -> Iterator[int]:
        ids = self.plan(self.epoch)
        while self.position < len(ids):
            i = int(ids[self.position])
            self.position += 1
            yield i
        self.epoch, self.position = self.epoch + 1, 0

    def state_dict(self) -> dict[str, Any]:
        """{"epoch", "position", and the configuration}: plain ints and strings."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "order": self.order,
            "window": self.window,
            "rank": self.rank,
            "world_size": self.world_size,
            "even": self.even,
            "num_samples": self.num_samples,
        }

    def load_state_dict(self, state: dict[str, Any], strict: bool = True) -> None:
        """Continue from :meth:`state_dict`: the next ``iter()`` yields the rest of the saved
        epoch (the next epoch if it was finished; an epoch with no ids for this rank is still
        iterated, yielding nothing, so ``epoch`` advances exactly as in the saved run).
        ValueError if the state belongs to another configuration (the rest of the stream
        would differ) or its position is out of range, and, with ``strict`` (the default), if it
        lacks the configuration keys that say so (``strict=False``: resumed with a warning
        naming them; :func:`check_identity_keys`)."""
        mine = self.state_dict()
        keys = ("seed", "order", "window", "rank", "world_size", "even", "num_samples")
        if not isinstance(state, dict) or not {"epoch", "position"} <= state.keys():
            got = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise ValueError(
                f"cannot resume: not a SampleStream state_dict() (it needs 'epoch' and 'position'; got {got})"
            )
        check_identity_keys(state, keys, strict, "sampler")
        for k in keys:
            if k in state and state[k] != mine[k]:
                raise ValueError(f"cannot resume: state has {k}={state[k]!r}, this stream has {mine[k]!r}")
        epoch, pos = int(state["epoch"]), int(state["position"])
        n = len(self.plan(epoch))
        if not 0 <= pos <= n:
            raise ValueError(f"cannot resume: position {pos} outside 0..{n} for epoch {epoch}")
        # A finished epoch continues with the next one; an epoch with no ids (0 samples, or
        # fewer than world_size with even="drop") saved at position 0 has not been iterated
        # yet: it stays, so the resumed stream counts its epochs as the saved one did.
        self.epoch, self.position = (epoch + 1, 0) if pos == n > 0 else (epoch, pos)
