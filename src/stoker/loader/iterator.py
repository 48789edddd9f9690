"""What ``iter(loader)`` returns: one epoch's batches, and the rule that a Loader serves one epoch
at a time.

:class:`EpochIterator` wraps the started pipeline's generator of an epoch
(:meth:`stoker.loader.pipeline.run.Run.epoch`) and keeps the Loader alive while it is iterated (so
``for batch in Loader(...)`` works with no name bound to the Loader, and a Loader dropped without
``close()`` is stopped by its finalizer only once no epoch of it is iterated any more). A later
``iter()`` on the same Loader ends this epoch at once (its stats are final, its slots free) and
:meth:`replace` marks it: its next ``next()`` raises :class:`~stoker.errors.StaleIteratorError`
naming both epochs, instead of waiting for batches that now go to the new epoch.
"""

from __future__ import annotations

import inspect

from ..errors import StaleIteratorError

__all__ = ["EpochIterator"]


class EpochIterator:
    """One epoch's batches (see the module docstring).

    Args:
        gen: the pipeline's generator of the epoch's batches.
        epoch: the epoch it serves.
        owner: what must stay alive while it is iterated (the Loader), or None.
    """

    def __init__(self, gen, epoch: int, owner=None):
        self._gen, self.epoch, self._owner = gen, epoch, owner
        self._replaced_by: int | None = None
        self._ended_by = ""  # what ended it, for the StaleIteratorError

    def __iter__(self):
        return self

    def __next__(self):
        if self._replaced_by is not None:
            raise StaleIteratorError(f"the iterator of epoch {self.epoch} was ended by {self._ended_by}")
        return next(self._gen)

    @property
    def running(self) -> bool:
        """True while the epoch has batches to give and is not being stepped right now."""
        gen = self._gen
        return gen.gi_frame is not None and not gen.gi_running

    @property
    def unstarted(self) -> bool:
        """True until its first ``next()`` (and while no later ``iter()`` replaced it)."""
        return self._replaced_by is None and inspect.getgeneratorstate(self._gen) == inspect.GEN_CREATED

    def restart(self, gen, epoch: int) -> None:
        """Serve ``gen`` (the pipeline's generator of ``epoch``) instead; only while
        :attr:`unstarted` (ValueError otherwise: batches of the old epoch were asked for)."""
        if not self.unstarted:
            raise ValueError(f"the iterator of epoch {self.epoch} has begun; it cannot serve epoch {epoch} instead")
        self._gen.close()
        self._gen, self.epoch = gen, epoch

    def close(self) -> None:
        """End the epoch now (as ``break`` does): its stats are final and its slots free."""
        self._gen.close()

    def replace(self, epoch: int, by: str | None = None) -> None:
        """A later ``iter()`` starts ``epoch`` (or ``by`` says what else takes this epoch's place,
        with what to do): end this one now; its next ``next()`` raises
        :class:`~stoker.errors.StaleIteratorError` saying so."""
        self._replaced_by = epoch
        self._ended_by = by or (
            f"a later iter() on the same Loader, which started epoch {epoch}: a Loader serves one epoch at a "
            "time. Finish (or break out of) one epoch before the next iter(), or use one Loader per stream"
        )
        self._gen.close()
