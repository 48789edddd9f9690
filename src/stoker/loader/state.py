"""Resume state of the Loader (the torchdata ``StatefulDataLoader`` convention): where the stream
stands, and how a new loader continues it (what a user sees: :meth:`stoker.loader.Loader.state_dict`
and :meth:`~stoker.loader.Loader.load_state_dict`).

The saved state is global to the job: the epoch and which samples of it all ranks together have
served. With the interleaved rank split (:func:`stoker.order.rank_plan`) after k batches per
rank those are the first ``k * batch_size * world_size`` ids of the epoch's permutation, and
their number, ``samples_done``, says it all. A split that deals the samples otherwise (the
cluster's co-located plan, where each node's samples go to that node's ranks; a resumed epoch
split again) serves another set: the state then holds it as a bitmap of sample ids (``served``,
one bit per sample, zlib-compressed, base64). Every rank computes the same state from the job's
layout (:class:`stoker.order.EpochShares`), so a framework that saves rank 0's state and loads
it on every rank (Lightning, accelerate, Ray Train) resumes right, and a resume at another world
size or placement splits the samples not yet served over the ranks it has: every sample still
owed exactly once, ranks even as ``even=`` says. This is the elastic deterministic resumption
Mosaic Streaming documents for its StreamingDataset. Everything else about the stream is a pure
function of the loader's configuration (order of (seed, epoch); augmentation of (seed, epoch,
sample id)), so this small record plus that configuration is enough to resume.
"""

from __future__ import annotations

import base64
import binascii
import warnings
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ..order import EpochShares, check_identity_keys, pack_bitmap, unpack_bitmap

__all__ = ["IDENTITY_KEYS", "LoaderState"]

#: ``shares(epoch, served, world_size)``: every rank's share of ``epoch`` over ``world_size``
#: ranks (None: the loader's) when the samples ``served`` (bool by sample id, or None) were served
#: before (the Loader's ``_shares``).
SharesFn = Callable[[int, "np.ndarray | None", "int | None"], EpochShares]

#: Configuration keys a saved state must agree on with the loader that resumes it (the rest of
#: the stream would not be the same otherwise). Rank and world size are not among them: the
#: state is the job's, and any rank of any world size continues it.
IDENTITY_KEYS = (
    "seed",
    "order",
    "order_window",
    "batch_size",
    "even",
    "drop_last",
    "transform",
    "dataset_version",
    "num_samples",
    "subset",
    "cache_aware_window",
    "carry_from",
)

#: Identity keys a state saved by an earlier release may lack, with the value they had then
#: (every loader read a whole dataset before subsets).
_ADDED_KEYS = {"subset": None}


@dataclass
class LoaderState:
    """Where one loader's stream stands; owned by the :class:`stoker.loader.Loader` and
    advanced by its running pipeline.

    Attributes:
        epoch: the epoch the next ``iter()`` runs.
        resume_batch: batches of ``epoch`` the next ``iter()`` skips (set by a resume, else 0).
        position: ``(epoch, batches done)`` of the stream: batches of this loader's plan of that
            epoch yielded, or skipped because every sample in them was skipped; once an epoch's
            iteration has ended (finished or cut short), ``(epoch + 1, 0)``.
        offset: ``(epoch, served)`` after a resume at a split of the epoch that batches of this
            loader cannot reach: the samples ``served`` (bool by sample id) were served before,
            and this loader's plan of that epoch is the rest split again
            (:class:`stoker.order.EpochShares`); None otherwise.
        hit_maps: epoch -> cached-block bitmap (bool array, one per block) used for that
            epoch's cache-aware order; kept so that a resume gets the same order.
        carry: tokens a streaming collate (:class:`stoker.collate.PackTokens`) carries from the
            batches done to the next one (a 1-D integer array), or None.
        opened: ``(epoch, start batch, loaded)`` of the last ``iter()`` while that epoch has not
            begun (no batch asked for yet), else None; ``loaded``: that position came from
            :meth:`load`. A later ``iter()`` runs that epoch again (:meth:`open_epoch`): a
            framework's look at the loader that never asks for a batch (Lightning's) does not
            use up an epoch or a resumed position.
        loaded: the position was set by :meth:`load` and no ``iter()`` has taken it yet.
        carry_before: :attr:`carry` as it was before the last batch delivered (a consumer that
            holds that batch has not handed it on: :meth:`to_dict` with ``held``).
        cut: ``(epoch, batches done, batches of the plan)`` of the last epoch whose iteration
            ended before its last batch (a ``break``, a caught Ctrl-C, an error), while the
            stream stands at the start of the next epoch; None otherwise.
    """

    epoch: int = 0
    resume_batch: int = 0
    position: tuple[int, int] = (0, 0)
    offset: tuple[int, np.ndarray] | None = None
    hit_maps: dict[int, np.ndarray] = field(default_factory=dict)
    carry: np.ndarray | None = None
    opened: tuple[int, int, bool] | None = None
    loaded: bool = False
    carry_before: np.ndarray | None = None
    cut: tuple[int, int, int] | None = None
    cut_said: bool = False  # the Loader has warned of a state taken after a cut epoch (once)

    def iterating(self) -> bool:
        """Whether an ``iter()``'s epoch has begun (a batch asked for) and its iteration has not
        ended: the stream stands inside that epoch, moved on by its iterator."""
        return self.opened is None and self.position[0] == self.epoch - 1

    def set_epoch(self, epoch: int) -> None:
        """Start the next ``iter()`` at ``epoch``, batch 0; but keep a position that :meth:`load`
        set and no batch has been taken from yet when ``epoch`` is its epoch (a framework that
        names the epoch before each ``iter()``, as the Hugging Face Trainer does, continues the
        resumed epoch where it stood).

        Raises:
            ValueError: such a loaded position is pending and ``epoch`` is another epoch: moving
                there would silently drop the resume (the samples before it trained twice, or
                the rest never). Nothing is changed then; the message names both epochs.
        """
        pending = self.pending_load()
        if pending is not None:
            if pending[0] == int(epoch):
                return
            raise ValueError(
                f"set_epoch({int(epoch)}): the loader holds a resumed position (epoch {pending[0]}, batch "
                f"{pending[1]}) from load_state_dict() that no batch has been taken from yet; moving to epoch "
                f"{int(epoch)} would drop it and serve samples twice or never. Name epoch {pending[0]} (the "
                "checkpoint's), or call set_epoch() before load_state_dict()"
            )
        self.epoch, self.resume_batch, self.position = int(epoch), 0, (int(epoch), 0)
        self.offset, self.carry, self.opened, self.loaded, self.cut = None, None, None, False, None

    def pending_load(self) -> tuple[int, int] | None:
        """``(epoch, batch)`` of the position :meth:`load` set, while the next ``iter()`` still
        starts there (none taken yet, or only by an ``iter()`` never asked for a batch); else None."""
        if self.loaded:
            return self.epoch, self.resume_batch
        if self.opened is not None and self.opened[2] and self._given_back():
            return self.opened[0], self.opened[1]
        return None

    def _given_back(self) -> bool:
        """Whether the next ``iter()`` runs the opened epoch again (see :meth:`open_epoch`)."""
        return self.opened is not None and self.epoch == self.opened[0] + 1 and self.resume_batch == 0

    def open_epoch(self) -> tuple[int, int]:
        """``(epoch, start batch)`` for an ``iter()``, and the stream moved past it (``epoch`` + 1,
        so an epoch cut short is not replayed). When the previous ``iter()``'s epoch never began
        and nothing moved the stream since (:meth:`set_epoch`, :meth:`load`), that epoch and
        start again: an iterator that was never asked for a batch served nothing."""
        if self.opened is not None and self._given_back():
            epoch, start, loaded = self.opened
        else:
            epoch, start, loaded = self.epoch, self.resume_batch, self.loaded
        self.epoch, self.resume_batch, self.loaded = epoch + 1, 0, False
        self.opened = (epoch, start, loaded)
        return epoch, start

    def reopen(self, epoch: int) -> None:
        """The opened iterator serves ``epoch`` from its first batch instead (nothing of it done yet)."""
        self.set_epoch(epoch)
        self.epoch, self.opened = int(epoch) + 1, (int(epoch), 0, False)

    def begin(self) -> None:
        """The opened epoch's first batch was asked for: a later ``iter()`` runs the next epoch."""
        self.opened = None

    def served_before(self, epoch: int) -> np.ndarray | None:
        """Samples of ``epoch`` served before this loader's plan of it begins (bool by sample id),
        or None (no resume split the rest of that epoch again)."""
        return self.offset[1] if self.offset is not None and self.offset[0] == epoch else None

    def to_dict(
        self, identity: dict, *, rank: int, world_size: int, batch_size: int, shares: SharesFn, held: bool = False
    ) -> dict:
        """The saved form, the same on every rank after the same number of batches.

        - ``epoch`` and ``samples_done``: samples of that epoch served by all ranks together
          (``num_samples`` once the epoch is finished; the ranks' repeats that only even their
          counts are not counted);
        - ``served``: None when those are the first ``samples_done`` ids of the epoch's
          permutation (the interleaved split from the epoch's start), else which they are: one
          bit per sample id (``numpy.packbits`` order), zlib-compressed, base64 text; at most
          ``ceil(num_samples / 8)`` bytes before base64 (about 217 KB of text for 1.3 M samples;
          far less where the served samples run in blocks);
        - ``batches_done``: batches of that epoch each rank has taken (for the user, and to
          continue the saved plan batch for batch where the resuming loader's plan is the same);
        - ``world_size``: the world size that saved it (a resume at another one splits the rest
          of the epoch again; not an identity key);
        - the loader's ``identity`` (the :data:`IDENTITY_KEYS` values);
        - ``cached_blocks``: the packed bitmap of the current epoch's cache-aware order, or None;
        - only when there is one, ``carry`` (``{"dtype": str, "tokens": [int], "rank": int}``):
          a streaming collate's tokens, which belong to the rank that saved them.

        ``shares``: the loader's split (:data:`SharesFn`). ``held``: the consumer holds the last
        batch yielded and has not handed it on (Ray Train's wrapper:
        :class:`stoker.loader.adapters.ReadAhead`): the state is the one before that batch (its
        position one batch back, the carry before it). Plain ints and strings (JSON-serialisable)."""
        epoch, done = self.position
        carry = self.carry
        if held and done > 0:
            done, carry = done - 1, self.carry_before
        mine = shares(epoch, self.served_before(epoch), world_size)
        nb = mine.batches(batch_size)
        bits = None
        if done >= nb > 0:
            count = len(mine.perm)
        else:
            got = mine.served(done * batch_size)
            count = int(got.sum())
            if not got[mine.perm[:count]].all():  # not the first ids of the permutation: say which
                bits = got
        out = {
            "epoch": epoch,
            "samples_done": count,
            "served": _pack_served(bits),
            "batches_done": done,
            "world_size": world_size,
            **identity,
            "cached_blocks": pack_bitmap(self.hit_maps.get(epoch)),
        }
        if carry is not None and len(carry) and done > 0:
            out["carry"] = {"dtype": carry.dtype.str, "tokens": carry.tolist(), "rank": rank}
        return out

    def load(
        self,
        state: dict,
        identity: dict,
        *,
        rank: int,
        world_size: int,
        batch_size: int,
        num_blocks: int,
        shares: SharesFn,
        interleaved: bool = True,
        resplit: bool = True,
        strict: bool = True,
    ) -> None:
        """Take ``state`` (from :meth:`to_dict`, saved on any rank at any world size and
        placement): the next ``iter()`` continues that epoch with this rank's share of the samples
        not yet served, or starts the next epoch if none is left for any rank (an epoch with no
        batches, saved before its ``iter()``, is still run, yielding nothing). Where this loader's
        own plan has served just those samples after ``k`` batches per rank (the saving world size
        and placement), it skips ``k`` batches: the rest is the saved run's, batch for batch; else
        the samples not served are split again (:class:`stoker.order.EpochShares`), ranks even.

        The per-rank form of earlier releases (``batches_done`` with the saving ``rank`` and
        ``world_size``) is still taken, with a DeprecationWarning: its ``batches_done`` batches of
        each of ``world_size`` ranks are the ids served.

        Args:
            state: the saved dict.
            identity: this loader's :data:`IDENTITY_KEYS` values.
            rank, world_size, batch_size: this loader's; ``shares``: its split (:data:`SharesFn`).
            num_blocks: the dataset's cache blocks (length of the cached-block bitmap).
            interleaved: whether the loader's split is the interleaved one, whose first ``k``
                batches per rank are the first ids of the permutation. A state without ``served``
                (earlier releases, a trimmed state) says only how many samples were served: a
                split of another kind (the cluster's) cannot tell which, and refuses one cut
                mid-epoch.
            resplit: whether the loader's plan can split the rest of an epoch again (False for a
                plan of its own that ``shares`` does not describe: refuse what it cannot skip to).
            strict: refuse a state that lacks some of :data:`IDENTITY_KEYS` (a trainer that kept
                only ``epoch`` and ``samples_done``): nothing would tell whether it was saved by a
                loader with the same seed, order, batch size and dataset, and resuming one that
                was not repeats and skips samples without a word. False: resume it anyway, with a
                warning (``RuntimeWarning``) that names the keys it lacks; it is then taken to be
                saved at this loader's world size (and rank, for the per-rank form).

        Raises:
            ValueError: ``state`` is not a state dict, lacks some of :data:`IDENTITY_KEYS` (with
                ``strict``; the message names them), or has another value for one of
                :data:`IDENTITY_KEYS` (another dataset version, seed, order, batch size, split mode
                or transform: named), or its ``samples_done`` (``batches_done``, ``served``) is out
                of range or malformed, or it cannot be continued on this rank (a streaming
                collate's carry saved on another rank or world size, or cut from a plan this one
                splits again; a cache-aware order cut at another world size or split; a split again
                that ``resplit`` forbids; a state without ``served`` cut mid-epoch, for a split that
                is not ``interleaved``). Nothing is changed then.
        """
        _check_saved(state, identity, strict)
        epoch = int(state["epoch"])
        saved_world = int(state.get("world_size", world_size))  # (a trimmed state: taken to be this loader's)
        if saved_world < 1:
            raise ValueError(f"cannot resume: state has world_size={saved_world}")
        count, skip, before, finished = _resume_point(
            state, epoch, saved_world, rank, world_size, batch_size, shares, interleaved
        )
        if not finished:  # (``before``: the rest is split again)
            again = before is not None
            _check_continuable(state, identity, epoch, count, saved_world, again, rank, world_size, resplit)
        carry = state.get("carry")
        if carry is not None and (not isinstance(carry, dict) or not {"dtype", "tokens"} <= carry.keys()):
            raise ValueError(f"cannot resume: 'carry' must be {{'dtype': ..., 'tokens': [...]}}, got {carry!r}")
        bits = unpack_bitmap(state.get("cached_blocks"), num_blocks)
        if bits is not None and not finished:
            self.hit_maps[epoch] = bits  # the same cache-aware order as the saved run
        if finished:  # the next epoch. An epoch saved at its start has not run yet: it stays
            epoch, skip, before = epoch + 1, 0, None  # (if it has no batches, its iter() yields nothing)
        self.epoch, self.resume_batch, self.position = epoch, skip, (epoch, skip)
        self.cut = None
        self.offset = (epoch, before) if before is not None else None
        self.opened, self.loaded = None, True
        self.carry = np.asarray(carry["tokens"], dtype=np.dtype(carry["dtype"])) if carry and skip else None


def _resume_point(
    state: dict, epoch: int, saved_world: int, rank, world_size, batch_size, shares: SharesFn, interleaved: bool
) -> tuple[int, int, np.ndarray | None, bool]:
    """Where this loader continues ``epoch`` of ``state``: ``(samples served, batches of its own
    plan to skip, the samples served when the rest is split again instead (else None), whether
    nothing is left of the epoch for any rank)``. ValueError as :meth:`LoaderState.load`'s for a
    malformed state, and for one without ``served`` cut mid-epoch when the split is not
    ``interleaved``; the other arguments as :meth:`LoaderState.load`'s."""
    fresh = shares(epoch, None, world_size)
    count, got = _served(state, epoch, saved_world, rank, world_size, batch_size, fresh.perm, shares)
    if got is None and not interleaved and "served" not in state and 0 < count < len(fresh.perm):
        raise ValueError(
            f"cannot resume: this state (samples_done={count} of epoch {epoch}, without 'served') says how "
            "many samples were served, not which, and this loader's plan does not serve the first ids of "
            "the permutation (a co-located cluster plan): it would repeat and skip samples. Resume a "
            "state_dict() saved by this release, or start the epoch again (set_epoch)"
        )
    skip = _same_plan(fresh, count, got, state, batch_size, world_size, interleaved)
    before = None
    if skip is None:
        before = got if got is not None else _first(fresh.perm, count)
        if not before.any():  # nothing served: the epoch from its start
            before = None
        left = (fresh if before is None else shares(epoch, before, world_size)).batches(batch_size)
        skip = 0
    else:
        left = fresh.batches(batch_size)
    return count, skip, before, count > 0 and left - skip <= 0


def _pack_served(bits: np.ndarray | None) -> str | None:
    """A bool array by sample id as the state's ``served`` text (None stays None)."""
    if bits is None:
        return None
    return base64.b64encode(zlib.compress(np.packbits(bits).tobytes(), 9)).decode("ascii")


def _unpack_served(text: object, num_samples: int, epoch: int) -> np.ndarray:
    """Inverse of :func:`_pack_served`: bool ``(num_samples,)``. ValueError naming the key when
    ``text`` is not such a bitmap of ``num_samples`` samples."""
    try:
        if not isinstance(text, str):
            raise TypeError(type(text).__name__)
        raw = zlib.decompress(base64.b64decode(text, validate=True))
    except (TypeError, binascii.Error, zlib.error) as exc:
        why = f"'served' of epoch {epoch} is not a bitmap of served samples ({exc})"
        raise ValueError(f"cannot resume: {why}") from None
    if len(raw) != -(-num_samples // 8):
        raise ValueError(
            f"cannot resume: 'served' of epoch {epoch} holds {len(raw) * 8} bits, not one per sample ({num_samples})"
        )
    return np.unpackbits(np.frombuffer(raw, dtype=np.uint8))[:num_samples].astype(bool)


def _first(perm: np.ndarray, count: int) -> np.ndarray:
    """The first ``count`` ids of ``perm`` as a bool array by sample id."""
    out = np.zeros(len(perm), dtype=bool)
    out[perm[:count]] = True
    return out


def _same_plan(
    fresh: EpochShares, count: int, got: np.ndarray | None, state: dict, batch_size: int, world_size: int, interleaved
) -> int | None:
    """Batches ``k`` of this loader's own plan of the epoch (``fresh``) after which its ranks have
    served exactly the samples the state says (``count`` first ids of the permutation, or
    ``got``), or None when there is no such ``k`` (the rest is split again)."""
    step = batch_size * world_size
    if got is None and interleaved:  # the first ``count`` ids: whole batches of every rank, or not
        return count // step if count % step == 0 and count < len(fresh.perm) else None
    want = got if got is not None else _first(fresh.perm, count)
    nb = fresh.batches(batch_size)
    tries = {count // step} if count % step == 0 else set()
    done = state.get("batches_done")
    if isinstance(done, int) and not isinstance(done, bool):
        tries.add(done)
    for k in sorted(t for t in tries if 0 <= t < nb or (t == 0 and nb == 0)):
        if np.array_equal(fresh.served(k * batch_size), want):
            return k
    return None


def _check_saved(state: dict, identity: dict, strict: bool) -> None:
    """ValueError unless ``state`` is a Loader state whose :data:`IDENTITY_KEYS` agree with this
    loader's ``identity`` (with ``strict``, all of them present; without, a RuntimeWarning at the
    user's ``load_state_dict`` naming those it lacks)."""
    if not isinstance(state, dict) or "epoch" not in state or not {"samples_done", "batches_done"} & state.keys():
        got = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"cannot resume: not a Loader state_dict() (it needs 'epoch' and 'samples_done'; got {got})")
    if all(k in state for k in IDENTITY_KEYS if k not in _ADDED_KEYS):  # a whole state, maybe of an earlier release
        state = {**_ADDED_KEYS, **state}
    check_identity_keys(state, IDENTITY_KEYS, strict, stacklevel=5)  # warns at the user's load_state_dict
    for k in sorted(IDENTITY_KEYS, key=lambda k: k != "subset"):  # another subset first: the clearest reason
        if k in state and state[k] != identity[k]:
            if k == "subset":
                raise ValueError(f"cannot resume: {_subset_mismatch(state[k], identity[k])}")
            raise ValueError(f"cannot resume: state has {k}={state[k]!r}, this loader has {identity[k]!r}")


def _subset_mismatch(saved: object, mine: object) -> str:
    """Why a state of one subset (``Dataset.subset``/``split``; a ``"<count>:<digest>"`` or None
    for the whole dataset) does not resume a loader over another, in words."""

    def what(x: object) -> str:
        return "the whole dataset" if x is None else f"a subset of {str(x).split(':')[0]} samples ({x})"

    return (
        f"the state was saved by a loader over {what(saved)}, this loader reads {what(mine)}: "
        "resume each subset (a split's train and validation parts) with its own state_dict()"
    )


def _served(
    state: dict, epoch: int, saved_world: int, rank, world_size, batch_size, perm: np.ndarray, shares: SharesFn
) -> tuple[int, np.ndarray | None]:
    """``(count, served)``: how many samples of ``epoch`` the ``state`` says all ranks were served
    and which (bool by sample id, from its ``served``), or None for the first ``count`` ids of the
    permutation ``perm``: its ``samples_done``, or for the per-rank form of earlier releases its
    ``batches_done`` batches of each of ``saved_world`` ranks (a DeprecationWarning at the user's
    ``load_state_dict``). ValueError when out of range or malformed; the other arguments as
    :meth:`LoaderState.load`'s."""
    num_samples = len(perm)
    if "samples_done" in state:
        served = int(state["samples_done"])
        if not 0 <= served <= num_samples:
            raise ValueError(f"cannot resume: samples_done={served} outside 0..{num_samples} for epoch {epoch}")
        if state.get("served") is None:
            return served, None
        got = _unpack_served(state["served"], num_samples, epoch)
        if int(got.sum()) != served:
            raise ValueError(
                f"cannot resume: 'served' of epoch {epoch} marks {int(got.sum())} samples, samples_done says {served}"
            )
        return served, got
    done = int(state["batches_done"])
    saved_rank = int(state.get("rank", rank if saved_world == world_size else 0))
    if not 0 <= saved_rank < saved_world:
        raise ValueError(f"cannot resume: state has rank={saved_rank} outside 0..{saved_world - 1}")
    nb = shares(epoch, None, saved_world).batches(batch_size)  # (every split gives each rank the same count)
    if not 0 <= done <= nb:
        raise ValueError(f"cannot resume: batches_done={done} outside 0..{nb} for epoch {epoch}")
    served = num_samples if done == nb > 0 else min(done * batch_size * saved_world, num_samples)
    if {"rank", "world_size"} & state.keys():  # (a trimmed one was warned about in check_identity_keys)
        warnings.warn(
            "a per-rank Loader state (batches_done, rank) is deprecated: it is read as "
            f"samples_done={served} of epoch {epoch}; save loader.state_dict() again",
            DeprecationWarning,
            stacklevel=5,  # at the user's load_state_dict
        )
    return served, None


def _check_continuable(
    state: dict, identity: dict, epoch, served, saved_world, split_again: bool, rank, world_size, resplit
) -> None:
    """ValueError when the rest of ``epoch`` (``served`` samples done; ``split_again``: this
    loader's plan does not reach them in whole batches, the rest is split again) cannot be
    continued on ``rank`` of ``world_size``: a cache-aware order cut mid-epoch at another split, a
    split again that ``resplit`` forbids, a streaming collate's carry saved by another rank or
    world size or for a plan that is split again."""
    window = identity.get("cache_aware_window", 0)
    if window > 0 and 0 < served and (saved_world != world_size or split_again):
        raise ValueError(
            f"cannot resume: a cache-aware order (cache_aware_window={window}) "
            f"saved at world_size={saved_world} mid-epoch cannot be split again over {world_size} ranks "
            "(each rank's order depends on its own node cache)"
        )
    if split_again and not resplit:
        raise ValueError(
            f"cannot resume: samples_done={served} of epoch {epoch} is not a whole number of batches of "
            f"{world_size} ranks, and this loader's plan cannot split the rest of an epoch again "
            f"(resume at world_size={saved_world})"
        )
    carry = state.get("carry")
    if carry is not None and (not isinstance(carry, dict) or not {"dtype", "tokens"} <= carry.keys()):
        return  # load() refuses it as malformed
    if carry is not None and (saved_world != world_size or carry.get("rank", state.get("rank", rank)) != rank):
        saver = carry.get("rank", state.get("rank"))
        raise ValueError(
            f"cannot resume: the streaming collate's carried tokens were saved by rank {saver} "
            f"of {saved_world}, this loader is rank {rank} of {world_size} (load each rank's own state)"
        )
    if carry is not None and split_again:
        raise ValueError(
            f"cannot resume: the streaming collate's carried tokens continue the saved plan of epoch {epoch}, "
            "and this loader's plan splits the rest of that epoch again (another placement of the ranks): "
            "resume where the ranks ran, or at the start of an epoch"
        )
