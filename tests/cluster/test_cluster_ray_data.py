"""stoker.ray_data.read on the 3-node test cluster: a ray.data.Dataset whose read tasks read the
packed dataset through the node caches. Two passes over the S3 test dataset: every sample once
per pass with the origin's bytes, and the second pass reads 0 bytes from the origin, with no
materialize()."""

from __future__ import annotations

import numpy as np
import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("ray.data")

BLOCK = 64 << 10  # small cache blocks: the 120-photo test set gives ~100 blocks over the 3 nodes


def _quiet():
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False


def _pass(ds) -> list[dict]:
    """Every row of one pass over ``ds`` (streamed, nothing kept in the object store)."""
    return [row for batch in ds.iter_batches(batch_size=16, batch_format="pyarrow") for row in batch.to_pylist()]


def test_two_passes_read_every_sample_once_and_the_second_reads_nothing_from_the_origin(
    cluster, fresh_services, s3_dataset, s3_origin, tmp_path
):
    import stoker.ray_data
    from stoker.store.dataset import open_dataset

    url, opts = s3_dataset
    _quiet()
    truth = open_dataset(url, storage_options=opts, cache=False)
    want = {truth.key(i): (i, truth.read(i), int(truth.labels[i])) for i in range(len(truth))}
    shard_bytes = int(truth.index.total_bytes)

    before = s3_origin.stats()["bytes_served"]
    ds = stoker.ray_data.read(
        url, storage_options=opts, cache_dir=str(tmp_path / "cache"), cache_bytes=64 << 20, block_bytes=BLOCK
    )
    assert ds.schema().names == ["key", "id", "label", "bytes"]
    setup = s3_origin.stats()["bytes_served"] - before
    assert setup < shard_bytes / 4  # the index (read once, here), no shard yet

    served = []
    for _ in range(2):
        at = s3_origin.stats()["bytes_served"]
        rows = _pass(ds)
        served.append(s3_origin.stats()["bytes_served"] - at)
        assert sorted(r["id"] for r in rows) == list(range(len(truth)))  # every sample exactly once
        for r in rows:
            assert want[r["key"]] == (r["id"], r["bytes"], r["label"]), r["key"]
    assert served[0] > 0  # the first pass filled the node caches from the origin ...
    assert served[0] <= 1.1 * shard_bytes  # ... each block once
    assert served[1] == 0  # the second read nothing from it


def test_payloads_gathers_the_ranges_of_a_block_into_one_binary_column():
    from stoker.cluster.train.datasource import payloads

    block = b"hdr1ABChdr2DEhdr3F"
    got = payloads(block, np.array([4, 11, 17]), np.array([3, 2, 1]))
    assert got.to_pylist() == [b"ABC", b"DE", b"F"] and str(got.type) == "binary"
    assert payloads(b"", np.array([], np.int64), np.array([], np.int64)).to_pylist() == []


def test_read_tasks_group_blocks_and_a_missing_dataset_is_named(cluster, fresh_services, s3_origin, tmp_path):
    import stoker.ray_data
    from stoker.cluster.train.datasource import task_groups
    from stoker.errors import OriginNotFoundError

    groups = task_groups(np.arange(10), 3)
    assert [g.tolist() for g in groups] == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert [g.tolist() for g in task_groups(np.arange(2), 5)] == [[0], [1]]
    assert task_groups(np.arange(0), 4) == []
    with pytest.raises(ValueError, match="blocks_per_task must be at least 1"):
        stoker.ray_data.read("s3://nowhere/x", blocks_per_task=0)
    url = s3_origin.url("no-such-dataset")
    with pytest.raises(OriginNotFoundError, match="no-such-dataset"):
        stoker.ray_data.read(url, storage_options=s3_origin.storage_options(), cache_dir=str(tmp_path / "c"))


def test_a_dataset_larger_than_the_object_store_reads_nothing_from_the_origin_the_second_time(
    cluster, fresh_services, s3_origin, tmp_path
):
    """480 MiB of incompressible samples, more than the test cluster's object stores hold together
    (3 x 150 MB): the first pass fills the node caches, the second reads 0 origin bytes; neither
    keeps the dataset in the object store (a materialize() would spill it to disk)."""
    import os

    import xxhash

    import stoker.ray_data
    from stoker.store.writer import Writer

    _quiet()
    opts = s3_origin.storage_options()
    url = s3_origin.url("ray-data/large")
    want = {}
    with Writer(url, shard_bytes="64MiB", storage_options=opts) as w:
        for i in range(120):
            data = os.urandom(4 << 20)
            want[f"{i:05d}"] = xxhash.xxh3_64_intdigest(data)
            w.write({"__key__": f"{i:05d}", "bin": data, "cls": i % 3})
    total = sum(4 << 20 for _ in want)
    assert total > 3 * (150 << 20)
    ds = stoker.ray_data.read(url, storage_options=opts, cache_dir=str(tmp_path / "cache"), cache_bytes=320 << 20)
    served = []
    for _ in range(2):
        at = s3_origin.stats()["bytes_served"]
        seen = {}
        for batch in ds.iter_batches(batch_size=4, batch_format="pyarrow"):
            for key, data, label in zip(
                batch["key"].to_pylist(), batch["bytes"].to_pylist(), batch["label"].to_pylist(), strict=True
            ):
                assert key not in seen, f"{key} twice in one pass"
                seen[key] = xxhash.xxh3_64_intdigest(data)
                assert label == int(key) % 3
        served.append(s3_origin.stats()["bytes_served"] - at)
        assert seen == want  # every sample once, with the bytes written
    assert total <= served[0] <= 1.1 * total
    assert served[1] == 0


def test_a_sample_damaged_at_the_origin_fails_the_pass_naming_its_key_and_shard(
    cluster, fresh_services, s3_dataset, s3_origin, tmp_path
):
    """A shard rewritten under its index (one byte of one sample changed, same size): the pass
    raises the ChecksumError of that sample, with its key, shard and the dataset's URL, instead of
    handing on wrong bytes."""
    import fsspec

    import stoker.ray_data
    from stoker.store.dataset import open_dataset
    from stoker.store.pack import pack

    _quiet()
    opts = s3_origin.storage_options()
    url = s3_origin.url("ray-data/damaged")
    pack(s3_origin.url("cluster/raw"), url, storage_options=opts, shard_bytes=1 << 20, progress=False)
    truth = open_dataset(url, storage_options=opts, cache=False)
    i = len(truth) // 2
    shard = truth.index.shard_name(truth.index.shard[i])
    fs, path = fsspec.core.url_to_fs(f"{url}/{shard}", **opts)
    data = bytearray(fs.cat_file(path))
    data[int(truth.index.offset[i]) + int(truth.index.length[i]) // 2] ^= 0xFF
    fs.pipe_file(path, bytes(data))
    ds = stoker.ray_data.read(url, storage_options=opts, cache_dir=str(tmp_path / "cache"), cache_bytes=64 << 20)
    with pytest.raises(Exception) as err:
        _pass(ds)
    text = str(err.value)
    assert "ChecksumError" in text and repr(truth.key(i)) in text and shard in text and url in text, text
