"""Small samples: grouped many to one tar member at a few bytes each, read like any other, and an
index that holds a few dozen bytes per sample (store/shards.py, store/index.py)."""

import os
import tarfile

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from _helpers import pack_killed_before_index
from stoker import Loader, RunOptions, Writer, open_dataset
from stoker.collate import raw_bytes
from stoker.store.index import index_array_bytes
from stoker.store.keytable import KeyTable
from stoker.store.pack import pack
from stoker.store.pack_options import PackOptions
from stoker.store.shards import GROUP_BYTES, is_group
from stoker.store.verify import verify

N = 3000
LAYOUTS = {"grouped": PackOptions(column="data"), "tar": PackOptions(column="data", small_sample_bytes=0)}


def _payload(i: int) -> bytes:
    return i.to_bytes(8, "little")


def _imagenet_key(i: int) -> str:
    """An ImageNet-length key (25 bytes): ``n01440764/n01440764_10026``."""
    return f"n{1440764 + i % 50:08d}/n{1440764 + i % 50:08d}_{i:05d}"


@pytest.fixture(scope="module")
def tiny_parquet(tmp_path_factory):
    """A Parquet file of ``N`` 8-byte samples in one column (keys ``tiny/<row>``)."""
    path = tmp_path_factory.mktemp("tiny") / "tiny.parquet"
    pq.write_table(pa.table({"data": pa.array([_payload(i) for i in range(N)], pa.binary())}), path)
    return path


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def packed(request, tiny_parquet, tmp_path_factory):
    dst = tmp_path_factory.mktemp(f"packed-{request.param}") / "d"
    r = pack(str(tiny_parquet), str(dst), source="parquet", options=LAYOUTS[request.param], progress=False)
    return request.param, dst, r


def _shard_files(dst) -> list:
    return sorted(p for p in (dst / "shards").iterdir())


def _expected(ds, sid: int) -> bytes:
    return _payload(int(ds.key(sid).rsplit("/", 1)[1]))


def test_tiny_samples_read_back_byte_exact_once_per_epoch(packed, tmp_path):
    """Both layouts through a Loader with forked workers (the raw batch path), two epochs: every
    sample once, every byte its own; and through ``read_fields``."""
    layout, dst, r = packed
    ds = open_dataset(str(dst), str(tmp_path / "cache"), 1 << 30)
    assert len(ds) == N == r.samples
    with Loader(ds, 64, num_workers=2, seed=5, collate=raw_bytes, run=RunOptions(start_method="fork")) as loader:
        for _ in range(2):
            seen = []
            for b in loader:
                for j, sid in enumerate(b.ids.tolist()):
                    assert b.sample(j).numpy().tobytes() == _expected(ds, sid), ds.key(sid)
                    seen.append(sid)
            assert sorted(seen) == list(range(N))
    for sid in (0, 1, N // 2, N - 1):
        assert ds.read_fields(sid) == {"data": _expected(ds, sid)}


def test_grouped_shards_cost_a_few_bytes_per_sample(packed):
    """The shard overhead per sample, from file sizes: at most 64 B grouped (a tar member per
    field costs over 512 B); a finished pack keeps no manifest."""
    layout, dst, r = packed
    files = _shard_files(dst)
    assert all(p.suffix == ".tar" for p in files)  # manifests are gone once the index is in
    shard_bytes = sum(p.stat().st_size for p in files)
    assert shard_bytes == r.shard_bytes and r.payload_bytes == 8 * N
    overhead = (shard_bytes - r.payload_bytes) / N
    if layout == "grouped":
        assert overhead <= 64, overhead
    else:
        assert overhead >= 512, overhead


def test_a_tar_reader_sees_one_member_per_group(packed):
    """What WebDataset or GNU tar see: grouped, one ``__stoker_group_NNNNNN__.samples`` member per
    group (the samples back to back); the tar layout, one ``<key>.data`` member per sample."""
    layout, dst, _ = packed
    ds = open_dataset(str(dst), cache=False)
    names = []
    for p in _shard_files(dst):
        with tarfile.open(p) as tf:
            names += tf.getnames()
    if layout == "grouped":
        assert names and all(is_group(n) for n in names)
        assert len(names) == -(-8 * N // GROUP_BYTES)
    else:
        assert sorted(names) == sorted(f"{ds.key(i)}.data" for i in range(N))


def test_verify_checks_grouped_samples_and_names_a_damaged_one(packed, tmp_path):
    layout, dst, _ = packed
    assert verify(str(dst)).ok
    ds = open_dataset(str(dst), cache=False)
    victim = N // 3
    shard = dst / ds.index.shard_name(ds.index.shard[victim])
    data = bytearray(shard.read_bytes())
    data[int(ds.index.offset[victim])] ^= 0xFF
    shard.write_bytes(bytes(data))
    report = verify(str(dst))
    assert [(b["key"], b["reason"].split(" at ")[0]) for b in report.bad_samples] == [
        (ds.key(victim), "checksum mismatch")
    ]


def test_a_damaged_group_header_is_a_framing_error_naming_its_samples(tmp_path):
    dst = tmp_path / "d"
    with Writer(str(dst)) as w:
        for i in range(100):
            w.write({"__key__": f"k{i:03d}", "bin": _payload(i)})
    shard = _shard_files(dst)[0]
    data = bytearray(shard.read_bytes())
    data[0:16] = b"\0" * 16  # the group member's name: no tar reader finds it now
    shard.write_bytes(bytes(data))
    report = verify(str(dst))
    assert len(report.bad_samples) == 100
    assert report.bad_samples[0]["key"] == "k000" and "tar framing" in report.bad_samples[0]["reason"]


def test_samples_either_side_of_the_threshold_share_a_shard(tmp_path):
    """Samples under ``small_sample_bytes`` are grouped, larger ones keep their own members; both
    read back byte-exact with their named fields, and verify passes."""
    dst = tmp_path / "mixed"
    sizes = [5, 100, 5000, 7, 4095, 4096, 3, 20000, 1]
    made = {}
    with Writer(str(dst), small_sample_bytes="4KiB") as w:
        for i, n in enumerate(sizes):
            made[f"s{i}"] = {"bin": bytes([i]) * n, "txt": f"sample {i}"}
            w.write({"__key__": f"s{i}", **made[f"s{i}"]})
    ds = open_dataset(str(dst), cache=False)
    for i in range(len(ds)):
        fields = ds.read_fields(i)
        assert fields == {"bin": made[ds.key(i)]["bin"], "txt": made[ds.key(i)]["txt"].encode()}
    with tarfile.open(_shard_files(dst)[0]) as tf:
        names = tf.getnames()
    own = sorted(n for n in names if not is_group(n))
    assert own == sorted(
        f"s{i}.{f}" for i, n in enumerate(sizes) if n + len(f"sample {i}") >= 4096 for f in ("bin", "txt")
    )
    assert sum(is_group(n) for n in names) == 4  # runs of small samples between the large ones
    assert verify(str(dst)).ok


def test_an_interrupted_grouped_pack_resumes_and_another_threshold_rewrites(tiny_parquet, tmp_path, monkeypatch):
    src, opts = str(tiny_parquet), dict(source="parquet", shard_bytes=4096, progress=False)
    whole = pack(src, str(tmp_path / "whole"), options=PackOptions(column="data"), **opts)
    assert whole.shards > 2
    dst = str(tmp_path / "d")
    pack_killed_before_index(monkeypatch, src, dst, options=PackOptions(column="data"), **opts)
    os.unlink(os.path.join(dst, "shards", "shard-000001.tar"))
    again = pack(src, dst, options=PackOptions(column="data"), **opts)
    assert (again.reused_shards, again.version) == (whole.shards - 1, whole.version)
    assert verify(dst).ok
    # a rerun with another threshold makes other shards: none is reused
    other = str(tmp_path / "other")
    pack_killed_before_index(monkeypatch, src, other, options=PackOptions(column="data"), **opts)
    redo = pack(src, other, options=PackOptions(column="data", small_sample_bytes=0), **opts)
    assert redo.reused_shards == 0 and redo.version != whole.version


def test_the_open_index_holds_under_128_bytes_per_sample(tmp_path):
    """ImageNet-length keys (25 B): the directory's arrays (keys, columns, the block map) divided
    by the sample count, measured structurally (no RSS)."""
    dst = tmp_path / "d"
    n = 20000
    with Writer(str(dst), shard_bytes="4MiB") as w:  # 2,048 samples of 8 B per shard (SMALL_SAMPLE_COST)
        for i in range(n):
            w.write({"__key__": _imagenet_key(i), "jpg": _payload(i)})
    ds = open_dataset(str(dst), cache=False)
    idx = ds.index
    assert len(ds) == n and len(idx.shards) > 1
    blocks = ds.blocks
    block_arrays = sum(a.nbytes for a in vars(blocks).values() if isinstance(a, np.ndarray))
    per_sample = (KeyTable(idx).nbytes + block_arrays) / n
    assert per_sample <= 128, per_sample
    assert (idx.keys.nbytes + index_array_bytes(idx)) / n <= 64
    assert max(a.itemsize for a in (idx.offset, idx.length, idx.span_end)) <= 4  # shard offsets < 2 GiB
    assert idx.shard.itemsize == idx.field.itemsize == 1  # < 128 shards, one field name
    assert idx.labels.dtype == np.int64  # Dataset.labels stays int64
    # key() decodes from the string array's own buffer: no copy of the keys per process
    assert ds.key(n - 1) == sorted(_imagenet_key(i) for i in range(n))[-1]
    _, data = idx.__dict__["_key_buffers"]
    assert data.obj is not None and data.nbytes == idx.keys.buffers()[2].size


@pytest.mark.parametrize("bad", ["lots", -1, True])
def test_a_bad_threshold_is_refused(tmp_path, bad):
    with pytest.raises((ValueError, TypeError), match="small_sample_bytes"):
        Writer(str(tmp_path / "w"), small_sample_bytes=bad)
    with pytest.raises((ValueError, TypeError), match="small_sample_bytes"):
        PackOptions(small_sample_bytes=bad)


def test_a_forked_workers_copy_of_the_dataset_shares_the_index_arrays(tmp_path):
    """A worker's fresh copy (what a forked worker or prefetch process reads through) refers to
    the parent's index arrays instead of copying them: their pages are never written, so every
    forked worker shares one index."""
    from stoker.loader.workers.worker import fresh_copy

    dst = tmp_path / "d"
    with Writer(str(dst)) as w:
        for i in range(1000):
            w.write({"__key__": _imagenet_key(i), "bin": _payload(i), "cls": i % 3})
    ds = open_dataset(str(dst), cache=False)
    copy = fresh_copy(ds)
    assert copy is not ds and copy.index is not ds.index
    for name in ("labels", "shard", "offset", "length", "checksum", "span_end", "field"):
        assert getattr(copy.index, name) is getattr(ds.index, name), name
    assert copy.index.members.checksum is ds.index.members.checksum and copy.index.keys is ds.index.keys
    assert copy.blocks.sample_block is ds.blocks.sample_block
    assert [copy.read_fields(i) for i in range(3)] == [ds.read_fields(i) for i in range(3)]
