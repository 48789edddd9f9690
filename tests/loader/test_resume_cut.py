"""A state taken after an epoch's iteration ended early, and a state loaded into a Loader whose
epoch is being iterated: the first starts the next epoch (said, once, with a RuntimeWarning),
the second is refused (it served samples twice)."""

import warnings

import numpy as np
import pytest

from stoker import Loader, open_dataset


def _ids(fields, rng):
    return np.int64(fields["__id__"])


@pytest.fixture
def loader(packed_local):
    ds = open_dataset(packed_local, cache=False)
    with Loader(ds, 4, num_workers=0, seed=1, decode=_ids) as ld:
        yield ld


@pytest.mark.parametrize("how", ["break", "KeyboardInterrupt"])
def test_a_state_after_an_epoch_ended_early_says_it_starts_the_next_epoch(loader, how):
    """A checkpoint saved after a caught Ctrl-C (the pattern docs/faults.md describes) or a break
    starts the next epoch: the rest of the cut epoch is not in it, and the user is told, once."""
    try:
        for k, _ in enumerate(loader):
            if k == 2:
                if how == "break":
                    break
                raise KeyboardInterrupt
    except KeyboardInterrupt:
        pass
    with pytest.warns(RuntimeWarning, match=r"epoch 0 ended early, after 3 of its \d+ batches.*inside the loop"):
        state = loader.state_dict()
    assert (state["epoch"], state["samples_done"]) == (1, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loader.state_dict()  # once per Loader


def test_a_state_after_a_whole_epoch_or_inside_the_loop_warns_nothing(loader):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for k, _ in enumerate(loader):
            if k == 1:
                inside = loader.state_dict()
        after = loader.state_dict()
    assert (inside["epoch"], inside["samples_done"]) == (0, 8)
    assert (after["epoch"], after["samples_done"]) == (1, 0)


@pytest.mark.parametrize("workers", [0, 2])
def test_load_state_dict_while_an_epoch_is_iterated_ends_that_iterator(packed_local, workers):
    """Before: the live iterator finished its own epoch and the loaded position was served after
    it, so its samples were trained twice, silently. Now the resume takes that epoch's place:
    the old iterator's next ``next()`` raises StaleIteratorError, and the next iter() serves
    exactly the rest of the saved epoch."""
    from stoker.errors import StaleIteratorError

    ds = open_dataset(packed_local, cache=False)
    with Loader(ds, 4, num_workers=workers, seed=1, decode=_ids) as a:
        it = iter(a)
        first = [int(i) for _ in range(3) for i in next(it)]
        state = a.state_dict()
        whole = first + [int(i) for batch in it for i in batch]
    with Loader(ds, 4, num_workers=workers, seed=1, decode=_ids) as b:
        it = iter(b)
        next(it)
        b.load_state_dict(state)
        with pytest.raises(StaleIteratorError, match="load_state_dict"):
            next(it)
        rest = [int(i) for batch in b for i in batch]
        assert rest == whole[12:]
        assert b.stats.epoch == 0
