"""The index built a row group at a time (store/indexwrite.py) is the index the whole-table build
gave: byte for byte on rows that span several row groups (primary-only and multi-field samples,
labels, class names), the same content version as before on a Writer dataset, and a duplicate
key across a row-group boundary still named with its two shards. The Writer's duplicate check
by key digests (store/seenkeys.py) stays exact when digests collide."""

from __future__ import annotations

import random
import subprocess
import sys
import textwrap

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

import stoker.store.seenkeys as seenkeys
from stoker import SourceError, Writer, open_dataset
from stoker.store.index import INDEX_ROWS_PER_GROUP, MEMBER_TYPE, assemble_table, table_to_bytes
from stoker.store.indexwrite import index_bytes
from stoker.store.rows import Rows

CLASSES = ["c0", "c1", "c2"]


def make_rows(n: int, extra_share: float, seed: int) -> tuple[Rows, list[int], list[str], list[dict]]:
    """``n`` samples in random key order over 4 shards: primary field jpg/png/bin, ``extra_share``
    of them with 1-2 more fields; labels -1..2 with their class names."""
    rng = random.Random(seed)
    rows, labels, names = Rows(), [], []
    for i in range(n):
        members = [(rng.choice(["jpg", "png", "bin"]), rng.randrange(10**6), rng.randrange(99), rng.randrange(2**64))]
        if rng.random() < extra_share:
            for field in rng.sample(["cls", "json", "txt"], rng.randrange(1, 3)):
                members.append((field, rng.randrange(10**6), rng.randrange(99), rng.randrange(2**64)))
        rows.append(f"k{rng.randrange(10**9):09d}/é{i}", rng.randrange(4), members)
        label = rng.randrange(-1, 3)
        labels.append(label)
        names.append("" if label < 0 else CLASSES[label])
    shards = [{"name": f"shards/shard-{i:06d}.tar", "bytes": 10**7, "samples": 1} for i in range(4)]
    return rows, labels, names, shards


def whole_table_index(rows: Rows, labels, names, shards) -> bytes:
    """The index as the whole-table build made it (every column of N sorted at once, then
    :func:`assemble_table` and :func:`table_to_bytes`): the reference the streamed build matches."""
    keys = rows.keys_array()
    order_arr = pc.sort_indices(keys)
    order = order_arr.to_numpy()
    cols = rows.columns()
    count = np.diff(cols["member_start"])
    first = cols["member_start"][:-1][order]
    extra = count[order] - 1
    fields_names = pa.array(rows.names, type=pa.string())
    if extra.any():
        offsets = np.zeros(len(extra) + 1, dtype=np.int32)
        np.cumsum(extra, out=offsets[1:])
        pick = np.repeat(first + 1 - offsets[:-1], extra) + np.arange(int(offsets[-1]))
        members = pa.StructArray.from_arrays(
            [fields_names.take(pa.array(cols["name"][pick]))]
            + [cols[c][pick] for c in ("offset", "length", "checksum")],
            fields=list(MEMBER_TYPE),
        )
        fields = pa.ListArray.from_arrays(pa.array(offsets), members, mask=pa.array(extra == 0))
    else:
        fields = pa.nulls(len(extra), pa.list_(MEMBER_TYPE))
    table, _ = assemble_table(
        keys.take(order_arr),
        np.asarray(labels, np.int64)[order],
        pa.array(names, type=pa.string()).take(order_arr),
        cols["shard"][order],
        cols["offset"][first],
        cols["length"][first],
        cols["checksum"][first],
        shards,
        CLASSES,
        fields_names.take(pa.array(cols["name"][first])),
        fields,
    )
    return table_to_bytes(table)


@pytest.mark.parametrize(
    ("n", "extra_share"),
    [(1, 0.0), (7, 0.5), (1000, 0.0), (2 * INDEX_ROWS_PER_GROUP + 17, 0.1), (INDEX_ROWS_PER_GROUP, 0.0)],
)
def test_streamed_index_is_byte_for_byte_the_whole_table_one(n, extra_share):
    rows, labels, names, shards = make_rows(n, extra_share, seed=n)
    data, version = index_bytes("mem://ds", rows, labels, names, CLASSES, shards)
    assert bytes(data) == whole_table_index(rows, labels, names, shards)
    table = pq.read_table(pa.BufferReader(bytes(data)))
    assert table.num_rows == n and table.column("key").to_pylist() == sorted(rows)
    assert version in table.schema.metadata[b"stoker"].decode()


def test_labels_as_an_array_give_the_same_index():
    rows, labels, names, shards = make_rows(300, 0.3, seed=3)
    as_list = index_bytes("mem://ds", rows, labels, names, CLASSES, shards)
    as_array = index_bytes("mem://ds", rows, np.array(labels, np.int64), names, CLASSES, shards)
    assert bytes(as_list[0]) == bytes(as_array[0]) and as_list[1] == as_array[1]


def test_content_version_is_the_one_before(tmp_path):
    """A Writer dataset (grouped and own-member samples, two fields, int labels, several shards)
    has the content version the whole-table build gave it, so caches keyed by it stay valid."""
    with Writer(str(tmp_path / "ds"), shard_bytes=3000, small_sample_bytes=64) as w:
        for i in range(40):
            w.write({"__key__": f"k/{(i * 7919) % 101:03d}", "bin": bytes([i]) * (i * 5), "cls": i % 3})
    assert w.result.version == "af729f34b3772b761b206d833769229e"
    ds = open_dataset(str(tmp_path / "ds"), cache=False)
    assert ds.version == w.result.version and len(ds) == 40


def test_duplicate_across_a_row_group_boundary_names_the_key_and_both_shards():
    rows, labels, names, shards = make_rows(INDEX_ROWS_PER_GROUP + 10, 0.0, seed=5)
    # the key that sorts last in the first row group, written again in shard 3
    last_first_group = sorted(rows)[INDEX_ROWS_PER_GROUP - 1]
    rows.append(last_first_group, 3, [("bin", 0, 1, 0)])
    with pytest.raises(SourceError, match=rf"duplicate key '{last_first_group}' \(in shards/shard-00000\d\.tar and"):
        index_bytes("mem://ds", rows, labels + [-1], names + [""], CLASSES, shards)


@pytest.fixture
def colliding(monkeypatch):
    """Every key's digest is its length: 'a' and 'b' collide, 'ab' does not collide with them."""
    monkeypatch.setattr(seenkeys, "key_digest", len)
    monkeypatch.setattr(seenkeys, "MERGE_EVERY", 2)  # the sorted array is searched too


@pytest.mark.parametrize("shard_bytes", ["1", "64MiB"])  # each sample its own shard (in flight, written) or one
def test_writer_accepts_different_keys_whose_digests_collide(tmp_path, colliding, shard_bytes):
    keys = ["a", "b", "ab", "c", "cd", "e", "f"]
    with Writer(str(tmp_path / "ds"), shard_bytes=shard_bytes) as w:
        for k in keys:
            w.write({"__key__": k, "bin": k.encode()})
        assert len(w) == len(keys)
    ds = open_dataset(str(tmp_path / "ds"), cache=False)
    assert [ds.key(i) for i in range(len(ds))] == sorted(keys)


@pytest.mark.parametrize("shard_bytes", ["1", "64MiB"])
def test_writer_refuses_an_equal_key_among_colliding_ones_naming_it(tmp_path, colliding, shard_bytes):
    with Writer(str(tmp_path / "ds"), shard_bytes=shard_bytes) as w:
        for k in ("a", "b", "ab", "c"):
            w.write({"__key__": k, "bin": b"x"})
        for dup in ("b", "a", "ab", "c"):
            with pytest.raises(SourceError, match=f"duplicate key '{dup}'"):
                w.write({"__key__": dup, "bin": b"y"})
        w.write({"__key__": "d", "bin": b"z"})  # the writer goes on
    assert len(open_dataset(str(tmp_path / "ds"), cache=False)) == 5


def test_seen_keys_find_every_key_after_the_bitmap_grew_and_the_set_merged(monkeypatch):
    monkeypatch.setattr(seenkeys, "FIRST_BITMAP_BITS", 64)  # grows 7 times over 500 keys
    monkeypatch.setattr(seenkeys, "MERGE_EVERY", 7)
    seen = seenkeys.SeenKeys()
    keys = [f"key{i}" for i in range(500)]
    for k in keys:
        d = seen.digest(k)
        assert seen.earlier(d) == []
        seen.add(d)
    assert all(seen.earlier(seen.digest(k)) == [i] for i, k in enumerate(keys))
    assert all(seen.earlier(seen.digest(f"other{i}")) == [] for i in range(500))


def test_seen_keys_positions_of_a_digest():
    seen = seenkeys.SeenKeys()
    for k in ("x", "y", "x2"):
        seen.add(seen.digest(k))
    assert seen.earlier(seen.digest("y")) == [1]
    assert seen.earlier(seen.digest("z")) == []
    assert len(seen) == 3


def test_writer_and_index_build_never_import_pandas(tmp_path):
    """pyarrow's ``pa.array`` and ``to_numpy`` import pandas where it is installed (+30 MB of RSS
    in a writer that never needed it): the Writer and the index build go without."""
    code = textwrap.dedent(
        f"""
        import sys
        import stoker
        with stoker.Writer({str(tmp_path / "ds")!r}) as w:
            for i in range(100):
                w.write({{"__key__": f"k{{i}}", "bin": b"12345678", "cls": i % 3}})
        assert "pandas" not in sys.modules, "pandas imported"
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
