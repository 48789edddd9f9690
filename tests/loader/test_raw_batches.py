"""Raw batches (``collate=stoker.collate.raw_bytes`` without decode): read by the workers straight
into their slot, every byte the origin's, the slot held while a batch is kept, resume unchanged."""

import gc
import tarfile

import numpy as np
import pytest
import torch

from _helpers import damage_cached_blocks
from stoker import Loader, RunOptions, WorkerError, open_dataset
from stoker.collate import RawBatch, raw_bytes
from stoker.store.pack import pack


def _tar_members(path) -> dict:
    with tarfile.open(path) as tf:
        return {m.name: tf.extractfile(m).read() for m in tf if m.isfile()}


@pytest.fixture(scope="module")
def jpegs(cases_dir, tmp_path_factory):
    """The shared Pillow JPEG cases (sizes from 1 KB to 500 KB: ragged), packed in small shards, with
    ``{key: file bytes}``."""
    src = tmp_path_factory.mktemp("jpegs")
    files = sorted((cases_dir / "pillow-jpeg").iterdir())
    origin = {}
    for f in files:
        (src / f.name).write_bytes(f.read_bytes())
        origin[f.stem] = f.read_bytes()
    dst = str(tmp_path_factory.mktemp("jpegs-packed") / "d")
    pack(str(src), dst, source="files", shard_bytes=256 << 10, progress=False)
    return dst, origin


@pytest.fixture(scope="module")
def tendata(cases_dir, tmp_path_factory):
    """WebDataset's ``tendata.tar`` (100 opaque members of 12,736 B each) packed, with ``{key: bytes}``."""
    src = cases_dir / "webdataset" / "tendata.tar"
    dst = str(tmp_path_factory.mktemp("tendata") / "d")
    pack(str(src), dst, progress=False)
    return dst, {name.rsplit(".", 1)[0]: data for name, data in _tar_members(src).items()}


def _origin_bytes(origin: dict, key: str) -> bytes:
    return origin[key.rsplit("/", 1)[-1].rsplit(".", 1)[0]]


def _check(ds, origin: dict, batch: RawBatch) -> int:
    """Every sample of ``batch`` equals its origin bytes; its offsets, ids and labels are the index's."""
    assert isinstance(batch, RawBatch)
    assert batch.data.dtype == torch.uint8 and batch.offsets.dtype == torch.int64
    n = len(batch.ids)
    assert batch.offsets.shape == (n + 1,) and int(batch.offsets[0]) == 0
    assert int(batch.offsets[-1]) == batch.data.numel()
    for j in range(n):
        sid = int(batch.ids[j])
        assert batch.sample(j).numpy().tobytes() == _origin_bytes(origin, ds.key(sid)), ds.key(sid)
        assert int(batch.labels[j]) == max(-1, int(ds.labels[sid]))
    return n


@pytest.mark.parametrize("workers", [2, 0])
def test_every_byte_of_every_sample_of_a_ragged_batch_is_the_origins(jpegs, tmp_path, workers, monkeypatch):
    url, origin = jpegs
    ds = open_dataset(url, str(tmp_path / "cache"), 1 << 30)
    assert len(set(ds.index.length.tolist())) > 1  # ragged
    from stoker.loader.workers import batches

    def per_sample(*args, **kwargs):
        raise AssertionError("a raw batch went through the per-sample path")

    # forked workers inherit this, and num_workers=0 runs here: a batch is read as a batch, never sample by sample
    monkeypatch.setattr(batches.GenericDecoder, "run", per_sample)
    run = RunOptions(start_method="fork") if workers else None
    with Loader(ds, 5, num_workers=workers, seed=3, collate=raw_bytes, run=run) as loader:
        for _ in range(3):  # the cold fill, then warm epochs from the node cache's block files
            seen = [sid for b in loader for sid in b.ids.tolist() if _check(ds, origin, b)]
            assert sorted(seen) == list(range(len(ds)))
            assert all(b.data.dim() == 1 for b in [next(iter(loader))])
        assert loader.stats.cache_hit_ratio == 1.0


@pytest.mark.parametrize("shuffle", [True, False])  # in order: runs of adjacent samples, one preadv each
def test_samples_of_one_size_come_as_n_by_sample_bytes(tendata, tmp_path, shuffle):
    url, origin = tendata
    ds = open_dataset(url, str(tmp_path / "cache"), 1 << 30)
    with Loader(ds, 16, num_workers=2, shuffle=shuffle, collate=raw_bytes, drop_last=True) as loader:
        for _ in range(2):
            for b in loader:
                assert tuple(b.data.shape) == (16, 12_736)
                _check(ds, origin, b)
                assert b.data[3].numpy().tobytes() == b.sample(3).numpy().tobytes()


def _as_written(samples):
    """raw_bytes run as written, sample by sample (a collate that is not raw_bytes itself)."""
    return raw_bytes(samples)


def test_the_batch_read_equals_the_collate_run_as_written(jpegs, tmp_path):
    """The same batches, in the same order, from the workers' batch read, the training process's
    (``num_workers=0``) and raw_bytes run sample by sample; batches kept without a copy at
    ``num_workers=0`` are never overwritten (each has a buffer of its own)."""
    url, _ = jpegs
    ds = open_dataset(url, str(tmp_path / "cache"), 1 << 30)
    got = []
    for workers, collate in ((2, raw_bytes), (0, raw_bytes), (0, _as_written)):
        with Loader(ds, 4, num_workers=workers, seed=9, collate=collate) as loader:
            got.append([tuple(t.clone() for t in b) for b in loader])
    for other in got[1:]:
        assert len(other) == len(got[0])
        for a, b in zip(got[0], other, strict=True):
            assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    with Loader(ds, 4, num_workers=0, seed=9, collate=raw_bytes) as loader:
        kept = list(loader)  # no clone
        list(loader)  # another epoch read meanwhile
    for a, b in zip(got[0], kept, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _slot_of(ring, tensor) -> int:
    """The index of the ring's slot that ``tensor``'s bytes live in."""
    ptr = tensor.data_ptr()
    for i in range(len(ring.paths)):
        buf = ring.buffer(i, 0)
        if buf.ctypes.data <= ptr < buf.ctypes.data + len(buf):
            return i
    raise AssertionError("the batch is not a view of any slot")


def test_a_kept_batch_holds_its_slot_and_is_never_overwritten(tendata, tmp_path):
    """Slot-held (not copy-on-keep): a kept batch is a view of its slot, which no worker gets again
    until every view of the batch is dropped."""
    url, origin = tendata
    ds = open_dataset(url, str(tmp_path / "cache"), 1 << 30)
    with Loader(ds, 8, num_workers=2, collate=raw_bytes) as loader:
        kept = next(iter(loader))
        ring = loader.pipeline.ring
        slot = _slot_of(ring, kept.data)
        first = kept.data.clone()
        for _ in range(4):  # every other batch comes and goes while the first is kept
            for b in loader:
                assert _slot_of(ring, b.data) != slot
                del b
            assert slot not in ring.free
        assert torch.equal(kept.data, first)
        _check(ds, origin, kept)
        one = kept.sample(0)  # a view of a view holds the slot too
        del kept
        gc.collect()
        assert slot not in ring.free
        del one
        gc.collect()
        assert slot in ring.free


def test_resume_mid_epoch_gives_the_rest_of_the_epoch(jpegs, tmp_path):
    url, _ = jpegs
    ds = open_dataset(url, str(tmp_path / "cache"), 1 << 30)
    with Loader(ds, 3, num_workers=2, seed=4, collate=raw_bytes) as whole:
        ref = [b.ids.tolist() for b in whole]
    with Loader(ds, 3, num_workers=2, seed=4, collate=raw_bytes) as first:
        it = iter(first)
        head = [next(it).ids.tolist() for _ in range(2)]
        state = first.state_dict()
    with Loader(ds, 3, num_workers=2, seed=4, collate=raw_bytes) as second:
        second.load_state_dict(state)
        rest = [b.ids.tolist() for b in second]
    assert head + rest == ref


def test_a_damaged_cached_block_is_read_again_from_the_origin(tendata, tmp_path):
    """A cached block whose bytes changed on disk fails the in-place check: the sample is read again
    the ordinary way (the damaged block dropped, fetched again), and the batch is still right."""
    url, origin = tendata
    cache = tmp_path / "cache"
    ds = open_dataset(url, str(cache), 1 << 30)
    with Loader(ds, 10, num_workers=2, collate=raw_bytes) as loader:
        for _ in loader:  # the cold fill (closed after: no batch of the next epoch read ahead of the damage)
            pass
    damage_cached_blocks(cache, 100)
    with Loader(ds, 10, num_workers=2, collate=raw_bytes) as loader:
        assert sum(_check(ds, origin, b) for b in loader) == len(ds)
        assert loader.stats.origin_bytes > 0  # the damaged blocks came again


def test_wrong_bytes_at_the_origin_name_the_sample(tendata, tmp_path):
    url, _ = tendata
    import shutil

    copy = tmp_path / "d"
    shutil.copytree(url, copy)
    shard = sorted(p for p in copy.rglob("*.tar"))[0]
    ds = open_dataset(str(copy), str(tmp_path / "cache"), 1 << 30)
    sid = 7
    start = int(ds.index.offset[sid])
    with open(shard, "r+b") as f:
        f.seek(start + 10)
        f.write(b"\x00\x01\x02\x03")
    with Loader(ds, 100, num_workers=1, shuffle=False, collate=raw_bytes) as loader:
        with pytest.raises(WorkerError, match=ds.key(sid)):
            next(iter(loader))


def test_a_slot_that_cannot_grow_sends_the_batch_pickled(tendata, tmp_path, monkeypatch):
    from stoker.loader.workers import batches
    from stoker.loader.workers.rawbatch import RawBatchReader

    url, origin = tendata
    ds = open_dataset(url, str(tmp_path / "cache"), 1 << 30)
    slot = tmp_path / "slot"
    slot.write_bytes(bytes(4096))
    writer = batches.SlotWriter()
    monkeypatch.setattr(writer, "reserve", lambda path, need: None)
    n, reply = RawBatchReader(ds, None).run(np.array([5, 1, 9]), str(slot), writer)
    assert n == 3 and reply[0] == "pickle"
    import pickle

    _check(ds, origin, pickle.loads(reply[1]))


def test_raw_bytes_refuses_decoded_samples():
    from stoker.collate import CollateError

    with pytest.raises(CollateError, match="without decode"):
        raw_bytes([np.zeros(3, np.uint8)])


# -- a batch-level user function over the raw batch (collate=stoker.collate.on_raw) ---------------
def _sums(raw: RawBatch) -> dict:
    """Per-sample byte sums and lengths of a raw batch, computed over the whole batch at once."""
    flat = raw.data.reshape(-1).to(torch.int64)
    cums = torch.cat([torch.zeros(1, dtype=torch.int64), flat.cumsum(0)])
    return {"sum": cums[raw.offsets[1:]] - cums[raw.offsets[:-1]], "len": raw.offsets.diff(), "ids": raw.ids.clone()}


def _fails_on_batch(raw: RawBatch):
    raise ValueError("no good")


@pytest.mark.parametrize("workers", [2, 0])
def test_on_raw_calls_the_users_function_once_per_batch_over_the_origins_bytes(jpegs, tmp_path, workers, monkeypatch):
    """``on_raw(fn)``: the workers read the batch as a batch (the per-sample path never runs) and
    call ``fn`` once over it; its result per sample is the origin's bytes' and every sample comes
    once per epoch, in the same batches as ``raw_bytes``; ``num_workers=0`` runs it as written."""
    from stoker.collate import on_raw

    url, origin = jpegs
    ds = open_dataset(url, str(tmp_path / "cache"), 1 << 30)
    from stoker.loader.workers import batches

    def per_sample(*args, **kwargs):
        raise AssertionError("an on_raw batch went through the per-sample path")

    monkeypatch.setattr(batches.GenericDecoder, "run", per_sample)  # workers and num_workers=0 alike
    run = RunOptions(start_method="fork") if workers else None
    with Loader(ds, 5, num_workers=workers, seed=3, collate=on_raw(_sums), run=run) as loader:
        for _ in range(2):
            seen = []
            for b in loader:
                assert set(b) == {"sum", "len", "ids"}
                for j, sid in enumerate(b["ids"].tolist()):
                    want = _origin_bytes(origin, ds.key(sid))
                    assert int(b["len"][j]) == len(want), ds.key(sid)
                    assert int(b["sum"][j]) == sum(want), ds.key(sid)
                    seen.append(sid)
            assert sorted(seen) == list(range(len(ds)))
    with Loader(ds, 5, num_workers=workers, seed=3, collate=raw_bytes, run=run) as same:
        want_ids = [b.ids.tolist() for b in same]
    with Loader(ds, 5, num_workers=workers, seed=3, collate=on_raw(_sums), run=run) as loader:
        assert [b["ids"].tolist() for b in loader] == want_ids


def test_on_raw_failures_name_the_batchs_samples_and_the_function(tendata, tmp_path):
    from stoker.collate import on_raw

    url, _ = tendata
    ds = open_dataset(url, str(tmp_path / "cache"), 1 << 30)
    with Loader(ds, 4, num_workers=1, shuffle=False, collate=on_raw(_fails_on_batch)) as loader:
        with pytest.raises(
            WorkerError,
            match=r"worker \d+ failed on a batch .*_fails_on_batch failed on the batch of samples \[.*"
            r"ValueError: no good",
        ):
            next(iter(loader))
    with pytest.raises(TypeError, match="function of a RawBatch"):
        on_raw(3)


def _slot_fds() -> int:
    """This process's descriptors of batch slot files (``/dev/shm/stoker-<pid>-...``, unlinked or not)."""
    import os

    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        n += f"stoker-{os.getpid()}-" in target
    return n


def _stack_payloads(samples):
    return np.stack([np.frombuffer(next(iter(s.values())), np.uint8)[:64] for s in samples])


@pytest.mark.parametrize("collate", [raw_bytes, _stack_payloads], ids=["raw_bytes", "user-collate"])
def test_a_dropped_batch_frees_its_slot_without_the_cycle_collector(tendata, tmp_path, collate):
    """A batch dropped by the loop gives its slot back by reference counting alone: with
    ``gc.disable()`` the loader holds the same few slots epoch after epoch (the batch's rebuild
    was a self-referencing closure over the slot's buffer: one new slot, two descriptors, per batch)."""
    url, _ = tendata
    ds = open_dataset(url, str(tmp_path / "cache"), 1 << 30)
    was = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        with Loader(ds, 4, num_workers=2, seed=1, collate=collate) as loader:
            held = []
            for _ in range(4):  # 25 batches an epoch
                for b in loader:
                    del b
                held.append(_slot_fds())
            # the first epoch's end sets up the next epoch's early batches: steady from there
            assert held[-1] == held[1] and held[-1] <= 40, held  # 100 batches: 200 descriptors before
    finally:
        if was:
            gc.enable()


def test_a_ragged_dataset_gives_flat_batches_even_when_one_batch_has_one_size(tmp_path):
    """The form of a raw batch is the loader's, not the batch's: a dataset of two sizes gives flat
    ``data`` in every batch, also in batches whose samples happen to share one size."""
    src = tmp_path / "src"
    src.mkdir()
    origin = {}
    for i in range(40):
        data = bytes([i]) * (100 if i < 36 else 200)  # the first 9 batches of 4 (in order): one size each
        (src / f"s{i:03d}.bin").write_bytes(data)
        origin[f"s{i:03d}"] = data
    pack(str(src), str(tmp_path / "d"), source="files", progress=False)
    ds = open_dataset(str(tmp_path / "d"), str(tmp_path / "cache"), 1 << 30)
    for workers in (0, 2):
        with Loader(ds, 4, num_workers=workers, shuffle=False, collate=raw_bytes) as loader:
            for b in loader:
                assert b.data.dim() == 1, tuple(b.data.shape)
                _check(ds, origin, b)


_KEEP_EVERY_BATCH = r"""
import logging, os, resource, sys
import numpy as np
from stoker import Loader, open_dataset
from stoker.collate import raw_bytes

logging.basicConfig(level=logging.WARNING, format="%(message)s")
url, cache = sys.argv[1], sys.argv[2]
ds = open_dataset(url, cache, 1 << 30)
with Loader(ds, 2, num_workers=2, seed=0, collate=raw_bytes) as loader:
    first = {int(i): b.sample(j).numpy().tobytes() for b in loader for j, i in enumerate(b.ids)}  # the cold fill
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 40, hard))
    kept = list(loader)  # 50 batches kept: 100 descriptors of slots, more than the limit leaves
    got = {int(i): b.sample(j).numpy().tobytes() for b in kept for j, i in enumerate(b.ids)}
    assert got == first and len(got) == 100
    print("kept", len(kept))
"""


def test_batches_kept_past_the_open_file_limit_are_copied_out_not_a_crash(tendata, tmp_path):
    """A loop that keeps every batch runs out of file descriptors for new slots: the loader warns
    once, naming the limit, and copies batches out of the slots it has; every kept batch stays
    right (before: ``OSError: [Errno 24] Too many open files`` from the slot ring)."""
    import subprocess
    import sys

    url, _ = tendata
    out = subprocess.run(
        [sys.executable, "-c", _KEEP_EVERY_BATCH, url, str(tmp_path / "cache")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "kept 50" in out.stdout
    assert out.stderr.count("no file descriptor left for another batch slot") == 1, out.stderr[-3000:]
    assert "ulimit -n" in out.stderr
