"""What training frameworks look for on a data loader, on a stoker Loader.

Frameworks reach into ``torch.utils.data.DataLoader``'s attributes:

- PyTorch Lightning's loops call ``loader.sampler.set_epoch(epoch)`` at the start of every
  training epoch (``lightning.fabric.utilities.data._set_sampler_epoch``), and probe
  ``loader.batch_sampler`` with ``getattr(..., None)``.
- Ray Train's ``ray.train.torch.prepare_data_loader`` rebuilds the loader with a
  ``DistributedSampler`` unless ``loader.sampler`` already is one; then it wraps it to move each
  batch to the worker's device.
- HF accelerate's ``skip_first_batches`` rebuilds the loader as a DataLoader over
  ``loader.dataset`` with a batch sampler that skips the first batches
  (``loader.batch_sampler``).

A Loader already splits every epoch over the ranks, as a ``DistributedSampler`` does, and moves
to the next epoch at every ``iter()``, so its ``sampler`` is a :class:`LoaderSampler`: a
``DistributedSampler`` whose iteration gives this rank's sample ids of the next epoch and whose
``set_epoch`` moves an iterator already opened but not yet asked for a batch to that epoch and is
otherwise left alone (:func:`follow_epoch`; Lightning calls it after it opened
the epoch's iterator, so following it otherwise would serve an epoch twice). An ``iter()`` whose
epoch never began (Lightning's look at the loader) is given back: the next ``iter()`` runs that
epoch again. Ray
Train then keeps the Loader as it is. A rebuild that would drop stoker's pipeline for a
DataLoader over its dataset has nothing to be built from: ``batch_sampler`` raises
:class:`~stoker.errors.NotADataLoaderError`, which names what to do instead (a resume from the
Loader's own ``state_dict()``).

The Loader's ``sampler`` and ``batch_sampler`` are :func:`sampler_for` and :func:`batch_sampler_of`
as properties: the adapters live here, the attributes frameworks read stay on the Loader.
"""

from __future__ import annotations

import functools
from typing import Any

from ..errors import NotADataLoaderError

__all__ = [  # noqa: F822 (LoaderSampler: module __getattr__)
    "LoaderSampler",
    "batch_sampler_of",
    "follow_epoch",
    "no_batch_sampler",
    "sampler_for",
]


@functools.cache
def _sampler_class() -> type:
    """:class:`LoaderSampler`, made on first use (torch is imported then, not with stoker)."""
    from torch.utils.data.distributed import DistributedSampler

    class LoaderSampler(DistributedSampler):
        """The sampler a framework finds on a Loader (``loader.sampler``): this rank's sample ids
        of the Loader's next epoch. ``DistributedSampler.__init__`` is not run: it needs a
        process group and a sized dataset, and the Loader already holds the split.

        Attributes (as ``DistributedSampler``'s): ``num_replicas``, ``rank``, ``shuffle``,
        ``seed``, ``drop_last``, ``dataset`` (the Loader's), ``epoch`` (the Loader's next one),
        ``num_samples`` (this rank's samples of it).
        """

        def __init__(self, loader: Any):  # noqa: D107 (the class doc says it)
            self.loader = loader
            self.dataset = loader.dataset
            self.num_replicas, self.rank = loader.world_size, loader.rank
            self.shuffle, self.seed, self.drop_last = loader.shuffle, loader.seed, loader.drop_last

        @property  # type: ignore[override]
        def epoch(self) -> int:
            """The epoch the Loader's next ``iter()`` runs."""
            return self.loader.epoch

        @epoch.setter
        def epoch(self, value: int) -> None:
            pass  # as set_epoch

        @property  # type: ignore[override]
        def num_samples(self) -> int:
            """This rank's samples in the Loader's next epoch."""
            return len(self.loader.plan())

        @property  # type: ignore[override]
        def total_size(self) -> int:
            """Samples of the next epoch over all ranks."""
            return self.num_samples * self.num_replicas

        def set_epoch(self, epoch: int) -> None:
            """The framework's number of the epoch it is about to train: followed only by an
            iterator opened but not yet asked for a batch (:func:`follow_epoch`), else ignored."""
            follow_epoch(self.loader, epoch)

        def __iter__(self):
            return iter(self.loader.plan().tolist())

        def __len__(self) -> int:
            return self.num_samples

    LoaderSampler.__module__, LoaderSampler.__qualname__ = __name__, "LoaderSampler"
    return LoaderSampler


def sampler_for(loader: Any):
    """``loader.sampler``: what a training framework takes for the sampler of ``loader`` (a
    :class:`stoker.loader.Loader`): a :class:`LoaderSampler` (module doc)."""
    return _sampler_class()(loader)


def batch_sampler_of(loader: Any):
    """``loader.batch_sampler``: not there. Raises :class:`~stoker.errors.NotADataLoaderError` (an
    AttributeError, :func:`no_batch_sampler`), which names the stoker way to skip the batches done
    (accelerate's ``skip_first_batches`` asks for it to rebuild the Loader as a DataLoader)."""
    raise no_batch_sampler()


def follow_epoch(loader: Any, epoch: int) -> bool:
    """A framework numbers the epoch it is about to train ``epoch`` (Lightning's loops call
    ``loader.sampler.set_epoch(epoch)``). When the epoch the last ``iter()`` of ``loader`` opened
    has not begun (no batch asked for yet), is another one and was not put there by
    ``load_state_dict``, that iterator serves ``epoch`` instead, from its first batch (a resume
    from a checkpoint taken at an epoch's end, for which Lightning restores no loader state,
    continues with the right epoch). Otherwise nothing changes (a Loader moves to its next epoch
    at every ``iter()`` by itself).

    Returns:
        True if the open iterator now serves ``epoch``.
    """
    opened, run = loader.state.opened, loader.pipeline
    if opened is None or run is None or opened[2] or opened[0] == int(epoch):
        return False
    if not run.reopen(int(epoch)):
        return False
    loader.state.reopen(int(epoch))
    return True


def no_batch_sampler() -> NotADataLoaderError:
    """The error ``loader.batch_sampler`` raises: a framework wants to rebuild the Loader as a
    DataLoader (accelerate's ``skip_first_batches``); it names the stoker way to skip batches."""
    return NotADataLoaderError(
        "a stoker Loader has no batch_sampler: it draws its own batches and cannot be rebuilt as a "
        "torch DataLoader (accelerate's skip_first_batches, for one). To continue an epoch after the "
        "batches already trained on, restore the Loader's own state instead: "
        "loader.load_state_dict(saved_loader_state) (with accelerate, "
        "accelerator.register_for_checkpointing(loader) saves and restores it in save_state/load_state)"
    )


def __getattr__(name: str):
    """``LoaderSampler``: the class, made on first use."""
    if name == "LoaderSampler":
        return _sampler_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
