"""A SIGKILLed decode worker or prefetcher is replaced and the epoch still delivers every sample
exactly once, in plan order, with the right pixels; restarts are counted; past the bound a worker's
death ends the epoch in a clean WorkerError (no hang)."""

import logging
import os
import signal
import threading

import numpy as np
import pytest

from stoker import ImageOptions, Loader, RunOptions, WorkerError, open_dataset
from stoker.loader.prefetch.prefetcher import MAX_PREFETCHER_RESTARTS
from stoker.loader.workers.pool import MAX_WORKER_RESTARTS

N = 48


def _colour(i: int) -> tuple:
    return (5 * i, 255 - 5 * i, 100)


@pytest.fixture(scope="module")
def flat(tmp_path_factory) -> str:
    """N 12x12 PNGs of one flat colour each (``_colour`` of the number in the key), 3 classes, packed."""
    from PIL import Image

    from stoker.store.pack import pack

    root = tmp_path_factory.mktemp("flat")
    for i in range(N):
        d = root / "src" / f"c{i % 3}"
        d.mkdir(parents=True, exist_ok=True)
        Image.fromarray(np.full((12, 12, 3), _colour(i), np.uint8)).save(d / f"s{i:03d}.png")
    pack(str(root / "src"), str(root / "ds"), progress=False)
    return str(root / "ds")


def _loader(url, cache_dir, **kw):
    ds = open_dataset(url, cache_dir=cache_dir, cache_bytes=64 << 20, block_bytes=1 << 10)
    return Loader(
        ds,
        4,
        num_workers=2,
        transform="eval",
        seed=3,
        **kw,
        image=ImageOptions(image_size=8),
        run=RunOptions(timeout_s=60),
    )


def _consume(loader, it) -> list:
    """Every batch of ``it`` as sample ids, each checked: its pixels are its own flat colour and its
    label is its own (a half-written or stale slot would show another colour)."""
    ds = loader.dataset
    by_colour = {_colour(int(ds.key(s).rsplit("/s", 1)[1][:3]))[0]: s for s in range(len(ds))}
    out = []
    for images, labels in it:
        ids = [by_colour[int(c)] for c in images[:, 0, 0, 0].tolist()]
        for img, sid in zip(images.numpy(), ids, strict=True):
            want = np.array(_colour(int(ds.key(sid).rsplit("/s", 1)[1][:3])), np.uint8)
            assert (img == want[:, None, None]).all(), f"sample {ds.key(sid)!r} delivered with wrong pixels"
        assert labels.tolist() == [int(ds.labels[i]) for i in ids]
        out.extend(ids)
    return out


def test_sigkilled_worker_is_replaced_and_its_batches_decoded_again(flat, tmp_path):
    """Worker 1 is stopped before it answers its first batch, then killed: its unanswered batches
    go to the live workers (the replacement included). Before: WorkerError ended the epoch."""
    loader = _loader(flat, str(tmp_path))
    with loader:
        it = iter(loader)
        victim = loader.processes.workers[1]
        os.kill(victim.pid, signal.SIGSTOP)  # it takes batches but answers none
        killer = threading.Timer(0.5, os.kill, (victim.pid, signal.SIGKILL))
        killer.start()
        got = _consume(loader, it)
        killer.join()
        assert got == loader.plan(0).tolist()  # every sample once, in plan order
        assert loader.stats.exactly_once
        assert loader.stats.worker_restarts == 1 and loader.stats.prefetcher_restarts == 0
        assert victim not in loader.processes.workers and all(p.is_alive() for p in loader.processes.workers)
        # the next epoch starts with a fresh bound and the replacement works
        assert _consume(loader, iter(loader)) == loader.plan(1).tolist()
        assert loader.stats.worker_restarts == 0


def _die_on(sample_number: int, marker: str | None):
    """A BatchDecoder.decode_sample that writes a wrong colour into the slot and SIGKILLs its process on
    sample ``sample_number`` (once, if ``marker`` is a path: the first process to create it dies)."""
    from stoker.loader.workers.worker import BatchDecoder

    real = BatchDecoder.decode_sample

    def decode_sample(self, sid, key, mode, rng, size, out, data=None):
        if key.endswith(f"s{sample_number:03d}.png") or key.endswith(f"s{sample_number:03d}"):
            die = True
            if marker is not None:
                try:
                    os.close(os.open(marker, os.O_CREAT | os.O_EXCL))
                except FileExistsError:
                    die = False
            if die:
                out[...] = 255  # a half-written slot: never delivered
                os.kill(os.getpid(), signal.SIGKILL)
        return real(self, sid, key, mode, rng, size, out, data)

    return decode_sample


def _forked(loader) -> bool:
    return loader.pipeline.start_method == "fork"


def test_worker_killed_mid_batch_never_delivers_the_half_written_slot(flat, tmp_path, monkeypatch):
    loader = _loader(flat, str(tmp_path / "cache"))
    victim = int(loader.plan(0)[5])  # in the second batch, after one sample of it was written
    number = int(loader.dataset.key(victim).rsplit("/s", 1)[1][:3])
    monkeypatch.setattr(
        "stoker.loader.workers.worker.BatchDecoder.decode_sample", _die_on(number, str(tmp_path / "died"))
    )
    with loader:
        it = iter(loader)
        if not _forked(loader):
            pytest.skip("the workers are not forked: the patched decoder is not theirs")
        assert _consume(loader, it) == loader.plan(0).tolist()
        assert os.path.exists(tmp_path / "died")
        assert loader.stats.worker_restarts == 1 and loader.stats.exactly_once


def test_worker_killed_past_the_bound_ends_in_a_clean_error(flat, tmp_path, monkeypatch):
    """A sample that kills every worker that decodes it: MAX_WORKER_RESTARTS replacements, then
    WorkerError naming the worker, the signal and the sample (no hang, no endless restarts)."""
    loader = _loader(flat, str(tmp_path / "cache"))
    victim = int(loader.plan(0)[2])
    key = loader.dataset.key(victim)
    monkeypatch.setattr(
        "stoker.loader.workers.worker.BatchDecoder.decode_sample", _die_on(int(key.rsplit("/s", 1)[1][:3]), None)
    )
    with loader:
        it = iter(loader)
        if not _forked(loader):
            pytest.skip("the workers are not forked: the patched decoder is not theirs")
        with pytest.raises(
            WorkerError,
            match=r"worker \d+ \(pid \d+\) died with exit code -9 \(signal SIGKILL\) "
            r"while reading/decoding sample " + repr(key).replace(".", r"\."),
        ):
            _consume(loader, it)
        assert loader.stats.worker_restarts == MAX_WORKER_RESTARTS


def test_sigkilled_prefetcher_is_replaced(flat, tmp_path):
    """Before: WorkerError at the next check. Now a new prefetcher takes over the plan."""
    loader = _loader(flat, str(tmp_path))
    with loader:
        it = iter(loader)
        got = _consume(loader, [next(it)])
        first = loader.processes.prefetcher
        os.kill(first.pid, signal.SIGKILL)
        first.join(10)
        got += _consume(loader, it)
        assert got == loader.plan(0).tolist()
        assert loader.stats.exactly_once
        assert loader.stats.prefetcher_restarts == 1 and loader.stats.worker_restarts == 0
        assert loader.processes.prefetcher is not first and loader.processes.prefetcher.is_alive()


def test_prefetcher_killed_past_the_bound_the_epoch_goes_on_without_it(flat, tmp_path, caplog):
    loader = _loader(flat, str(tmp_path))
    with loader, caplog.at_level(logging.WARNING, logger="stoker.loader.prefetch.prefetcher"):
        it = iter(loader)
        got = _consume(loader, [next(it)])
        for _ in range(MAX_PREFETCHER_RESTARTS + 1):  # the last one is not replaced
            p = loader.processes.prefetcher
            os.kill(p.pid, signal.SIGKILL)
            p.join(10)
            loader.pipeline.check_processes()
        got += _consume(loader, it)
        assert got == loader.plan(0).tolist() and loader.stats.exactly_once
        assert loader.stats.prefetcher_restarts == MAX_PREFETCHER_RESTARTS
        assert sum("going on without prefetch" in r.getMessage() for r in caplog.records) == 1
