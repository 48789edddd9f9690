"""Process liveness, for finding what dead processes left behind (temporary fills, batch slots)."""
from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """True if process ``pid`` exists and is not a zombie (a killed process whose parent has not
    reaped it yet still answers ``kill(pid, 0)``). A pid we may not signal counts as alive."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except (OSError, IndexError):
        return True


def exit_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its parent dies (Linux prctl
    PR_SET_PDEATHSIG). Workers call it first thing, so a training process killed with
    SIGKILL does not leave its workers running. No-op where unsupported; the workers
    also poll :func:`parent_gone`."""
    try:
        import ctypes
        import signal
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        pass


def parent_gone(parent_pid: int) -> bool:
    """True once the process that started us has exited (we were re-parented)."""
    return os.getppid() != parent_pid


class SharedCell:
    """One cell of a shared int64 array, with a ``.value`` like mp.Value (picklable to workers)."""

    def __init__(self, arr, i: int):
        self.arr, self.i = arr, i

    @property
    def value(self) -> int:
        return self.arr[self.i]

    @value.setter
    def value(self, v: int) -> None:
        self.arr[self.i] = v
