"""Ctrl-C and the Loader's processes: the training process alone turns SIGINT into one
KeyboardInterrupt.

A terminal sends SIGINT to its whole foreground process group, so the decode workers and the
prefetcher get every Ctrl-C the training process gets. They ignore it: the training process
decides (its KeyboardInterrupt ends the epoch, and its exit or ``close()`` stops them), so one
Ctrl-C gives one traceback, and a caught one leaves every worker as it was, with no batch
failed by the interrupt. The handler is set in the child's first line, so a Ctrl-C that comes
while a child starts must not reach it before: SIGINT is blocked in the starting thread around
``Process.start()`` (:func:`blocked`), the child inherits the blocked mask (fork, spawn and the
forkserver started then all keep it), ignores SIGINT and only then unblocks it
(:func:`ignore_in_child`); a SIGINT pending meanwhile is dropped. The training process gets its
own at once when the block ends.

Signal handlers set from Python in the training process are not the children's either: a
framework's SIGTERM handler (PyTorch Lightning installs one that joins a collective on the
training process's process group) would run in a forked worker that is terminated at exit and
block it there for good. :func:`ignore_in_child` sets every handler the child inherited from
Python back to the default, SIGTERM's included, so a SIGTERM ends a worker or the prefetcher
at once whatever framework started it.

A KeyboardInterrupt in the training process can land in the middle of reading a worker's reply
from its pipe, which would leave the rest of that message in the pipe, read later as a new one.
The few lines that read replies run under :func:`held`: a SIGINT there is held until the block
ends and raised then, as it would have been. ``close()`` runs under it too, so a second Ctrl-C
never stops a close halfway (processes or shared memory left): it is raised once the close is
done, or dropped when the close is itself the work of a KeyboardInterrupt (an ``except
KeyboardInterrupt`` or a ``with`` block it is leaving) or of a finalizer at exit.
"""

from __future__ import annotations

import contextlib
import signal
import threading

__all__ = ["blocked", "held", "ignore_in_child", "reset_inherited_handlers"]

#: blocked around a child's start: SIGTERM too, so that an inherited handler never runs in the child
_STARTING = {signal.SIGINT, signal.SIGTERM}


@contextlib.contextmanager
def blocked():
    """Block SIGINT and SIGTERM in the calling thread inside the block (children started there
    inherit the blocked mask); one that came meanwhile is delivered when it ends."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, _STARTING)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def ignore_in_child() -> None:
    """The first thing a worker or prefetch process does: ignore SIGINT, set every other handler
    inherited from Python (SIGTERM's above all) back to the default, then unblock SIGINT (a pending
    one is dropped) and SIGTERM (a pending one ends the process now), see the module docstring."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    reset_inherited_handlers()
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _STARTING)


def reset_inherited_handlers() -> None:
    """Set SIGTERM, and every other signal whose handler is a Python function (one a framework
    set in the process this one was forked from), except SIGINT, to the default action. Only in
    the main thread (Python sets handlers nowhere else)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in signal.valid_signals():
        if sig == signal.SIGINT:
            continue
        try:
            handler = signal.getsignal(sig)
        except (OSError, ValueError):
            continue
        if sig == signal.SIGTERM or callable(handler):
            signal.signal(sig, signal.SIG_DFL)


@contextlib.contextmanager
def held(deliver: bool = True):
    """Hold a SIGINT that arrives inside the block and hand it to the handler that was in place
    when the block ends (a KeyboardInterrupt raised there, not halfway through the block), or,
    with ``deliver=False``, drop it (a Ctrl-C during the ``close()`` that an earlier Ctrl-C's
    KeyboardInterrupt is already running: stopping is what both asked for, and a second
    traceback says nothing new). Only in the main thread, where Python runs signal handlers, and
    only over a handler set from Python; elsewhere the block runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.getsignal(signal.SIGINT)
    if not callable(old):  # SIG_IGN, SIG_DFL or a handler not set from Python: nothing to hold
        yield
        return
    frames: list = []
    signal.signal(signal.SIGINT, lambda signum, frame: frames.append(frame))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)
        if frames and deliver:
            old(signal.SIGINT, frames[0])
