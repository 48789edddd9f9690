"""Clean exit inside a training framework: a SIGTERM handler the framework set in the training
process (PyTorch Lightning sets one that joins a collective) is not the workers' or the
prefetcher's, and a script that never calls ``close()`` exits by itself with a half-iterated
epoch, printing nothing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from _helpers import in_child
from stoker import ImageOptions, Loader, RunOptions, open_dataset


def _caught_signals(pid: int) -> int:
    """The bitmask of signals ``pid`` catches (``SigCgt`` in /proc/<pid>/status)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("SigCgt:"):
                return int(line.split()[1], 16)
    raise AssertionError(f"no SigCgt for {pid}")


def _children_catch_sigterm(packed: str, cache: str, method: str) -> dict:
    """A Python SIGTERM handler in the training process, then a Loader with workers and a
    prefetcher: which of its processes catch SIGTERM."""
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    ds = open_dataset(packed, cache_dir=cache, cache_bytes=64 << 20)
    with Loader(ds, 8, num_workers=2, image=ImageOptions(image_size=32), run=RunOptions(start_method=method)) as ld:
        next(iter(ld))
        pids = ld.processes.pids()
        bit = 1 << (signal.SIGTERM - 1)
        return {
            "me": bool(_caught_signals(os.getpid()) & bit),
            "children": {p: bool(_caught_signals(p) & bit) for p in pids},
        }


def test_workers_and_prefetcher_reset_an_inherited_sigterm_handler(packed_local, tmp_path):
    out = in_child(_children_catch_sigterm, packed_local, str(tmp_path / "cache"), "fork", timeout_s=120)
    assert out["me"]  # the training process keeps its own handler
    assert len(out["children"]) == 3  # 2 workers and the prefetcher
    assert not any(out["children"].values()), out


#: A script as a framework runs it: a SIGTERM handler that blocks (Lightning's joins a collective
#: the workers never reach), workers forked after it, an epoch left half-iterated, no close(). A
#: ``weakref.finalize`` made before multiprocessing is imported (as some of a framework's imports
#: do) puts the interpreter's finalizer hook after multiprocessing's exit function, which then
#: terminates and joins the workers before any Loader finalizer runs.
BLOCKING_HANDLER = """
import signal, sys, time, weakref
class Early:
    pass
early = Early()
weakref.finalize(early, lambda: None)
def handler(signum, frame):
    time.sleep(300)
signal.signal(signal.SIGTERM, handler)
from stoker import ImageOptions, Loader, RunOptions, open_dataset
ds = open_dataset(sys.argv[1], cache_dir=sys.argv[2], cache_bytes=64 << 20)
ld = Loader(ds, 8, num_workers=int(sys.argv[3]), image=ImageOptions(image_size=32),
            run=RunOptions(start_method=sys.argv[4]))
it = iter(ld)
next(it)
print("exiting", flush=True)
"""


def _run_script(script: str, *args: str, timeout_s: float = 90) -> subprocess.CompletedProcess:
    p = subprocess.Popen(
        [sys.executable, "-c", script, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = p.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        raise AssertionError(f"the script did not exit by itself within {timeout_s:g} s: {out}\n{err}") from None
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def test_a_framework_sigterm_handler_does_not_hang_the_exit(packed_local, tmp_path):
    done = _run_script(BLOCKING_HANDLER, packed_local, str(tmp_path / "cache"), "2", "fork")
    assert done.returncode == 0 and done.stdout.strip() == "exiting", done
    assert done.stderr.strip() == "", done.stderr


def test_a_half_iterated_epoch_at_exit_prints_nothing(packed_local, tmp_path):
    for workers in ("0", "2"):
        done = _run_script(BLOCKING_HANDLER, packed_local, str(tmp_path / "cache"), workers, "forkserver")
        assert done.returncode == 0 and done.stdout.strip() == "exiting", done
        assert done.stderr.strip() == "", (workers, done.stderr)


def _close_after_an_interrupted_wait() -> dict:
    """A decode thread whose wait a Ctrl-C interrupted (its batch goes on for 1 s), then closed."""
    import threading
    import time

    from stoker.loader.workers.inline import DecodeThread

    dt = DecodeThread()
    assert dt.run(lambda cell: 1, (), timeout_s=10) == 1
    threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT)).start()
    try:
        dt.run(lambda cell: time.sleep(1.0), (), timeout_s=10)
    except KeyboardInterrupt:
        interrupted = True
    else:
        interrupted = False
    threads = [t for t in threading.enumerate() if t.name.startswith("stoker-decode-")]
    dt.close()
    return {"interrupted": interrupted, "dropped": dt.dropped, "alive": [t.is_alive() for t in threads]}


def test_close_waits_for_the_decode_thread_to_end_its_batch():
    """A Loader without workers decodes on a thread of the training process, whose thread-local
    torch scratch buffers (decode/resample.py) are freed when it ends. The exit hook closes a
    Loader that was never closed just before the interpreter finalizes: a thread that ended after
    that freed them when it could no longer take the GIL, and the process aborted ("terminate
    called without an active exception", 1 run in ~100 under load). close() now returns only
    when its thread has ended, also when it was still decoding a batch nobody waits for."""
    out = in_child(_close_after_an_interrupted_wait, timeout_s=60)
    assert out["interrupted"] and out["dropped"], out
    assert out["alive"] == [False], out
