"""User code that never returns: ``timeout_s`` holds with and without workers. The error names the
sample (and the worker or the training-process thread stuck on it); a stuck worker is ended and
replaced, a stuck decode thread is left and the next batch goes to a new one, so the next epoch
does not wait behind the same call."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from _helpers import in_child, make_image_folder
from stoker import Loader, RunOptions, WorkerError, open_dataset
from stoker.store.pack import pack

STUCK = 17  # the sample whose first decode never returns (key s0017)


class HangsOnce:
    """A user decode that hangs (sleeps for ever) the first time it meets sample ``STUCK``, across
    processes: the first caller creates ``marker``."""

    def __init__(self, marker: str):
        self.marker = marker

    def __call__(self, fields, rng):
        i = int(fields["bin"].split(b".")[0])
        if i == STUCK:
            try:
                os.close(os.open(self.marker, os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                pass
            else:
                time.sleep(10**6)
        return np.array([i], np.int64)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> str:
    """64 small samples s0000..s0063 packed with ``--source files`` (field ``bin``)."""
    root = tmp_path_factory.mktemp("hung")
    make_image_folder(root / "src", {f"s{i:04d}.bin": f"{i}".encode().ljust(200, b".") for i in range(64)})
    pack(str(root / "src"), str(root / "packed"), source="files", progress=False)
    return str(root / "packed")


def _two_epochs(packed: str, marker: str, workers: int) -> tuple:
    """Epoch 0 stalls on the stuck sample; epoch 1 (the same Loader, the error caught) runs whole."""
    ds = open_dataset(packed, cache=False)
    with Loader(ds, 8, num_workers=workers, decode=HangsOnce(marker), run=RunOptions(timeout_s=3)) as ld:
        t0, pids = time.monotonic(), []
        it = iter(ld)
        try:
            next(it)
            pids = ld.processes.pids()
            for _ in it:
                pass
            first = "no error"
        except WorkerError as exc:
            first = str(exc)
        stall_s = time.monotonic() - t0
        got = sorted(int(v) for b in ld for v in b.reshape(-1))
        return first, stall_s, got, ld.stats.exactly_once, pids, ld.processes.pids()


@pytest.mark.parametrize("workers", [0, 2])
def test_a_decode_that_never_returns_is_named_and_the_next_epoch_runs(files, tmp_path, workers):
    first, stall_s, got, once, before, after = in_child(
        _two_epochs, files, str(tmp_path / "marker"), workers, timeout_s=90
    )
    assert "'s0017'" in first and "no batch" in first, first
    assert stall_s < 60  # the timeout held: not a hang
    if workers == 0:  # decoded in the training process: the thread is named and left
        assert "thread stoker-decode-" in first and "num_workers=0" in first, first
    else:  # the stuck worker is ended and replaced
        assert "Ended and replaced: worker" in first, first
        assert len(after) == len(before) and set(after) != set(before)
    assert got == list(range(64)) and once  # the next epoch did not wait behind the stuck call
