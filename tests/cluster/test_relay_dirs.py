"""A relay's directory (``stoker-relay-<pid>-*``) is removed by close(), by the interpreter's exit,
and - for a process that ended with ``os._exit`` or a signal - by the next relay's sweep."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from stoker.cluster.service.reader import RELAY_PREFIX, Relay, sweep_relay_dirs

CHILD = textwrap.dedent(
    """
    import os, sys, tempfile
    tempfile.tempdir = sys.argv[1]
    from stoker.cluster.service.reader import Relay
    r = Relay(router=None)
    print(r.address, flush=True)
    if sys.argv[2] == "exit":
        sys.exit(0)
    os._exit(0)
    """
)


def _relay_dirs(root) -> list[str]:
    return sorted(n for n in os.listdir(root) if n.startswith(RELAY_PREFIX))


def _child(root, how: str) -> str:
    out = subprocess.run([sys.executable, "-c", CHILD, str(root), how], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_close_removes_the_directory(tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    r = Relay(router=None)
    assert os.path.exists(r.address)
    assert _relay_dirs(tmp_path) and _relay_dirs(tmp_path)[0].startswith(f"{RELAY_PREFIX}{os.getpid()}-")
    r.close()
    r.close()  # twice is harmless
    assert _relay_dirs(tmp_path) == []


def test_exit_without_close_removes_the_directory(tmp_path):
    _child(tmp_path, "exit")
    assert _relay_dirs(tmp_path) == []


def test_a_process_gone_without_exit_hooks_is_swept_by_the_next_relay(tmp_path, monkeypatch):
    address = _child(tmp_path, "os_exit")
    left = os.path.basename(os.path.dirname(address))
    assert _relay_dirs(tmp_path) == [left]  # os._exit runs no hook
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    r = Relay(router=None)
    try:
        assert left not in _relay_dirs(tmp_path)
        assert len(_relay_dirs(tmp_path)) == 1  # this relay's own
    finally:
        r.close()


def test_sweep_keeps_live_processes_and_other_names(tmp_path):
    live = tmp_path / f"{RELAY_PREFIX}{os.getpid()}-abc"
    old_form = tmp_path / f"{RELAY_PREFIX}abc123"  # no pid: not ours to judge
    other = tmp_path / "something-else"
    for d in (live, old_form, other):
        d.mkdir()
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    dead = tmp_path / f"{RELAY_PREFIX}{p.pid}-xyz"
    dead.mkdir()
    (dead / "peers.sock").write_bytes(b"")
    assert sweep_relay_dirs(str(tmp_path)) == [str(dead)]
    assert live.exists() and old_form.exists() and other.exists() and not dead.exists()
