"""What training frameworks look for on a data loader works on a stoker Loader, or is refused with
a stoker error naming what to do: Lightning's ``sampler.set_epoch``, Ray Train's
``prepare_data_loader`` check for a ``DistributedSampler``, accelerate's ``prepare`` and
``skip_first_batches``."""

from __future__ import annotations

import pytest

from stoker import ImageOptions, Loader, NotADataLoaderError, StokerError, open_dataset


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
