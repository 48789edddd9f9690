"""stoker.Writer: samples made in Python written as a packed dataset (the same shards and index as
pack), read back byte-exact with every field type; errors that name the sample; atomic publish
(an exception, or SIGKILL, leaves nothing a reader opens); parallel parts merged; S3."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import tarfile
import textwrap
import time

import fsspec
import numpy as np
import pytest

import stoker
from stoker import DatasetExistsError, Loader, SourceError, SourceNotFoundError, Writer, open_dataset
from stoker.store.index import INDEX_NAME

SRC = os.path.join(os.path.dirname(__file__), "..", "..", "src")


def make_sample(i: int) -> dict:
    """Sample ``i`` with every field type; its array's shape depends on ``i``."""
    rng = np.random.default_rng(i)
    return {
        "__key__": f"k/{i:05d}",
        "jpg": rng.bytes(100 + 37 * i),
        "cls": i % 3,
        "txt": f"sample {i}: größe ✓",
        "score": i / 7,
        "emb": rng.standard_normal((i % 4 + 1, 8)).astype(np.float16),
        "ids": np.arange(i, dtype=np.int64),
        "meta": {"i": i, "tags": ["a", str(i)]},
    }


def check_fields(fields: dict, want: dict) -> None:
    """``fields`` (read back: bytes per field) holds ``want``'s values, decoded as the guide says."""
    assert fields["jpg"] == want["jpg"]
    assert int(fields["cls"]) == want["cls"]
    assert fields["txt"].decode() == want["txt"]
    assert float(fields["score"]) == want["score"]
    for name in ("emb", "ids"):
        arr = np.load(io.BytesIO(fields[name]))
        assert arr.dtype == want[name].dtype and arr.shape == want[name].shape
        assert arr.tobytes() == want[name].tobytes()
    assert json.loads(fields["meta"]) == want["meta"]


def keep(samples):
    """A collate that keeps the samples' field dicts (pickled to the training process)."""
    return samples


def test_every_field_type_round_trips_through_read_fields_and_a_loader(tmp_path):
    dst = str(tmp_path / "ds")
    with Writer(dst, shard_bytes="8KiB") as w:
        for i in range(40):
            w.write(make_sample(i))
        assert len(w) == 40
    assert w.result is not None and w.result.samples == 40 and w.result.shards > 3
    ds = open_dataset(dst, cache=False)
    assert len(ds) == 40 and [ds.key(i) for i in range(40)] == [f"k/{i:05d}" for i in range(40)]
    assert ds.labels.tolist() == [i % 3 for i in range(40)]  # the cls field is the label
    for i in range(40):
        fields = ds.read_fields(i)
        assert list(fields) == ["jpg", "cls", "txt", "score", "emb", "ids", "meta"]  # jpg is the primary
        check_fields(fields, make_sample(i))
    seen = []
    with Loader(ds, batch_size=8, num_workers=2, collate=keep, seed=1) as loader:
        for batch in loader:
            for fields in batch:
                i = int(fields["__key__"].split("/")[1])
                check_fields(fields, make_sample(i))
                assert fields["__label__"] == i % 3
                seen.append(i)
    assert sorted(seen) == list(range(40))


def test_shards_are_tar_files_as_pack_writes_them(tmp_path):
    dst = tmp_path / "ds"
    with Writer(str(dst), small_sample_bytes=0) as w:  # WebDataset's layout even for a tiny sample
        w.write({"__key__": "a", "png": b"P" * 10, "txt": "x"})
    shards = sorted(p for p in os.listdir(dst / "shards") if p.endswith(".tar"))
    assert shards == ["shard-000000.tar"]
    with tarfile.open(dst / "shards" / shards[0]) as tf:
        assert tf.getnames() == ["a.png", "a.txt"]
        assert tf.extractfile("a.txt").read() == b"x"
    assert (dst / INDEX_NAME).exists() and not (dst / "_stoker_pack.lease").exists()


@pytest.mark.parametrize(
    "second, words",
    [
        ({"__key__": "b", "jpg": b"x", "cls": "3"}, ["'b'", "'cls'", "a str", "an int"]),
        ({"__key__": "b", "jpg": b"x"}, ["'b'", "no field 'cls'"]),
        ({"__key__": "b", "jpg": b"x", "cls": 1, "extra": b""}, ["'b'", "'extra'"]),
        ({"__key__": "b", "jpg": b"x", "cls": 1, "emb": np.zeros(3, np.float32)}, ["'b'", "'emb'"]),
    ],
)
def test_a_sample_unlike_the_first_is_refused_naming_its_key_and_field(tmp_path, second, words):
    first = {"__key__": "a", "jpg": b"x", "cls": 1}
    if "emb" in second:
        first["emb"] = np.zeros(3, np.float16)
    w = Writer(str(tmp_path / "ds"))
    w.write(first)
    with pytest.raises(SourceError) as err:
        w.write(second)
    for word in words:
        assert word in str(err.value)
    w.write({**first, "__key__": "c"})  # the writer goes on after a refused sample
    w.close()
    assert [open_dataset(str(tmp_path / "ds"), cache=False).key(i) for i in range(2)] == ["a", "c"]


def test_bad_keys_values_and_duplicates_are_refused_naming_the_key(tmp_path):
    with Writer(str(tmp_path / "ds")) as w:
        w.write({"__key__": "a", "bin": b"1"})
        with pytest.raises(SourceError, match="duplicate key 'a'"):
            w.write({"__key__": "a", "bin": b"2"})
        with pytest.raises(TypeError, match="must be a str"):
            w.write({"__key__": 7, "bin": b"2"})
        with pytest.raises(SourceError, match="no '__key__'"):
            w.write({"bin": b"2"})
        with pytest.raises(SourceError, match="'x.y'") as e:
            w.write({"__key__": "x.y", "bin": b"2"})
        assert str(e.value).startswith(w.url), e.value  # names the dataset too
        for bad in (None, True, (1, 2), np.array([object()], dtype=object)):
            with pytest.raises(TypeError, match="sample 'b' field 'bin'") as e:
                w.write({"__key__": "b", "bin": bad})
            assert str(e.value).startswith(w.url), e.value  # names the dataset too
        with pytest.raises(TypeError, match="not JSON"):
            w.write({"__key__": "b", "bin": {"x": object()}})
    assert len(open_dataset(str(tmp_path / "ds"), cache=False)) == 1


def test_an_exception_inside_the_with_leaves_nothing(tmp_path):
    dst = tmp_path / "new" / "ds"
    with pytest.raises(RuntimeError, match="boom"):
        with Writer(str(dst), shard_bytes="4KiB") as w:
            for i in range(30):
                w.write(make_sample(i))
            assert (dst / "shards").exists()  # shards were written
            raise RuntimeError("boom")
    assert not (tmp_path / "new").exists()  # the folders it made are gone too
    with pytest.raises(FileNotFoundError, match="not a packed stoker dataset"):
        open_dataset(str(dst), cache=False)
    with pytest.raises(ValueError, match="aborted"):
        w.write(make_sample(99))


def test_an_existing_dataset_needs_overwrite(tmp_path):
    dst = str(tmp_path / "ds")
    with Writer(dst) as w:
        w.write({"__key__": "a", "bin": b"1"})
    with pytest.raises(DatasetExistsError):
        Writer(dst)
    with Writer(dst, overwrite=True) as w:
        w.write({"__key__": "b", "bin": b"2"})
    ds = open_dataset(dst, cache=False)
    assert [ds.key(0), ds[0][0]] == ["b", b"2"]


_KILLED_WRITER = """
import sys, time
import numpy as np
import stoker
w = stoker.Writer(sys.argv[1], shard_bytes="4KiB")
i = 0
while True:  # never closes: killed mid-write
    w.write({"__key__": f"k{i:07d}", "bin": np.random.default_rng(i).bytes(1000), "n": i})
    i += 1
    if i % 20 == 0:
        time.sleep(0.01)
"""


def test_a_writer_killed_mid_write_leaves_nothing_a_reader_opens(tmp_path):
    dst = tmp_path / "ds"
    env = {**os.environ, "PYTHONPATH": os.path.abspath(SRC)}
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(_KILLED_WRITER), str(dst)], env=env)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            if (dst / "shards").exists() and len(os.listdir(dst / "shards")) >= 6:
                break
            time.sleep(0.05)
        assert proc.poll() is None, "the writer exited by itself"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(30)
    assert not (dst / INDEX_NAME).exists()
    with pytest.raises(FileNotFoundError, match="not a packed stoker dataset"):
        open_dataset(str(dst), cache=False)
    # the next writer takes the dead writer's lease over at once and replaces its shards
    with Writer(str(dst)) as w:
        w.write({"__key__": "fresh", "bin": b"new", "n": 0})
    ds = open_dataset(str(dst), cache=False)
    assert len(ds) == 1 and ds[0][0] == b"new"
    assert sorted(os.listdir(dst / "shards")) == ["shard-000000.tar"]  # its manifest goes once the index is in


_PART_WRITER = """
import sys
import stoker
dst, part, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
with stoker.Writer(dst, part=part, shard_bytes="2KiB") as w:
    for i in range(part, n, 2):  # two parts: even and odd samples
        w.write({"__key__": f"s{i:05d}", "bin": bytes([i % 256]) * (50 + i), "cls": i % 5})
"""


def test_two_parallel_writers_merge_into_one_dataset_with_every_sample_once(tmp_path):
    dst = tmp_path / "ds"
    env = {**os.environ, "PYTHONPATH": os.path.abspath(SRC)}
    script = textwrap.dedent(_PART_WRITER)
    procs = [subprocess.Popen([sys.executable, "-c", script, str(dst), str(p), "200"], env=env) for p in (0, 1)]
    try:
        assert [p.wait(180) for p in procs] == [0, 0]
    finally:
        for p in procs:
            p.kill()
    with pytest.raises(FileNotFoundError, match="parts of parallel stoker.Writers that were not merged"):
        open_dataset(str(dst), cache=False)  # nothing to open before the merge
    with pytest.raises(SourceNotFoundError, match="part 2 is missing"):
        Writer.merge(str(dst), 3)
    with pytest.raises(SourceError, match="part-000001 beyond the 1 parts"):
        Writer.merge(str(dst), 1)
    result = Writer.merge(str(dst), 2)
    assert result.samples == 200 and result.shards > 4
    assert not (dst / "_parts").exists()
    ds = open_dataset(str(dst), cache=False)
    assert [ds.key(i) for i in range(len(ds))] == [f"s{i:05d}" for i in range(200)]
    seen = []
    with Loader(ds, batch_size=16, num_workers=2, collate=keep, seed=0) as loader:
        for batch in loader:
            for f in batch:
                i = int(f["__key__"][1:])
                assert f["bin"] == bytes([i % 256]) * (50 + i) and f["__label__"] == i % 5
                seen.append(i)
    assert sorted(seen) == list(range(200))


def test_merge_refuses_an_unfinished_part_and_parts_that_disagree(tmp_path):
    dst = str(tmp_path / "ds")
    with Writer(dst, part=0) as w:
        w.write({"__key__": "a", "bin": b"1"})
    busy = Writer(dst, part=1)
    busy.write({"__key__": "b", "bin": b"2"})
    with pytest.raises(SourceNotFoundError, match="part 1 is unfinished"):
        Writer.merge(dst, 2)
    with pytest.raises(stoker.PackLeaseError):
        Writer(dst, part=1)  # one writer per part
    busy.abort()
    with Writer(dst, part=1) as w:
        w.write({"__key__": "a", "bin": b"2"})
    with pytest.raises(SourceError, match="duplicate key 'a' in parts 0 and 1"):
        Writer.merge(dst, 2)
    with Writer(dst, part=1) as w:
        w.write({"__key__": "b", "bin": "text"})
    with pytest.raises(SourceError, match="part 1's samples field 'bin' is a str"):
        Writer.merge(dst, 2)
    with Writer(dst, part=1) as w:
        w.write({"__key__": "b", "bin": b"2"})
    Writer.merge(dst, 2)
    ds = open_dataset(dst, cache=False)
    assert [ds[i][0] for i in range(2)] == [b"1", b"2"]


def test_writer_on_s3(s3_origin, tmp_path):
    opts = s3_origin.storage_options()
    dst = s3_origin.url("writer/ds")
    with pytest.raises(RuntimeError, match="boom"):
        with Writer(dst, shard_bytes="8KiB", storage_options=opts) as w:
            for i in range(20):
                w.write(make_sample(i))
            raise RuntimeError("boom")
    with pytest.raises(FileNotFoundError):
        open_dataset(dst, storage_options=opts, cache=False)
    fs, root = fsspec.core.url_to_fs(dst, **opts)
    fs.invalidate_cache()
    assert fs.find(root) == []  # no shard, manifest or lease left behind
    with Writer(dst, shard_bytes="8KiB", storage_options=opts) as w:
        for i in range(20):
            w.write(make_sample(i))
    ds = open_dataset(dst, storage_options=opts, cache_dir=str(tmp_path / "c"), cache_bytes="64MiB")
    assert len(ds) == 20
    for i in range(20):
        check_fields(ds.read_fields(i), make_sample(i))
    for p in (0, 1):
        with Writer(s3_origin.url("writer/parts"), part=p, storage_options=opts) as w:
            w.write({"__key__": f"p{p}", "bin": bytes([p])})
    Writer.merge(s3_origin.url("writer/parts"), 2, storage_options=opts)
    ds = open_dataset(s3_origin.url("writer/parts"), storage_options=opts, cache=False)
    assert [ds[i][0] for i in range(2)] == [b"\x00", b"\x01"]
