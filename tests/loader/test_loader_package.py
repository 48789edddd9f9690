"""The loader package's parts: the frozen worker configuration, the resume state as its own
record, and the started pipeline as one object that ``close()`` ends."""

from __future__ import annotations

import dataclasses
import pickle

import numpy as np
import pytest

import stoker
from stoker.loader import EpochStats, ImageOptions, Loader, RunOptions, WorkerError
from stoker.loader.options import WorkerConfig
from stoker.loader.state import IDENTITY_KEYS, LoaderState
from stoker.store.dataset import open_dataset


def test_public_names_stay_where_they_were():
    assert stoker.Loader is Loader and stoker.EpochStats is EpochStats and stoker.WorkerError is WorkerError
    assert stoker.loader.Loader is Loader


def test_worker_config_is_frozen_and_pickles(packed_local):
    ld = Loader(
        open_dataset(packed_local), batch_size=4, num_workers=0, transform="eval", image=ImageOptions(image_size=32)
    )
    cfg = ld.cfg
    assert isinstance(cfg, WorkerConfig)
    assert (cfg.transform, cfg.image_size, cfg.batch_size, cfg.decode_on, cfg.derived) == ("eval", 32, 4, "cpu", None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.image_size = 64  # type: ignore[misc]
    assert pickle.loads(pickle.dumps(cfg)) == cfg  # what each worker process receives


def test_loader_state_refuses_a_foreign_state_and_changes_nothing():
    from stoker.order import interleaved_shares

    ident = dict.fromkeys(IDENTITY_KEYS, 0)
    # one rank, batches of 4 over 16 samples: 4 batches an epoch

    def shares(epoch, served, world_size=None):
        return interleaved_shares(np.arange(16), world_size or 1, "pad", served)

    job = dict(rank=0, world_size=1, batch_size=4, shares=shares)
    load = dict(job, num_blocks=10)
    st = LoaderState(epoch=3, position=(3, 0))
    saved = st.to_dict(ident, **job)
    assert (saved["epoch"], saved["samples_done"], saved["served"], saved["cached_blocks"]) == (3, 0, None, None)
    with pytest.raises(ValueError, match="batch_size=8"):
        st.load({**saved, "epoch": 5, "samples_done": 4, "batch_size": 8}, ident, **load)
    with pytest.raises(ValueError, match="samples_done=17 outside 0..16"):
        st.load({**saved, "samples_done": 17}, ident, **load)
    with pytest.raises(ValueError, match="'served' of epoch 5 is not a bitmap"):
        st.load({**saved, "epoch": 5, "samples_done": 4, "served": "not base64!"}, ident, **load)
    assert (st.epoch, st.resume_batch, st.position) == (3, 0, (3, 0))
    st.load({**saved, "epoch": 5, "samples_done": 16}, ident, **load)  # finished: the next epoch
    assert (st.epoch, st.resume_batch, st.position) == (6, 0, (6, 0))
    st.load({**saved, "epoch": 5, "samples_done": 8}, ident, **load)
    assert (st.epoch, st.resume_batch, st.position, st.offset) == (5, 2, (5, 2), None)
    st.load({**saved, "epoch": 5, "samples_done": 6}, ident, **load)  # not a whole batch: the rest split again
    assert (st.epoch, st.resume_batch, st.position) == (5, 0, (5, 0))
    assert st.offset is not None and st.offset[0] == 5 and st.offset[1].tolist() == [True] * 6 + [False] * 10
    assert st.to_dict(ident, **job)["samples_done"] == 6


def test_loader_state_says_which_samples_when_they_are_not_the_first_ids():
    """A state whose served samples are not the permutation's first ids keeps them as a bitmap;
    a loader resumes from it with the rest split again, and one that disagrees is refused."""
    from stoker.order import interleaved_shares

    ident = dict.fromkeys(IDENTITY_KEYS, 0)
    served = np.zeros(16, dtype=bool)
    served[[1, 5, 6, 9]] = True

    def shares(epoch, before, world_size=None):
        return interleaved_shares(np.arange(16), world_size or 2, "pad", before)

    job = dict(rank=1, world_size=2, batch_size=2, shares=shares)
    st = LoaderState(epoch=0, position=(0, 0), offset=(0, served))
    saved = st.to_dict(ident, **job)
    assert saved["samples_done"] == 4 and saved["served"] is not None
    again = LoaderState()
    again.load(saved, ident, **job, num_blocks=1)
    assert again.offset is not None and np.array_equal(again.offset[1], served)
    rest = np.concatenate([shares(0, served).plan(r) for r in range(2)])
    assert sorted(rest.tolist()) == sorted(set(range(16)) - {1, 5, 6, 9})
    with pytest.raises(ValueError, match="marks 4 samples, samples_done says 5"):
        LoaderState().load({**saved, "samples_done": 5}, ident, **job, num_blocks=1)
    # a state without ``served`` cut mid-epoch: which samples is unknown to a split of another kind
    with pytest.raises(ValueError, match="says how many samples were served, not which"):
        LoaderState().load(
            {k: v for k, v in saved.items() if k != "served"}, ident, **job, num_blocks=1, interleaved=False
        )


def test_an_epoch_after_close_is_served_by_a_new_pipeline(packed_local):
    """close() after an epoch whose successor was already dispatched to the workers: the next
    iter() starts new processes and serves the whole next epoch (the early batches went to the
    stopped workers and must not be waited for)."""
    ds = open_dataset(packed_local)
    ld = Loader(
        ds,
        batch_size=8,
        num_workers=1,
        transform="eval",
        shuffle=False,
        image=ImageOptions(image_size=32),
        run=RunOptions(timeout_s=10),
    )
    try:
        first = np.concatenate([lab.numpy() for _, lab in ld])
        old = [p.pid for p in ld.processes.workers]
        ld.close()
        assert ld.processes.workers == () and ld.pipeline is None
        second = np.concatenate([lab.numpy() for _, lab in ld])
        assert [p.pid for p in ld.processes.workers] != old
        assert len(first) == len(second) == len(ds)
        assert (second == ds.index.labels[ld.plan(1)]).all()
        assert [s.epoch for s in ld.history] == [0, 1]
    finally:
        ld.close()
