"""Starting the Loader's processes, and what is said when one dies.

Start method: :func:`stoker._procs.pick_start_method` (``fork`` unless the training process runs
threads that a forked child cannot live with, then ``forkserver``), chosen again when a pipeline
starts (threads may have appeared since the Loader was built); replacements use the same one.
A dead worker or prefetcher is named with its pid and its exit code or signal; one killed by
SIGBUS is pointed at the shared-memory directory (a full ``/dev/shm`` is the usual cause).

Every process is started with SIGINT blocked (:func:`start`, :mod:`.interrupts`). One that exits
before its own start is done (it never counted itself ready) is not replaced: it would exit the
same way again (one killed by a signal then is replaced as any other death).
:func:`start_failure` names the cause: the main script imported again by a spawn/forkserver
child without the ``if __name__ == "__main__":`` guard, a ``__main__`` such a child cannot
import, or the child's own error.
The parts that own the processes: :class:`stoker.loader.workers.pool.WorkerPool` and
:class:`stoker.loader.prefetch.prefetcher.Prefetcher`.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import signal
import time

from ..._procs import (
    EXIT_UNGUARDED_MAIN,
    check_main_for,
    describe_exit,
    main_importable,
    main_module_name,
    pick_start_method,
)
from ..shm import free_bytes, shm_base
from . import interrupts

log = logging.getLogger(__name__)

__all__ = [
    "FORKSERVER_PRELOAD",
    "READY_TIMEOUT_S",
    "abandon",
    "died",
    "start",
    "start_context",
    "start_failure",
    "wait_ready",
]

#: Modules the forkserver imports once, so that each child it forks starts with them loaded.
FORKSERVER_PRELOAD = [
    "stoker.loader.workers.worker",
    "stoker.decode",
    "stoker.loader.prefetch.process",
    "stoker.loader.prefetch.loop",
    "stoker.loader.prefetch.fills",
]
#: Most seconds a start waits for the processes to finish their own start (spawn or forkserver
#: children import stoker and torch: seconds on a loaded machine).
READY_TIMEOUT_S = 30.0


def start_context(asked: str | None, cfg):
    """The multiprocessing context to start the processes with.

    Args:
        asked: the start method the user asked for (None: chosen here).
        cfg: the :class:`stoker.loader.options.WorkerConfig` the workers get; its user functions
            must pickle under the method chosen.

    Returns:
        (context, start method name, fork hazards of this process: a list of strings).

    Raises:
        ForkUnsafeError: ``asked == "fork"`` in a process where fork is unsafe.
        WorkerStartError: spawn/forkserver children could not start from this ``__main__``
            (code fed on stdin, :func:`stoker._procs.check_main_for`).
        TypeError: the user's decode/collate do not pickle (names the function).
    """
    method, hazards = pick_start_method(asked, mp.get_all_start_methods())
    if hazards and method != "fork":
        log.warning(
            "starting stoker's worker processes with %r instead of fork: %s. Each worker imports "
            'the main script again: keep the training code under `if __name__ == "__main__":`',
            method,
            "; ".join(hazards),
        )
    check_main_for(method)
    cfg.check_picklable(method)
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
    return ctx, method, hazards


def wait_ready(ready, procs: list, timeout_s: float = READY_TIMEOUT_S) -> None:
    """Wait until every process of ``procs`` has counted itself in ``ready`` (a shared int the
    processes increment once set up), so that their own start is counted in the pipeline's start
    (``pipeline_start_s``). Returns early when one has died (the epoch loop replaces or reports it)
    and after ``timeout_s`` seconds (the first epoch then starts with processes still starting:
    never a hang)."""
    deadline = time.monotonic() + timeout_s
    while ready.value < len(procs) and time.monotonic() < deadline:
        if not all(p.is_alive() for p in procs):
            return
        time.sleep(0.002)


def start(proc) -> None:
    """``proc.start()`` with SIGINT blocked in this thread meanwhile (:mod:`.interrupts`)."""
    with interrupts.blocked():
        proc.start()


def start_failure(what: str, exitcode: int | None, method: str, detail: str | None = None) -> str:
    """Why ``what`` (a process that exited before its own start was done) could not start, in words.

    Args:
        what: the process, e.g. ``"worker 0 (pid 123)"``.
        exitcode: its exit code.
        method: the start method it was started with.
        detail: its own error (type, message and traceback) when it could send one.
    """
    if exitcode == EXIT_UNGUARDED_MAIN:
        return (
            f"{what} could not start: it ran the training code of the main script "
            f"({main_module_name()}) again. Processes started with {method!r} import the main script "
            'again, and a script without the `if __name__ == "__main__":` guard starts a Loader at '
            'import. Put the training code under `if __name__ == "__main__":`, or use '
            "RunOptions(start_method='fork')"
        )
    msg = f"{what} {died('', exitcode).strip()} before it had started (not restarted: it would fail again)"
    if detail:
        return msg + f": {detail}"
    if method != "fork" and not main_importable():
        return msg + (
            f". Processes started with {method!r} import the main module again, and {main_module_name()} "
            "cannot be imported: run the code from a file, or use RunOptions(start_method='fork')"
        )
    if method != "fork":
        return msg + (
            f". Processes started with {method!r} import the main module ({main_module_name()}) again "
            "first: its error, if it failed there, is above"
        )
    return msg + ": its error, if it wrote one, is above"


def died(what: str, exitcode: int | None) -> str:
    """``what`` died with ``exitcode``, in words, with the usual cause of a bus error."""
    msg = f"{what} died with {describe_exit(exitcode)}"
    if exitcode == -signal.SIGBUS:
        base = shm_base()
        msg += (
            f" (a bus error in stoker's processes usually means shared memory ran out: {base} has "
            f"{free_bytes(base)} bytes free)"
        )
    return msg


def abandon(q) -> None:
    """Close a queue of a dead process without waiting for its feeder thread (nobody reads it)."""
    with contextlib.suppress(OSError, ValueError):  # already closed
        q.cancel_join_thread()
        q.close()


def stop_processes(procs: list, deadline: float) -> None:
    """Join each process until ``deadline`` (``time.monotonic()``), then kill the ones still alive."""
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(1)
