"""What training frameworks look for on a data loader works on a stoker Loader, or is refused with
a stoker error naming what to do: Lightning's ``sampler.set_epoch``, Ray Train's
``prepare_data_loader`` check for a ``DistributedSampler`` and its wrapper that reads one batch
ahead, accelerate's ``prepare`` and ``skip_first_batches``."""

from __future__ import annotations

import numpy as np
import pytest

from stoker import ImageOptions, Loader, NotADataLoaderError, StokerError, open_dataset
from stoker import collate as C


@pytest.fixture
def loader(packed_local, tmp_path):
    ds = open_dataset(packed_local, cache_dir=str(tmp_path / "cache"), cache_bytes=64 << 20)
    ld = Loader(ds, 8, num_workers=0, rank=1, world_size=2, image=ImageOptions(image_size=32))
    yield ld
    ld.close()


def test_the_sampler_is_a_distributed_sampler_of_this_ranks_ids(loader):
    from torch.utils.data.distributed import DistributedSampler

    s = loader.sampler
    assert isinstance(s, DistributedSampler)  # what Ray Train's prepare_data_loader keeps as it is
    assert (s.num_replicas, s.rank, s.epoch) == (2, 1, 0)
    assert list(s) == loader.plan().tolist() and len(s) == len(loader.plan())
    s.set_epoch(4)  # ignored with no iterator open: the Loader moves to its next epoch at every iter()
    assert loader.epoch == 0 and list(loader.sampler) == loader.plan(0).tolist()


def test_lightnings_set_epoch_never_serves_an_epoch_twice(loader):
    from lightning.fabric.utilities.data import _set_sampler_epoch

    iter(loader)  # Lightning's look at the loader
    it = iter(loader)  # its fit loop's iterator, opened before it sets the epoch
    _set_sampler_epoch(loader, 0)
    first = sum(len(y) for _, y in it)
    _set_sampler_epoch(loader, 1)
    second = sum(len(y) for _, y in loader)
    assert [h.epoch for h in loader.history] == [0, 1]  # the look used up nothing; not an epoch twice
    assert first == second == len(loader.plan(0)) and all(h.exactly_once for h in loader.history)


def _batches(it) -> int:
    return sum(1 for _ in it)


def test_an_iter_that_never_yields_gives_its_epoch_back(loader):
    """Lightning opens the loader once for a look and drops it; the next ``iter()`` runs the same
    epoch, and an iterator that did take a batch still moves the stream on."""
    nb = len(loader)
    iter(loader)
    iter(loader)
    assert _batches(iter(loader)) == nb and [h.epoch for h in loader.history] == [0]
    it = iter(loader)
    next(it)
    assert _batches(iter(loader)) == nb  # epoch 2: epoch 1 was cut short after one batch
    assert [(h.epoch, h.batches) for h in loader.history] == [(0, nb), (1, 1), (2, nb)]


def test_a_resumed_position_survives_a_look_at_the_loader(loader):
    """The Loader's state loaded before the framework's look (``iter()`` and dropped, as
    Lightning's ``fit`` does before it iterates): the epoch still resumes after the batches done."""
    it = iter(loader)
    for _ in range(3):
        next(it)
    state = loader.state_dict()
    loader.load_state_dict(state)
    iter(loader)  # the look
    it = iter(loader)
    loader.sampler.set_epoch(7)  # a resumed position is not moved by the framework's epoch number
    assert _batches(it) == len(loader) - 3 and loader.history[-1].epoch == 0


def test_lightnings_epoch_number_moves_an_iterator_not_yet_asked_for_a_batch(loader):
    """Resumed from a checkpoint taken at an epoch's end, Lightning restores no loader state: it
    opens the loader (a look, then its iterator) and then names the epoch it trains with
    ``sampler.set_epoch``; the iterator serves that epoch, and the next ``iter()`` the one after."""
    from lightning.fabric.utilities.data import _set_sampler_epoch

    iter(loader)
    it = iter(loader)
    _set_sampler_epoch(loader, 3)  # resumed after its epoch 2 ended
    assert _batches(it) == len(loader)
    _set_sampler_epoch(loader, 4)
    assert _batches(iter(loader)) == len(loader)
    assert [h.epoch for h in loader.history] == [3, 4] and all(h.exactly_once for h in loader.history)
    it = iter(loader)
    next(it)
    _set_sampler_epoch(loader, 9)  # too late: a batch of epoch 5 was taken
    assert _batches(it) == len(loader) - 1 and loader.history[-1].epoch == 5


def test_accelerate_prepare_keeps_the_loader_and_skip_first_batches_names_the_alternative(loader):
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    assert acc.prepare(loader) is loader
    # num_workers=0: torch refuses the rebuild itself (accelerate passes it a prefetch_factor)
    with pytest.raises(ValueError, match="prefetch_factor"):
        acc.skip_first_batches(loader, 2)
    with Loader(loader.dataset, 8, num_workers=1, rank=1, world_size=2, image=ImageOptions(image_size=32)) as ld:
        rebuilt = acc.skip_first_batches(ld, 2)  # a torch DataLoader over the dataset: it yields nothing,
        with pytest.raises(
            NotADataLoaderError, match=r"load_state_dict.*register_for_checkpointing.*ignore_data_skip"
        ) as e:
            next(iter(rebuilt.batch_sampler))  # as its first next() finds
    assert isinstance(e.value, StokerError) and isinstance(e.value, AttributeError)


def test_the_batch_sampler_describes_the_batches_lightning_reads(loader):
    """Lightning's ``validate``/``test``/``predict`` and a fit's validation read
    ``loader.batch_sampler`` directly (``_is_dataloader_shuffled``): it is there, describes the
    Loader's batches, and says the Loader does not shuffle the way a DataLoader does."""
    from lightning.fabric.utilities.data import _set_sampler_epoch
    from lightning.pytorch.utilities.data import _is_dataloader_shuffled
    from torch.utils.data.distributed import DistributedSampler

    bs = loader.batch_sampler
    assert isinstance(bs.sampler, DistributedSampler) and list(bs.sampler) == loader.plan().tolist()
    assert (bs.batch_size, bs.drop_last, len(bs)) == (8, False, len(loader))
    assert _is_dataloader_shuffled(loader) is False  # no warning about a shuffled evaluation loader
    with pytest.raises(NotADataLoaderError, match="cannot be iterated"):
        iter(bs)  # only a rebuild as a torch DataLoader iterates it
    it = iter(loader)
    _set_sampler_epoch(loader, 2)  # through sampler and batch_sampler.sampler: followed once
    assert _batches(it) == len(loader) and [h.epoch for h in loader.history] == [2]


def test_set_epoch_after_a_resume_keeps_the_loaded_position(loader):
    """The Hugging Face Trainer calls ``set_epoch(epoch)`` right before every ``iter()``, a resumed
    one too: naming the loaded epoch keeps the loaded position; another epoch is refused (it
    would serve samples twice or never), and nothing changes then."""
    it = iter(loader)
    for _ in range(3):
        next(it)
    state = loader.state_dict()
    loader.load_state_dict(state)
    loader.set_epoch(0)
    with pytest.raises(ValueError, match=r"set_epoch\(1\).*resumed position \(epoch 0, batch 3\)"):
        loader.set_epoch(1)
    with pytest.raises(ValueError, match="resumed position"):
        loader.epoch = 5
    iter(loader)  # a look that takes no batch: the loaded position is still pending
    loader.set_epoch(0)
    assert _batches(iter(loader)) == len(loader) - 3 and loader.history[-1].epoch == 0
    loader.set_epoch(4)  # once a batch was taken, set_epoch moves the loader as before
    assert _batches(iter(loader)) == len(loader) and loader.history[-1].epoch == 4
    assert all(h.exactly_once for h in loader.history[-1:])


def _sample_id(fields, rng):
    return np.int64(fields["__id__"])


def _tokens(fields, rng):
    """A document of 1-40 tokens, from the sample's bytes (as tests/loader/test_user_decode.py's)."""
    raw = np.frombuffer(fields[next(iter(fields))], np.uint8)
    return raw[: 1 + int(fields["__id__"]) % 40].astype(np.int64)


class _Recorded(Loader):
    """A Loader subclass whose ``__iter__`` wraps the epoch in a generator of its own, as the
    cluster's ``ClusterLoader`` does."""

    def __iter__(self):
        return self._recorded(super().__iter__())

    def _recorded(self, it):
        yield from it


def _ray_wrapped(loader):
    """What ``ray.train.torch.prepare_data_loader(loader)`` returns on a CPU worker (its defaults,
    ``move_to_device=True``), made here without a Ray Train session: Ray's own wrapper class."""
    import torch
    from ray.train.torch.train_loop_utils import _WrappedDataLoader

    return _WrappedDataLoader(loader, torch.device("cpu"), False)


def _as_lists(batch):
    return {k: v.tolist() for k, v in batch.items()} if isinstance(batch, dict) else batch.tolist()


@pytest.mark.parametrize("kind", ["images", "subclass", "pack_tokens"])
def test_under_ray_trains_wrapper_the_state_counts_the_batches_handed_to_the_loop(packed_local, kind):
    """Ray Train's ``prepare_data_loader`` wrapper takes each batch one ahead of the training loop;
    a ``loader.state_dict()`` saved in the loop's body after ``k`` batches says ``k`` batches (before:
    ``k + 1``, and a resume skipped a batch never trained on), and a Loader resumed from it yields
    exactly the rest of the uninterrupted stream: ids (plain, and a Loader subclass whose
    ``__iter__`` is a generator of its own) and a streaming collate's carried tokens. At an epoch's
    last batch the wrapper has found the end: the state is the next epoch's start."""
    pytest.importorskip("ray.train.torch")
    ds = open_dataset(packed_local, cache=False)
    cls = _Recorded if kind == "subclass" else Loader
    decode, collate = (_tokens, C.pack_tokens(48, eos_id=999)) if kind == "pack_tokens" else (_sample_id, None)

    def make():
        workers = 1 if kind == "subclass" else 0  # (both delivery paths: decode workers, and in this process)
        return cls(ds, 8, num_workers=workers, seed=3, rank=0, world_size=2, decode=decode, collate=collate)

    with make() as whole:
        ref = [_as_lists(b) for b in whole]
    nb = len(ref)
    for k in sorted({1, 2, nb // 2, nb - 1, nb}):
        with make() as loader:
            wrapped = _ray_wrapped(loader)
            for i, batch in enumerate(wrapped):
                assert _as_lists(batch) == ref[i]
                if i + 1 == k:
                    state = loader.state_dict()  # in the loop's body: batch k is being trained on
                    break
        if k == nb:
            assert (state["epoch"], state["samples_done"]) == (1, 0)
            continue
        assert state["epoch"] == 0
        if kind != "pack_tokens":  # (a streaming collate yields no batch for a plan batch carried on whole)
            assert state["batches_done"] == k
        with make() as again:
            again.load_state_dict(state)
            assert [_as_lists(b) for b in again] == ref[k:], f"resumed after {k} of {nb} batches"
            assert again.stats.exactly_once


def test_under_ray_trains_wrapper_each_epoch_starts_at_its_first_batch(packed_local):
    """Through the wrapper epoch after epoch: its ``iter()`` takes the epoch's first batch at once;
    a state saved then (before the loop's first step) is that epoch at batch 0, and one saved after
    the loop is the next epoch's start."""
    pytest.importorskip("ray.train.torch")
    ds = open_dataset(packed_local, cache=False)
    with Loader(ds, 8, num_workers=0, seed=3, rank=1, world_size=2, decode=_sample_id) as loader:
        wrapped = _ray_wrapped(loader)
        for epoch in range(2):
            nb = len(loader)
            it = iter(wrapped)  # (the wrapper itself: a second iter() would start another epoch)
            state = loader.state_dict()
            assert (state["epoch"], state["batches_done"], state["samples_done"]) == (epoch, 0, 0)
            assert sum(1 for _ in range(nb + 1) if next(it, None) is not None) == nb
            state = loader.state_dict()
            assert (state["epoch"], state["samples_done"]) == (epoch + 1, 0)
        assert [h.epoch for h in loader.history] == [0, 1] and all(h.exactly_once for h in loader.history)


def test_a_ray_train_wrapper_of_unknown_shape_gets_no_state(packed_local):
    """A Ray Train wrapper without the ``next_batch`` stoker reads (another Ray than the one
    pyproject.toml names) may hold a batch it took and has not handed on: ``state_dict()`` refuses,
    naming ``move_to_device=False``, rather than give a state that could skip it."""
    from torch.utils.data import DataLoader

    ds = open_dataset(packed_local, cache=False)

    class Wrapper(DataLoader):
        def __init__(self, loader):
            self.loader = loader

        def __iter__(self):
            self.it = iter(self.loader)
            self.held = next(self.it)
            return self

        def __next__(self):
            batch, self.held = self.held, next(self.it)
            return batch

    Wrapper.__module__ = "ray.train.torch.elsewhere"
    with Loader(ds, 8, num_workers=0, decode=_sample_id) as loader:
        wrapper = iter(Wrapper(loader))
        with pytest.raises(RuntimeError, match=r"ray\.train\.torch\.elsewhere.*move_to_device=False"):
            loader.state_dict()
        it = iter(loader)  # iterated by the user itself again: the state counts what it took
        next(it)
        assert loader.state_dict()["batches_done"] == 1 and wrapper.held is not None


def test_looking_for_ray_trains_wrapper_keeps_no_batch_of_the_caller_alive(packed_local):
    """``iter(loader)`` looks up the call stack for Ray Train's wrapper; it must not leave a
    snapshot of the caller's locals behind (one would keep the caller's batch, and its shared-memory
    slot, alive after the caller dropped it) nor a frame (which would keep the epoch's iterator)."""
    import gc
    import weakref

    ds = open_dataset(packed_local, cache=False)
    with Loader(ds, 8, num_workers=0, decode=_sample_id) as loader:
        batch = next(iter(loader))
        kept = weakref.ref(batch)
        it = iter(loader)  # the look happens here, with ``batch`` among this frame's locals
        del batch
        assert kept() is None
        next(it)
        gone = weakref.ref(it)
        del it
        assert gone() is None and loader.history[-1].epoch == 1  # the dropped epoch ended at once
    gc.collect()


def test_rays_documented_loop_sets_the_epoch_through_the_wrapper(packed_local):
    """Ray Train's documented loop with more than one worker calls
    ``train_dataloader.sampler.set_epoch(epoch)`` on what ``prepare_data_loader`` returned: Ray's
    wrapper copies the Loader's instance attributes only, and before the Loader kept a sampler
    there this raised ``AttributeError``. Now each epoch's batches are the Loader's plan of that
    epoch, the wrapper's sampler is the Loader's, and it does not keep a dropped Loader alive."""
    pytest.importorskip("ray.train.torch")
    import gc
    import weakref

    ds = open_dataset(packed_local, cache=False)
    with Loader(ds, 8, num_workers=0, seed=3, rank=1, world_size=2, decode=_sample_id) as loader:
        wrapped = _ray_wrapped(loader)
        for epoch in range(2):
            wrapped.sampler.set_epoch(epoch)  # Ray's loop, before each epoch
            assert wrapped.sampler.epoch == loader.sampler.epoch == epoch
            assert len(wrapped.sampler) == len(loader.sampler)
            plan = list(wrapped.sampler)
            got = [i for b in wrapped for i in _as_lists(b)]
            assert sorted(got) == sorted(plan), f"epoch {epoch}"
    gone = Loader(ds, 8, num_workers=0, seed=3, decode=_sample_id)
    ref = weakref.ref(gone)
    copied = _ray_wrapped(gone).sampler
    gc.disable()
    try:
        del gone
        assert ref() is None, "the copied sampler kept the Loader alive"
    finally:
        gc.enable()
    with pytest.raises(ReferenceError):
        copied.set_epoch(0)
