"""A start gate for the ranks of a benchmark job: every rank waits until all have arrived.

Synchronous data-parallel training starts an epoch on every rank together (the first step's
all-reduce holds the early ranks back), but Ray starts a job's tasks one after another, and on a
loaded machine the last rank can start seconds after the first. A benchmark that times each
rank from its own task start then measures Ray's task start-up as much as the data path, and the
early ranks read while the late ones are still being started. ``stoker bench cluster --netns``
passes every rank of a job through one gate before it starts its clock, so an epoch's seconds
are the data path's, from a common start (within the gate's release, a few milliseconds).

The gate is a Ray async actor (one per benchmark driver, no CPU reserved): ``wait(key, parties)``
returns when ``parties`` calls with the same ``key`` have arrived.
"""

from __future__ import annotations

import asyncio
import time


class StartGate:
    """Ray async actor body (wrap with ``ray.remote``): a reusable barrier per key."""

    def __init__(self) -> None:
        self._arrived: dict[str, int] = {}
        self._open: dict[str, asyncio.Event] = {}

    async def wait(self, key: str, parties: int) -> float:
        """Return (unix seconds of the release) once ``parties`` callers have called with ``key``.
        Raises ValueError for ``parties < 1``."""
        if parties < 1:
            raise ValueError(f"a gate needs at least one party, got {parties}")
        event = self._open.setdefault(key, asyncio.Event())
        self._arrived[key] = self._arrived.get(key, 0) + 1
        if self._arrived[key] >= parties:
            event.set()
        await event.wait()
        return time.time()


def start_gate():
    """A :class:`StartGate` actor on this driver's node (needs ``ray.init()`` first)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node = ray.get_runtime_context().get_node_id()
    return (
        ray.remote(StartGate)
        .options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False))
        .remote()
    )


def pass_gate(gate, key: str, parties: int, timeout_s: float) -> float:
    """Wait at ``gate`` (an actor from :func:`start_gate`, or None: no wait) until ``parties``
    ranks have arrived with ``key``. Returns the unix seconds of the release (now, without a
    gate). Raises ``ray.exceptions.GetTimeoutError`` after ``timeout_s`` seconds (a rank that
    never arrived, e.g. one that failed before its epoch)."""
    if gate is None:
        return time.time()
    import ray

    return float(ray.get(gate.wait.remote(key, parties), timeout=timeout_s))
