"""A node shared by several users: what one user's cache lets another user see or redirect.

The second user is a real Unix user made with ``useradd`` for this module (and removed after);
its side runs in a forked child that drops to its uid, gid and groups (``os.setuid``). Outside
root the module skips, saying why.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat
import subprocess
import tempfile
import uuid

import numpy as np
import pytest

from stoker import CacheModeError, UnsafePathError
from stoker.cache import DiskCache, StagingArea, TieredCache, default_memory_root
from stoker.cache.policy import JobRegistry
from stoker.loader.derived import DerivedCache

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("useradd") is None,
    reason="needs root and useradd to create a second Unix user (runs as root in CI)",
)


class _User:
    def __init__(self, name: str, uid: int, gid: int, groups: list[int]):
        self.name, self.uid, self.gid, self.groups = name, uid, gid, groups


@pytest.fixture(scope="module")
def other():
    """A second user, member of a fresh group (its gid is ``other.groups[0]``)."""
    import grp
    import pwd

    tag = uuid.uuid4().hex[:6]
    group, name = f"stkg{tag}", f"stku{tag}"
    subprocess.run(["groupadd", group], check=True, capture_output=True)
    try:
        subprocess.run(
            ["useradd", "-M", "-N", "-G", group, "-s", "/usr/sbin/nologin", name], check=True, capture_output=True
        )
        try:
            pw = pwd.getpwnam(name)
            yield _User(name, pw.pw_uid, pw.pw_gid, [grp.getgrnam(group).gr_gid])
        finally:
            subprocess.run(["userdel", name], check=False, capture_output=True)
    finally:
        subprocess.run(["groupdel", group], check=False, capture_output=True)


def as_user(user: _User, fn, *args):
    """``fn(*args)`` in a forked child running as ``user``; its JSON-able result, or
    ``{"raised": "ExcName: message"}``. Only modules imported already are used (the
    interpreter's own files may not be readable by ``user``)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        try:
            os.close(r)
            os.setgroups(user.groups)
            os.setgid(user.gid)
            os.setuid(user.uid)
            try:
                out = fn(*args)
            except BaseException as exc:
                out = {"raised": f"{type(exc).__name__}: {exc}"}
            os.write(w, json.dumps(out).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        raw = f.read()
    os.waitpid(pid, 0)
    return json.loads(raw)


def _try(fn, *args) -> str:
    try:
        got = fn(*args)
    except PermissionError:
        return "denied"
    except OSError as exc:
        return f"{errno.errorcode.get(exc.errno, exc.errno)}"
    return f"allowed: {got!r}"[:80]


def _read(path):
    with open(path, "rb") as f:
        return f.read()


@pytest.fixture()
def base():
    """A directory both users can pass through (like a node's /nvme); removed after."""
    d = tempfile.mkdtemp(prefix="stoker-private-")
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _modes(root: str) -> dict[str, str]:
    out = {}
    for d, dirs, files in os.walk(root):
        for n in dirs + files:
            p = os.path.join(d, n)
            out[os.path.relpath(p, root)] = f"{stat.S_IMODE(os.lstat(p).st_mode):04o}"
    return out


def _fill(root: str, mode=None):
    """A tiered cache with one block in each tier, a staged block, a job record and a derived
    entry; returns (cache, staging, memory root)."""
    mem = default_memory_root(root)
    c = TieredCache(DiskCache(mem, 1000, "noevict", mode=mode), DiskCache(root, 1 << 20, "noevict", mode=mode))
    c.register("v1", 1 << 20)
    assert c.put("v1", "b0", b"memory-block" + bytes(900)) and c.put("v1", "b1", b"disk-block" + bytes(900))
    st = StagingArea.create(root, c.mode)
    assert st.put("v1", "s0", b"staged-block")
    JobRegistry(root, c.mode).register("v1", 1 << 20, 3.0)
    d = DerivedCache(os.path.join(root, ".derived"), 1 << 20, "rgb", "v1", mode=mode)
    assert d.put(0, "k0", np.zeros((4, 4, 3), np.uint8))
    return c, st, mem


def test_private_by_default_whatever_the_umask(base, other):
    root = os.path.join(base, "cache")
    old = os.umask(0o022)
    try:
        c, st, mem = _fill(root)
    finally:
        os.umask(old)
    try:
        for where in (root, mem):
            modes = _modes(where)
            assert modes and all(
                m == ("0700" if os.path.isdir(os.path.join(where, p)) else "0600") for p, m in modes.items()
            ), modes
        assert stat.S_IMODE(os.stat(root).st_mode) == 0o700 and stat.S_IMODE(os.stat(mem).st_mode) == 0o700
        block = c.disk.path("v1", "b1")
        staged = st.path("v1", "s0")
        seen = as_user(
            other,
            lambda: {
                "list cache": _try(os.listdir, root),
                "read block": _try(_read, block),
                "list memory tier": _try(os.listdir, mem),
                "read memory block": _try(_read, c.memory.path("v1", "b0")),
                "list staging": _try(os.listdir, os.path.join(root, ".staging")),
                "read staged": _try(_read, staged),
                "plant link in cache": _try(os.symlink, "/tmp", os.path.join(root, "stoker-ns-v1", "b9")),
            },
        )
        assert set(seen.values()) == {"denied"}, seen
    finally:
        shutil.rmtree(mem, ignore_errors=True)


def test_memory_tier_planted_by_another_user_is_refused(base, other):
    root = os.path.join(base, "cache")
    mem = default_memory_root(root)
    lure = os.path.join("/dev/shm", f"stoker-lure-{uuid.uuid4().hex[:8]}")

    def plant(kind):
        os.mkdir(lure, 0o777)
        os.chmod(lure, 0o777)
        if kind == "link":
            os.symlink(lure, mem)
        else:
            os.mkdir(mem, 0o777)
            os.chmod(mem, 0o777)
        return "planted"

    try:
        for kind in ("link", "dir"):
            assert as_user(other, plant, kind) == "planted"
            with pytest.raises(UnsafePathError, match=mem):
                DiskCache(mem, 1000, "noevict")
            assert os.listdir(lure) == [] and not os.path.exists(os.path.join(mem, ".stoker-cache"))
            for p in (mem, lure):
                if os.path.islink(p):
                    os.unlink(p)
                else:
                    shutil.rmtree(p)
    finally:
        for p in (mem, lure):
            if os.path.islink(p):
                os.unlink(p)
            shutil.rmtree(p, ignore_errors=True)


def test_a_cache_dir_writable_by_others_or_owned_by_another_user_is_refused(base, other):
    open_dir = os.path.join(base, "open")
    os.mkdir(open_dir)
    os.chmod(open_dir, 0o777)
    with pytest.raises(UnsafePathError, match=open_dir):
        DiskCache(open_dir, 1000)
    theirs = os.path.join(base, "theirs")
    os.mkdir(theirs, 0o755)
    os.chown(theirs, other.uid, other.gid)
    with pytest.raises(UnsafePathError, match=theirs):
        DiskCache(theirs, 1000)
    assert os.listdir(theirs) == []


def test_group_shared_cache_readable_by_the_group_and_no_fill_through_a_planted_link(base, other):
    gid = other.groups[0]
    root = os.path.join(base, "shared")
    os.mkdir(root)
    os.chown(root, -1, gid)
    os.chmod(root, 0o2770)
    c = DiskCache(root, 1 << 20, "noevict", mode="0660")
    c.register("v1", 1 << 20)
    assert c.put("v1", "b0", b"shared-block")
    block = c.path("v1", "b0")
    assert stat.S_IMODE(os.stat(block).st_mode) == 0o660 and os.stat(block).st_gid == gid
    assert stat.S_IMODE(os.stat(os.path.dirname(block)).st_mode) == 0o2770

    secret = os.path.join(base, "secret")
    with open(secret, "wb") as f:
        f.write(b"not-for-the-group")
    os.chmod(secret, 0o600)
    link = c.path("v1", "b1")

    def member():
        mine = DiskCache(root, 1 << 20, "noevict", mode="0660")
        os.symlink(secret, link)  # a group member plants a link where the owner will fill
        return {
            "list": sorted(os.listdir(os.path.dirname(block))),
            "read": _read(block).decode(),
            "via cache": mine.read("v1", "b0", 0, 12).decode(),
        }

    seen = as_user(other, member)
    assert seen == {"list": ["b0", "b1"], "read": "shared-block", "via cache": "shared-block"}, seen
    assert c.read("v1", "b1", 0, 17) is None  # the link is not followed
    assert c.put("v1", "b1", b"real-block-data!!")
    assert _read(secret) == b"not-for-the-group"  # the fill did not go through the link
    assert stat.S_ISREG(os.lstat(link).st_mode) and _read(link) == b"real-block-data!!"

    with pytest.raises(CacheModeError, match=root):  # made 0660, opened 0600: refused, not mixed
        DiskCache(root, 1 << 20, "noevict")
    assert "UnsafePathError" in as_user(other, lambda: DiskCache(root, 1 << 20) and "opened")["raised"]


def test_group_read_only_cache(base, other):
    """0640: the group lists and reads the blocks, and cannot write there."""
    gid = other.groups[0]
    root = os.path.join(base, "ro")
    os.mkdir(root)
    os.chown(root, -1, gid)
    c = DiskCache(root, 1 << 20, "noevict", mode=0o640)
    c.register("v1", 1 << 20)
    assert c.put("v1", "b0", b"group-readable")
    block = c.path("v1", "b0")
    assert stat.S_IMODE(os.stat(block).st_mode) == 0o640 and os.stat(block).st_gid == gid
    seen = as_user(other, lambda: {"read": _try(_read, block), "write": _try(os.symlink, "/tmp", c.path("v1", "b1"))})
    assert seen == {"read": "allowed: b'group-readable'", "write": "denied"}, seen
