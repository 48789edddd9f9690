"""What a fresh user reads: ``stoker cache status`` names datasets by URL and version and shows the
budget in force; ``stoker ls`` prints full keys, inclusive id ranges and empty classes;
``Dataset.class_names``; a cache directory that is a file is a clear error naming it; the default
cache directory prefers node-local scratch to the home directory."""

from __future__ import annotations

import logging
import os

import pytest

from _helpers import make_image_folder
from stoker import CacheOptions
from stoker.cache import paths
from stoker.cli import main
from stoker.store.dataset import open_dataset
from stoker.store.pack import pack


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    root = tmp_path_factory.mktemp("labels")
    files = {f"cat/{i}.jpg": bytes([i]) * 200 for i in range(3)}
    files.update({f"dog/{i}.jpg": bytes([9 + i]) * 200 for i in range(2)})
    tree = make_image_folder(root / "src", files)
    (tree / "emu").mkdir()  # an empty class folder: it keeps its label
    dst = root / "ds"
    pack(str(tree), str(dst), progress=False)
    return str(dst)


def test_cache_status_names_datasets_by_url_and_shows_the_budget(packed, tmp_path, capsys):
    cache = tmp_path / "cache"
    ds = open_dataset(packed, cache_dir=str(cache), cache_bytes="3MiB")
    ds[0]
    assert main(["cache", "status", str(cache)]) == 0
    out = capsys.readouterr().out
    assert f"dataset {packed} (version {ds.version[:12]})" in out
    assert f"dataset {ds.version}" not in out  # never the bare hash where the URL is known
    assert "budget: 3,145,728 bytes (3.0 MiB, of the last job that opened it)" in out
    assert main(["cache", "status", str(cache), "--budget", "1MiB"]) == 0
    assert "budget: 1,048,576 bytes (1.0 MiB, given with --budget)" in capsys.readouterr().out
    from stoker.cache.status import status

    st = status(str(cache))
    assert st["datasets"][ds.version] == {"url": packed, "version": ds.version}
    assert st["budget_bytes"] == 3 << 20 and st["budget_source"] == "recorded"


def test_a_relative_url_is_recorded_absolute(packed, tmp_path, monkeypatch, capsys):
    """The node-wide catalog is read from other directories (another job, ``stoker cache status``
    run elsewhere): a dataset opened as a relative path is recorded and shown by its absolute path."""
    from stoker.cache.status import status
    from stoker.cli.top import snapshot

    cache = tmp_path / "cache"
    monkeypatch.chdir(os.path.dirname(packed))
    ds = open_dataset(os.path.basename(packed), cache_dir=str(cache), cache_bytes="3MiB")
    ds[0]
    monkeypatch.chdir(tmp_path)
    assert status(str(cache))["datasets"][ds.version]["url"] == packed
    assert main(["cache", "status", str(cache)]) == 0
    assert f"dataset {packed} (version {ds.version[:12]})" in capsys.readouterr().out
    (c,) = snapshot(str(cache))["caches"]
    assert [(d["dataset"], d["version"]) for d in c["datasets"]] == [(packed, ds.version)]


def test_ls_full_keys_inclusive_ids_and_empty_classes(packed, capsys):
    assert main(["ls", packed]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == ["cat/\t3 samples\tids 0-2", "dog/\t2 samples\tids 3-4", "emu/\t0 samples\tlabel 2 (empty class)"]
    assert main(["ls", packed, "dog"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split("\t")[0] for line in out] == ["dog/0", "dog/1"]
    assert main(["ls", packed, "dog/1"]) == 0  # a listed name is a key that ls takes back
    assert capsys.readouterr().out.startswith("dog/1\t")


def test_dataset_class_names(packed):
    ds = open_dataset(packed, cache=False)
    assert ds.class_names == ["cat", "dog", "emu"]
    assert [ds.class_names[int(x)] for x in ds.labels] == ["cat"] * 3 + ["dog"] * 2


def test_cache_dir_that_is_a_file_is_a_clear_error(packed, tmp_path, capsys):
    f = tmp_path / "not-a-dir"
    f.write_text("notes")
    with pytest.raises(NotADirectoryError, match=f"cache directory {f} is a file"):
        open_dataset(packed, cache_dir=str(f))
    with pytest.raises(NotADirectoryError, match=f"cannot be made: {f} is a file"):
        open_dataset(packed, cache_dir=str(f / "sub"))
    assert f.read_text() == "notes"
    assert main(["cache", "status", str(f)]) == 2


def test_default_cache_dir_prefers_local_scratch(tmp_path, monkeypatch, caplog):
    monkeypatch.delenv("STOKER_CACHE_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    nvme = tmp_path / "mnt" / "disk-nvme0"
    nvme.mkdir(parents=True)
    caplog.set_level(logging.INFO, logger="stoker.cache.paths")
    cands = (str(tmp_path / "local"), str(tmp_path / "mnt" / "*nvme*"))
    chosen = paths.default_cache_dir(cands)
    assert os.path.dirname(chosen) == str(nvme) and os.path.basename(chosen).startswith("stoker-")
    assert paths.default_cache_dir(cands) == chosen
    assert sum(chosen in r.getMessage() for r in caplog.records) == 1  # logged once
    (tmp_path / "local").mkdir()
    assert os.path.dirname(paths.default_cache_dir(cands)) == str(tmp_path / "local")  # the order counts
    assert paths.default_cache_dir((str(tmp_path / "none"),)) == str(tmp_path / "home" / ".cache" / "stoker")
    monkeypatch.setenv("STOKER_CACHE_DIR", str(tmp_path / "mine"))
    assert paths.default_cache_dir(cands) == str(tmp_path / "mine")


def test_the_default_place_and_budget_are_told_at_warning_once(packed, tmp_path, monkeypatch, caplog):
    """A user who names no cache gets ~/.cache/stoker with 8 GiB: a WARNING says so the first time,
    with how to choose, see and empty it; a cache given in full says nothing."""
    monkeypatch.delenv("STOKER_CACHE_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setattr(paths, "SCRATCH_CANDIDATES", ())
    caplog.set_level(logging.WARNING, logger="stoker.cache.paths")
    home_cache = str(tmp_path / "home" / ".cache" / "stoker")
    open_dataset(packed)
    open_dataset(packed)  # the second time: nothing more
    told = [r for r in caplog.records if r.levelno == logging.WARNING and "node cache" in r.getMessage()]
    assert len(told) == 1, caplog.text
    assert (
        told[0]
        .getMessage()
        .startswith(
            f"node cache {home_cache}, up to 8.0 GiB: the default place and budget (choose with "
            "open_dataset(cache_dir=, cache_bytes=) or $STOKER_CACHE_DIR; "
            f"`stoker cache status {home_cache}` shows it"
        )
    ), told[0].getMessage()
    caplog.clear()
    open_dataset(packed, cache_dir=str(tmp_path / "mine"))
    assert f"node cache {tmp_path / 'mine'}, up to 8.0 GiB: the default budget (" in caplog.text
    caplog.clear()
    open_dataset(packed, cache_dir=str(tmp_path / "chosen"), cache_bytes="1GiB")
    assert "node cache" not in caplog.text


def test_network_filesystems_are_not_scratch(tmp_path):
    mounts = tmp_path / "mounts"
    mounts.write_text(f"server:/export {tmp_path} nfs4 rw 0 0\n/dev/sda1 / ext4 rw 0 0\n")
    assert paths._fs_type(str(tmp_path / "x"), str(mounts)) == "nfs4"
    assert paths._fs_type("/usr", str(mounts)) == "ext4"


def test_only_a_ram_backed_memory_tier_keeps_the_shared_memory_reserve(tmp_path, monkeypatch):
    from stoker.cache.disk import DiskCache
    from stoker.cache.tiered import SHM_KEEP_FREE, TieredCache

    mounts = tmp_path / "mounts"
    mounts.write_text(f"tmpfs {tmp_path / 'ram'} tmpfs rw 0 0\n/dev/sda1 / ext4 rw 0 0\n")
    assert paths.ram_backed(str(tmp_path / "ram" / "tier"), str(mounts))
    assert not paths.ram_backed(str(tmp_path / "disk" / "tier"), str(mounts))
    assert paths.ram_backed("/dev/shm/x", str(tmp_path / "no-such-mounts"))  # unknown table: by path
    assert not paths.ram_backed(str(tmp_path / "x"), str(tmp_path / "no-such-mounts"))

    def tiers(mem_root):
        return TieredCache(
            DiskCache(str(mem_root), 1 << 20, "future"), DiskCache(str(tmp_path / "d"), 1 << 20, "future")
        )

    # a memory tier on a disk directory: a quarter of a large disk is not RAM to keep free
    monkeypatch.setattr("stoker.cache.tiered.ram_backed", lambda p: False)
    assert tiers(tmp_path / "m1").memory.budget.keep_free_fraction == 0.0
    monkeypatch.setattr("stoker.cache.tiered.ram_backed", lambda p: True)
    assert tiers(tmp_path / "m2").memory.budget.keep_free_fraction == SHM_KEEP_FREE


def test_a_memory_tier_in_a_directory_of_the_users_is_shown_and_cleared(packed_local, tmp_path):
    from stoker.cache.status import clear, status

    root, mem = tmp_path / "cache", tmp_path / "mem"
    ds = open_dataset(
        packed_local,
        cache_dir=str(root),
        cache_bytes=64 << 20,
        cache=CacheOptions(memory_bytes=64 << 20, memory_dir=str(mem)),
    )
    for i in range(len(ds)):
        ds.read(i)
    from stoker.cluster.registration import end

    end(ds)  # this process's job on the cache is over: clear may delete
    got = status(str(root))["stores"]
    assert got["memory tier"]["path"] == str(mem) and got["memory tier"]["bytes"] > 0
    assert clear(str(root)) >= got["memory tier"]["bytes"]
    assert not mem.exists() or not any(p.is_file() and p.stat().st_size > 0 for p in mem.rglob("*"))
