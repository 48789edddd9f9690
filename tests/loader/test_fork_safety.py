"""Forking after the training process started a runtime that cannot survive fork (tokio, e.g.
through obstore): stoker notices, whoever started it, and starts its processes with forkserver;
an explicit ``start_method="fork"`` there fails at construction naming the cause. A dead or
stalled worker is reported with its exit code or signal and what it was doing."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from stoker import _procs as procs
from stoker._procs import ForkUnsafeError, describe_exit, fork_hazards, pick_start_method
from stoker.loader import Loader, RunOptions

ALL = ["fork", "spawn", "forkserver"]


def test_no_hazard_keeps_fork(monkeypatch):
    monkeypatch.setattr(procs, "thread_names", lambda: ["python", "pt_main_thread", "fsspecIO"])
    assert pick_start_method(None, ALL) == ("fork", [])
    assert pick_start_method("spawn", ALL)[0] == "spawn"


def test_tokio_threads_switch_to_forkserver(monkeypatch):
    monkeypatch.setattr(procs, "thread_names", lambda: ["python", "tokio-rt-worker", "tokio-rt-worker"])
    method, hazards = pick_start_method(None, ALL)
    assert method == "forkserver"
    assert "tokio" in hazards[0] and "2 tokio runtime thread(s)" in hazards[0]
    assert pick_start_method(None, ["fork", "spawn"])[0] == "spawn"
    assert pick_start_method("forkserver", ALL)[0] == "forkserver"
    with pytest.raises(ForkUnsafeError, match="tokio-rt-worker"):
        pick_start_method("fork", ALL)


def test_explicit_fork_fails_at_construction(monkeypatch, packed_local):
    from stoker import open_dataset

    monkeypatch.setattr(procs, "thread_names", lambda: ["python", "tokio-runtime-w"])
    ds = open_dataset(packed_local)
    with pytest.raises(ForkUnsafeError, match="start_method='fork' is unsafe here: .*tokio-runtime-w"):
        Loader(ds, batch_size=8, num_workers=1, run=RunOptions(start_method="fork"))
    ld = Loader(ds, batch_size=8, num_workers=1)  # chosen when the processes start
    assert ld.start_method == "forkserver"
    no_procs = Loader(ds, batch_size=8, num_workers=0, run=RunOptions(start_method="fork"))
    assert no_procs.start_method == "fork"  # no processes


def test_signal_deaths_are_named():
    assert describe_exit(1) == "exit code 1"
    assert describe_exit(-7) == "exit code -7 (signal SIGBUS)"
    assert describe_exit(-11) == "exit code -11 (signal SIGSEGV)"


def _run(code: str, timeout_s: float = 150) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=timeout_s, env=env
    )


def test_real_tokio_runtime_is_detected(tmp_path):
    pytest.importorskip("obstore")
    (tmp_path / "x").write_bytes(b"abc")
    r = _run(f"""
        import obstore
        from obstore.store import LocalStore
        from stoker._procs import fork_hazards
        assert fork_hazards() == [], fork_hazards()
        assert bytes(obstore.get(LocalStore({str(tmp_path)!r}), "x").bytes()) == b"abc"
        print(fork_hazards())
    """)
    assert r.returncode == 0, r.stderr
    assert "tokio runtime thread" in r.stdout
    assert fork_hazards() == []  # the pytest process itself never starts one


def test_epoch_completes_after_the_user_ran_obstore(s3_packed, tmp_path):
    """The training script used obstore itself (a tokio runtime with live threads) before making the
    Loader, whose workers and prefetcher read the S3 origin through obstore too: forked, they hung
    (or the trainer died by SIGSEGV); now they are started by a forkserver and the epoch completes."""
    pytest.importorskip("obstore")
    url, opts = s3_packed
    (tmp_path / "x").write_bytes(b"abc")
    r = _run(f"""
        import obstore, stoker
        from obstore.store import LocalStore
        obstore.get(LocalStore({str(tmp_path)!r}), "x").bytes()  # the user's own runtime
        if __name__ == "__main__":
            ds = stoker.open_dataset({url!r}, storage_options={opts!r}, cache_dir={str(tmp_path / "c")!r},
                                     cache_bytes=64 << 20)
            with stoker.Loader(ds, batch_size=16, num_workers=1, transform="eval",
                               image=stoker.ImageOptions(image_size=32), run=stoker.RunOptions(timeout_s=40)) as ld:
                n = sum(len(labels) for _, labels in ld)
                print("samples", n, len(ds), ld.start_method)
    """)
    assert r.returncode == 0, r.stderr[-3000:]
    words = r.stdout.split()
    assert words[0] == "samples" and words[1] == words[2] == "120", r.stdout
    assert words[3] == "forkserver"
    assert "instead of fork" in r.stderr and "tokio" in r.stderr
