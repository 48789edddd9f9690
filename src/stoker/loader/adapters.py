"""What training frameworks look for on a data loader, on a stoker Loader.

Frameworks reach into ``torch.utils.data.DataLoader``'s attributes:

- PyTorch Lightning's loops call ``loader.sampler.set_epoch(epoch)`` and
  ``loader.batch_sampler.sampler.set_epoch(epoch)`` at the start of every epoch
  (``lightning.fabric.utilities.data._set_sampler_epoch``); for an evaluation loader
  (``validate``, ``test``, ``predict``, a fit's validation and its sanity check) it reads
  ``loader.batch_sampler`` directly to tell whether the loader shuffles
  (``lightning.pytorch.utilities.data._is_dataloader_shuffled``).
- Ray Train's ``ray.train.torch.prepare_data_loader`` rebuilds the loader with a
  ``DistributedSampler`` unless ``loader.sampler`` already is one; then (``move_to_device=True``,
  its default) it wraps it to move each batch to the worker's device, and that wrapper takes each
  batch one ahead of the training loop (:class:`ReadAhead`).
- HF accelerate's ``skip_first_batches`` rebuilds the loader as a DataLoader over
  ``loader.dataset`` with a batch sampler that skips the first batches
  (``loader.batch_sampler``); the Hugging Face Trainer calls it to resume mid-epoch, and calls
  ``loader.set_epoch(epoch)`` before every epoch's ``iter()``.

A Loader already splits every epoch over the ranks, as a ``DistributedSampler`` does, and moves
to the next epoch at every ``iter()``, so its ``sampler`` is a :class:`LoaderSampler`: a
``DistributedSampler`` whose iteration gives this rank's sample ids of the next epoch and whose
``set_epoch`` moves an iterator already opened but not yet asked for a batch to that epoch and is
otherwise left alone (:func:`follow_epoch`; Lightning calls it after it opened
the epoch's iterator, so following it otherwise would serve an epoch twice). An ``iter()`` whose
epoch never began (Lightning's look at the loader) is given back: the next ``iter()`` runs that
epoch again. Ray Train then keeps the Loader as it is. Its ``batch_sampler`` is a
:class:`LoaderBatchSampler`, which describes the Loader's batches (``sampler``, ``batch_size``,
``drop_last``, ``len()``) for the frameworks that read it; a rebuild that would drop stoker's
pipeline for a DataLoader over its dataset has nothing to be built from: iterating it raises
:class:`~stoker.errors.NotADataLoaderError`, which names what to do instead (a resume from the
Loader's own ``state_dict()``). For the Hugging Face Trainer, :func:`loader_checkpoint` keeps
that state in the Trainer's checkpoints and loads it on a resume. Under Ray Train's wrapper the
state counts the batches the wrapper has handed to the training loop, not the one it holds
(:func:`read_ahead`), so a ``loader.state_dict()`` saved in the loop resumes after the batches
trained on.

The Loader's ``sampler`` and ``batch_sampler`` are :func:`sampler_for` and :func:`batch_sampler_of`
as properties: the adapters live here, the attributes frameworks read stay on the Loader.
"""

from __future__ import annotations

import functools
import inspect
import sys
import weakref
from types import FrameType
from typing import Any

from ..errors import NotADataLoaderError

__all__ = [  # noqa: F822 (LoaderSampler, LoaderBatchSampler, LoaderCheckpoint: module __getattr__)
    "LoaderBatchSampler",
    "LoaderCheckpoint",
    "LoaderSampler",
    "CopiedSampler",
    "ReadAhead",
    "batch_sampler_of",
    "follow_epoch",
    "loader_checkpoint",
    "no_batch_sampler",
    "read_ahead",
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


class CopiedSampler:
    """The ``sampler`` a wrapper that copies a Loader's instance attributes finds: Ray Train's
    ``prepare_data_loader`` wrapper (``self.__dict__.update(loader.__dict__)``, Ray 2.60's
    ``ray.train.torch.train_loop_utils._WrappedDataLoader``) does, and Ray's documented loop then
    calls ``train_dataloader.sampler.set_epoch(epoch)``. The Loader's own ``sampler`` is a class
    property, which a copy of ``__dict__`` does not carry; the Loader also keeps one of these in
    its ``__dict__`` (shadowed there by the property) for such copies.

    Every attribute (``set_epoch``, ``epoch``, ``num_samples``, ``iter()``, ``len()``...) is the
    Loader's :class:`LoaderSampler`'s, made on use (torch is imported then). It holds the Loader
    weakly, so a Loader dropped without ``close()`` is not kept alive by a cycle; used after the
    Loader is gone it raises ``ReferenceError``.
    """

    __slots__ = ("_loader",)

    def __init__(self, loader: Any):  # noqa: D107 (the class doc says it)
        self._loader = weakref.ref(loader)

    def _sampler(self) -> Any:
        loader = self._loader()
        if loader is None:
            raise ReferenceError("the Loader of this sampler is gone")
        return sampler_for(loader)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sampler(), name)

    def __iter__(self):
        return iter(self._sampler())

    def __len__(self) -> int:
        return len(self._sampler())


@functools.cache
def _batch_sampler_class() -> type:
    """:class:`LoaderBatchSampler`, made on first use (torch is imported then, not with stoker)."""
    from torch.utils.data import Sampler

    class LoaderBatchSampler(Sampler):
        """What a framework finds as ``loader.batch_sampler``: a description of the batches the
        Loader draws itself, for the frameworks that read it (Lightning's check whether an
        evaluation loader shuffles reads ``batch_sampler.sampler``; Lightning's and the HF
        Trainer's epoch hooks look for ``batch_sampler.sampler.set_epoch``).

        Attributes: ``sampler`` (the Loader's :class:`LoaderSampler`), ``batch_size``,
        ``drop_last``; ``len()`` is the Loader's batches of its next epoch. Iterating it raises
        :class:`~stoker.errors.NotADataLoaderError` (:func:`no_batch_sampler`): only a rebuild of
        the Loader as a torch DataLoader over its dataset iterates a batch sampler (accelerate's
        ``skip_first_batches``, which the HF Trainer's mid-epoch resume calls unless
        ``ignore_data_skip``), and that would drop stoker's pipeline, decode and augmentation.
        """

        def __init__(self, loader: Any):  # noqa: D107 (the class doc says it)
            self.loader = loader
            self.sampler = sampler_for(loader)

        @property
        def batch_size(self) -> int:  # read where it is stored, never copied
            return self.loader.batch_size

        @property
        def drop_last(self) -> bool:
            return self.loader.drop_last

        def __iter__(self):
            raise no_batch_sampler()

        def __len__(self) -> int:
            return len(self.loader)

    LoaderBatchSampler.__module__, LoaderBatchSampler.__qualname__ = __name__, "LoaderBatchSampler"
    return LoaderBatchSampler


def batch_sampler_of(loader: Any):
    """``loader.batch_sampler``: a :class:`LoaderBatchSampler` (``sampler``, ``batch_size``,
    ``drop_last``, ``len()``), which Lightning reads directly in ``validate``, ``test``,
    ``predict`` and a fit's validation. Iterating it raises
    :class:`~stoker.errors.NotADataLoaderError`, which names the stoker way to skip the batches
    done: a rebuild of the Loader as a DataLoader (accelerate's ``skip_first_batches``) cannot
    keep stoker's pipeline."""
    return _batch_sampler_class()(loader)


#: the Loaders of this process's :func:`loader_checkpoint` callbacks, by name (weakly: a callback
#: the Trainer makes again from a checkpoint, ``restore_callback_states_from_checkpoint``, finds
#: its Loader here)
_CHECKPOINTED: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


@functools.cache
def _checkpoint_class() -> type:
    """:class:`LoaderCheckpoint`, made on first use (transformers is imported then)."""
    from transformers import TrainerCallback
    from transformers.trainer_callback import ExportableState

    class LoaderCheckpoint(TrainerCallback, ExportableState):
        """A Hugging Face ``Trainer`` callback that keeps a Loader's ``state_dict()`` in every
        checkpoint the Trainer saves (in its ``trainer_state.json``, as the Trainer's own
        stateful callbacks are kept) and loads it back when ``trainer.train(resume_from_checkpoint=...)``
        resumes one, so a resumed epoch goes on after the batches already trained on.

        The Trainer's own way to skip them (accelerate's ``skip_first_batches``) would rebuild the
        Loader as a torch DataLoader, so ``TrainingArguments(ignore_data_skip=True)`` is required:
        ``on_train_begin`` raises ValueError without it. The Trainer's ``set_epoch(epoch)`` before
        each ``iter()`` keeps the loaded position (``Loader.set_epoch``). Only rank 0 writes the
        checkpoint; every rank loads the same state (the state is the job's), at any world size.

        Args:
            loader: the training :class:`stoker.loader.Loader` (the one ``get_train_dataloader``
                returns); None: the Loader registered under ``name`` in this process.
            name: the key it is kept under (one callback per Loader; ``"train"``).

        Raises:
            KeyError: ``loader`` is None and no Loader is registered under ``name``.
        """

        def __init__(self, loader: Any = None, name: str = "train"):  # noqa: D107 (the class doc says it)
            if loader is not None:
                _CHECKPOINTED[name] = loader
            self.loader, self.name = _CHECKPOINTED[name], name

        def state(self) -> dict:
            """What the Trainer keeps in the checkpoint: the name, and the Loader's ``state_dict()``."""
            return {"args": {"name": self.name}, "attributes": {"loader_state": self.loader.state_dict()}}

        def on_train_begin(self, args, state, control, **kwargs):
            """Check ``ignore_data_skip``; on a resume (``global_step`` > 0), load the checkpoint's
            Loader state (``load_state_dict``: its ValueError names a state that does not fit)."""
            if not args.ignore_data_skip:
                raise ValueError(
                    "LoaderCheckpoint needs TrainingArguments(ignore_data_skip=True): the Loader resumes from its "
                    "own state, and the Trainer's skip (accelerate's skip_first_batches) would rebuild it as a "
                    "torch DataLoader"
                )
            saved = (state.stateful_callbacks or {}).get(type(self).__name__)
            if state.global_step > 0 and isinstance(saved, dict) and saved.get("args", {}).get("name") == self.name:
                self.loader.load_state_dict(saved["attributes"]["loader_state"])

    LoaderCheckpoint.__module__, LoaderCheckpoint.__qualname__ = __name__, "LoaderCheckpoint"
    return LoaderCheckpoint


def loader_checkpoint(loader: Any, name: str = "train"):
    """A :class:`LoaderCheckpoint` for ``loader``: pass it in the Hugging Face ``Trainer``'s
    ``callbacks``, with ``TrainingArguments(ignore_data_skip=True)``, and a resumed run continues
    the Loader's epoch where the checkpoint left it (see the class). ``name``: one per Loader
    (``"train"``). Needs ``transformers`` (ImportError otherwise)."""
    return _checkpoint_class()(loader, name)


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


class ReadAhead:
    """A consumer that takes a batch from the Loader before it hands the one before on: Ray
    Train's ``prepare_data_loader`` wrapper (``move_to_device=True``, its default). Its
    ``__iter__`` calls ``iter(loader)`` and takes the first batch at once; each ``__next__`` returns
    the batch it holds (kept in its ``next_batch``) and takes the next (Ray 2.60's
    ``ray.train.torch.train_loop_utils._WrappedDataLoader``). While the training loop
    works on batch ``k``, the Loader has given batch ``k + 1`` away; a state counting it would make
    a resume skip a batch never trained on.

    Args:
        consumer: the wrapper (held weakly).
        iterator: the :class:`~stoker.loader.iterator.EpochIterator` it iterates (held weakly).
        known: whether ``consumer`` has the shape described above (False: a Ray Train wrapper of
            another shape, which :meth:`held` refuses to guess about).
    """

    def __init__(self, consumer: Any, iterator: Any, known: bool = True):  # noqa: D107 (the class doc says it)
        self._consumer, self._iterator = weakref.ref(consumer), weakref.ref(iterator)
        self.known, self.kind = known, f"{type(consumer).__module__}.{type(consumer).__qualname__}"

    def held(self, position: tuple[int, int]) -> bool:
        """Whether the consumer holds the last batch the Loader yielded, not yet handed on: the
        consumer is alive and holds a batch, its epoch's iterator is still between batches, and the
        Loader's ``position`` (``(epoch, batches done)``) is in that epoch.

        Raises:
            RuntimeError: a Ray Train wrapper of a shape not known here holds the epoch (its
                ``next_batch`` is gone): whether it took a batch it has not handed on cannot be
                told, so no state is given (it could skip a batch on resume). Names the wrapper
                and the way out (``move_to_device=False``).
        """
        consumer, it = self._consumer(), self._iterator()
        if consumer is None or it is None or not it.running or it.epoch != position[0] or position[1] < 1:
            return False
        if not self.known:
            raise RuntimeError(
                f"loader.state_dict(): the Loader is iterated by {self.kind}, a Ray Train wrapper this stoker "
                "does not know (its next_batch attribute is gone): it may hold a batch it took from the "
                "Loader and has not handed to the training loop, and a state counting that batch would skip "
                "it on resume. Use ray.train.torch.prepare_data_loader(loader, move_to_device=False), or "
                "the Ray version stoker's dependencies name"
            )
        return getattr(consumer, "next_batch", None) is not None


def read_ahead(loader: Any, iterator: Any) -> ReadAhead | None:
    """The consumer whose ``iter(loader)`` is running, when it is Ray Train's wrapper that reads one
    batch ahead (:class:`ReadAhead`), else None. Called from the Loader's ``__iter__``; found on the
    call stack: past stoker's own frames and a Loader subclass's ``__iter__``, the ``__iter__`` of a
    torch ``DataLoader`` of a ``ray.train`` class. Only an ``__iter__`` frame's locals are read (a
    snapshot of a frame's locals stays on that frame, and a long-lived frame, the training loop's,
    must not keep a batch alive), and no frame is kept. The consumer is held weakly: a wrapper
    dropped (after a ``break``) drops the epoch's iterator with it, which ends the epoch as a
    ``break`` does.

    Args:
        loader: the Loader whose ``__iter__`` runs.
        iterator: the epoch's :class:`~stoker.loader.iterator.EpochIterator` it returns.
    """
    here = inspect.currentframe()
    frame: FrameType | None = here.f_back if here is not None else None  # the Loader's __iter__, then outward
    owner = None
    try:
        while frame is not None:
            code = frame.f_code
            if str(frame.f_globals.get("__name__", "")).startswith("stoker."):
                frame = frame.f_back
                continue
            if code.co_name != "__iter__" or code.co_argcount < 1:
                return None
            owner = frame.f_locals.get(code.co_varnames[0])
            if owner is not loader:  # (else a Loader subclass's own __iter__: look past it)
                break
            frame = frame.f_back
    finally:
        del here, frame  # (a frame kept here would keep the Loader and its epoch's iterator alive)
    data = sys.modules.get("torch.utils.data")  # (imported wherever Ray Train's torch wrapper is)
    if owner is None or data is None or not isinstance(owner, data.DataLoader):
        return None
    if not type(owner).__module__.startswith("ray.train."):
        return None
    return ReadAhead(owner, iterator, known=hasattr(owner, "next_batch") and hasattr(owner, "dataloader_iter"))


def no_batch_sampler() -> NotADataLoaderError:
    """The error iterating ``loader.batch_sampler`` raises: a framework rebuilt the Loader as a
    DataLoader (accelerate's ``skip_first_batches``); it names the stoker way to skip batches."""
    return NotADataLoaderError(
        "a stoker Loader draws its own batches: its batch_sampler cannot be iterated, and the Loader cannot be "
        "rebuilt as a torch DataLoader (accelerate's skip_first_batches, for one, which the Hugging Face "
        "Trainer calls to resume mid-epoch). To continue an epoch after the batches already trained on, "
        "restore the Loader's own state instead: loader.load_state_dict(saved_loader_state) (with accelerate, "
        "accelerator.register_for_checkpointing(loader) saves and restores it in save_state/load_state; with "
        "the Hugging Face Trainer, TrainingArguments(ignore_data_skip=True) and "
        "callbacks=[stoker.loader.adapters.loader_checkpoint(loader)])"
    )


def __getattr__(name: str):
    """``LoaderSampler``, ``LoaderBatchSampler``, ``LoaderCheckpoint``: the classes, made on first use."""
    if name == "LoaderSampler":
        return _sampler_class()
    if name == "LoaderBatchSampler":
        return _batch_sampler_class()
    if name == "LoaderCheckpoint":
        return _checkpoint_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
