"""What a Loader's ``decode=`` gets: every member by name, then the sample's ``__key__``,
``__id__`` and (where it has one) ``__label__``, the same for every source, so an ImageFolder pack
with the user's own augmentation gets its labels."""

from __future__ import annotations

import io
import json
import tarfile

import numpy as np
import pytest

import stoker
from stoker import Loader, open_dataset
from stoker.store.dataset import ID_FIELD, KEY_FIELD, LABEL_FIELD
from stoker.store.pack import pack


def _facts(fields, rng):
    """The sample's facts as decode sees them (a label of -2 where it has none)."""
    return {
        "id": np.int64(fields["__id__"]),
        "label": np.int64(fields.get("__label__", -2)),
        "key": fields["__key__"],
        "names": ",".join(fields),
    }


def _augment(fields, rng):
    """An ImageFolder user's own augmentation: stoker's fast decode, then a brightness jitter."""
    img = stoker.decode.jpeg(fields, 32, "random", rng=rng)  # the primary payload: the photo
    img = np.clip(img * rng.uniform(0.8, 1.2), 0, 255).astype(np.uint8)
    return img.transpose(2, 0, 1), fields["__label__"]


def test_names_are_documented_constants():
    assert (KEY_FIELD, ID_FIELD, LABEL_FIELD) == ("__key__", "__id__", "__label__")


def test_imagefolder_read_fields_with_meta(packed_local):
    ds = open_dataset(packed_local, cache=False)
    for i in (0, 7, len(ds) - 1):
        plain = ds.read_fields(i)
        assert list(plain) == ["JPEG"]  # members only, as before
        fields = ds.read_fields(i, meta=True)
        assert list(fields) == ["JPEG", "__key__", "__id__", "__label__"]  # primary first, facts after
        assert fields["JPEG"] == plain["JPEG"] == ds.read(i)
        assert (fields["__key__"], fields["__id__"], fields["__label__"]) == (ds.key(i), i, int(ds.labels[i]))
        assert ds.class_names[fields["__label__"]] == ds.key(i).split("/")[0]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_imagefolder_decode_gets_key_id_and_label(packed_local, num_workers):
    ds = open_dataset(packed_local, cache=False)
    assert (ds.labels >= 0).all() and len(set(ds.labels.tolist())) > 1
    with Loader(ds, 16, num_workers=num_workers, seed=1, decode=_facts) as loader:
        plan = loader.plan(0)
        got = list(loader)
    ids = np.concatenate([b["id"].numpy() for b in got])
    assert np.array_equal(ids, plan)
    assert np.array_equal(np.concatenate([b["label"].numpy() for b in got]), ds.labels[ids])
    assert [k for b in got for k in b["key"]] == [ds.key(i) for i in ids]
    assert {n for b in got for n in b["names"]} == {"JPEG,__key__,__id__,__label__"}


def test_imagefolder_own_augmentation_gets_its_labels(packed_local):
    """The guide's example in small: stoker.decode.jpeg + the user's jitter, with the labels."""
    ds = open_dataset(packed_local, cache=False)
    ds_labels = {ds.key(i): int(ds.labels[i]) for i in range(len(ds))}
    with Loader(ds, 16, num_workers=2, seed=0, shuffle=False, decode=_augment) as loader:
        batches = list(loader)
    images = np.concatenate([b[0].numpy() for b in batches])
    labels = np.concatenate([b[1].numpy() for b in batches])
    assert images.shape == (len(ds), 3, 32, 32) and images.dtype == np.uint8
    assert labels.tolist() == [ds_labels[ds.key(i)] for i in range(len(ds))]
    assert (labels >= 0).all()


def _tar(path, members):
    with tarfile.open(path, "w") as tf:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))


def test_webdataset_keeps_cls_and_gets_the_same_facts(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    _tar(
        src / "shard-000.tar",
        [
            ("a/s1.cls", b"3"),
            ("a/s1.bin", b"one"),
            ("a/s2.json", json.dumps({"label": 1}).encode()),
            ("a/s2.bin", b"two"),
            ("a/s3.bin", b"three"),  # no label
        ],
    )
    pack(str(src), str(tmp_path / "d"), progress=False)
    ds = open_dataset(str(tmp_path / "d"), cache=False)
    by_key = {ds.key(i): i for i in range(len(ds))}
    s1 = ds.read_fields(by_key["a/s1"], meta=True)
    assert s1 == {"bin": b"one", "cls": b"3", "__key__": "a/s1", "__id__": by_key["a/s1"], "__label__": 3}
    s2 = ds.read_fields(by_key["a/s2"], meta=True)
    assert s2["__label__"] == 1 and json.loads(s2["json"]) == {"label": 1}
    s3 = ds.read_fields(by_key["a/s3"], meta=True)
    assert "__label__" not in s3 and s3["__key__"] == "a/s3"  # no label: none made up
    with Loader(ds, 3, num_workers=0, shuffle=False, decode=_facts) as loader:
        (batch,) = list(loader)
    assert batch["label"].tolist() == [3, 1, -2] and batch["key"] == ["a/s1", "a/s2", "a/s3"]


def test_file_list_labels_reach_decode(tmp_path, packed_local):
    """A CSV file list's label column, through pack, to decode."""
    files = tmp_path / "files"
    files.mkdir()
    rows = ["path,label"]
    for j, name in enumerate(["x", "y", "z"]):
        (files / f"{name}.bin").write_bytes(name.encode() * 3)
        rows.append(f"{files / name}.bin,{'cat' if j != 1 else 'dog'}")
    (tmp_path / "list.csv").write_text("\n".join(rows) + "\n")
    pack(str(tmp_path / "list.csv"), str(tmp_path / "d"), progress=False)
    ds = open_dataset(str(tmp_path / "d"), cache=False)
    with Loader(ds, 3, num_workers=0, shuffle=False, decode=_facts) as loader:
        (batch,) = list(loader)
    names = [ds.class_names[label] for label in batch["label"].tolist()]
    assert sorted((k.rsplit("/", 1)[-1], n) for k, n in zip(batch["key"], names, strict=True)) == [
        ("x", "cat"),
        ("y", "dog"),
        ("z", "cat"),
    ]
