"""`stoker pack --source files|parquet`: any file tree grouped by basename, and Parquet tables of
sample bytes written by Hugging Face's `datasets`; members byte-exact, resumable, clear errors."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from _helpers import pack_killed_before_index, require
from stoker import PackOptions, open_dataset, pack

ALSA = "/usr/share/sounds/alsa"


@pytest.fixture(scope="module")
def wav_tree(tmp_path_factory):
    """Real recordings (Debian's alsa-utils WAVs) with a transcript and a class per sample, in
    two folders, plus metadata files that are not samples."""
    require("ALSA sample recordings", path=ALSA)
    root = tmp_path_factory.mktemp("wavs")
    names = sorted(n for n in os.listdir(ALSA) if n.endswith(".wav"))
    for i, n in enumerate(names):
        stem = n[:-4]
        folder = root / ("front" if stem.startswith("Front") else "other")
        folder.mkdir(exist_ok=True)
        shutil.copy(os.path.join(ALSA, n), folder / f"{stem}.wav")
        (folder / f"{stem}.txt").write_text(stem.replace("_", " "))
        (folder / f"{stem}.cls").write_text(str(i % 3))
    (root / ".DS_Store").write_bytes(b"x")
    return root, names


def test_files_source_groups_members_by_basename_byte_exact(wav_tree, tmp_path, monkeypatch):
    root, names = wav_tree
    r = pack(str(root), str(tmp_path / "out"), source="files", progress=False, shard_bytes=300_000)
    assert r.samples == len(names) and r.shards > 1 and r.source == "files"
    ds = open_dataset(str(tmp_path / "out"), cache=False)
    for i in range(len(ds)):
        key = ds.key(i)
        folder, stem = key.split("/")
        fields = ds.read_fields(i)
        assert set(fields) == {"wav", "txt", "cls"}
        assert fields["wav"] == (root / folder / f"{stem}.wav").read_bytes()
        assert ds.read(i) == fields["wav"]  # the largest member is the primary payload
        assert fields["txt"] == stem.replace("_", " ").encode()
        assert int(ds.labels[i]) == int(fields["cls"])
    cut_short = str(tmp_path / "cut")  # as a pack cut short before its index leaves it
    pack_killed_before_index(monkeypatch, str(root), cut_short, source="files", progress=False, shard_bytes=300_000)
    again = pack(str(root), cut_short, source="files", progress=False, shard_bytes=300_000)
    assert again.reused_shards == again.shards and again.version == r.version  # resumed: nothing rewritten


def _hf_parquet(path, feature: str):
    datasets = require("Parquet written by Hugging Face datasets", "datasets")
    require("ALSA sample recordings", path=ALSA)
    names = sorted(n for n in os.listdir(ALSA) if n.endswith(".wav"))
    rows = {
        "audio": [{"bytes": open(os.path.join(ALSA, n), "rb").read(), "path": n} for n in names],
        "text": [n[:-4].replace("_", " ") for n in names],
        "label": [i % 2 for i in range(len(names))],
    }
    if feature == "binary":
        rows["audio"] = [r["bytes"] for r in rows["audio"]]
    ds = datasets.Dataset.from_dict(rows)
    if feature == "audio":  # the Hub's audio struct {bytes, path}; cast, not encoded (that needs torchcodec)
        ds = ds.cast_column("audio", datasets.Audio(decode=False))
    ds = ds.cast_column("label", datasets.ClassLabel(names=["front", "back"]))
    ds.to_parquet(str(path))
    return names, rows


@pytest.mark.parametrize("feature", ["audio", "binary"])
def test_parquet_from_hugging_face_datasets_keeps_every_column(tmp_path, feature):
    names, rows = _hf_parquet(tmp_path / "train.parquet", feature)
    pack(str(tmp_path / "train.parquet"), str(tmp_path / "out"), source="parquet", options=PackOptions(column="audio"))
    ds = open_dataset(str(tmp_path / "out"), cache=False)
    assert len(ds) == len(names)
    field = "wav" if feature == "audio" else "audio"  # a {bytes, path} struct: the path's extension
    for i in range(len(ds)):
        assert ds.key(i) == f"train/{i:08d}"
        fields = ds.read_fields(i)
        assert fields[field] == open(os.path.join(ALSA, names[i]), "rb").read()
        assert fields["text"] == rows["text"][i].encode() and int(ds.labels[i]) == i % 2
        assert set(fields) == {field, "text", "label"}


def test_parquet_errors_name_the_column_and_the_row(tmp_path):
    _hf_parquet(tmp_path / "t.parquet", "audio")
    cols = r"its columns are \['audio', 'text', 'label'\]"
    with pytest.raises(ValueError, match=r"no column 'wave' \(--column\); " + cols):
        pack(str(tmp_path / "t.parquet"), str(tmp_path / "o1"), source="parquet", options=PackOptions(column="wave"))
    with pytest.raises(ValueError, match="column 'text' holds str, not bytes"):
        pack(str(tmp_path / "t.parquet"), str(tmp_path / "o2"), source="parquet", options=PackOptions(column="text"))
    with pytest.raises(ValueError, match="needed with source='parquet'"):
        pack(str(tmp_path / "t.parquet"), str(tmp_path / "o3"), source="parquet", progress=False)
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"image": [{"bytes": None, "path": "/data/x.jpg"}]}), str(tmp_path / "ext.parquet"))
    with pytest.raises(ValueError, match=r"ext/00000000.*holds no bytes, only the path '/data/x.jpg'"):
        pack(str(tmp_path / "ext.parquet"), str(tmp_path / "o4"), source="parquet", options=PackOptions(column="image"))
    assert not any((tmp_path / d / "index.parquet").exists() for d in ("o1", "o2", "o3", "o4"))


def test_cli_packs_a_parquet_directory(tmp_path):
    (tmp_path / "src").mkdir()
    names, _ = _hf_parquet(tmp_path / "src" / "part-0.parquet", "audio")
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "stoker.cli",
            "pack",
            str(tmp_path / "src"),
            str(tmp_path / "out"),
            "--source",
            "parquet",
            "--column",
            "audio",
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["samples"] == len(names)
    ds = open_dataset(str(tmp_path / "out"), cache=False)
    assert ds.key(0) == "part-0/00000000"
