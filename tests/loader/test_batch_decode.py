"""The built-in decode reads a batch as a batch and makes its generators together: the same
random numbers, the same pixels and the same errors as one sample at a time."""

import shutil

import numpy as np
import pytest

from _helpers import damage_cached_blocks
from stoker import Loader, WorkerError, open_dataset
from stoker.decode import decode_image
from stoker.decode.transforms import decode_transform, eval_transform
from stoker.loader.workers import worker
from stoker.loader.workers.samplerng import BatchRngs
from stoker.loader.workers.worker import scratch_parts
from stoker.order import sample_seed


def _draws(rng) -> tuple:
    """What the train transform draws (uniform, integers, random) and a few more of each kind."""
    return (
        rng.uniform(0.08, 1.0),
        rng.uniform(-0.28, 0.28),
        int(rng.integers(0, 371)),
        int(rng.integers(0, 5000)),
        rng.random(),
        tuple(rng.integers(0, 1 << 40, 3).tolist()),
        rng.standard_normal(),
    )


@pytest.mark.parametrize(
    "seed, epoch",
    [(0, 0), (9, 1), (12345, 77), ((1 << 32) - 1, (1 << 32) - 1), (1 << 32, 3), (5, 1 << 40)],
)
def test_batch_generators_draw_what_default_rng_of_sample_seed_draws(seed, epoch):
    """Bit for bit, for ids up to 2^32 - 1 and beyond (values of more than 32 bits take the plain way)."""
    ids = [0, 1, 2, 99, 1_000_003, (1 << 31) + 5, (1 << 32) - 1, 1 << 32, (1 << 33) + 7]
    rngs = BatchRngs(seed, epoch, ids)
    assert len(rngs) == len(ids)
    for k in list(range(len(ids))) + [3, 0]:  # in any order, and again
        want = np.random.default_rng(sample_seed(seed, epoch, ids[k]))
        got = rngs[k]
        assert got.bit_generator.state == want.bit_generator.state, (seed, epoch, ids[k])
        assert _draws(got) == _draws(want), (seed, epoch, ids[k])


def test_batch_generators_of_many_random_batches():
    r = np.random.default_rng(2024)
    for _ in range(50):
        seed, epoch = int(r.integers(0, 1 << 32)), int(r.integers(0, 1 << 16))
        ids = r.integers(0, 1 << 32, size=int(r.integers(1, 65)))
        rngs = BatchRngs(seed, epoch, ids)
        for k, sid in enumerate(ids.tolist()):
            assert _draws(rngs[k]) == _draws(np.random.default_rng(sample_seed(seed, epoch, sid)))


@pytest.mark.parametrize("workers", [0, 2])
def test_train_pixels_are_the_per_sample_recipes_for_every_sample(packed_local, tmp_path, workers):
    """Every sample of two epochs (the cold one and a warm one) equals decode_transform of its bytes
    with default_rng(sample_seed(seed, epoch, id)): what the loader gave before batches were read
    and seeded as batches."""
    ds = open_dataset(packed_local, cache_dir=str(tmp_path), cache_bytes=64 << 20)
    with Loader(ds, 16, num_workers=workers, seed=9) as loader:
        for epoch in range(2):
            loader.set_epoch(epoch)
            plan = loader.plan(epoch)
            n = 0
            for images, labels in loader:
                for j in range(len(labels)):
                    sid = int(plan[n])
                    want = decode_transform(
                        ds.read(sid), ds.key(sid), "train", np.random.default_rng(sample_seed(9, epoch, sid))
                    )
                    assert np.array_equal(images[j].numpy(), want), (epoch, ds.key(sid))
                    assert int(labels[j]) == int(ds.labels[sid])
                    n += 1
            assert n == len(ds) and loader.stats.exactly_once


def test_a_damaged_cached_block_is_read_again_and_the_pixels_are_right(packed_local, tmp_path):
    """A cached block whose bytes changed on disk fails the in-place check of the batch read: its
    samples are read again the ordinary way (the block dropped and fetched again)."""
    cache = tmp_path / "cache"
    ds = open_dataset(packed_local, cache_dir=str(cache), cache_bytes=64 << 20)
    with Loader(ds, 16, num_workers=2, transform="eval", shuffle=False) as loader:
        for _ in loader:  # the cold fill
            pass
    damage_cached_blocks(cache, 5000)
    with Loader(ds, 16, num_workers=2, transform="eval", shuffle=False) as loader:
        n = 0
        for images, _ in loader:
            for j in range(len(images)):
                want = eval_transform(decode_image(ds.read(n), ds.key(n)))
                assert np.array_equal(images[j].numpy(), want), ds.key(n)
                n += 1
        assert n == len(ds) and loader.stats.origin_bytes > 0  # the damaged blocks came again


def test_wrong_bytes_at_the_origin_name_the_sample(packed_local, tmp_path):
    copy = tmp_path / "d"
    shutil.copytree(packed_local, copy)
    ds = open_dataset(str(copy), cache_dir=str(tmp_path / "cache"), cache_bytes=64 << 20)
    sid = 7
    shard = copy / ds.index.shard_name(int(ds.index.shard[sid]))
    with open(shard, "r+b") as f:
        f.seek(int(ds.index.offset[sid]) + 10)
        f.write(b"\x00\x01\x02\x03")
    with Loader(ds, 16, num_workers=1, shuffle=False, transform="eval") as loader:
        with pytest.raises(WorkerError, match=ds.key(sid)):
            for _ in loader:
                pass


def test_scratch_parts_hold_at_most_the_limit_and_every_sample_once():
    assert scratch_parts(np.array([10, 10, 10, 10, 10]), 25) == [(0, 2), (2, 4), (4, 5)]
    assert scratch_parts(np.array([30, 5, 5, 40, 1]), 25) == [(0, 1), (1, 3), (3, 4), (4, 5)]  # a large one alone
    assert scratch_parts(np.array([], dtype=np.int64), 25) == []


def test_a_batch_read_in_several_parts_gives_the_same_pixels(packed_local, tmp_path, monkeypatch):
    """Samples larger together than the scratch buffer's limit are read in parts (inline, where the
    limit can be lowered): the pixels are those of one sample at a time."""
    monkeypatch.setattr(worker, "SCRATCH_BYTES", 150_000)
    ds = open_dataset(packed_local, cache_dir=str(tmp_path), cache_bytes=64 << 20)
    assert int(ds.index.length[:16].sum()) > 3 * 150_000
    with Loader(ds, 16, num_workers=0, seed=3) as loader:
        plan = loader.plan(0)
        n = 0
        for images, _ in loader:
            for j in range(len(images)):
                sid = int(plan[n])
                want = decode_transform(
                    ds.read(sid), ds.key(sid), "train", np.random.default_rng(sample_seed(3, 0, sid))
                )
                assert np.array_equal(images[j].numpy(), want), ds.key(sid)
                n += 1
        assert n == len(ds)


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_a_payload_in_a_shared_buffer_decodes_as_its_bytes(cases_dir, mode):
    """The batch read hands each sample to the decoder as a view of its scratch buffer: every shared
    JPEG case (CMYK, grey, bad EXIF, truncated, ...) gives the same pixels or the same error as bytes."""
    from stoker.decode import DecodeError

    for f in sorted((cases_dir / "pillow-jpeg").iterdir()):
        data = f.read_bytes()
        buf = np.frombuffer(bytearray(b"\xff\xd8" + data + b"\xff\xd9"), np.uint8)
        outs = []
        for given in (data, buf.data[2 : 2 + len(data)]):
            try:
                outs.append(decode_transform(given, f.stem, mode, np.random.default_rng(1)))
            except DecodeError as exc:
                outs.append(str(exc))
        if isinstance(outs[0], str):
            assert outs[1] == outs[0], f.name
        else:
            assert np.array_equal(outs[0], outs[1]), f.name
