"""Process liveness, for finding what dead processes left behind (temporary fills, batch slots)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
from collections.abc import Iterator

from .errors import ForkUnsafeError, WorkerStartError  # noqa: F401 - ForkUnsafeError re-exported


def stat_fields(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (index 0: the state, field 3 of
    proc(5); so field ``k`` is at ``k - 3``), or None: no such process, or no /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


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
    fields = stat_fields(pid)
    return fields is None or fields[0] not in ("Z", "X")


def left_by_dead(directory: str, prefix: str) -> Iterator[tuple[str, os.stat_result]]:
    """``(path, lstat result)`` of each entry of ``directory`` named ``<prefix><pid>-...`` that
    belongs to this user and whose process ``pid`` is gone (what a process killed before its
    clean-up left); nothing when the directory cannot be listed. Other names, other users'
    entries and those of live processes are left out; an entry that vanishes meanwhile too."""
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        pid, dash, _ = name[len(prefix) :].partition("-")
        if not name.startswith(prefix) or not dash or not pid.isdigit():
            continue
        path = os.path.join(directory, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if st.st_uid == os.getuid() and not pid_alive(int(pid)):
            yield path, st


def exit_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its parent dies (Linux prctl
    PR_SET_PDEATHSIG). Workers call it first thing, so a training process killed with
    SIGKILL does not leave its workers running. No-op where unsupported; the workers
    also poll :func:`parent_gone`."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG = 1


def _start_ticks(pid: int) -> int | None:
    """When live process ``pid`` started (clock ticks after boot, ``/proc/<pid>/stat`` field
    22), or None: no such process, or a zombie."""
    fields = stat_fields(pid)
    return None if fields is None or fields[0] in ("Z", "X") else int(fields[19])


def parent_identity() -> tuple[int, int | None]:
    """The process this multiprocessing child serves, as :func:`parent_gone` watches it:
    ``(pid, start time)`` of the process that started it (``multiprocessing.parent_process()``:
    the training process under every start method), the start time telling a reused pid apart.

    Not the OS parent: under ``forkserver`` that is the fork server, which lives on while any of
    its children does (each keeps a copy of the server's "alive" pipe, as CPython's forkserver
    module hands it to them), so a worker that watched it outlived a training
    process ended by SIGTERM or SIGKILL, and kept the fork server alive in turn.
    """
    import multiprocessing

    parent = multiprocessing.parent_process()
    pid = parent.pid if parent is not None and parent.pid else os.getppid()
    return pid, _start_ticks(pid)


def parent_gone(parent: tuple[int, int | None]) -> bool:
    """True once the process of :func:`parent_identity` has exited (a zombie counts as exited;
    a new process under its pid is not it). Without /proc: whether the pid is gone."""
    pid, start = parent
    if not os.path.isdir("/proc"):
        return not pid_alive(pid)
    now = _start_ticks(pid)
    return now is None or now != start


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


#: Exit code of a stoker worker or prefetch process that found itself running the user's main
#: script again while it starts (spawn and forkserver import ``__main__`` again in every child): a
#: script without the ``if __name__ == "__main__":`` guard, whose training code would start a
#: Loader of its own in each child. The child exits at once and quietly with this code, and the
#: training process names the cause (:func:`stoker.loader.workers.launch.start_failure`).
EXIT_UNGUARDED_MAIN = 87
#: Names of stoker's worker and prefetch processes (``multiprocessing.Process.name``): the
#: workers' start with the first, the prefetcher's is the second.
PROCESS_NAMES = ("stoker-worker-", "stoker-prefetch")


def importing_main_in_child() -> bool:
    """True in a stoker worker or prefetch process that runs the user's training code: only the
    import of the main script that spawn/forkserver children make before their own start runs
    it (stoker's processes never start a Loader themselves). The process name is set before
    that import (``multiprocessing.spawn.prepare``)."""
    import multiprocessing as mp

    name = mp.current_process().name
    return name.startswith(PROCESS_NAMES[0]) or name == PROCESS_NAMES[1]


def exit_quietly(code: int) -> None:
    """End this process now with ``code``, output flushed, no traceback and no clean-up of the
    parent's objects (for a child that must not run the user's code any further)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            if stream is not None:
                stream.flush()
    os._exit(code)


def main_module_name() -> str:
    """The user's main module in words: its file, its module name (``python -m``), or what it is
    when neither exists (code fed on stdin, ``python -c``, an interactive session, a notebook)."""
    main = sys.modules.get("__main__")
    spec_name = getattr(getattr(main, "__spec__", None), "name", None)
    if spec_name:
        return f"module {spec_name}"
    path = getattr(main, "__file__", None)
    if path:
        return os.path.abspath(path)
    return "a __main__ with no file (code fed on stdin, python -c, an interactive session or a notebook)"


def _main_file() -> str | None:
    """The file ``multiprocessing.spawn`` runs again as the main module in each child, or None
    when it imports none (``python -m`` imports by name; ``python -c`` and interactive sessions
    have no ``__file__``)."""
    main = sys.modules.get("__main__")
    if getattr(getattr(main, "__spec__", None), "name", None):
        return None
    path = getattr(main, "__file__", None)
    if path is None:
        return None
    import multiprocessing.process

    base = getattr(multiprocessing.process, "ORIGINAL_DIR", None)  # what spawn joins a relative path to
    return os.path.normpath(path if os.path.isabs(path) or base is None else os.path.join(base, path))


def main_importable() -> bool:
    """Whether a child started with spawn or forkserver can import this process's ``__main__``
    again (by its module name or its file, as ``multiprocessing.spawn`` does), so that functions
    defined there reach it: not for code fed on stdin, ``python -c``, an interactive session or a
    notebook."""
    main = sys.modules.get("__main__")
    if getattr(getattr(main, "__spec__", None), "name", None):
        return True
    path = _main_file()
    return path is not None and os.path.isfile(path)


def check_main_for(method: str) -> None:
    """Refuse a start method whose children cannot start at all from this ``__main__``: spawn and
    forkserver children run the main module's file again, and code fed on stdin (``python -``)
    has a ``__file__`` (``<stdin>``) that is no file, so every child would die starting.

    Raises:
        WorkerStartError: ``method`` is spawn or forkserver and ``__main__`` names a file that
            does not exist; says what to do.
    """
    if method == "fork":
        return
    path = _main_file()
    if path is not None and not os.path.exists(path):
        raise WorkerStartError(
            f"worker processes started with {method!r} cannot start here: each imports the main module "
            f"again from its file, and this one's is {path!r}, which does not exist (code fed on stdin?). "
            "Save the code to a file and run that, or use RunOptions(start_method='fork')"
        )


def dumpable() -> bool:
    """Whether this process is dumpable (Linux ``PR_GET_DUMPABLE``): only then may other processes
    of the same user open its descriptors through ``/proc/<pid>/fd/<n>``. False where unknown."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(3, 0, 0, 0, 0) == 1  # PR_GET_DUMPABLE = 3
    except (OSError, AttributeError):
        return False
