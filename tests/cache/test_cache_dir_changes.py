"""A cache directory that changes under the cache: one that cannot be written (a read-only mount,
no permission) is one clear error naming it; a pre-filled one is served read-only without a
write; one removed while the cache is in use is made again, with the descriptors a process keeps
open (stoker.cache.handles) noticed as stale."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from _helpers import in_child
from stoker.cache import DiskCache, ReadOnlyCache, StagingArea, TieredCache, layout
from stoker.errors import CacheUnwritableError, NotACacheError

NS = "v1"


def _block(k: int, n: int = 4096) -> bytes:
    return bytes((k * 7 + j) % 251 for j in range(n))


def _tree(root) -> dict:
    """{relative path: (size, mtime_ns)} of everything under ``root``."""
    out = {}
    for d, dirs, files in os.walk(root):
        for n in dirs + files:
            p = os.path.join(d, n)
            st = os.lstat(p)
            out[os.path.relpath(p, root)] = (st.st_size if n in files else 0, st.st_mtime_ns)
    return out


# -- a directory that cannot be written ---------------------------------------------------------


def _can_mount_read_only() -> bool:
    if os.geteuid() != 0 or not shutil.which("unshare"):
        return False
    return subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode == 0


def _run_on_read_only_mount(ro_dir, code: str) -> subprocess.CompletedProcess:
    """Run python ``code`` in a child whose mount namespace has ``ro_dir`` bound read-only (the
    test process's mounts stay as they are)."""
    script = (
        f"mount --bind {ro_dir} {ro_dir} && mount -o remount,ro,bind {ro_dir} && "
        f"exec {sys.executable} -c {subprocess.list2cmdline([textwrap.dedent(code)])}"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, timeout=60, env=env)


def test_an_unwritable_cache_directory_is_one_error_naming_it(tmp_path):
    """A read-only mount (root: a real one, in a mount namespace of its own) or a directory this
    user may not write (others: mode 0500): CacheUnwritableError, a PermissionError, naming the
    directory and why, at once, for an empty cache, a filled one and one under a read-only parent."""
    filled = tmp_path / "filled"
    DiskCache(str(filled), 1 << 20).put(NS, "b", _block(1))
    (tmp_path / "empty").mkdir(mode=0o700)
    (tmp_path / "parent").mkdir(mode=0o700)
    if _can_mount_read_only():
        code = f"""
            import errno
            from stoker.cache import DiskCache
            from stoker.errors import CacheUnwritableError
            for d in ({str(filled)!r}, {str(tmp_path / "empty")!r}, {str(tmp_path / "parent" / "cache")!r}):
                try:
                    DiskCache(d, 1 << 20)
                except CacheUnwritableError as e:
                    assert isinstance(e, PermissionError) and e.errno == errno.EROFS, e
                    assert d in str(e) and "read-only filesystem" in str(e) and "cache_read_only" in str(e), e
                    print("ok")
                else:
                    print("opened", d)
        """
        out = _run_on_read_only_mount(tmp_path, code)
        assert out.stdout.split() == ["ok"] * 3, out.stdout + out.stderr
        return
    for d in (filled, tmp_path / "empty"):
        os.chmod(d, 0o500)
    os.chmod(tmp_path / "parent", 0o500)
    try:
        for d in (filled, tmp_path / "empty", tmp_path / "parent" / "cache"):
            with pytest.raises(CacheUnwritableError, match=str(d)) as info:
                DiskCache(str(d), 1 << 20)
            assert info.value.errno in (errno.EACCES, errno.EPERM)
    finally:
        for d in (filled, tmp_path / "empty", tmp_path / "parent"):
            os.chmod(d, 0o700)


def test_a_read_only_cache_on_a_read_only_mount_is_served(tmp_path):
    """The read-only mode on a real read-only mount: blocks are read, nothing is written."""
    if not _can_mount_read_only():
        pytest.skip("needs root and unshare for a read-only bind mount (the mode itself is tested below)")
    filled = tmp_path / "filled"
    DiskCache(str(filled), 1 << 20).put(NS, "b", _block(1))
    code = f"""
        from stoker.cache import ReadOnlyCache
        c = ReadOnlyCache({str(filled)!r})
        assert c.read("v1", "b", 10, 20) == {_block(1)[10:30]!r}
        assert c.read("v1", "missing", 0, 1) is None and not c.would_admit(10, "v1") and not c.put("v1", "x", b"1")
        with c.fetch_lock("v1", "x") as held:
            assert held
        c.register("v1", 100)
        print("ok", c.recover()["used"])
    """
    out = _run_on_read_only_mount(tmp_path, code)
    assert out.stdout.split() == ["ok", "4096"], out.stdout + out.stderr


# -- the read-only mode ---------------------------------------------------------------------------


def test_a_read_only_cache_writes_nothing(tmp_path):
    root = tmp_path / "c"
    c = DiskCache(str(root), 1 << 20)
    c.register(NS, 1 << 20)
    assert c.put(NS, "b", _block(1))
    before = _tree(root)
    ro = ReadOnlyCache(str(root))
    assert ro.read(NS, "b", 0, 4096) == _block(1)
    assert ro.read(NS, "other", 0, 1) is None and not ro.contains(NS, "other") and ro.contains(NS, "b")
    assert not ro.would_admit(1, NS) and not ro.put(NS, "other", b"x") and ro.stats.refused == 1
    ro.remove(NS, "b")
    ro.register(NS, 1 << 20, 3.0)
    ro.describe(NS, "s3://b/d")
    ro.note_fill_failure(NS, "b", {"pid": 1})
    assert ro.fill_failure(NS, "b") is None
    assert ro.recover() == {"removed_tmp": 0, "used": 4096} and ro.used_bytes() == 4096
    ro.close()
    assert _tree(root) == before


def test_a_read_only_cache_must_be_a_cache(tmp_path):
    with pytest.raises(NotACacheError, match="does not exist"):
        ReadOnlyCache(str(tmp_path / "nothing"))
    (tmp_path / "plain").mkdir()
    with pytest.raises(NotACacheError, match="not a stoker cache"):
        ReadOnlyCache(str(tmp_path / "plain"))


# -- a directory removed while the cache is in use ----------------------------------------------


def test_a_cache_directory_removed_in_use_is_made_again(tmp_path, caplog):
    root = tmp_path / "c"
    c = DiskCache(str(root), 1 << 20)
    c.register(NS, 1 << 20)
    assert c.put(NS, "b0", _block(0))
    with c.fetch_lock(NS, "b1") as held:  # keeps the stripe's descriptor open in this process
        assert held
    assert c.read(NS, "b0", 0, 10) == _block(0)[:10]  # and the block's
    shutil.rmtree(root)
    assert c.read(NS, "b0", 0, 10) is None  # its block went with it: a miss
    with caplog.at_level("WARNING", logger="stoker.cache"):
        with c.fetch_lock(NS, "b1") as held:
            assert held
            assert c.would_admit(4096, NS)  # the job's record was made again: the policy admits it
            assert c.put(NS, "b1", _block(1))
    assert layout.is_cache(str(root)) and c.read(NS, "b1", 0, 4096) == _block(1)
    assert c.used_bytes() == 4096
    assert sum("was removed while this job ran" in r.getMessage() for r in caplog.records) == 1
    # another process sees the same budget and lock files (none of this process's stale ones)
    assert in_child(lambda: DiskCache(str(root), 1 << 20).used_bytes()) == 4096


def _fill_after_the_parent_removed(root: str) -> tuple:
    c = DiskCache(root, 1 << 20)
    c.register(NS, 1 << 20)
    c.put(NS, "b0", _block(0))
    shutil.rmtree(root)  # between two fills of this process: no descriptor of it noticed yet
    return c.put(NS, "b1", _block(1)), c.used_bytes(), layout.is_cache(root)


def test_a_fill_after_the_directory_went_away_is_kept(tmp_path):
    assert in_child(_fill_after_the_parent_removed, str(tmp_path / "c")) == (True, 4096, True)


def test_the_memory_tier_directory_removed_in_use_is_made_again(tmp_path):
    mem = DiskCache(str(tmp_path / "mem"), 8192)
    tiered = TieredCache(mem, DiskCache(str(tmp_path / "disk"), 1 << 20))
    tiered.register(NS, 1 << 20)
    assert tiered.put(NS, "b0", _block(0)) and os.path.exists(mem.path(NS, "b0"))
    shutil.rmtree(tmp_path / "mem")
    assert tiered.read(NS, "b0", 0, 10) is None
    assert tiered.put(NS, "b0", _block(0)) and tiered.read(NS, "b0", 0, 10) == _block(0)[:10]
    assert os.path.exists(mem.path(NS, "b0")) and mem.used_bytes() == 4096


def test_a_staging_area_removed_in_use_is_made_again(tmp_path):
    DiskCache(str(tmp_path / "c"), 1 << 20)
    st = StagingArea.create(str(tmp_path / "c"))
    assert st.put(NS, "b0", _block(0))
    shutil.rmtree(tmp_path / "c")
    assert st.put(NS, "b1", _block(1)) and st.read(NS, "b1", 0, 4096) == _block(1)


def test_a_removal_in_progress_is_let_through_before_the_directory_is_made_again(tmp_path):
    """An ``rm -rf`` that has taken the marker and the lock file but not yet the directory: a fill
    waits for it to finish rather than make files under its feet ("Directory not empty"), then
    makes the directory again and keeps the block."""
    import threading
    import time

    root = tmp_path / "c"
    c = DiskCache(str(root), 1 << 20)
    c.register(NS, 1 << 20)
    assert c.put(NS, "b0", _block(0))
    os.unlink(root / layout.ROOT_MARKER)
    os.unlink(root / ".lock")
    failed: list = []

    def rest_of_the_rm():
        time.sleep(0.3)
        try:
            shutil.rmtree(root)
        except OSError as exc:
            failed.append(exc)

    t = threading.Thread(target=rest_of_the_rm)
    t.start()
    try:
        assert c.put(NS, "b1", _block(1))
    finally:
        t.join()
    assert failed == []
    assert layout.is_whole(str(root)) and c.read(NS, "b1", 0, 4096) == _block(1)
