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
    s.set_epoch(4)  # ignored: the Loader moves to its next epoch at every iter()
    assert loader.epoch == 0 and list(loader.sampler) == loader.plan(0).tolist()


def test_lightnings_set_epoch_never_serves_an_epoch_twice(loader):
    from lightning.fabric.utilities.data import _set_sampler_epoch

    iter(loader)  # Lightning's look at the loader
    it = iter(loader)  # its fit loop's iterator, opened before it sets the epoch
    _set_sampler_epoch(loader, 0)
    first = sum(len(y) for _, y in it)
    _set_sampler_epoch(loader, 1)
    second = sum(len(y) for _, y in loader)
    assert [h.epoch for h in loader.history] == [1, 2]  # not epoch 1 twice
    assert first == second == len(loader.plan(0)) and all(h.exactly_once for h in loader.history)


def test_accelerate_prepare_keeps_the_loader_and_skip_first_batches_names_the_alternative(loader):
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    assert acc.prepare(loader) is loader
    with pytest.raises(NotADataLoaderError, match=r"load_state_dict.*register_for_checkpointing") as e:
        acc.skip_first_batches(loader, 2)
    assert isinstance(e.value, StokerError) and isinstance(e.value, AttributeError)
    assert getattr(loader, "batch_sampler", None) is None  # a probe still goes on
