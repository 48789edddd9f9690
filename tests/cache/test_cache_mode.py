"""Cache modes without a second user: defaults, the recorded mode, refusals, old caches, status."""

from __future__ import annotations

import json
import os
import stat

import pytest

from stoker import CacheModeError, UnsafePathError
from stoker.cache import DiskCache
from stoker.cache.perms import dir_mode, parse_mode
from stoker.cli import main


def _mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_parse_mode_and_env(monkeypatch):
    monkeypatch.delenv("STOKER_CACHE_MODE", raising=False)
    assert parse_mode(None) == 0o600 and parse_mode("0640") == parse_mode("640") == parse_mode(0o640) == 0o640
    monkeypatch.setenv("STOKER_CACHE_MODE", "0660")
    assert parse_mode(None) == 0o660
    for bad in ("0666", "0644x", "0400", "0700", "4600", 0o602, True):
        with pytest.raises(ValueError, match="mode"):
            parse_mode(bad)
    assert (dir_mode(0o600), dir_mode(0o640), dir_mode(0o660)) == (0o700, 0o2750, 0o2770)


def test_mode_is_recorded_and_another_mode_refused(tmp_path):
    root = tmp_path / "c"
    c = DiskCache(str(root), 1 << 20, "noevict", mode="0640")
    assert json.loads((root / ".stoker-cache").read_text())["mode"] == "0640"
    c.register("v1", 1 << 20)
    assert c.put("v1", "b0", b"x")
    assert _mode(c.path("v1", "b0")) == 0o640
    with pytest.raises(CacheModeError, match=str(root)) as err:
        DiskCache(str(root), 1 << 20, "noevict", mode="0600")
    assert "0640" in str(err.value) and "0600" in str(err.value)
    assert _mode(c.path("v1", "b0")) == 0o640  # nothing changed


def test_symlinked_root_of_own_is_followed_but_not_others_writable(tmp_path):
    real = tmp_path / "nvme"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    DiskCache(str(tmp_path / "link"), 1000)
    assert (real / ".stoker-cache").exists()
    real.chmod(0o777)
    with pytest.raises(UnsafePathError, match=str(real)):
        DiskCache(str(tmp_path / "link"), 1000)


def test_a_cache_of_an_older_stoker_is_brought_to_the_mode(tmp_path):
    """Layout-2 caches made before modes existed (umask modes, no mode in the marker)."""
    root = tmp_path / "old"
    old = os.umask(0o022)
    try:
        root.mkdir()
        (root / ".stoker-cache").write_text(json.dumps({"layout": 2}))
        (root / ".usage").mkdir()
        (root / ".usage" / "v1").write_bytes((3).to_bytes(8, "little"))
        (root / "stoker-ns-v1").mkdir()
        (root / "stoker-ns-v1" / "b0").write_bytes(b"abc")
        (root / "notes.txt").write_text("the user's own file")
    finally:
        os.umask(old)
    c = DiskCache(str(root), 1 << 20, "noevict")
    assert c.read("v1", "b0", 0, 3) == b"abc"
    assert _mode(root / "stoker-ns-v1") == 0o700 and _mode(root / "stoker-ns-v1" / "b0") == 0o600
    assert _mode(root / ".usage" / "v1") == 0o600 and _mode(root / "notes.txt") == 0o644  # not the cache's
    assert json.loads((root / ".stoker-cache").read_text())["mode"] == "0600"


def test_status_reports_mode_and_owner(tmp_path, capsys):
    import pwd

    root = tmp_path / "c"
    DiskCache(str(root), 1000, mode="0640")
    assert main(["cache", "status", str(root)]) == 0  # status opens the cache with its own mode
    out = capsys.readouterr().out
    me = pwd.getpwuid(os.geteuid()).pw_name
    assert f"mode 0640 (directories 2750), owner {me} (uid {os.geteuid()}" in out
    assert main(["cache", "status", "--json", str(root)]) == 0
    acc = json.loads(capsys.readouterr().out)["access"]
    assert acc["mode"] == "0640" and acc["owner"] == me and acc["owner_uid"] == os.geteuid()


def test_cli_cache_mode_option(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("STOKER_CACHE_MODE", "0600")  # restored after the test: main() sets it
    monkeypatch.delenv("STOKER_CACHE_MODE")
    with pytest.raises(SystemExit):
        main(["--cache-mode", "0666", "cache", "status", str(tmp_path)])
    assert "not allowed" in capsys.readouterr().err
    root = tmp_path / "c"
    DiskCache(str(root), 1000, mode="0660")
    assert main(["--cache-mode", "0660", "cache", "status", str(root)]) == 0
    assert os.environ["STOKER_CACHE_MODE"] == "0660"
    assert DiskCache(str(root), 1000).mode == 0o660  # the option is the default of every cache opened
