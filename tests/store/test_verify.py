"""`stoker verify` and the open-time shard check."""

import os
import shutil
import subprocess
import sys

import pytest

from stoker.store.dataset import open_dataset
from stoker.store.verify import DatasetChangedError, check_shards, verify


@pytest.fixture
def packed_copy(packed_local, tmp_path):
    dst = tmp_path / "copy"
    shutil.copytree(packed_local, dst)
    return dst


def test_clean_dataset_verifies(packed_copy):
    r = verify(str(packed_copy), progress=False)
    assert r.ok and r.samples == 120 and r.bytes_read > 0
    ds = open_dataset(str(packed_copy), cache=False)
    check_shards(ds.origin, ds.index)  # no exception


def test_one_flipped_byte_is_found_and_named(packed_copy):
    ds = open_dataset(str(packed_copy), cache=False)
    i = 37
    shard = packed_copy / ds.index.shard_name(ds.index.shard[i])
    raw = bytearray(shard.read_bytes())
    raw[int(ds.index.offset[i]) + 10] ^= 0x01
    shard.write_bytes(bytes(raw))
    r = verify(str(packed_copy), progress=False)
    assert not r.ok
    assert [b["key"] for b in r.bad_samples] == [ds.key(i)]
    assert r.bad_samples[0]["shard"] == ds.index.shard_name(ds.index.shard[i])
    out = subprocess.run(
        [sys.executable, "-m", "stoker.cli", "verify", "--no-progress", str(packed_copy)],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 1 and ds.key(i) in out.stdout


def test_truncated_and_missing_shards(packed_copy):
    ds = open_dataset(str(packed_copy), cache=False)
    s0 = packed_copy / ds.index.shard_name(0)
    s1 = packed_copy / ds.index.shard_name(1)
    with open(s0, "r+b") as f:
        f.truncate(os.path.getsize(s0) // 2)
    s1.unlink()
    with pytest.raises(
        DatasetChangedError, match=r"shard-000000.tar: \d+ bytes at the origin.*shard-000001.tar: missing"
    ):
        check_shards(ds.origin, ds.index)
    r = verify(str(packed_copy), progress=False)
    assert {b["shard"] for b in r.bad_shards} == {ds.index.shard_name(0), ds.index.shard_name(1)}
    assert r.bad_samples  # samples past the cut are named
    zero = packed_copy / ds.index.shard_name(2)
    zero.write_bytes(b"")
    with pytest.raises(DatasetChangedError, match="shard-000002.tar: 0 bytes"):
        check_shards(ds.origin, ds.index)


def test_flipped_byte_in_a_named_field_is_found(tmp_path, cases_dir):
    from stoker.store.pack import pack

    dst = tmp_path / "wds"
    pack(str(cases_dir / "webdataset" / "sample.tgz"), str(dst), progress=False)
    ds = open_dataset(str(dst), cache=False)
    i = 5
    table = ds.index.member_table(i)
    cls = [m for m in table if m[0] == "cls"]
    assert cls, table
    _, off, n, _ = cls[0]
    shard = dst / ds.index.shard_name(ds.index.shard[i])
    raw = bytearray(shard.read_bytes())
    raw[off] ^= 0x01
    shard.write_bytes(bytes(raw))
    r = verify(str(dst), progress=False)
    assert [b["key"] for b in r.bad_samples] == [ds.key(i)] and "field 'cls'" in r.bad_samples[0]["reason"]


def test_same_size_rewrite_of_a_shard_on_s3_is_detected_at_open(s3_origin, sample_tree):
    from stoker_lab.bench.origin import upload_tree
    from stoker.store.pack import pack
    from stoker.storage import url_to_fs

    opts = s3_origin.storage_options()
    upload_tree(str(sample_tree / "train"), s3_origin.url("etag/raw"), opts)
    url = s3_origin.url("etag/packed")
    pack(s3_origin.url("etag/raw"), url, storage_options=opts, progress=False)
    ds = open_dataset(url, cache=False, storage_options=opts)
    assert all(s.get("etag") for s in ds.index.shards)  # recorded at pack time
    fs, root = url_to_fs(url, opts)
    path = f"{root}/{ds.index.shard_name(0)}"
    raw = bytearray(fs.cat_file(path))
    raw[int(ds.index.offset[0]) + 3] ^= 0xFF  # same size, different content
    fs.pipe_file(path, bytes(raw))
    with pytest.raises(DatasetChangedError, match="shard-000000.tar: ETag"):
        open_dataset(url, cache=False, storage_options=opts)


def test_damaged_tar_header_is_found(packed_copy):
    """stoker reads by offset and would not notice, but tar and WebDataset readers would."""
    ds = open_dataset(str(packed_copy), cache=False)
    in0 = [i for i in range(len(ds)) if ds.index.shard[i] == 0]
    i = sorted(in0, key=lambda j: ds.index.offset[j])[1]  # the second member of shard 0
    shard = packed_copy / ds.index.shard_name(0)
    raw = bytearray(shard.read_bytes())
    raw[int(ds.index.offset[i]) - 512 + 10] ^= 0x01  # a byte of its header's name field
    shard.write_bytes(bytes(raw))
    r = verify(str(packed_copy), progress=False)
    assert not r.ok
    assert ds.key(i) in [b["key"] for b in r.bad_samples]
    assert "tar framing" in r.bad_samples[0]["reason"]


def test_a_damaged_tar_header_names_only_its_own_sample(packed_copy):
    """One flipped byte in one member's tar header: that sample is reported, and the members
    after it (which a resyncing tar reader such as GNU tar still finds) are not."""
    ds = open_dataset(str(packed_copy), cache=False)
    s = int(ds.index.shard[0])
    in_shard = [i for i in range(len(ds)) if int(ds.index.shard[i]) == s]
    i = min(in_shard, key=lambda j: int(ds.index.offset[j]))  # the shard's first member
    shard = packed_copy / ds.index.shard_name(s)
    raw = bytearray(shard.read_bytes())
    raw[int(ds.index.offset[i]) - 512 + 10] ^= 0x01  # inside the name field of its ustar header
    shard.write_bytes(bytes(raw))
    r = verify(str(packed_copy), progress=False)
    assert not r.ok and [b["key"] for b in r.bad_samples] == [ds.key(i)]
