"""Resume state of the Loader (the torchdata ``StatefulDataLoader`` convention): where the stream
stands, and how a new loader continues it batch for batch.

Everything else about the stream is a pure function of the loader's configuration (order of
(seed, epoch, rank, world size); augmentation of (seed, epoch, sample id)), so this small record
plus that configuration is enough to resume.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ..order import check_identity_keys, pack_bitmap, unpack_bitmap

__all__ = ["IDENTITY_KEYS", "LoaderState"]

#: Configuration keys a saved state must agree on with the loader that resumes it (the rest of
#: the stream would not be the same otherwise).
IDENTITY_KEYS = (
    "seed",
    "order",
    "order_window",
    "rank",
    "world_size",
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
        position: ``(epoch, batches done)`` of the stream: batches yielded, or skipped because
            every sample in them was skipped; once an epoch's iteration has ended (finished or
            cut short), ``(epoch + 1, 0)``.
        hit_maps: epoch -> cached-block bitmap (bool array, one per block) used for that
            epoch's cache-aware order; kept so that a resume gets the same order.
        carry: tokens a streaming collate (:class:`stoker.collate.PackTokens`) carries from the
            batches done to the next one (a 1-D integer array), or None.
    """

    epoch: int = 0
    resume_batch: int = 0
    position: tuple[int, int] = (0, 0)
    hit_maps: dict[int, np.ndarray] = field(default_factory=dict)
    carry: np.ndarray | None = None

    def set_epoch(self, epoch: int) -> None:
        """Start the next ``iter()`` at ``epoch``, batch 0."""
        self.epoch, self.resume_batch, self.position = int(epoch), 0, (int(epoch), 0)
        self.carry = None

    def to_dict(self, identity: dict) -> dict:
        """The saved form: ``epoch``, ``batches_done``, the loader's ``identity`` (the
        :data:`IDENTITY_KEYS` values), ``cached_blocks`` (the packed bitmap of the current
        epoch, or None) and, only when there is one, ``carry`` (``{"dtype": str, "tokens": [int]}``).
        Plain ints and strings (JSON-serialisable)."""
        out = {
            "epoch": self.position[0],
            "batches_done": self.position[1],
            **identity,
            "cached_blocks": pack_bitmap(self.hit_maps.get(self.position[0])),
        }
        if self.carry is not None and len(self.carry) and self.position[1] > 0:
            out["carry"] = {"dtype": self.carry.dtype.str, "tokens": self.carry.tolist()}
        return out

    def load(
        self, state: dict, identity: dict, num_batches: Callable[[int], int], num_blocks: int, strict: bool = True
    ) -> None:
        """Take ``state`` (from :meth:`to_dict`): the next ``iter()`` continues that epoch after its
        ``batches_done`` batches, or starts the next epoch if that one was finished (an epoch with
        no batches, saved before its ``iter()``, is still run, yielding nothing).

        Args:
            state: the saved dict.
            identity: this loader's :data:`IDENTITY_KEYS` values.
            num_batches: batches of an epoch for this loader (a function of the epoch).
            num_blocks: the dataset's cache blocks (length of the cached-block bitmap).
            strict: refuse a state that lacks some of :data:`IDENTITY_KEYS` (a trainer that kept
                only ``epoch`` and ``batches_done``): nothing would tell whether it was saved by a
                loader with the same seed, order, rank split, batch size and dataset, and resuming
                one that was not repeats and skips samples without a word. False: resume it
                anyway, with a warning (``RuntimeWarning``) that names the keys it lacks.

        Raises:
            ValueError: ``state`` is not a state dict, lacks some of :data:`IDENTITY_KEYS` (with
                ``strict``; the message names them), or has another value for one of them
                (another dataset version, order, batch size, rank split or transform), or its
                ``batches_done`` is outside 0..batches of its epoch. Nothing is changed then.
        """
        if not isinstance(state, dict) or not {"epoch", "batches_done"} <= state.keys():
            got = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise ValueError(
                f"cannot resume: not a Loader state_dict() (it needs 'epoch' and 'batches_done'; got {got})"
            )
        check_identity_keys(state, IDENTITY_KEYS, strict, stacklevel=4)  # warns at the user's load_state_dict
        for k in IDENTITY_KEYS:
            if k in state and state[k] != identity[k]:
                raise ValueError(f"cannot resume: state has {k}={state[k]!r}, this loader has {identity[k]!r}")
        epoch, done = int(state["epoch"]), int(state["batches_done"])
        nb = num_batches(epoch)
        if not 0 <= done <= nb:
            raise ValueError(f"cannot resume: batches_done={done} outside 0..{nb} for epoch {epoch}")
        bits = unpack_bitmap(state.get("cached_blocks"), num_blocks)
        if bits is not None and done < nb:
            self.hit_maps[epoch] = bits  # the same cache-aware order as the saved run
        carry = state.get("carry")
        if carry is not None and (not isinstance(carry, dict) or not {"dtype", "tokens"} <= carry.keys()):
            raise ValueError(f"cannot resume: 'carry' must be {{'dtype': ..., 'tokens': [...]}}, got {carry!r}")
        if done == nb > 0:  # finished: the next epoch. An epoch of 0 batches saved at its
            epoch, done = epoch + 1, 0  # start has not run yet: it stays (its iter() yields nothing)
        self.epoch, self.resume_batch, self.position = epoch, done, (epoch, done)
        self.carry = np.asarray(carry["tokens"], dtype=np.dtype(carry["dtype"])) if carry and done else None
