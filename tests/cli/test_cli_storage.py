"""One spelling for storage settings (``storage_options`` / ``--storage-options``, with a per-side
pair for pack; the old names still work and warn), and errors that name the URL they are about."""

from __future__ import annotations

import json
import warnings

import pytest

from _helpers import make_image_folder
from stoker.cli import main
from stoker.store.dataset import open_dataset
from stoker.store.pack import pack
from stoker.store.pack_options import PackOptions


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    root = tmp_path_factory.mktemp("opts-tree")
    return make_image_folder(root, {"a/1.jpg": b"1" * 300, "a/2.jpg": b"2" * 300, "b/3.jpg": b"3" * 300})


def test_pack_takes_storage_options_for_both_sides(s3_origin, tree):
    opts = s3_origin.storage_options(throttled=False)
    url = s3_origin.url("opts/both")
    r = pack(str(tree), url, storage_options=opts, progress=False, overwrite=True)
    assert r.samples == 3 and len(open_dataset(url, cache=False, storage_options=opts)) == 3
    dst_only = PackOptions(dst_storage_options=opts)
    r = pack(str(tree), s3_origin.url("opts/dst-only"), options=dst_only, progress=False, overwrite=True)
    assert r.samples == 3


def test_old_pack_option_names_warn_and_work(s3_origin, tree):
    opts = s3_origin.storage_options(throttled=False)
    with pytest.warns(
        DeprecationWarning, match=r"^dst_options= is deprecated; use options=PackOptions\(dst_storage_opt"
    ):
        r = pack(str(tree), s3_origin.url("opts/old"), dst_options=opts, progress=False, overwrite=True)
    assert r.samples == 3
    with pytest.warns(DeprecationWarning, match="dst_storage_options= is deprecated"):
        r = pack(str(tree), s3_origin.url("opts/old"), dst_storage_options=opts, progress=False, overwrite=True)
    assert r.samples == 3
    with pytest.raises(ValueError, match="dst_options= and dst_storage_options= both set"):
        pack(str(tree), s3_origin.url("opts/old"), dst_options=opts, dst_storage_options=opts, progress=False)


def test_cli_pack_storage_options_and_old_flags(s3_origin, tree, capsys):
    opts = json.dumps(s3_origin.storage_options(throttled=False))
    assert (
        main(["pack", str(tree), s3_origin.url("opts/cli"), "--storage-options", opts, "--no-progress", "--overwrite"])
        == 0
    )
    assert json.loads(capsys.readouterr().out)["samples"] == 3
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the CLI itself uses no deprecated name
        assert (
            main(["pack", str(tree), s3_origin.url("opts/cli2"), "--dst-options", opts, "--no-progress", "--overwrite"])
            == 0
        )
    assert "--dst-options is deprecated; use --dst-storage-options" in capsys.readouterr().err
    assert main(["pack", str(tree), s3_origin.url("opts/cli3"), "--dst-storage-options", "[1]", "--no-progress"]) == 2
    assert "--dst-storage-options must be a JSON object" in capsys.readouterr().err


def test_pack_errors_name_the_destination(s3_origin, tree, capsys):
    opts = json.dumps(s3_origin.storage_options(throttled=False))
    assert main(["pack", str(tree), "s3://no-such-bucket/ds", "--storage-options", opts, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "s3://no-such-bucket/ds" in err and "destination bucket 'no-such-bucket' does not exist" in err
    assert str(tree) not in err
    dst = s3_origin.url("opts/exists")
    assert main(["pack", str(tree), dst, "--storage-options", opts, "--no-progress", "--overwrite"]) == 0
    capsys.readouterr()
    assert main(["pack", str(tree), dst, "--storage-options", opts, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"the destination {dst} already holds a dataset" in err and str(tree) not in err


def test_open_errors_say_what_is_missing(s3_origin, tree, tmp_path, capsys):
    opts = s3_origin.storage_options(throttled=False)
    assert main(["stat", "s3://no-such-bucket/ds", "--storage-options", json.dumps(opts)]) == 2
    err = capsys.readouterr().err
    assert "s3://no-such-bucket/ds is not a packed stoker dataset: its bucket 'no-such-bucket' does not exist" in err
    assert "stoker pack" not in err
    with pytest.raises(FileNotFoundError, match="never-written is not a packed stoker dataset: nothing is stored") as e:
        open_dataset(s3_origin.url("opts/never-written"), cache=False, storage_options=opts)
    assert "stoker pack" not in str(e.value)
    local = tmp_path / "half"
    pack(str(tree), str(local), progress=False)
    (local / "index.parquet").unlink()  # as a pack killed before its last step leaves it
    with pytest.raises(FileNotFoundError, match="did not finish.*run the same `stoker pack` again"):
        open_dataset(str(local), cache=False)


def test_a_pack_error_of_the_destination_is_labelled_with_the_destination():
    import argparse
    import errno

    from stoker.cli import _where

    a = argparse.Namespace(src="raw/train", dst="/mnt/small/out")
    assert _where(a, OSError(errno.ENOSPC, "No space left on device")) == " (/mnt/small/out)"
    assert _where(a, OSError(errno.EROFS, "Read-only file system")) == " (/mnt/small/out)"
    assert _where(a, OSError(errno.EACCES, "Permission denied", "/mnt/small/out/shards")) == ""  # names the path
    assert _where(a, OSError(errno.EACCES, "Permission denied", "/mnt/small")) == " (/mnt/small/out)"  # a parent
    assert _where(a, OSError(errno.EIO, "I/O error", "/elsewhere/file")) == ""  # it names its file
    assert _where(a, ValueError("duplicate keys")) == " (raw/train)"
