"""A worker that cannot start is not restarted as if it had crashed: the training process raises
one WorkerStartError naming the cause (a script without the ``__main__`` guard under spawn, code
fed on stdin, a function a spawned worker cannot rebuild), with one traceback, its own."""

from __future__ import annotations

import operator
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from _helpers import in_child
from stoker import Loader, RunOptions, StokerError, WorkerError, open_dataset

#: Training code at the top level of a script: no ``if __name__ == "__main__":`` guard.
UNGUARDED = """
import sys
from stoker import ImageOptions, Loader, RunOptions, open_dataset
ds = open_dataset({packed!r}, cache_dir={cache!r}, cache_bytes=64 << 20)
ld = Loader(ds, 8, num_workers=2, image=ImageOptions(image_size=32), run=RunOptions(start_method="spawn"))
print(sum(len(y) for _, y in ld), flush=True)
"""


def _run(args: list, cwd: str, stdin: str | None = None) -> tuple[int, str, str]:
    p = subprocess.Popen(
        [sys.executable, *args],
        stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=cwd,
        start_new_session=True,
    )
    try:
        out, err = p.communicate(stdin, timeout=120)  # a guard against a hang, not a speed limit
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
    return p.returncode, out, err


def _last_line(err: str) -> str:
    return [line for line in err.splitlines() if line.strip() and not line.startswith(" ")][-1]


def test_spawn_without_the_main_guard_fails_once_naming_the_guard(packed_local, tmp_path):
    script = tmp_path / "train.py"
    script.write_text(UNGUARDED.format(packed=packed_local, cache=str(tmp_path / "cache")))
    rc, out, err = _run([str(script)], str(tmp_path))
    assert rc == 1 and out == "", err
    assert err.count("Traceback (most recent call last)") == 1, err  # the training process's only
    assert "bootstrapping phase" not in err and "starting a new worker" not in err, err
    last = _last_line(err)
    assert last.startswith("stoker.errors.WorkerStartError: "), last
    assert 'if __name__ == "__main__":' in last and str(script) in last and "'spawn'" in last, last


def test_code_fed_on_stdin_under_spawn_is_refused_at_construction(packed_local, tmp_path):
    code = UNGUARDED.format(packed=packed_local, cache=str(tmp_path / "cache"))
    rc, out, err = _run(["-"], str(tmp_path), stdin=code)
    assert rc == 1 and out == "", err
    assert err.count("Traceback (most recent call last)") == 1, err
    last = _last_line(err)
    assert last.startswith("stoker.errors.WorkerStartError: ") and "stdin" in last, last
    assert 'File "<stdin>", line 5, in <module>' in err and "in __init__" in err  # Loader(...), not iter()


class RebuildFails:
    """A decode that pickles but cannot be rebuilt in a spawned worker (1 / 0 while unpickling)."""

    def __call__(self, fields, rng):
        return np.zeros(1)

    def __reduce__(self):
        return operator.truediv, (1, 0)


def _unbuildable(packed: str) -> tuple:
    ds = open_dataset(packed, cache=False)
    ld = Loader(ds, 8, num_workers=2, decode=RebuildFails(), run=RunOptions(start_method="spawn"))
    try:
        next(iter(ld))
    except StokerError as exc:
        return type(exc).__name__, isinstance(exc, WorkerError), str(exc)
    finally:
        ld.close()
    return None


def test_a_worker_that_fails_while_starting_names_its_error_and_is_not_restarted(packed_local):
    name, is_worker_error, msg = in_child(_unbuildable, packed_local, timeout_s=100)
    assert name == "WorkerStartError" and is_worker_error, msg
    assert "before it had started (not restarted" in msg and "ZeroDivisionError" in msg, msg


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_the_start_failure_words_name_the_cause(method):
    from stoker._procs import EXIT_UNGUARDED_MAIN
    from stoker.loader.workers.launch import start_failure

    guard = start_failure("worker 0 (pid 9)", EXIT_UNGUARDED_MAIN, method)
    assert 'if __name__ == "__main__":' in guard and repr(method) in guard
    own = start_failure("worker 0 (pid 9)", 1, method, "OSError: no such bucket")
    assert own.endswith("OSError: no such bucket") and "exit code 1" in own
