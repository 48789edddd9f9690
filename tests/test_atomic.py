"""The one temporary-and-rename write (stoker._atomic): private temporaries, exact final
modes whatever the umask, no write through a planted link."""

from __future__ import annotations

import errno
import os
import stat

import pytest

from stoker import _atomic


def _mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_temporary_is_private_and_final_mode_exact_whatever_the_umask(tmp_path, monkeypatch):
    seen = []
    real = _atomic.write_fd

    def spy(fd, data, path):
        seen.append((path, stat.S_IMODE(os.fstat(fd).st_mode)))
        real(fd, data, path)

    monkeypatch.setattr(_atomic, "write_fd", spy)
    old = os.umask(0o077)
    try:
        assert _atomic.write_atomic(str(tmp_path / "a"), b"abc", mode=0o644)
        assert _atomic.write_atomic(str(tmp_path / "b"), b"abc", mode=0o660)
    finally:
        os.umask(old)
    old = os.umask(0)
    try:
        assert _atomic.write_atomic(str(tmp_path / "c"), b"abc")
    finally:
        os.umask(old)
    assert [m for _, m in seen] == [0o600] * 3
    assert [_mode(tmp_path / n) for n in "abc"] == [0o644, 0o660, 0o600]
    assert sorted(os.listdir(tmp_path)) == ["a", "b", "c"]


def test_umask_mode_is_what_a_plain_open_gives(tmp_path):
    old = os.umask(0o027)
    try:
        with open(tmp_path / "plain", "w"):
            pass
        assert _atomic.umask_mode() == _mode(tmp_path / "plain") == 0o640
    finally:
        os.umask(old)


def test_a_link_at_the_final_name_is_replaced_not_followed(tmp_path):
    target = tmp_path / "elsewhere"
    target.write_bytes(b"keep")
    (tmp_path / "final").symlink_to(target)
    assert _atomic.write_atomic(str(tmp_path / "final"), b"new")
    assert target.read_bytes() == b"keep" and (tmp_path / "final").read_bytes() == b"new"
    assert not (tmp_path / "final").is_symlink()
    (tmp_path / "kept").symlink_to(target)
    assert not _atomic.write_atomic(str(tmp_path / "kept"), b"new", replace=False)  # no clobber
    assert target.read_bytes() == b"keep"
    with pytest.raises(OSError) as err:
        _atomic.open_file(str(tmp_path / "kept"), os.O_RDONLY)
    assert err.value.errno == errno.ELOOP


def test_failed_write_leaves_no_temporary(tmp_path, monkeypatch):
    def full(fd, data, path):
        raise OSError(errno.ENOSPC, "No space left on device", path)

    monkeypatch.setattr(_atomic, "write_fd", full)
    with pytest.raises(OSError):
        _atomic.write_atomic(str(tmp_path / "x"), b"abc")
    assert os.listdir(tmp_path) == []


def test_open_file_gives_a_created_file_its_exact_mode(tmp_path):
    old = os.umask(0o077)
    try:
        fd = _atomic.open_file(str(tmp_path / "lock"), os.O_CREAT | os.O_RDWR, 0o660)
        os.close(fd)
    finally:
        os.umask(old)
    assert _mode(tmp_path / "lock") == 0o660
