"""How old the extender's cache state is, and a state source that refreshes off the request path.

A cache state (the form :func:`stoker.cluster.extender.scoring.check_state` reads) says when it was
gathered: ``"time"``, Unix seconds (:func:`stoker.cluster.service.warmup.cluster_state` writes it; a
state file without it is as old as the file's modification time). Past ``max_age_s`` a state
says nothing about the nodes any more (a node's cache may have been wiped, its service gone):
the extender then gives no preference, and fails ``require-cache`` pods with an error, instead
of trusting it. Standard library only.
"""

from __future__ import annotations

import logging
import math
import threading
import time

log = logging.getLogger(__name__)

#: Default age (seconds) past which the extender no longer trusts a cache state: six refreshes
#: of the live source (10 s each), or a CronJob running every minute that missed one run.
MAX_AGE_S = 60.0


#: How far (seconds) a state's ``"time"`` may be ahead of this clock (clocks of two hosts differ a
#: little); a later one is refused, since a state from the future would never grow old.
FUTURE_SKEW_S = 300.0


def check_time(t, source: str = "cache state", now_s: float | None = None) -> None:
    """Raise ValueError naming ``source`` unless ``t`` is None or a finite number of Unix seconds
    at most :data:`FUTURE_SKEW_S` ahead of now."""
    if t is None:
        return
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t):
        raise ValueError(f"{source}: 'time' must be Unix seconds (a finite number), got {t!r:.60}")
    now = time.time() if now_s is None else now_s
    if t > now + FUTURE_SKEW_S:
        raise ValueError(
            f"{source}: 'time' {t!r} is {t - now:.0f} s in the future (more than the "
            f"{FUTURE_SKEW_S:g} s allowed for clock skew): such a state would never grow old"
        )


def state_age_s(state: dict, now_s: float | None = None) -> float | None:
    """Seconds since ``state["time"]`` (Unix seconds), or None when the state carries no time."""
    t = state.get("time")
    if isinstance(t, bool) or not isinstance(t, (int, float)):
        return None
    return max(0.0, (time.time() if now_s is None else now_s) - float(t))


def is_stale(state: dict, max_age_s: float | None) -> bool:
    """Whether ``state`` is older than ``max_age_s`` seconds (None: never stale; a state without
    a time is not judged)."""
    age = state_age_s(state)
    return max_age_s is not None and age is not None and age > max_age_s


def refreshing(fetch, ttl_s: float = 10.0, name: str = "stoker-state-refresh"):
    """A state source that never blocks its caller: a daemon thread calls ``fetch()`` (returning
    a cache state) every ``ttl_s`` seconds and the source answers with the last state it got,
    stamped with the time it was fetched (``"time"``, unless ``fetch`` set one), or
    ``{"nodes": {}, "time": 0}`` (stale at once) before the first. A ``fetch`` that fails is
    logged and tried again ``ttl_s`` later; one that hangs holds only its thread, and the state
    it left grows old (see :func:`is_stale`). Returns the callable; its ``stop()`` ends the thread
    after its current fetch."""
    box = {"state": {"nodes": {}, "time": 0.0}}
    done = threading.Event()

    def loop():
        while not done.is_set():
            t = time.time()
            try:
                state = dict(fetch())
                state.setdefault("time", t)
                box["state"] = state
            except Exception as exc:  # noqa: BLE001 - keep the last state; it ages
                log.warning("cache state refresh failed: %s: %s", type(exc).__name__, exc)
            done.wait(ttl_s)

    def get() -> dict:
        return box["state"]

    get.stop = done.set  # type: ignore[attr-defined]  # the caller's handle to end the refresh thread
    threading.Thread(target=loop, name=name, daemon=True).start()
    return get
