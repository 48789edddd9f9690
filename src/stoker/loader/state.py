"""Resume state of the Loader (the torchdata ``StatefulDataLoader`` convention): where the stream
stands, and how a new loader continues it (what a user sees: :meth:`stoker.loader.Loader.state_dict`
and :meth:`~stoker.loader.Loader.load_state_dict`).

The saved state is global to the job: the epoch and how many ids of the epoch's permutation all
ranks together have served (the rank split interleaves, :func:`stoker.order.rank_plan`, so after
k batches per rank they have served the first ``k * batch_size * world_size``), so a resume at
another world size splits the rest of the epoch again over the ranks it has.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ..order import check_identity_keys, pack_bitmap, unpack_bitmap

__all__ = ["IDENTITY_KEYS", "LoaderState"]

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
    "cache_aware_window",
    "carry_from",
)


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
        offset: ``(epoch, ids)`` after a resume at a split of the epoch that batches of this
            loader cannot reach: ``ids`` of that epoch's permutation were served before, and this
            loader's plan of it is the rest split again (:func:`stoker.order.rank_plan`'s
            ``start``); None otherwise.
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
    """

    epoch: int = 0
    resume_batch: int = 0
    position: tuple[int, int] = (0, 0)
    offset: tuple[int, int] | None = None
    hit_maps: dict[int, np.ndarray] = field(default_factory=dict)
    carry: np.ndarray | None = None
    opened: tuple[int, int, bool] | None = None
    loaded: bool = False

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
        self.offset, self.carry, self.opened, self.loaded = None, None, None, False

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

    def start_of(self, epoch: int) -> int:
        """Ids of ``epoch``'s permutation served before this loader's plan of it begins (0 unless
        a resume split the rest of that epoch again)."""
        return self.offset[1] if self.offset is not None and self.offset[0] == epoch else 0

    def to_dict(
        self,
        identity: dict,
        *,
        rank: int,
        world_size: int,
        batch_size: int,
        num_samples: int,
        num_batches: Callable[[int], int],
    ) -> dict:
        """The saved form, the same on every rank after the same number of batches.

        - ``epoch`` and ``samples_done``: ids of that epoch's permutation served by all ranks
          together (``num_samples`` once the epoch is finished; ids of the ranks' padding are not
          counted);
        - ``batches_done``: batches of that epoch each rank has taken (for the user; a resume reads
          ``samples_done``);
        - ``world_size``: the world size that saved it (a resume at another one splits the rest
          of the epoch again; not an identity key);
        - the loader's ``identity`` (the :data:`IDENTITY_KEYS` values);
        - ``cached_blocks``: the packed bitmap of the current epoch's cache-aware order, or None;
        - only when there is one, ``carry`` (``{"dtype": str, "tokens": [int], "rank": int}``):
          a streaming collate's tokens, which belong to the rank that saved them.

        ``num_batches(epoch)``: this loader's batches of ``epoch``. Plain ints and strings
        (JSON-serialisable)."""
        epoch, done = self.position
        nb = num_batches(epoch)
        if done >= nb > 0:
            served = num_samples
        else:
            served = min(self.start_of(epoch) + done * batch_size * world_size, num_samples)
        out = {
            "epoch": epoch,
            "samples_done": served,
            "batches_done": done,
            "world_size": world_size,
            **identity,
            "cached_blocks": pack_bitmap(self.hit_maps.get(epoch)),
        }
        if self.carry is not None and len(self.carry) and done > 0:
            out["carry"] = {"dtype": self.carry.dtype.str, "tokens": self.carry.tolist(), "rank": rank}
        return out

    def load(
        self,
        state: dict,
        identity: dict,
        *,
        rank: int,
        world_size: int,
        batch_size: int,
        num_samples: int,
        num_blocks: int,
        plan_len: Callable[[int, int, int, int], int],
        resplit: bool = True,
        strict: bool = True,
    ) -> None:
        """Take ``state`` (from :meth:`to_dict`) as :meth:`stoker.loader.Loader.load_state_dict`
        says. When ``samples_done`` is a whole number of this loader's steps (``batch_size *
        world_size``), as it always is at the world size that saved it, that is the same as
        skipping that many batches of the epoch's plan.

        The per-rank form of earlier releases (``batches_done`` with the saving ``rank`` and
        ``world_size``) is still taken, with a DeprecationWarning: its ``batches_done`` batches of
        each of ``world_size`` ranks are the ids served.

        Args:
            state: the saved dict.
            identity: this loader's :data:`IDENTITY_KEYS` values.
            rank, world_size, batch_size, num_samples: this loader's.
            num_blocks: the dataset's cache blocks (length of the cached-block bitmap).
            plan_len: ``(epoch, start, rank, world_size) -> ids`` of that rank's plan of ``epoch``
                when ``start`` ids of its permutation were served before.
            resplit: whether the loader's plan can split the rest of an epoch again (False for a
                plan that is not the interleaved split: a state cut between two of its steps is
                then refused).
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
                or transform: named), or its ``samples_done`` (``batches_done``) is out of range,
                or it cannot be continued on this rank (a streaming collate's carry saved on
                another rank or world size; a cache-aware order cut at another world size
                between two of this loader's steps; a split again that ``resplit`` forbids).
                Nothing is changed then.
        """
        _check_saved(state, identity, strict)
        epoch = int(state["epoch"])
        saved_world = int(state.get("world_size", world_size))  # (a trimmed state: taken to be this loader's)
        if saved_world < 1:
            raise ValueError(f"cannot resume: state has world_size={saved_world}")
        served = _served(state, epoch, saved_world, rank, world_size, batch_size, num_samples, plan_len)
        step = batch_size * world_size
        whole = served % step == 0 and served < num_samples  # a number of this loader's batches
        start = 0 if whole else served
        left = -(-plan_len(epoch, start, rank, world_size) // batch_size)  # this loader's batches from there
        skip = served // step if whole else 0
        finished = served > 0 and left - skip <= 0
        if not finished:
            _check_continuable(state, identity, epoch, served, saved_world, start, rank, world_size, resplit)
        carry = state.get("carry")
        if carry is not None and (not isinstance(carry, dict) or not {"dtype", "tokens"} <= carry.keys()):
            raise ValueError(f"cannot resume: 'carry' must be {{'dtype': ..., 'tokens': [...]}}, got {carry!r}")
        bits = unpack_bitmap(state.get("cached_blocks"), num_blocks)
        if bits is not None and not finished:
            self.hit_maps[epoch] = bits  # the same cache-aware order as the saved run
        if finished:  # the next epoch. An epoch saved at its start has not run yet: it stays
            epoch, skip, start = epoch + 1, 0, 0  # (if it has no batches, its iter() yields nothing)
        self.epoch, self.resume_batch, self.position = epoch, skip, (epoch, skip)
        self.offset = (epoch, start) if start else None
        self.opened, self.loaded = None, True
        self.carry = np.asarray(carry["tokens"], dtype=np.dtype(carry["dtype"])) if carry and skip else None


def _check_saved(state: dict, identity: dict, strict: bool) -> None:
    """ValueError unless ``state`` is a Loader state whose :data:`IDENTITY_KEYS` agree with this
    loader's ``identity`` (with ``strict``, all of them present; without, a RuntimeWarning at the
    user's ``load_state_dict`` naming those it lacks)."""
    if not isinstance(state, dict) or "epoch" not in state or not {"samples_done", "batches_done"} & state.keys():
        got = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"cannot resume: not a Loader state_dict() (it needs 'epoch' and 'samples_done'; got {got})")
    check_identity_keys(state, IDENTITY_KEYS, strict, stacklevel=5)  # warns at the user's load_state_dict
    for k in IDENTITY_KEYS:
        if k in state and state[k] != identity[k]:
            raise ValueError(f"cannot resume: state has {k}={state[k]!r}, this loader has {identity[k]!r}")


def _served(state: dict, epoch: int, saved_world: int, rank, world_size, batch_size, num_samples, plan_len) -> int:
    """Ids of ``epoch``'s permutation that ``state`` says all ranks were served: its
    ``samples_done``, or for the per-rank form of earlier releases its ``batches_done`` batches of
    each of ``saved_world`` ranks (a DeprecationWarning at the user's ``load_state_dict``).
    ValueError when out of range; the other arguments as :meth:`LoaderState.load`'s."""
    if "samples_done" in state:
        served = int(state["samples_done"])
        if not 0 <= served <= num_samples:
            raise ValueError(f"cannot resume: samples_done={served} outside 0..{num_samples} for epoch {epoch}")
        return served
    done = int(state["batches_done"])
    saved_rank = int(state.get("rank", rank if saved_world == world_size else 0))
    if not 0 <= saved_rank < saved_world:
        raise ValueError(f"cannot resume: state has rank={saved_rank} outside 0..{saved_world - 1}")
    nb = -(-plan_len(epoch, 0, saved_rank, saved_world) // batch_size)
    if not 0 <= done <= nb:
        raise ValueError(f"cannot resume: batches_done={done} outside 0..{nb} for epoch {epoch}")
    served = num_samples if done == nb > 0 else min(done * batch_size * saved_world, num_samples)
    if {"rank", "world_size"} & state.keys():  # (a trimmed one was warned about in check_identity_keys)
        warnings.warn(
            "a per-rank Loader state (batches_done, rank) is deprecated: it is read as "
            f"samples_done={served} of epoch {epoch}; save loader.state_dict() again",
            DeprecationWarning,
            stacklevel=4,
        )
    return served


def _check_continuable(
    state: dict, identity: dict, epoch, served, saved_world, start, rank, world_size, resplit
) -> None:
    """ValueError when the rest of ``epoch`` (``served`` ids done; ``start``: the ids before a
    split again, 0 when ``served`` is a whole number of this loader's batches) cannot be continued
    on ``rank`` of ``world_size``: a cache-aware order cut mid-epoch at another split, a split again
    that ``resplit`` forbids, a streaming collate's carry saved by another rank or world size."""
    window = identity.get("cache_aware_window", 0)
    if window > 0 and 0 < served and (saved_world != world_size or start):
        raise ValueError(
            f"cannot resume: a cache-aware order (cache_aware_window={window}) "
            f"saved at world_size={saved_world} mid-epoch cannot be split again over {world_size} ranks "
            "(each rank's order depends on its own node cache)"
        )
    if start and not resplit:
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
