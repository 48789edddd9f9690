"""Pack sources (ImageFolder, WebDataset shards, file lists), named fields, format compatibility."""

import io
import json
import os
import subprocess
import tarfile

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from _helpers import make_image_folder, pack_killed_before_index
from stoker.storage import Origin
from stoker.store.blockmap import plan_blocks
from stoker.store.dataset import ChecksumError, open_dataset
from stoker.store.index import INDEX_NAME, DatasetIndex, Members, build_table, read_index, table_to_bytes
from stoker.store.pack import pack
from stoker.store.pack_options import PackOptions
from stoker.store.sources import detect_source
from stoker.store.wds import brace_expand, expand_urls


def _tar_members(path):
    """{member name: bytes} of a tar archive (any compression)."""
    with tarfile.open(path) as tf:
        return {m.name: tf.extractfile(m).read() for m in tf if m.isfile()}


def _make_tar(path, members, gz=False, encoding="utf-8"):
    """Write ``[(name, bytes)]`` as a tar (pax) archive; names may hold surrogate escapes."""
    os.makedirs(os.path.dirname(str(path)), exist_ok=True)
    with tarfile.open(
        path, "w:gz" if gz else "w", format=tarfile.PAX_FORMAT, encoding=encoding, errors="surrogateescape"
    ) as tf:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return path


def _check_all(ds, expected):
    """Every member of every sample of ``ds`` equals ``expected[<key>.<field>]``; all members covered."""
    seen = set()
    for i in range(len(ds)):
        fields = ds.read_fields(i)
        assert ds.read(i) == fields[ds.index.field_name(i)]
        for name, data in fields.items():
            member = f"{ds.key(i)}.{name}"
            assert data == expected[member], member
            seen.add(member)
    assert seen == set(expected)


# -- the shared WebDataset cases ------------------------------------------------------------
def test_sample_tgz_round_trip(cases_dir, tmp_path):
    src = cases_dir / "webdataset" / "sample.tgz"
    r = pack(str(src), str(tmp_path / "d"), progress=False, shard_bytes=8 << 10)
    assert r.source == "webdataset" and r.samples == 90 and r.shards > 1
    expected = _tar_members(src)
    ds = open_dataset(str(tmp_path / "d"), cache_dir=str(tmp_path / "c"), cache_bytes=1 << 20, block_bytes=2048)
    _check_all(ds, expected)
    for i in range(len(ds)):
        data, label = ds[i]
        assert label == int(expected[f"{ds.key(i)}.cls"].decode())
        assert ds.index.field_name(i) == "png"
        assert ds.index.classes[label] == str(label)
    from PIL import Image

    assert Image.open(io.BytesIO(ds[0][0])).convert("RGB").size[0] > 0


def test_tendata_raw_bytes_round_trip(cases_dir, tmp_path):
    src = cases_dir / "webdataset" / "tendata.tar"
    r = pack(str(src), str(tmp_path / "d"), progress=False)
    assert (r.samples, r.classes) == (100, 0)
    ds = open_dataset(str(tmp_path / "d"), cache=False)
    _check_all(ds, _tar_members(src))
    assert set(ds.labels.tolist()) == {-1}
    assert ds.read_fields(0).keys() == {"ten"}


# -- WebDataset grouping, labels, fields ----------------------------------------------------
def test_webdataset_fields_labels_and_grouping(tmp_path):
    a = _make_tar(
        tmp_path / "src" / "a-000.tar",
        [
            ("x/s1.json", json.dumps({"label": 3}).encode()),
            ("x/s1.jpg", b"\xff\xd8jpeg1"),
            ("x/s1.txt", b"caption one"),
            ("x/s2.cls", b" 7\n"),
            ("x/s2.seg.png", b"png-seg"),
            ("x/s2.json", b'{"label": 1}'),
            ("x/s3.ten", b"\x00\x01opaque"),
            ("x/s3.idx", b"i"),  # no image: first member is primary
            ("README", b"no field: skipped"),
        ],
    )
    _make_tar(tmp_path / "src" / "a-001.tar.gz", [("y/t1.json", b'{"cls": 0}'), ("y/t1.webp", b"RIFFw")], gz=True)
    r = pack(str(tmp_path / "src"), str(tmp_path / "d"), progress=False)
    assert (r.source, r.samples, r.skipped_files) == ("webdataset", 4, 1)
    ds = open_dataset(str(tmp_path / "d"), cache=False)
    expected = {**_tar_members(a), **_tar_members(tmp_path / "src" / "a-001.tar.gz")}
    del expected["README"]
    _check_all(ds, expected)
    by_key = {ds.key(i): i for i in range(len(ds))}
    assert [ds.key(i) for i in range(len(ds))] == sorted(by_key)  # ids in key order
    s1, s2, s3, t1 = (by_key[k] for k in ("x/s1", "x/s2", "x/s3", "y/t1"))
    assert [int(ds.labels[i]) for i in (s1, s2, s3, t1)] == [3, 7, -1, 0]  # cls beats json
    assert [ds.index.field_name(i) for i in (s1, s2, s3, t1)] == ["jpg", "seg.png", "ten", "webp"]
    assert ds[s1][0] == b"\xff\xd8jpeg1"
    assert list(ds.read_fields(s1)) == ["jpg", "json", "txt"]  # primary first, then source order
    assert ds.index.member_table(s3)[1][0] == "idx"


def test_webdataset_class_name_labels_and_duplicate_keys(tmp_path):
    _make_tar(
        tmp_path / "a.tar",
        [("k1.json", b'{"label": "dog"}'), ("k1.png", b"1"), ("k2.json", b'{"label": "cat"}'), ("k2.png", b"2")],
    )
    pack(str(tmp_path / "a.tar"), str(tmp_path / "d"), progress=False)
    ds = open_dataset(str(tmp_path / "d"), cache=False)
    assert ds.index.classes == ["cat", "dog"] and ds.labels.tolist() == [1, 0]
    _make_tar(tmp_path / "b.tar", [("k1.png", b"3")])
    with pytest.raises(ValueError, match="duplicate key 'k1'"):
        pack(str(tmp_path / "{a,b}.tar"), str(tmp_path / "d2"), progress=False)


def test_source_detection_and_brace_expansion(tmp_path, sample_tree):
    _make_tar(tmp_path / "w" / "train-000.tar", [("a.png", b"x")])
    _make_tar(tmp_path / "w" / "train-001.tar", [("b.png", b"y")])
    (tmp_path / "l.csv").write_text("path,label\nx.jpg,1\n")
    o = lambda u: Origin(str(u))  # noqa: E731
    assert detect_source(o(tmp_path / "w" / "train-000.tar")) == "webdataset"
    assert detect_source(o(f"{tmp_path}/w/train-{{000..001}}.tar")) == "webdataset"
    assert detect_source(o(f"{tmp_path}/w/train-*.tar")) == "webdataset"
    assert detect_source(o(tmp_path / "w")) == "webdataset"
    assert detect_source(o(f"{tmp_path}/w/train-")) == "webdataset"  # a prefix
    assert detect_source(o(tmp_path / "l.csv")) == "filelist"
    assert detect_source(o(sample_tree / "train")) == "imagefolder"
    assert detect_source(o(tmp_path / "w"), "imagefolder") == "imagefolder"
    with pytest.raises(ValueError, match="unknown source"):
        detect_source(o(tmp_path), "zip")
    assert brace_expand("s-{08..10}-{a,b}.tar") == [
        "s-08-a.tar",
        "s-08-b.tar",
        "s-09-a.tar",
        "s-09-b.tar",
        "s-10-a.tar",
        "s-10-b.tar",
    ]
    for src in (f"{tmp_path}/w/train-{{000..001}}.tar", f"{tmp_path}/w/train-*.tar", f"{tmp_path}/w/train-"):
        r = pack(src, str(tmp_path / "d"), progress=False, overwrite=True)
        assert r.samples == 2, src


@pytest.mark.parametrize(
    "spec",
    [
        "{a,{b,c}}.tar",
        "s-{0..6..2}.tar",
        "s-{a..c}.tar",
        "s-{08..10}-{a,b}.tar",
        "s-{10..0..5}.tar",
        "x-{000..002}.tar::y-{a,b}.tar",
        "a-{1,2}{x,y}.tar",
        "plain.tar",
        r"lit-\{a,b\}.tar",
        "s-{a..e..2}.tar",
        "{,x}.tar",
    ],
)
def test_shard_specs_expand_as_webdataset_does(spec):
    from webdataset.shardlists import expand_urls as wds_expand

    assert brace_expand(spec) == wds_expand(spec)


def test_shard_specs_nested_stepped_and_letter_ranges_pack(tmp_path):
    assert brace_expand("{a,{b,c}}.tar") == ["a.tar", "b.tar", "c.tar"]
    assert brace_expand("{0..6..2}") == ["0", "2", "4", "6"] and brace_expand("{a..c}") == ["a", "b", "c"]
    assert brace_expand("http://[::1]:8000/s-{0..1}.tar") == ["http://[::1]:8000/s-0.tar", "http://[::1]:8000/s-1.tar"]
    with pytest.raises(ValueError, match=r"shard spec '\{a,b'"):
        brace_expand("{a,b")
    w = tmp_path / "w"
    w.mkdir()
    for i in range(5):
        with tarfile.open(w / f"s-{i}.tar", "w") as tf:
            info = tarfile.TarInfo(f"k{i}.cls")
            info.size = 1
            tf.addfile(info, io.BytesIO(b"1"))
    r = pack(f"{w}/s-{{0..4..2}}.tar", str(tmp_path / "d"), progress=False)
    assert r.samples == 3  # s-0, s-2, s-4
    assert expand_urls(f"{w}/s-{{0..1}}.tar::{w}/s-4.tar") == [f"{w}/s-0.tar", f"{w}/s-1.tar", f"{w}/s-4.tar"]
    # a spec names its shards one by one: a missing one is an error naming it, never left out
    with pytest.raises(FileNotFoundError, match=r"5 of its 10 shards not found: .*s-5\.tar.*s-9\.tar"):
        expand_urls(f"{w}/s-{{0..9}}.tar")
    with pytest.raises(FileNotFoundError, match=r"2 of its 4 shards not found: .*none-1\.tar"):
        pack(f"{w}/s-{{0..1}}.tar::{w}/none-{{1..2}}.tar", str(tmp_path / "e"), progress=False)
    assert not (tmp_path / "e").exists()  # a failed first pack leaves no empty destination behind
    (tmp_path / "f").mkdir()  # one the user made is kept
    with pytest.raises(FileNotFoundError, match="shards not found"):
        pack(f"{w}/none-{{1..2}}.tar", str(tmp_path / "f"), progress=False)
    assert (tmp_path / "f").is_dir()
    with pytest.raises(FileNotFoundError, match="shards not found"):  # the parents pack made go too
        pack(f"{w}/none-{{1..2}}.tar", str(tmp_path / "g" / "h" / "out"), progress=False)
    assert not (tmp_path / "g").exists()
    assert [u.removeprefix("file://") for u in expand_urls(f"{w}/s-")] == [f"{w}/s-{i}.tar" for i in range(5)]


# -- file lists -------------------------------------------------------------------------------
def _file_list_tree(tmp_path):
    files = {
        "imgs/a/1.jpg": b"\xff\xd8one",
        "imgs/b/2.png": b"\x89PNGtwo",
        "imgs/c/3.bin": b"",
        "other/4.ten": b"\x00" * 1000,
    }
    make_image_folder(tmp_path / "src", files)
    return files


def test_file_list_csv_and_parquet_round_trip(tmp_path):
    files = _file_list_tree(tmp_path)
    src = tmp_path / "src"
    (src / "list.csv").write_text(f"path,label\nimgs/a/1.jpg,2\nimgs/b/2.png,0\nimgs/c/3.bin,\n{src}/other/4.ten,1\n")
    r = pack(str(src / "list.csv"), str(tmp_path / "d1"), progress=False)
    assert (r.source, r.samples, r.classes) == ("filelist", 4, 3)
    ds = open_dataset(str(tmp_path / "d1"), cache=False)
    got = {ds.key(i): (ds[i][0], int(ds.labels[i]), ds.index.field_name(i)) for i in range(len(ds))}
    assert got == {
        "imgs/a/1": (files["imgs/a/1.jpg"], 2, "jpg"),
        "imgs/b/2": (files["imgs/b/2.png"], 0, "png"),
        "imgs/c/3": (b"", -1, "bin"),
        str(src / "other/4").lstrip("/"): (files["other/4.ten"], 1, "ten"),
    }
    pq.write_table(
        pa.table({"path": ["imgs/a/1.jpg", "imgs/b/2.png"], "label": ["zebra", "ant"], "key": ["first", "second"]}),
        src / "list.parquet",
    )
    pack(str(src / "list.parquet"), str(tmp_path / "d2"), progress=False)
    ds = open_dataset(str(tmp_path / "d2"), cache=False)
    assert [ds.key(i) for i in range(2)] == ["first", "second"]
    assert ds.index.classes == ["ant", "zebra"] and ds.labels.tolist() == [1, 0]
    assert ds[0][0] == files["imgs/a/1.jpg"]
    (src / "bad.csv").write_text("path,label\nimgs/a/1.jpg,0\nimgs/a/1.png,1\n")
    with pytest.raises(ValueError, match="duplicate key"):
        pack(str(src / "bad.csv"), str(tmp_path / "d3"), progress=False)
    (src / "missing.csv").write_text("path,label\nimgs/nope.jpg,0\n")
    with pytest.raises(FileNotFoundError, match="nope.jpg"):
        pack(str(src / "missing.csv"), str(tmp_path / "d4"), progress=False)


# -- format compatibility ---------------------------------------------------------------------
LONG = "d" * 60 + "/" + "k" * 120  # > 100 bytes: pax header
UNICODE = "клас/ñandú-鳥-🐦"


def _odd_tar(tmp_path):
    return _make_tar(
        tmp_path / "odd.tar",
        [
            (f"{LONG}.jpg", b"\xff\xd8long"),
            (f"{LONG}.json", b'{"label": 1}'),
            (f"{UNICODE}.png", b"\x89PNGu"),
            (f"{UNICODE}.txt", "текст".encode()),
            ("empty.jpg", b""),
            ("empty.txt", b""),
            ("plain.cls", b"2"),
            ("plain.jpg", b"j" * 513),
        ],
    )


#: One tar member per field whatever the sample's size (tiny samples are grouped by default).
WDS_LAYOUT = PackOptions(small_sample_bytes=0)


def test_long_unicode_and_empty_members_gnu_tar(tmp_path):
    src = _odd_tar(tmp_path)
    pack(str(src), str(tmp_path / "d"), progress=False, options=WDS_LAYOUT)
    ds = open_dataset(str(tmp_path / "d"), cache_dir=str(tmp_path / "c"), cache_bytes=1 << 20)
    expected = _tar_members(src)
    _check_all(ds, expected)
    assert ds.read(ds.index.keys.to_pylist().index("empty")) == b""
    shard = os.path.join(str(tmp_path / "d"), ds.index.shards[0]["name"])
    listing = subprocess.run(["tar", "-tf", shard], capture_output=True, check=True).stdout
    assert sorted(listing.decode().split("\n")[:-1]) == sorted(expected)
    out = tmp_path / "x"
    out.mkdir()
    subprocess.run(["tar", "-xf", shard, "-C", str(out)], check=True)
    for name, data in expected.items():
        assert (out / name).read_bytes() == data


def test_stoker_shards_read_by_webdataset(tmp_path, sample_tree):
    wds = pytest.importorskip("webdataset")
    src = _odd_tar(tmp_path)
    pack(str(src), str(tmp_path / "d"), progress=False, options=WDS_LAYOUT)
    ds = open_dataset(str(tmp_path / "d"), cache=False)
    shard = os.path.join(str(tmp_path / "d"), ds.index.shards[0]["name"])
    got = {}
    for sample in wds.WebDataset(f"file:{shard}", shardshuffle=False):
        got[sample["__key__"]] = {k: v for k, v in sample.items() if not k.startswith("__")}
    want = {ds.key(i): {k.lower(): v for k, v in ds.read_fields(i).items()} for i in range(len(ds))}
    assert got == want  # webdataset lower-cases field names; bytes are identical
    # an ImageFolder pack too (field = the original extension)
    packed = tmp_path / "if"
    pack(str(sample_tree / "train"), str(packed), progress=False)
    ds = open_dataset(str(packed), cache=False)
    n = 0
    for name in sorted({s["name"] for s in ds.index.shards}):
        for sample in wds.WebDataset(f"file:{packed / name}", shardshuffle=False):
            i = ds.index.keys.to_pylist().index(sample["__key__"])
            assert sample["jpeg"] == ds[i][0]
            n += 1
    assert n == len(ds)


def test_non_utf8_names_are_refused(tmp_path):
    bad = _make_tar(tmp_path / "bad.tar", [("ok.png", b"1"), ("caf\udce9.png", b"2")], encoding="latin-1")
    with pytest.raises(ValueError, match=r"bad\.tar.*not valid UTF-8"):
        pack(str(bad), str(tmp_path / "d"), progress=False)
    root = tmp_path / "tree"
    (root / "cls").mkdir(parents=True)
    try:
        with open(os.fsencode(str(root / "cls")) + b"/caf\xe9.jpg", "wb") as f:
            f.write(b"x")
    except OSError:
        pytest.skip("this filesystem does not take non-UTF-8 names")
    with pytest.raises(ValueError, match=r"caf\\xe9.*not valid UTF-8"):
        pack(str(root), str(tmp_path / "d2"), progress=False)
    assert not (tmp_path / "d" / INDEX_NAME).exists() and not (tmp_path / "d2" / INDEX_NAME).exists()


def test_offsets_past_8_gib_are_exact(tmp_path):
    base = 1 << 33
    n = 6
    offsets = [base + 3 + i * (3 << 20) for i in range(n)]
    lengths = [1 << 20] * n
    fields = [[("json", o + (1 << 20) + 512, 700, 42)] if i % 2 else None for i, o in enumerate(offsets)]
    shards = [{"name": "shards/big.tar", "bytes": base + n * (3 << 20) + 4096, "samples": n}]
    table, _ = build_table(
        [f"k{i}" for i in range(n)],
        [0] * n,
        ["c"] * n,
        [0] * n,
        offsets,
        lengths,
        [7] * n,
        shards,
        ["c"],
        field=["jpg"] * n,
        fields=fields,
    )
    idx = read_index(table_to_bytes(table))
    assert idx.offset.dtype == np.int64 and idx.offset.tolist() == offsets
    assert idx.members.offset.tolist() == [o + (1 << 20) + 512 for o in offsets[1::2]]
    assert idx.span_end.tolist() == [o + (1 << 20) + (1212 if i % 2 else 0) for i, o in enumerate(offsets)]
    blocks = plan_blocks(idx, 4 << 20)
    assert blocks["start"].dtype == np.int64 and blocks["start"][0] == offsets[0]
    for i in range(n):  # every sample's whole range lies inside its block
        b = blocks["sample_block"][i]
        assert blocks["start"][b] <= idx.offset[i] and idx.span_end[i] <= blocks["end"][b]
    # a synthetic in-memory index works too
    mem = DatasetIndex(
        keys=pa.array(["a"]),
        labels=np.zeros(1, np.int64),
        shard=np.zeros(1, np.int32),
        offset=np.array([base * 2], np.int64),
        length=np.array([5], np.int64),
        checksum=np.zeros(1, np.uint64),
        shards=shards,
        classes=[],
        version="v",
        field=np.zeros(1, np.int32),
        names=["jpg", "txt"],
        members=Members(
            np.array([0, 1]),
            np.array([1], np.int32),
            np.array([base * 2 + 1024]),
            np.array([3]),
            np.zeros(1, np.uint64),
        ),
    )
    assert mem.span_end.tolist() == [base * 2 + 1027]
    assert plan_blocks(mem, 1 << 20)["end"].tolist() == [base * 2 + 1027]


def test_format_1_index_still_reads(packed_local, tmp_path):
    import shutil

    dst = tmp_path / "old"
    shutil.copytree(packed_local, dst)
    t = pq.read_table(dst / INDEX_NAME)
    meta = json.loads(t.schema.metadata[b"stoker"])
    meta["format"] = 1
    t = t.drop_columns(["field", "fields"])
    pq.write_table(t.replace_schema_metadata({"stoker": json.dumps(meta)}), dst / INDEX_NAME)
    old = open_dataset(str(dst), cache=False)
    new = open_dataset(packed_local, cache=False)
    assert old.index.field is None and old.index.members is None
    for i in range(0, len(old), 17):
        assert old[i][0] == new[i][0]
        assert old.read_fields(i) == {"": new[i][0]}


def test_corrupt_field_is_named(tmp_path):
    src = _make_tar(tmp_path / "a.tar", [("k.png", b"p" * 100), ("k.json", b'{"label": 0}')])
    pack(str(src), str(tmp_path / "d"), progress=False)
    ds = open_dataset(str(tmp_path / "d"), cache=False)
    ((_, off, n, _),) = [m for m in ds.index.member_table(0) if m[0] == "json"]
    shard = tmp_path / "d" / ds.index.shards[0]["name"]
    raw = bytearray(shard.read_bytes())
    raw[off] ^= 0xFF
    shard.write_bytes(bytes(raw))
    assert ds.read(0) == b"p" * 100  # the primary payload is intact
    with pytest.raises(ChecksumError, match=r"'k'.*field 'json'"):
        ds.read_fields(0)
    cached = open_dataset(str(tmp_path / "d"), cache_dir=str(tmp_path / "c"), cache_bytes=1 << 20)
    with pytest.raises(ChecksumError, match="field 'json'"):
        cached[0]


def test_streamed_pack_resumes(cases_dir, tmp_path, monkeypatch):
    src = str(cases_dir / "webdataset" / "sample.tgz")
    r1 = pack(src, str(tmp_path / "whole"), progress=False, shard_bytes=8 << 10)
    pack_killed_before_index(monkeypatch, src, str(tmp_path / "d"), progress=False, shard_bytes=8 << 10)
    os.unlink(tmp_path / "d" / "shards" / "shard-000001.tar")
    r2 = pack(src, str(tmp_path / "d"), progress=False, shard_bytes=8 << 10)
    assert (r2.reused_shards, r2.version) == (r1.shards - 1, r1.version)


# -- through the emulated S3 origin -------------------------------------------------------------
def test_every_source_round_trips_through_s3(s3_origin, cases_dir, tmp_path):
    from stoker_lab.bench.origin import upload_tree

    opts = s3_origin.storage_options()
    raw = s3_origin.url("src-rt/raw")
    files = _file_list_tree(tmp_path)
    (tmp_path / "src" / "list.csv").write_text("path,label\nimgs/a/1.jpg,1\nimgs/b/2.png,0\nimgs/c/3.bin,1\n")
    import shutil

    shutil.copy(cases_dir / "webdataset" / "sample.tgz", tmp_path / "src" / "sample.tgz")
    shutil.copy(cases_dir / "webdataset" / "tendata.tar", tmp_path / "src" / "tendata.tar")
    _odd_tar(tmp_path / "src")
    upload_tree(str(tmp_path / "src"), raw, opts)
    cases = {
        "sample.tgz": _tar_members(tmp_path / "src" / "sample.tgz"),
        "tendata.tar": _tar_members(tmp_path / "src" / "tendata.tar"),
        "odd.tar": _tar_members(tmp_path / "src" / "odd.tar"),
        "list.csv": {"imgs/a/1.jpg": files["imgs/a/1.jpg"], "imgs/b/2.png": files["imgs/b/2.png"], "imgs/c/3.bin": b""},
    }
    for name, expected in cases.items():
        dst = s3_origin.url(f"src-rt/packed-{name}")
        r = pack(f"{raw}/{name}", dst, storage_options=opts, progress=False, shard_bytes=64 << 10)
        assert r.samples == len({m.rsplit(".", 1)[0] if name == "list.csv" else m.split(".")[0] for m in expected}), (
            name
        )
        ds = open_dataset(
            dst, cache_dir=str(tmp_path / "cache"), cache_bytes=64 << 20, storage_options=opts, block_bytes=16 << 10
        )
        for i in np.random.default_rng(0).permutation(len(ds)):
            fields = ds.read_fields(int(i))
            for field, data in fields.items():
                assert data == expected[f"{ds.key(int(i))}.{field}"]
        if name == "sample.tgz":
            assert all(int(ds.labels[i]) == int(expected[f"{ds.key(i)}.cls"]) for i in range(len(ds)))


# -- ImageFolder labels: stray folders, empty classes, fixed class lists ---------------
_IMG = {f"{c}/img{i}.jpg": bytes([65 + k]) * (200 + i) for k, c in enumerate(["cat", "dog", "owl"]) for i in range(2)}


def _labels_by_class(url: str) -> dict:
    ds = open_dataset(url, cache=False)
    out = {}
    for i in range(len(ds)):
        out.setdefault(ds.key(i).split("/")[0], set()).add(int(ds.labels[i]))
    return out


def test_hidden_and_os_metadata_entries_are_never_classes_or_samples(tmp_path, caplog):
    stray = {
        ".ipynb_checkpoints/img0-checkpoint.jpg": _IMG["cat/img0.jpg"],
        "__MACOSX/cat/._img0.jpg": b"\x00\x05\x16\x07" + b"\x00" * 60,
        "cat/._img1.jpg": b"\x00\x05\x16\x07",
        "cat/.ipynb_checkpoints/img0-checkpoint.jpg": b"x",
        "dog/.DS_Store": b"ds",
        "owl/Thumbs.db": b"t",
        "Desktop.ini": b"d",
    }
    src = make_image_folder(tmp_path / "src", {**_IMG, **stray})
    r = pack(str(src), str(tmp_path / "d"), progress=False)
    assert (r.samples, r.classes, r.skipped_files) == (6, 3, 0)
    ds = open_dataset(str(tmp_path / "d"), cache=False)
    assert ds.index.classes == ["cat", "dog", "owl"]
    assert sorted(ds.key(i) for i in range(len(ds))) == sorted(k[:-4] for k in _IMG)
    assert _labels_by_class(str(tmp_path / "d")) == {"cat": {0}, "dog": {1}, "owl": {2}}
    warned = [rec.getMessage() for rec in caplog.records if "OS-metadata" in rec.getMessage()]
    assert len(warned) == 1  # one warning naming every dropped folder and file
    for name in (
        ".ipynb_checkpoints/",
        "__MACOSX/",
        "cat/._img1.jpg",
        "cat/.ipynb_checkpoints/",
        "dog/.DS_Store",
        "owl/Thumbs.db",
        "Desktop.ini",
    ):
        assert name in warned[0]


def test_metadata_folder_beside_tars_is_still_webdataset(tmp_path):
    _make_tar(tmp_path / "w" / "a-000.tar", [("k.jpg", b"j")])
    (tmp_path / "w" / "__MACOSX").mkdir()
    (tmp_path / "w" / "__MACOSX" / "._a-000.tar").write_bytes(b"\x00\x05\x16\x07")
    assert detect_source(Origin(str(tmp_path / "w"))) == "webdataset"


def test_empty_class_folder_keeps_its_label(tmp_path):
    make_image_folder(tmp_path / "train", _IMG)
    make_image_folder(tmp_path / "val", {k: v for k, v in _IMG.items() if not k.startswith("dog/")})
    (tmp_path / "val" / "dog").mkdir()
    pack(str(tmp_path / "train"), str(tmp_path / "ptrain"), progress=False)
    r = pack(str(tmp_path / "val"), str(tmp_path / "pval"), progress=False)
    assert r.classes == 3
    assert _labels_by_class(str(tmp_path / "pval")) == {"cat": {0}, "owl": {2}}
    assert open_dataset(str(tmp_path / "pval"), cache=False).index.classes == ["cat", "dog", "owl"]


def test_pack_classes_keeps_labels_across_splits_and_stat_prints_them(tmp_path, capsys):
    from stoker.cli import main

    make_image_folder(tmp_path / "train", _IMG)
    # val as an object store would list it: the class with no images has no folder at all
    make_image_folder(tmp_path / "val", {k: v for k, v in _IMG.items() if not k.startswith("cat/")})
    (tmp_path / "classes.txt").write_text("cat\ndog\nowl\n")
    assert (
        main(
            [
                "pack",
                str(tmp_path / "train"),
                str(tmp_path / "ptrain"),
                "--no-progress",
                "--classes",
                str(tmp_path / "classes.txt"),
            ]
        )
        == 0
    )
    assert (
        main(
            [
                "pack",
                str(tmp_path / "val"),
                str(tmp_path / "pval"),
                "--no-progress",
                "--classes",
                str(tmp_path / "ptrain"),
            ]
        )
        == 0
    )  # the train dataset's class list
    train, val = _labels_by_class(str(tmp_path / "ptrain")), _labels_by_class(str(tmp_path / "pval"))
    assert val == {"dog": {1}, "owl": {2}} and all(train[c] == val[c] for c in val)
    capsys.readouterr()
    assert main(["stat", str(tmp_path / "pval")]) == 0
    out = capsys.readouterr().out
    assert "  0\tcat\n  1\tdog\n  2\towl" in out
    assert main(["stat", "--json", str(tmp_path / "pval")]) == 0
    (tmp_path / "stat.json").write_text(capsys.readouterr().out)
    assert (
        pack(
            str(tmp_path / "val"), str(tmp_path / "pval2"), progress=False, classes=str(tmp_path / "stat.json")
        ).classes
        == 3
    )
    # a class directory that the list does not name is refused, naming it
    (tmp_path / "short.txt").write_text("dog\n")
    assert (
        main(
            [
                "pack",
                str(tmp_path / "val"),
                str(tmp_path / "px"),
                "--no-progress",
                "--classes",
                str(tmp_path / "short.txt"),
            ]
        )
        == 2
    )
    assert "'owl' not in the class list" in capsys.readouterr().err
    with pytest.raises(ValueError, match="appears twice"):
        pack(str(tmp_path / "val"), str(tmp_path / "py"), progress=False, classes=["dog", "owl", "dog"])


def test_classes_apply_to_streamed_sources(tmp_path):
    for name in ("a.jpg", "b.jpg", "c.jpg"):
        (tmp_path / name).write_bytes(name.encode())
    (tmp_path / "list.csv").write_text("path,label\na.jpg,zebra\nb.jpg,1\nc.jpg,\n")
    pack(str(tmp_path / "list.csv"), str(tmp_path / "d"), progress=False, classes=["ant", "bee", "zebra"])
    ds = open_dataset(str(tmp_path / "d"), cache=False)
    assert ds.index.classes == ["ant", "bee", "zebra"] and ds.labels.tolist() == [2, 1, -1]
    (tmp_path / "bad.csv").write_text("path,label\na.jpg,yak\n")
    with pytest.raises(ValueError, match="sample 'a': label 'yak' is not in the class list"):
        pack(str(tmp_path / "bad.csv"), str(tmp_path / "d2"), progress=False, classes=["ant"])


def test_source_errors_are_stoker_errors_and_a_broken_symlink_is_named(tmp_path):
    """Every way a pack source can be wrong raises a StokerError (keeping its builtin base) that
    names the source; a broken symlink among the images stops the pack instead of being dropped."""
    import stoker

    make_image_folder(tmp_path / "src", _IMG)
    cls = sorted(p.name for p in (tmp_path / "src").iterdir())[0]
    os.symlink(str(tmp_path / "gone.jpg"), str(tmp_path / "src" / cls / "dangling.jpg"))
    with pytest.raises(stoker.SourceNotFoundError, match=cls + r"/dangling\.jpg is a symbolic link to .*gone\.jpg"):
        pack(str(tmp_path / "src"), str(tmp_path / "d"), progress=False)
    assert not os.path.exists(tmp_path / "d" / INDEX_NAME)
    with pytest.raises(stoker.SourceNotFoundError, match="does not exist") as e:
        pack(str(tmp_path / "nothing-here"), str(tmp_path / "d2"), progress=False)
    assert isinstance(e.value, FileNotFoundError) and isinstance(e.value, stoker.StokerError)
    with pytest.raises(stoker.SourceError, match="unknown source") as e2:
        detect_source(Origin(str(tmp_path / "src")), "nonsense")
    assert isinstance(e2.value, ValueError)
    (tmp_path / "bad.tar").write_bytes(b"this is not a tar archive" * 40)
    with pytest.raises(stoker.SourceArchiveError, match=r"bad\.tar.*not a readable tar archive") as e3:
        pack(str(tmp_path / "bad.tar"), str(tmp_path / "d3"), progress=False)
    assert isinstance(e3.value, tarfile.TarError) and isinstance(e3.value, stoker.StokerError)
