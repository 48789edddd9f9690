"""Process liveness, for finding what dead processes left behind (temporary fills, batch slots)."""

from __future__ import annotations

import ctypes
import os
import signal
import sys

from .errors import ForkUnsafeError  # noqa: F401 - re-exported


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
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        pass


def parent_gone(parent_pid: int) -> bool:
    """True once the process that started us has exited (we were re-parented)."""
    return os.getppid() != parent_pid


#: Name prefixes of threads (Linux ``/proc/self/task/*/comm``, at most 15 characters) that belong to
#: runtimes a forked child cannot use: tokio's workers ("tokio-rt-worker", "tokio-runtime-w"), as
#: started by obstore and other Rust extensions. A child forked from such a process inherits the
#: runtime's locks and state but none of its threads, so its first call into the runtime hangs or
#: crashes (tokio documents that a runtime must not be used across fork).
FORK_UNSAFE_THREADS = ("tokio-",)


def thread_names() -> list[str]:
    """Names of this process's threads as the kernel has them (``/proc/self/task/*/comm``);
    empty where /proc is not available."""
    names: list[str] = []
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return names
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # the thread ended meanwhile
            continue
    return names


def fork_hazards() -> list[str]:
    """Why forking this process now is unsafe: one line per cause, empty if none is known.

    Looks at the threads alive now, whoever started them (:data:`FORK_UNSAFE_THREADS`), and at
    whether stoker itself read through obstore in this process (:mod:`stoker.storage._native_s3`).
    """
    out = []
    bad = sorted(n for n in thread_names() if n.startswith(FORK_UNSAFE_THREADS))
    if bad:
        out.append(
            f"{len(bad)} tokio runtime thread(s) running in this process ({', '.join(sorted(set(bad)))}; "
            "obstore or another Rust extension started them)"
        )
    native = sys.modules.get("stoker.storage._native_s3")
    if native is not None and os.getpid() in getattr(native, "_USED_IN_PID", ()):
        out.append("stoker read through obstore in this process")
    return out


def pick_start_method(requested: str | None, available: list[str]) -> tuple[str, list[str]]:
    """The multiprocessing start method for stoker's worker and prefetch processes, and the
    fork hazards found (:func:`fork_hazards`).

    ``requested=None``: ``fork`` (cheap, no ``__main__`` re-import: torch's DataLoader default)
    unless a hazard is found, then ``forkserver`` (a clean single-threaded server forks the
    children), else ``spawn``. An explicit method is kept.

    Raises:
        ForkUnsafeError: ``requested == "fork"`` and a hazard is found.
    """
    hazards = fork_hazards() if requested in (None, "fork") and "fork" in available else []
    if requested is not None:
        if requested == "fork" and hazards:
            raise ForkUnsafeError(
                "start_method='fork' is unsafe here: "
                + "; ".join(hazards)
                + ". A forked worker would hang or crash: use start_method='forkserver' or "
                "'spawn', or None to let stoker choose"
            )
        return requested, hazards
    if "fork" not in available:
        return "spawn", []
    if not hazards:
        return "fork", []
    return ("forkserver" if "forkserver" in available else "spawn"), hazards


def describe_exit(exitcode: int | None) -> str:
    """A process's exit as words: ``"exit code 1"``, ``"exit code -7 (signal SIGBUS)"``."""
    if exitcode is None or exitcode >= 0:
        return f"exit code {exitcode}"
    try:
        name = signal.Signals(-exitcode).name
    except ValueError:
        name = str(-exitcode)
    return f"exit code {exitcode} (signal {name})"
