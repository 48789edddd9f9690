"""KeyTable over the sample directory (the index): id and key lookups, the prefix tree, summary, ls/stat output."""

import argparse
import pickle

import numpy as np
import pyarrow as pa
import pytest

from stoker.store import keytable as dirmod
from stoker.store.index import IndexFormatError, build_table, index_array_bytes, read_index, table_to_bytes
from stoker.store.keytable import KeyTable, hash_keys
from stoker.store.listing import ls, stat

TRICKY = [
    "a/b",
    "a/bc",
    "a/b/c",
    "a/b!x",
    "a/b/d/e",
    "a/b/d/f",
    "a/ba/z",
    "a/",
    "a//x",
    "b",
    "b0",
    "b/",
    "b/0",
    "ünï/cødé/ß",
    "ünï/cødé/ß2",
    "ünï/日本/語",
    "emoji/🙂/x",
    "emoji/🙂🙂",
    "long/" + "L" * 300 + "/leaf",
    "long/" + "L" * 300,
    "long/" + "L" * 299 + "M",
    "n01440764/n01440764_10026",
    "n01440764/n01440764_10027",
    "n01440764/n01440764_9",
    "n01443537/n01443537_1",
    "x",
    "x/y/z/w/v",
    "",
]


def make_index(keys, *, sort=True, shards=3, seed=0):
    """A small index over ``keys`` via the real build_table/read_index path (as pack does)."""
    keys = sorted(keys) if sort else list(keys)
    n = len(keys)
    rng = np.random.default_rng(seed)
    classes = sorted({k.split("/")[0] for k in keys})
    cnames = [k.split("/")[0] for k in keys]
    labels = [classes.index(c) for c in cnames]
    shard = rng.integers(0, shards, n).astype(np.int32)
    length = rng.integers(0, 5000, n).astype(np.int64)
    offset = np.zeros(n, np.int64)
    ends = np.zeros(shards, np.int64)
    for i in rng.permutation(n):
        offset[i] = ends[shard[i]] + 512
        ends[shard[i]] = offset[i] + length[i]
    checksum = rng.integers(0, 2**64, n, dtype=np.uint64)
    table = [
        {"name": f"shards/shard-{s:06d}.tar", "bytes": int(ends[s]) + 1024, "samples": int((shard == s).sum())}
        for s in range(shards)
    ]
    t, _ = build_table(keys, labels, cnames, shard, offset, length, checksum, table, classes)
    return read_index(table_to_bytes(t), "mem://index.parquet"), keys


def brute_children(keys, prefix):
    d = prefix if prefix == "" or prefix.endswith("/") else prefix + "/"
    seen = {}
    for k in sorted(keys):
        if not k.startswith(d):
            continue
        rest = k[len(d) :]
        name = rest[: rest.index("/") + 1] if "/" in rest else rest
        seen.setdefault((name, "/" not in rest), []).append(k)
    return seen


@pytest.fixture(scope="module")
def tricky():
    idx, keys = make_index(TRICKY)
    return KeyTable(idx), keys, idx


def test_keys_sorted_and_id_lookups_match_the_index(tricky):
    d, keys, idx = tricky
    assert d.keys_sorted and d.order is None
    assert len(d) == len(keys)
    for i, k in enumerate(keys):
        r = d.sample(i)
        assert r.id == i and r.key == k == d.key(i)
        assert (r.label, r.offset, r.length, r.checksum) == (
            int(idx.labels[i]),
            int(idx.offset[i]),
            int(idx.length[i]),
            int(idx.checksum[i]),
        )
        assert r.shard == idx.shards[int(idx.shard[i])]["name"]
    ids = np.array([5, 0, len(keys) - 1, 5])
    got = d.lookup(ids)
    for name, col in (
        ("label", idx.labels),
        ("shard", idx.shard),
        ("offset", idx.offset),
        ("length", idx.length),
        ("checksum", idx.checksum),
    ):
        assert np.array_equal(got[name], col[ids])
    assert d.keys_of(ids).to_pylist() == [keys[i] for i in ids]
    for bad in (-1, len(keys)):
        with pytest.raises(IndexError, match=str(bad)):
            d.sample(bad)
        with pytest.raises(IndexError, match=str(bad)):
            d.lookup([0, bad])


def test_key_lookups_agree_with_a_dict(tricky):
    d, keys, _ = tricky
    truth = {k: i for i, k in enumerate(keys)}
    for k, i in truth.items():
        assert d.id_of(k) == i
        assert d.id_of(k.encode()) == i
        assert k in d
    rng = np.random.default_rng(1)
    q = [keys[i] for i in rng.integers(0, len(keys), 5000)]  # > 4096: sorted-needle path
    assert np.array_equal(d.ids_of(q), [truth[k] for k in q])
    assert np.array_equal(d.ids_of(pa.array(q[:10])), [truth[k] for k in q[:10]])
    assert d.ids_of([]).shape == (0,)


@pytest.mark.parametrize(
    "missing",
    ["a/b/", "a/b/d", "A/b", "a/bc ", "n01440764/n01440764_1002", "ünï/cødé", "long/" + "L" * 299, "zzz", "a/b\x00"],
)
def test_missing_keys_raise_key_error_naming_the_key(tricky, missing):
    d, keys, _ = tricky
    assert missing not in keys
    with pytest.raises(KeyError) as exc:
        d.id_of(missing)
    assert repr(missing) in exc.value.args[0]
    assert missing not in d
    with pytest.raises(KeyError) as exc:
        d.ids_of([keys[0], missing, keys[1]])
    assert repr(missing) in exc.value.args[0]
    got = d.ids_of([keys[0], missing, keys[1]], default=-1)
    assert got.tolist() == [0, -1, 1]


def test_ids_of_names_the_first_missing_keys_and_counts_the_rest(tricky):
    d, _, _ = tricky
    with pytest.raises(KeyError) as exc:
        d.ids_of([f"nope{i}" for i in range(8)])
    msg = exc.value.args[0]
    assert "'nope0'" in msg and "'nope4'" in msg and "'nope5'" not in msg and "3 more" in msg


def test_hash_collisions_are_resolved_by_the_key_bytes(monkeypatch):
    # Force every key to the same hash: lookups must still find the right ids.
    idx, keys = make_index([f"c/{i}" for i in range(50)])
    from stoker.store import keyhash

    for mod in (dirmod, keyhash):
        monkeypatch.setattr(mod, "hash_keys", lambda offsets, data: np.zeros(len(offsets) - 1, np.uint64))
        monkeypatch.setattr(mod, "_hash_one", lambda kb: 0)
    d = KeyTable(idx)
    assert [d.id_of(k) for k in keys] == list(range(50))
    assert d.ids_of(keys[::-1]).tolist() == list(range(50))[::-1]
    with pytest.raises(KeyError, match="c/50"):
        d.id_of("c/50")
    assert d.ids_of(["c/50", "c/7"], default=-1).tolist() == [-1, keys.index("c/7")]


def test_hash_of_one_key_matches_the_vectorised_hash():
    for s in ["", "a", "abcdefgh", "abcdefghi", "é" * 13, "k" * 301]:
        b = s.encode()
        assert dirmod._hash_one(b) == int(hash_keys(np.array([0, len(b)]), np.frombuffer(b, np.uint8))[0])
    # the same bytes hash the same at any position in a buffer, including the very end
    words = ["x" * n for n in range(20)]
    arr = pa.array(words)
    _, off, data = dirmod._string_buffers(arr)
    h = hash_keys(off, data)
    assert [int(v) for v in h] == [dirmod._hash_one(w.encode()) for w in words]
    assert len(set(h.tolist())) == len(words)


@pytest.mark.parametrize(
    "prefix",
    [
        "",
        "a",
        "a/",
        "a/b",
        "a/b/",
        "a/b/d/",
        "a/ba",
        "b",
        "b/",
        "ü",
        "ünï/",
        "ünï/c",
        "emoji/🙂",
        "long/" + "L" * 299,
        "n0144",
        "x/y/z/w/v",
        "zz",
        "a/b!",
        "/",
    ],
)
def test_prefix_ranges_equal_brute_force(tricky, prefix):
    d, keys, _ = tricky
    want = [i for i, k in enumerate(keys) if k.startswith(prefix)]
    start, stop = d.prefix_range(prefix)
    if want:
        assert (start, stop) == (want[0], want[-1] + 1)
        assert want == list(range(start, stop))  # contiguous
    else:
        assert start == stop
    assert d.ids(start, stop).tolist() == want


@pytest.mark.parametrize(
    "prefix",
    [
        "",
        "a",
        "a/",
        "a/b",
        "a/b/d",
        "b",
        "ünï",
        "ünï/cødé",
        "emoji/🙂",
        "long",
        "long/" + "L" * 300,
        "n01440764",
        "x/y/z/w",
    ],
)
def test_children_equal_brute_force(tricky, prefix):
    d, keys, _ = tricky
    want = brute_children(keys, prefix)
    got = d.children(prefix)
    assert [(n, leaf) for n, leaf, *_ in got] == list(want)  # same entries, key order
    for name, leaf, start, stop in got:
        assert [keys[i] for i in range(start, stop)] == want[(name, leaf)]
    # limit keeps a prefix of the full listing
    assert d.children(prefix, limit=2) == got[:2]


def test_children_lists_a_key_and_a_directory_of_the_same_name(tricky):
    d, keys, _ = tricky
    names = [(n, leaf) for n, leaf, *_ in d.children("a")]
    assert ("b", True) in names and ("b/", False) in names and ("bc", True) in names
    assert ("b!x", True) in names and ("ba/", False) in names
    # the key "a/" is the empty-named leaf of directory a/; "a//x" sits in directory "a//"
    assert ("", True) in names and ("/", False) in names
    with pytest.raises(KeyError, match="nothere"):
        d.children("nothere")
    with pytest.raises(KeyError, match="a/bc"):
        d.children("a/bc")  # a key, not a directory


def test_unsorted_index_keeps_an_order_and_still_answers(tricky):
    keys = sorted(TRICKY)
    rng = np.random.default_rng(3)
    shuffled = [keys[i] for i in rng.permutation(len(keys))]
    idx, ks = make_index(shuffled, sort=False)
    d = KeyTable(idx)
    assert not d.keys_sorted and d.order is not None
    assert [ks[i] for i in d.order] == keys
    for i, k in enumerate(ks):
        assert d.id_of(k) == i
    assert d.ids_of(ks[::-1]).tolist() == list(range(len(ks)))[::-1]
    for prefix in ["a/", "a/b", "ünï/", "zz", ""]:
        start, stop = d.prefix_range(prefix)
        assert sorted(d.ids(start, stop).tolist()) == [i for i, k in enumerate(ks) if k.startswith(prefix)]
    want = brute_children(ks, "a")
    for name, leaf, start, stop in d.children("a"):
        assert sorted(ks[i] for i in d.ids(start, stop)) == want[(name, leaf)]
    assert not any("ids " in line for line in ls(d, "a"))


def test_duplicate_keys_are_refused_naming_the_key():
    idx, _ = make_index(["c/1", "c/2", "c/2", "c/3"], sort=False)
    with pytest.raises(IndexFormatError, match=r"'c/2'.*1 and 2"):
        KeyTable(idx)
    idx, _ = make_index(["c/9", "c/1", "c/9"], sort=False)
    with pytest.raises(IndexFormatError, match=r"'c/9'.*0 and 2"):
        KeyTable(idx)


def test_empty_and_single_sample_directories():
    idx, _ = make_index([], shards=1)
    d = KeyTable(idx)
    assert len(d) == 0 and d.children("") == [] and d.prefix_range("a") == (0, 0)
    with pytest.raises(KeyError):
        d.id_of("a")
    assert d.ids_of(["a"], default=-7).tolist() == [-7]
    assert d.summary()["samples"] == 0
    idx, _ = make_index(["only"], shards=1)
    d = KeyTable(idx)
    assert d.id_of("only") == 0 and d.children("") == [("only", True, 0, 1)]


def test_summary_and_stat(tricky):
    d, keys, idx = tricky
    s = d.summary()
    assert s["samples"] == len(keys)
    assert s["payload_bytes"] == int(idx.length.sum())
    assert s["shards"] == 3 and s["shard_bytes"] == sum(sh["bytes"] for sh in idx.shards)
    assert s["classes"] == len(idx.classes) and s["version"] == idx.version
    assert s["keys_sorted"] is True
    assert s["directory_bytes"] >= idx.keys.nbytes + index_array_bytes(idx) >= idx.keys.nbytes + 13 * len(keys)
    lines = stat(d, "mem://x")
    assert lines[0] == "url: mem://x"
    assert f"samples: {len(keys)}" in lines and f"version: {idx.version}" in lines


def test_nbytes_counts_the_key_table_once_built():
    idx, keys = make_index([f"k/{i:05d}" for i in range(1000)])
    d = KeyTable(idx)
    base = d.nbytes
    assert base == idx.keys.nbytes + index_array_bytes(idx)
    d.prepare()
    assert d.nbytes == base + 12 * len(keys)  # uint64 hash + int32 id per sample


def test_ls_lines(tricky):
    d, keys, idx = tricky
    lines = ls(d, "a")
    names = [line.split("\t")[0] for line in lines]
    assert names == ["a/" + n for n, *_ in d.children("a")]  # full keys, as ls and index_of take them
    b = keys.index("a/b")
    assert lines[names.index("a/b")] == (
        f"a/b\t{int(idx.length[b])} B\tlabel {int(idx.labels[b])}\t"
        f"{idx.shards[int(idx.shard[b])]['name']}@{int(idx.offset[b])}\tid {b}"
    )
    s, e = d.prefix_range("a/b/")
    assert lines[names.index("a/b/")] == f"a/b/\t{e - s} samples\tids {s}-{e - 1}"  # inclusive
    # an exact key that is also a directory prints its record first
    both = ls(d, "a/b")
    assert both[0].startswith("a/b\t") and both[1:] == ls(d, "a/b/")
    # an exact key that is not a directory prints just its record
    bc = keys.index("a/bc")
    assert ls(d, "a/bc") == [
        f"a/bc\t{int(idx.length[bc])} B\tlabel {int(idx.labels[bc])}\t"
        f"{idx.shards[int(idx.shard[bc])]['name']}@{int(idx.offset[bc])}\tid {bc}"
    ]
    short = ls(d, "a", limit=2)
    assert short[:2] == lines[:2] and short[2].startswith("... more")
    assert len(ls(d, "", limit=None)) == len(d.children(""))
    with pytest.raises(KeyError, match="nothere"):
        ls(d, "nothere")


def test_pickled_directory_answers_the_same(tricky):
    d, keys, _ = tricky
    d.prepare()
    d2 = pickle.loads(pickle.dumps(d))
    assert [d2.id_of(k) for k in keys] == list(range(len(keys)))
    assert d2.children("a") == d.children("a")


def test_cli_parsers_open_the_dataset_and_print(tmp_path, capsys):
    from stoker.store.index import INDEX_NAME

    # a dataset directory needs only the index for ls/stat
    idx2, keys2 = make_index(["c1/a", "c1/b", "c2/a"])
    t, _ = build_table(
        keys2,
        [0, 0, 1],
        ["c1", "c1", "c2"],
        idx2.shard,
        idx2.offset,
        idx2.length,
        idx2.checksum,
        idx2.shards,
        ["c1", "c2"],
    )
    (tmp_path / INDEX_NAME).write_bytes(table_to_bytes(t))
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    from stoker.cli import data

    data.add_parsers(sub)
    a = p.parse_args(["ls", str(tmp_path)])
    assert a.fn(a) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == ["c1/\t2 samples\tids 0-1", "c2/\t1 sample\tids 2-2"]
    a = p.parse_args(["ls", str(tmp_path), "c1", "--limit", "1", "--storage-options", "{}"])
    assert a.fn(a) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("c1/a\t") and out[1].startswith("... more")
    a = p.parse_args(["ls", str(tmp_path), "c9"])
    assert a.fn(a) == 2
    assert "c9" in capsys.readouterr().err
    a = p.parse_args(["stat", str(tmp_path)])
    assert a.fn(a) == 0
    out = capsys.readouterr().out
    assert "samples: 3" in out and "classes: 2" in out
    a = p.parse_args(["stat", str(tmp_path), "--json"])
    assert a.fn(a) == 0
    import json

    js = json.loads(capsys.readouterr().out)
    assert js["samples"] == 3 and js["url"] == str(tmp_path)
