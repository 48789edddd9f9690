"""Resume for the Loader (the torchdata ``StatefulDataLoader`` convention): where the stream
stands, and how a new loader continues it batch for batch."""
from __future__ import annotations

from ..order import pack_bitmap, unpack_bitmap

__all__ = ["ResumableMixin"]


class ResumableMixin:
    """``state_dict`` / ``load_state_dict`` of :class:`stoker.loader.Loader` (uses its plan,
    position and cache-aware bitmaps)."""

    def state_dict(self) -> dict:
        """Where the stream stands: the epoch and the batches of it already yielded (once an
        epoch's iteration has ended early, by ``break``, ``close()`` or an error, the next
        epoch at batch 0: the next ``iter()`` runs that one, a cut epoch is not replayed).

        Everything else is a pure function of the configuration (order of (seed, epoch,
        rank, world size); augmentation of (seed, epoch, sample id)), so a loader built
        with the same arguments in a new process and given this state yields the rest of
        the stream batch for batch. Plain ints and strings (JSON-serialisable).
        """
        return {"epoch": self._position[0], "batches_done": self._position[1], "seed": self.seed,
                "order": self.order, "order_window": self.order_window, "rank": self.rank,
                "world_size": self.world_size, "batch_size": self.batch_size, "even": self.even,
                "drop_last": self.drop_last, "transform": self.cfg["transform"],
                "dataset_version": self.dataset.version, "num_samples": len(self.dataset),
                "cache_aware_window": self.cache_aware_window,
                "cached_blocks": pack_bitmap(self._hit_maps.get(self._position[0]))}

    def load_state_dict(self, state: dict) -> None:
        """Resume from :meth:`state_dict`: the next ``iter()`` continues that epoch after its
        ``batches_done`` batches (or starts the next epoch if that one was finished; an epoch
        with no batches for this rank, saved before its ``iter()``, is still run, yielding
        nothing, so ``epoch`` and ``history`` advance exactly as in the saved run).

        Raises ValueError when the state belongs to another dataset version or to a
        different order, batch size, rank split or transform (the rest of the stream
        would not be the same).
        """
        mine = self.state_dict()
        for k in ("seed", "order", "order_window", "rank", "world_size", "batch_size", "even",
                  "drop_last", "transform", "dataset_version", "num_samples", "cache_aware_window"):
            if k in state and state[k] != mine[k]:
                raise ValueError(f"cannot resume: state has {k}={state[k]!r}, this loader has {mine[k]!r}")
        epoch, done = int(state["epoch"]), int(state["batches_done"])
        nb = -(-len(self.plan(epoch)) // self.batch_size)
        if not 0 <= done <= nb:
            raise ValueError(f"cannot resume: batches_done={done} outside 0..{nb} for epoch {epoch}")
        bits = unpack_bitmap(state.get("cached_blocks"), self.dataset.num_blocks)
        if bits is not None and done < nb:
            self._hit_maps[epoch] = bits  # the same cache-aware order as the saved run
        if done == nb > 0:  # finished: the next epoch. An epoch of 0 batches saved at its
            epoch, done = epoch + 1, 0  # start has not run yet: it stays (its iter() yields nothing)
        self.epoch, self._resume_batch, self._position = epoch, done, (epoch, done)
        self._pre = None
