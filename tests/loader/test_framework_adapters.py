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
    s.set_epoch(4)
    assert loader.epoch == 4 and list(loader.sampler) == loader.plan(4).tolist()


def test_lightning_sets_the_loaders_epoch(loader):
    from lightning.fabric.utilities.data import _set_sampler_epoch

    next(iter(loader))  # Lightning's own first look at the loader runs an epoch
    assert loader.epoch == 1
    _set_sampler_epoch(loader, 0)  # what its fit loop calls at the start of epoch 0
    assert loader.epoch == 0
    ids = [int(i) for _, y in loader for i in y]
    assert len(ids) == len(loader.plan(0))


def test_set_epoch_of_the_resumed_epoch_keeps_its_place(loader):
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    it.close()
    loader.load_state_dict(state)
    loader.sampler.set_epoch(0)  # a framework resuming epoch 0 says so again
    assert len(list(loader)) == len(loader) - 1


def test_accelerate_prepare_keeps_the_loader_and_skip_first_batches_names_the_alternative(loader):
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    assert acc.prepare(loader) is loader
    with pytest.raises(NotADataLoaderError, match=r"load_state_dict.*register_for_checkpointing") as e:
        acc.skip_first_batches(loader, 2)
    assert isinstance(e.value, StokerError) and isinstance(e.value, AttributeError)
    assert getattr(loader, "batch_sampler", None) is None  # a probe still goes on
