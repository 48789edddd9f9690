"""Node cache faults: other people's files in the cache directory, a disk smaller than the
budget (or filled by others), a memory tier larger than /dev/shm."""

import errno
import logging
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from stoker import _atomic
from stoker._atomic import write_fd as _write_fd
from stoker.cache import DiskCache, StagingArea, TieredCache, files
from stoker.cli import main

USER = {
    "wds-src/000.tar": b"t" * 3000,
    "wds-src/001.tar": b"u" * 2500,
    "notes/todo.txt": b"my notes\n",
    "mydata/index.parquet": b"p" * 700,
    "mydata/shards/shard-000000.tar": b"s" * 4000,
    "top.bin": b"z" * 10,
}


def _write_user(root):
    for rel, data in USER.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
        os.utime(path, (1, 1))  # older than any block: first in line for an LRU that took it as its own


def _user_intact(root):
    for rel, data in USER.items():
        with open(os.path.join(root, rel), "rb") as f:
            assert f.read() == data, rel


def _own_bytes(cache):
    return sum(
        os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(os.path.dirname(cache.path("v1", "x"))) for f in fs
    )


@pytest.mark.parametrize("policy", ["future", "noevict", "lru"])
def test_user_files_in_the_cache_dir_are_never_counted_evicted_or_cleared(tmp_path, policy):
    root = str(tmp_path)
    _write_user(root)
    cap = 6000  # below what the user's files take
    c = DiskCache(root, cap, policy)
    c.recover()  # as open_dataset does: recounts usage from what is on disk
    c.register("v1", 20_000)
    assert c.used_bytes() == 0
    admitted = sum(c.put("v1", f"b{i}", bytes(1000)) for i in range(12))
    assert admitted == (6 if policy != "lru" else 12)
    _user_intact(root)
    assert c.used_bytes() == _own_bytes(c) <= cap
    assert c.recover()["used"] == _own_bytes(c)
    from stoker.cache.status import clear, status

    st = status(root)
    assert st["namespaces"] == {"v1": _own_bytes(c)}
    assert st["ignored"] == ["mydata", "notes", "top.bin", "wds-src"]
    c.jobs.unregister("v1")  # the job ends; clear runs after it
    assert clear(root) == 6000
    _user_intact(root)


def test_cache_clear_refuses_a_directory_that_is_not_a_cache(tmp_path, capsys):
    plain = tmp_path / "plain"
    _write_user(str(plain))
    before = sorted(os.listdir(plain))
    assert main(["cache", "clear", str(plain)]) == 2
    assert main(["cache", "status", str(plain)]) == 2
    err = capsys.readouterr().err
    assert str(plain) in err and "not a stoker cache" in err
    _user_intact(str(plain))
    assert sorted(os.listdir(plain)) == before  # nothing written there either


def test_a_cache_of_the_old_layout_is_left_alone(tmp_path):
    """Layout 1 (every folder a namespace, no marker) cannot be told from user folders:
    its folders are neither counted nor deleted, and status lists them."""
    root = tmp_path / "old"
    old_ns = root / ("ab" * 16)
    old_ns.mkdir(parents=True)
    (old_ns / "000000-0-1000").write_bytes(bytes(1000))
    (root / ".lock").write_bytes((1000).to_bytes(8, "little"))
    from stoker.cache.status import clear, status

    assert main(["cache", "clear", str(root)]) == 2
    c = DiskCache(str(root), 10_000, "lru")
    assert c.recover()["used"] == 0
    assert status(str(root))["ignored"] == ["ab" * 16]
    assert clear(str(root)) == 0 and (old_ns / "000000-0-1000").exists()


# -- a full disk ---------------------------------------------------------------------------------


class _FullAfter:
    """A stand-in for :func:`stoker._atomic.write_fd` that lets ``allow`` whole block files (the
    cache's temporaries, under ``under``) through and then writes half of each one and fails
    with ENOSPC (a disk that fills up mid-write)."""

    def __init__(self, allow: int, under: str = ""):
        self.allow, self.under = allow, under

    def __call__(self, fd, data, path):
        if os.path.basename(path).startswith(files.TMP_MARK) and str(path).startswith(self.under):
            if self.allow > 0:
                self.allow -= 1
            else:
                view = memoryview(data).cast("B")
                os.write(fd, view[: len(view) // 2])
                raise OSError(errno.ENOSPC, "No space left on device", path)
        _write_fd(fd, data, path)


def _tmp_files(root):
    return [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f.startswith(files.TMP_MARK)]


def test_enospc_on_a_fill_refuses_the_block_and_leaves_nothing(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(_atomic, "write_fd", _FullAfter(allow=2))
    c = DiskCache(str(tmp_path), 1 << 30, "lru")
    c.register("v1", 1 << 20)
    with caplog.at_level(logging.WARNING, logger="stoker.cache"):
        got = [c.put("v1", f"b{i}", bytes(1000)) for i in range(5)]
        st = StagingArea.create(str(tmp_path))
        assert not st.put("v1", "b9", bytes(1000))  # staging shares the disk
    assert got == [True, True, False, False, False]
    assert c.used_bytes() == 2000 == _own_bytes(c) and c.stats.refused == 3
    assert _tmp_files(tmp_path) == []
    full = [r for r in caplog.records if "is full" in r.getMessage()]
    assert len(full) == 1 and str(tmp_path) in full[0].getMessage() and "bytes free" in full[0].getMessage()


def test_budget_above_the_free_space_is_capped_by_statvfs(tmp_path, monkeypatch):
    """A 1 GiB budget on a disk with 5 blocks' room: what fits is cached, nothing is written past it."""
    from stoker.cache import space

    frsize = 4096
    disk = {"free": 5 * frsize + 2 * frsize}

    def fake_free(path):
        return disk["free"], frsize

    monkeypatch.setattr(space, "free_bytes", fake_free)
    c = DiskCache(str(tmp_path), 1 << 30, "noevict")
    c.register("v1", 1 << 20)
    results = []
    for i in range(8):
        ok = c.put("v1", f"b{i}", bytes(frsize))
        disk["free"] -= frsize * ok
        results.append(ok)
    assert results == [True] * 5 + [False] * 3
    assert not c.would_admit(frsize, "v1")
    disk["free"] += 10 * frsize  # another program frees space: the cache may grow again
    assert c.would_admit(frsize, "v1") and c.put("v1", "b8", bytes(frsize))


def _full_put(cache, q):
    """Child: one refused fill; reports how many full-disk warnings it logged."""
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("stoker.cache").addHandler(handler)
    ok = cache.put("v1", f"b{os.getpid()}", bytes(4096))
    q.put((ok, len(records)))


def test_one_warning_per_job_across_its_processes(tmp_path, monkeypatch):
    from stoker.cache import space

    monkeypatch.setattr(space, "free_bytes", lambda path: (0, 4096))
    c = DiskCache(str(tmp_path), 1 << 30, "noevict")
    c.register("v1", 1 << 20)
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=_full_put, args=(c, q)) for _ in range(3)]
    for p in procs:
        p.start()
    out = [q.get(timeout=30) for _ in procs]
    for p in procs:
        p.join(30)
    assert [ok for ok, _ in out] == [False] * 3
    assert sum(n for _, n in out) == 1


def test_memory_tier_larger_than_shm_falls_back_to_the_disk_tier(tmp_path, monkeypatch):
    mem_root, disk_root = str(tmp_path / "shm"), str(tmp_path / "disk")
    monkeypatch.setattr(_atomic, "write_fd", _FullAfter(allow=1, under=mem_root))
    t = TieredCache(DiskCache(mem_root, 64 << 20, "future"), DiskCache(disk_root, 64 << 20, "future"))
    t.register("v1", 1 << 20)
    assert all(t.put("v1", f"b{i}", bytes(1000)) for i in range(4))
    assert t.memory.used_bytes() == 1000 and t.disk.used_bytes() == 3000
    assert all(t.read("v1", f"b{i}", 0, 1000) == bytes(1000) for i in range(4))
    assert _tmp_files(mem_root) == []


def test_loader_epoch_completes_once_on_a_disk_that_fills_up(tmp_path, packed_local, monkeypatch):
    from stoker import ImageOptions, Loader, RunOptions, open_dataset

    monkeypatch.setattr(_atomic, "write_fd", _FullAfter(allow=1))  # in the forked prefetcher too
    cache_dir = str(tmp_path / "c")
    ds = open_dataset(packed_local, cache_dir=cache_dir, cache_bytes=1 << 30, block_bytes=256 << 10)
    ld = Loader(
        ds,
        batch_size=16,
        num_workers=0,
        transform="eval",
        image=ImageOptions(image_size=32),
        run=RunOptions(start_method="fork", timeout_s=60),
    )
    try:
        for _ in range(2):
            n = sum(len(labels) for _, labels in ld)
            assert n == len(ds) and ld.stats.exactly_once
    finally:
        ld.close()
    assert _tmp_files(cache_dir) == []


_TMPFS_CHILD = textwrap.dedent("""
    import glob, logging, os, sys
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    import stoker
    url, cache_dir, mem = sys.argv[1], sys.argv[2], int(sys.argv[3])
    ds = stoker.open_dataset(url, cache_dir=cache_dir, cache_bytes=1 << 30, cache=stoker.CacheOptions(memory_bytes=mem),
                             block_bytes=256 << 10)
    ld = stoker.Loader(ds, batch_size=16, num_workers=0, transform="eval", image=stoker.ImageOptions(image_size=32),
                       run=stoker.RunOptions(timeout_s=60, start_method="fork"))
    n = sum(len(labels) for _, labels in ld)
    ld.close()
    tmp = [p for p in glob.glob(cache_dir + "/**", recursive=True) + glob.glob("/dev/shm/**", recursive=True)
           if os.path.basename(p).startswith(".tmp-")]
    print("RESULT", n, len(ds), ld.stats.exactly_once, len(tmp), flush=True)
""")


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare -m")
@pytest.mark.parametrize("where", ["disk", "shm"])
def test_small_tmpfs_epoch_completes_with_one_warning(tmp_path, packed_local, where):
    """A real 1 MiB tmpfs (in a private mount namespace) under the cache dir, or a 2 MiB /dev/shm
    under a 64 MiB memory tier."""
    script = tmp_path / "child.py"
    script.write_text(_TMPFS_CHILD)
    cache_dir = tmp_path / "small"
    cache_dir.mkdir()
    # a cache directory must not be writable by others: the cache's tmpfs is mounted 0700
    target, mem, opts = (cache_dir, 0, "size=1m,mode=0700") if where == "disk" else ("/dev/shm", 64 << 20, "size=2m")
    cmd = f"mount -t tmpfs -o {opts} tmpfs {target} && exec {sys.executable} {script} {packed_local} {cache_dir} {mem}"
    r = subprocess.run(
        ["unshare", "-m", "sh", "-c", cmd],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert r.returncode == 0, r.stderr[-2000:]
    (line,) = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT")]
    _, n, total, once, tmp = line.split()
    assert n == total and once == "True" and tmp == "0"
    full = [ln for ln in r.stderr.splitlines() if "is full" in ln]
    assert len(full) == 1 and "bytes free" in full[0], r.stderr[-2000:]
    assert (str(cache_dir) if where == "disk" else "/dev/shm/stoker-cache-") in full[0]
    assert "Error" not in r.stderr, r.stderr[-2000:]


def test_a_staged_block_is_taken_from_another_loader_only_as_a_whole_file_of_this_user(tmp_path):
    # StagingArea.adopt links another loader's staged block; a link planted in another staging
    # area, a fill still in progress and a staging area outside the cache's .staging are not taken.
    ours, theirs = StagingArea.create(str(tmp_path)), StagingArea.create(str(tmp_path))
    assert theirs.put("v1", "b0", b"block-0")
    assert ours.adopt("v1", "b0") and ours.read("v1", "b0", 0, 7) == b"block-0"
    assert theirs.remove("v1", "b0") == 7 and ours.read("v1", "b0", 0, 7) == b"block-0"
    assert not ours.adopt("v1", "b1")  # nobody staged it
    secret = tmp_path / "secret"
    secret.write_bytes(b"not a block")
    os.symlink(secret, os.path.join(theirs.root, "v1", "b2"))
    with open(os.path.join(theirs.root, "v1", files.TMP_MARK + "b3"), "wb") as f:
        f.write(b"half")
    assert not ours.adopt("v1", "b2") and not ours.contains("v1", "b2")
    assert not ours.adopt("v1", "b3") and ours.names("v1") == ["b0"]
    loose = StagingArea(str(tmp_path / "elsewhere"))
    assert not loose.adopt("v1", "b0")
