"""Bad input through pack and the loader: named errors, nothing lost or silently changed, no hangs."""

import io
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from PIL import Image

from _helpers import make_image_folder
from stoker import Loader, RunOptions, WorkerError, open_dataset
from stoker.storage import Origin
from stoker.store.index import INDEX_NAME
from stoker.store.pack import pack


def _jpeg(seed=0, size=(64, 48), mode="RGB"):
    arr = (np.random.default_rng(seed).random((size[1], size[0], 3)) * 255).astype("uint8")
    buf = io.BytesIO()
    Image.fromarray(arr).convert(mode).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def _png(seed=1):
    buf = io.BytesIO()
    Image.fromarray((np.random.default_rng(seed).random((40, 30, 3)) * 255).astype("uint8")).save(buf, "PNG")
    return buf.getvalue()


@pytest.fixture
def odd_tree(tmp_path):
    return make_image_folder(
        tmp_path / "src",
        {
            "good/a.JPEG": _jpeg(0),
            "good/gray.JPEG": _jpeg(1, mode="L"),
            "odd/empty.JPEG": b"",
            "odd/text.JPEG": b"this is not an image\n",
            "odd/png_named_jpeg.JPEG": _png(),
        },
    )


def test_odd_files_pack_byte_exact_and_fail_by_name(odd_tree, tmp_path):
    dst = tmp_path / "dst"
    pack(str(odd_tree), str(dst), progress=False)
    ds = open_dataset(str(dst), cache_dir=str(tmp_path / "c"), cache_bytes=1 << 20)
    for i in range(len(ds)):  # nothing lost or changed: bytes as on disk, empty payload included
        assert ds[i][0] == (odd_tree / f"{ds.key(i)}.JPEG").read_bytes()
    with Loader(ds, 2, num_workers=0, transform="eval", shuffle=False, run=RunOptions(on_error="skip")) as loader:
        shapes = [tuple(x.shape) for x, _ in loader]
        assert loader.stats.skipped == 2
        assert sorted(loader.stats.skipped_keys) == ["odd/empty", "odd/text"]
        # the last batch, odd/text alone, is not yielded: one rank needs no substitute (loader/workers/padding.py)
        assert loader.stats.padded == 0 and len(shapes) == len(loader) - 1 and loader.stats.exactly_once
    assert sum(s[0] for s in shapes) == 3  # good/a, good/gray (as RGB), the PNG named .JPEG
    assert all(s[1:] == (3, 224, 224) for s in shapes)
    with Loader(ds, 2, num_workers=2, transform="eval", shuffle=False) as loader:
        with pytest.raises(WorkerError, match="odd/empty"):
            list(loader)


def test_symlink_loop_is_not_followed(tmp_path):
    src = make_image_folder(tmp_path / "src", {"a/x.JPEG": _jpeg(3)})
    os.symlink("..", src / "a" / "loop")
    r = pack(str(src), str(tmp_path / "dst"), progress=False)
    assert r.samples == 1


def test_unreadable_file_names_the_file(tmp_path, monkeypatch):
    src = make_image_folder(tmp_path / "src", {"a/ok.JPEG": _jpeg(4), "a/secret.JPEG": _jpeg(5)})
    real = Origin.read

    def read(self, rel):
        if rel.endswith("secret.JPEG"):
            raise PermissionError(13, "Permission denied", self.path(rel))
        return real(self, rel)

    monkeypatch.setattr(Origin, "read", read)
    with pytest.raises(PermissionError, match="secret.JPEG"):
        pack(str(src), str(tmp_path / "dst"), progress=False)
    assert not (tmp_path / "dst" / INDEX_NAME).exists()


def test_pack_killed_with_sigkill_then_rerun(tmp_path, sample_tree):
    dst = tmp_path / "dst"
    cmd = [
        sys.executable,
        "-m",
        "stoker.cli",
        "pack",
        str(sample_tree / "train"),
        str(dst),
        "--shard-size",
        "256KiB",
        "--no-progress",
        "--read-workers",
        "1",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # wait until some, not all, shards are written
        done = list((dst / "shards").glob("*.json")) if (dst / "shards").exists() else []
        if len(done) >= 3 or proc.poll() is not None:
            break
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    if proc.returncode == 0:
        pytest.skip("pack finished before it could be killed")
    assert not (dst / INDEX_NAME).exists()
    with pytest.raises(FileNotFoundError, match="not a packed stoker dataset"):
        open_dataset(str(dst), cache=False)
    r = pack(str(sample_tree / "train"), str(dst), shard_bytes=256 << 10, progress=False)
    assert r.reused_shards >= 1 and r.samples == 120
    ds = open_dataset(str(dst), cache=False)
    assert all(ds[i][0] == (sample_tree / "train" / f"{ds.key(i)}.JPEG").read_bytes() for i in range(len(ds)))
    leftovers = [p for p in (dst / "shards").iterdir() if ".tmp-" in p.name]
    assert leftovers == []  # temporary files of the killed pack are gone


def test_api_misuse_gets_errors_that_name_the_argument(packed_local, tmp_path):
    """Ids, batch sizes and resume states of the wrong kind are refused with errors that say what
    was expected (not numpy's or Python's own wording, and never a silent truncation)."""
    from stoker.loader import Loader
    from stoker.store.dataset import open_dataset

    ds = open_dataset(packed_local, cache=False)
    with pytest.raises(IndexError, match=f"sample 999 out of range for {len(ds)} samples in"):
        ds.read_fields(999)
    with pytest.raises(TypeError, match="indexed by id"):
        ds["n00000000/n00000000_000000"]
    with pytest.raises(TypeError, match="batch_size must be an integer"):
        Loader(ds, "8", num_workers=0)
    with pytest.raises(TypeError, match="batch_size must be an integer"):
        Loader(ds, 2.5, num_workers=0)
    with pytest.raises(ValueError, match="not a Loader state_dict"):
        Loader(ds, 8, num_workers=0).load_state_dict({"x": 1})
    assert ds[-1] == ds[len(ds) - 1] and ds[np.int64(3)] == ds[3]
