"""The last epoch a job runs (``RunOptions.epochs``): nothing of a later epoch is decoded, and
samples skipped in a batch decoded ahead for an epoch that never runs are never logged."""

import logging
import os

import numpy as np
import pytest

from stoker import Loader, RunOptions, open_dataset


@pytest.fixture(scope="module")
def ds(packed_local):
    return open_dataset(packed_local, cache=False)


def counting_decode(fields, rng):
    """Each call appends one line to $STOKER_TEST_CALLS (the workers' decodes, counted across processes);
    fails on samples whose payload length is a multiple of 5."""
    data = next(iter(fields.values()))
    with open(os.environ["STOKER_TEST_CALLS"], "a") as f:
        f.write("x\n")
    if len(data) % 5 == 0:
        raise ValueError(f"length {len(data)} is a multiple of 5")
    return np.frombuffer(data[:8], np.uint8).copy()


def _calls(path) -> int:
    with open(path) as f:
        return len(f.readlines())


@pytest.mark.parametrize("workers", [0, 2])
def test_nothing_is_decoded_past_the_last_epoch(ds, tmp_path, monkeypatch, workers):
    calls = tmp_path / "calls"
    calls.touch()
    monkeypatch.setenv("STOKER_TEST_CALLS", str(calls))
    run = RunOptions(on_error="skip", epochs=2)
    with Loader(ds, 8, decode=counting_decode, num_workers=workers, run=run) as loader:
        for _ in range(2):
            for _ in loader:
                pass
        assert loader.epoch == 2
        decoded = _calls(calls)  # before close(): nothing of epoch 2 is in flight either
    assert decoded == 2 * len(ds)
    assert _calls(calls) == 2 * len(ds)


def test_without_a_bound_the_unrun_epoch_logs_nothing(ds, tmp_path, monkeypatch, caplog):
    bad = sum(1 for i in range(len(ds)) if len(ds.read(i)) % 5 == 0)
    assert bad
    calls = tmp_path / "calls"
    calls.touch()
    monkeypatch.setenv("STOKER_TEST_CALLS", str(calls))
    caplog.set_level(logging.WARNING, logger="stoker")
    with Loader(ds, 8, decode=counting_decode, num_workers=2, run=RunOptions(on_error="skip")) as loader:
        for _ in range(2):
            for _ in loader:
                pass
    skips = [r.getMessage() for r in caplog.records if "skipping sample" in r.getMessage()]
    # logged in the training process as each batch is delivered: each skip of epochs 0 and 1 once,
    # none for epoch 2, whose first batches were decoded ahead and then dropped at close()
    assert len(skips) == 2 * bad and not any("(epoch 2)" in m for m in skips), skips
    assert sum("(epoch 0)" in m for m in skips) == bad


def test_epochs_must_be_a_positive_integer():
    with pytest.raises(ValueError, match=r"RunOptions\.epochs must be >= 1"):
        RunOptions(epochs=0)
    with pytest.raises(TypeError, match=r"RunOptions\.epochs must be an integer"):
        RunOptions(epochs=2.0)
