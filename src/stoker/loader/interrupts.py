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

A KeyboardInterrupt in the training process can land in the middle of reading a worker's reply
from its pipe, which would leave the rest of that message in the pipe, read later as a new one.
The few lines that read replies run under :func:`held`: a SIGINT there is held until the block
ends and raised then, as it would have been.
"""

from __future__ import annotations

import contextlib
import signal
import threading

__all__ = ["blocked", "held", "ignore_in_child"]

_SIGINT = {signal.SIGINT}


@contextlib.contextmanager
def blocked():
    """Block SIGINT in the calling thread inside the block (children started there inherit the
    blocked mask); a SIGINT that came meanwhile is delivered when it ends."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, _SIGINT)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def ignore_in_child() -> None:
    """The first thing a worker or prefetch process does: ignore SIGINT, then unblock it (a
    pending one is dropped), see the module docstring."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _SIGINT)


@contextlib.contextmanager
def held():
    """Hold a SIGINT that arrives inside the block and hand it to the handler that was in place
    when the block ends (a KeyboardInterrupt raised there, not halfway through the block). Only
    in the main thread, where Python runs signal handlers, and only over a handler set from Python;
    elsewhere the block runs as it is."""
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
        if frames:
            old(signal.SIGINT, frames[0])
