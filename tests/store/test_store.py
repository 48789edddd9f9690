"""Pack and read: byte-identical round trips, GNU-tar-readable shards, resumable packs."""

import json
import os
import subprocess
import tarfile

import numpy as np
import pyarrow.parquet as pq
import pytest

from _helpers import make_image_folder, pack_killed_before_index
from stoker.store.dataset import open_dataset
from stoker.store.index import INDEX_NAME
from stoker.store.pack import DatasetExistsError, pack


def _source_bytes(root, ds, i):
    return (root / "train" / f"{ds.key(i)}.JPEG").read_bytes()


def test_round_trip_local_byte_identical(sample_tree, packed_local, tmp_path):
    ds = open_dataset(packed_local, cache_dir=str(tmp_path / "cache"), cache_bytes=64 << 20)
    assert len(ds) == 120
    assert len(ds.index.shards) > 1
    for i in range(len(ds)):
        data, label = ds[i]
        assert data == _source_bytes(sample_tree, ds, i)
        assert ds.index.classes[label] == ds.key(i).split("/")[0]
    # second pass is served from the cache, still identical
    before = ds.origin.counters.bytes
    for i in range(len(ds)):
        assert ds[i][0] == _source_bytes(sample_tree, ds, i)
    assert ds.origin.counters.bytes == before


def test_index_schema_is_64_bit(packed_local):
    t = pq.read_table(os.path.join(packed_local, INDEX_NAME))
    assert str(t.schema.field("offset").type) == "int64"
    assert str(t.schema.field("length").type) == "int64"
    assert str(t.schema.field("checksum").type) == "uint64"
    assert set(t.column_names) >= {"sample_id", "key", "label", "class_name", "shard", "offset", "length", "checksum"}
    meta = json.loads(t.schema.metadata[b"stoker"])
    assert meta["version"] and len(meta["shards"]) >= 2


def test_shards_are_gnu_tar_readable(packed_local, sample_tree, tmp_path):
    ds = open_dataset(packed_local, cache=False)
    shard = os.path.join(packed_local, ds.index.shards[0]["name"])
    listing = subprocess.run(["tar", "-tf", shard], capture_output=True, text=True, check=True).stdout.split()
    in_shard = np.flatnonzero(ds.index.shard == 0)
    in_shard = in_shard[np.argsort(ds.index.offset[in_shard])]  # tar order
    assert listing == [f"{ds.key(i)}.JPEG" for i in in_shard]
    out = tmp_path / "x"
    out.mkdir()
    subprocess.run(["tar", "-xf", shard, "-C", str(out)], check=True)
    for i in in_shard:
        assert (out / f"{ds.key(i)}.JPEG").read_bytes() == _source_bytes(sample_tree, ds, i)
    with tarfile.open(shard) as tf:  # and Python's reader agrees on payload offsets
        for i, m in zip(in_shard, tf.getmembers()):
            assert m.offset_data == ds.index.offset[i]
    # samples are placed in shuffled order (classes mixed within a shard), ids in key order
    assert [ds.key(i) for i in range(len(ds))] == sorted(ds.key(i) for i in range(len(ds)))
    assert len({ds.key(i).split("/")[0] for i in in_shard[:12]}) > 1


def test_round_trip_through_s3(s3_origin, sample_tree, tmp_path):
    from stoker_lab.bench.origin import upload_tree

    opts = s3_origin.storage_options()
    raw, dst = s3_origin.url("rt/raw"), s3_origin.url("rt/packed")
    upload_tree(str(sample_tree / "train"), raw, opts)
    r = pack(raw, dst, shard_bytes=2 << 20, storage_options=opts, progress=False)
    assert r.samples == 120
    ds = open_dataset(
        dst, cache_dir=str(tmp_path / "c"), cache_bytes=1 << 30, storage_options=opts, block_bytes=256 << 10
    )
    for i in np.random.default_rng(0).permutation(len(ds)):
        assert ds[int(i)][0] == _source_bytes(sample_tree, ds, int(i))
    assert ds.origin.counters.requests <= len(ds.blocks) + 1  # one ranged GET per block, not per sample


def test_pack_refuses_existing_dataset(sample_tree, packed_local):
    with pytest.raises(DatasetExistsError, match="already holds a dataset"):
        pack(str(sample_tree / "train"), packed_local, progress=False)


def test_interrupted_pack_is_never_a_dataset_and_rerun_finishes(sample_tree, tmp_path, monkeypatch):
    dst = tmp_path / "p"
    r1 = pack(str(sample_tree / "train"), str(tmp_path / "whole"), shard_bytes=1 << 20, progress=False)
    assert not list((tmp_path / "whole" / "shards").glob("*.json"))  # a finished pack keeps no manifest
    # A pack killed before the end: no index, one shard missing, one torn (no manifest).
    pack_killed_before_index(monkeypatch, str(sample_tree / "train"), str(dst), shard_bytes=1 << 20, progress=False)
    os.unlink(dst / "shards" / "shard-000001.tar")
    os.unlink(dst / "shards" / "shard-000002.tar.json")
    with pytest.raises(FileNotFoundError, match="not a packed stoker dataset"):
        open_dataset(str(dst), cache=False)
    r2 = pack(str(sample_tree / "train"), str(dst), shard_bytes=1 << 20, progress=False)
    assert r2.reused_shards == r1.shards - 2
    assert r2.version == r1.version  # the same content, byte for byte
    ds = open_dataset(str(dst), cache=False)
    assert all(ds[i][0] == _source_bytes(sample_tree, ds, i) for i in range(len(ds)))


def test_image_folder_listing_skips_non_images_and_refuses_duplicate_keys(tmp_path):
    src = make_image_folder(tmp_path / "src", {"a/1.jpg": b"x", "a/notes.txt": b"t", "b/2.png": b"y", "README": b"r"})
    r = pack(str(src), str(tmp_path / "d"), progress=False)
    assert (r.samples, r.classes, r.skipped_files) == (2, 2, 2)
    dup = make_image_folder(tmp_path / "dup", {"a/1.jpg": b"x", "a/1.png": b"y"})
    with pytest.raises(ValueError, match="duplicate key"):
        pack(str(dup), str(tmp_path / "d2"), progress=False)
    with pytest.raises(FileNotFoundError):
        pack(str(tmp_path / "missing"), str(tmp_path / "d3"), progress=False)


@pytest.mark.parametrize("kind", ["string", "large_string"])
def test_index_key_lookup_matches_arrow(kind):
    """DatasetIndex.key slices the string buffers directly; it must agree with pyarrow for
    non-ASCII keys, large_string arrays and arrays that are slices (non-zero offset), and
    survive pickling (workers get a copy)."""
    import pickle

    import pyarrow as pa

    from stoker.store.index import DatasetIndex

    keys = ["a/0", "été/ß", "", "日本/猫.jpg", "x" * 300, "z/9"]
    arr = pa.array(["pad", "pad"] + keys, type=pa.large_string() if kind == "large_string" else pa.string())
    arr = arr.slice(2)  # every kind is a slice of a longer array (offset 2)
    n = len(keys)
    ix = DatasetIndex(
        keys=arr,
        labels=np.zeros(n, np.int64),
        shard=np.zeros(n, np.int32),
        offset=np.arange(n, dtype=np.int64),
        length=np.ones(n, np.int64),
        checksum=np.zeros(n, np.uint64),
        shards=[],
        classes=[],
        version="v",
    )
    assert [ix.key(i) for i in range(n)] == keys
    assert [pickle.loads(pickle.dumps(ix)).key(i) for i in range(n)] == keys
