"""A Loader serves one epoch at a time: a second ``iter()`` while the first epoch's iterator is
still open ends that epoch at once, and the old iterator refuses its next ``next()`` with a clear
error instead of waiting ``timeout_s`` for batches that now go to the new epoch."""

from __future__ import annotations

import time

import pytest

from _helpers import in_child
from stoker import ImageOptions, Loader, RunOptions, StokerError, open_dataset


def _second_iter(packed: str, cache: str, workers: int) -> tuple:
    ds = open_dataset(packed, cache_dir=cache, cache_bytes=64 << 20)
    with Loader(ds, 8, num_workers=workers, image=ImageOptions(image_size=32), run=RunOptions(timeout_s=60)) as ld:
        old = iter(ld)
        next(old)
        new = iter(ld)  # epoch 1, while epoch 0 is open
        n = sum(len(y) for _, y in new)
        t0 = time.monotonic()
        try:
            next(old)
            refused = None
        except StokerError as exc:
            refused = (type(exc).__name__, isinstance(exc, RuntimeError), str(exc))
        waited = time.monotonic() - t0
        epochs = [(s.epoch, s.samples) for s in ld.history]
        again = sum(len(y) for _, y in ld)  # the Loader goes on as usual
        return n, len(ds), refused, waited, epochs, again, ld.stats.exactly_once


@pytest.mark.parametrize("workers", [2, 0])
def test_a_second_iter_refuses_the_old_iterator_at_once(packed_local, tmp_path, workers):
    n, total, refused, waited, epochs, again, once = in_child(
        _second_iter, packed_local, str(tmp_path / "cache"), workers, timeout_s=50
    )
    assert n == total  # the new epoch is whole
    assert refused is not None and refused[:2] == ("StaleIteratorError", True), refused
    assert "epoch 0" in refused[2] and "epoch 1" in refused[2], refused
    assert waited < 30  # at once, not after timeout_s
    assert epochs[0] == (0, 8) and epochs[1] == (1, total)  # the old epoch ended (cut short) when the new one began
    assert again == total and once
