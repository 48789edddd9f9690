"""A job's ranks on Ray: reserved together on their nodes, watched, and ended together.

What each part does is in this folder's README.md and the functions' docstrings. :func:`reserve`
holds each rank's bundle on its node by the node-id label (``bundle_label_selector``); a placement
group is reserved all at once or not at all (Ray's gang scheduling), so the ranks start together.
A rank stamps the error that ended it with the time (:func:`stamp_failure`) before it tears its
process group down, so when a rank's failure makes its peers' collectives fail too,
:func:`gather` raises the error that came first, not the first one Ray happened to report.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time

import ray
from ray.util import placement_group, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from ...errors import CapacityError
from ..capacity import rank_slots, refusal

log = logging.getLogger(__name__)

#: Attribute a rank sets on the error that ended it: when (unix seconds, :func:`stamp_failure`).
FAILED_AT = "stoker_failed_at"

#: Seconds the other ranks of a failed job get to end by themselves before they are cancelled:
#: a rank that failed first may still be tearing down (its process group, its peer connections) when a peer
#: whose collective failed because of it is reported.
SETTLE_S = 2.0

#: Ray's label that every node carries with its node id (placement-group bundles select on it).
NODE_ID_LABEL = "ray.io/node-id"


def stamp_failure(exc: BaseException) -> None:
    """Mark ``exc`` (the error that ends a rank) with the time now, as :data:`FAILED_AT`; an
    error that takes no attributes is left as it is."""
    with contextlib.suppress(AttributeError, TypeError):
        setattr(exc, FAILED_AT, time.time())


def _failed_at(exc: BaseException) -> float | None:
    """When a rank's error (or, for a ``RayTaskError``, its cause) was stamped; None if never."""
    for e in (exc, getattr(exc, "cause", None)):
        t = getattr(e, FAILED_AT, None)
        if isinstance(t, float):
            return t
    return None


def first_failure(refs: list, ref, exc: BaseException):
    """``(ref, error)`` of the rank that failed first, once the job is over: ``ref``/``exc`` is
    the first failure Ray reported; another rank of ``refs`` already done whose error was stamped
    earlier (:func:`stamp_failure`) replaces it. An unstamped ``exc`` (a crash, a dead node)
    stays: nothing says it came later."""
    best = _failed_at(exc)
    if best is None:
        return ref, exc
    done, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0)
    for other in done:
        if other == ref:
            continue
        try:
            ray.get(other, timeout=0)
        except Exception as e:  # noqa: BLE001 - every failure is a candidate; cancelled ones carry no stamp
            t = _failed_at(e)
            if t is not None and t < best:
                ref, exc, best = other, e, t
    return ref, exc


def free_resources(nodes: list[str]) -> dict[str, dict[str, float]]:
    """``{node id: {resource: free amount}}`` for ``nodes`` (Ray's units). From Ray's resource
    view of available resources; where that is not to be had, the nodes' totals
    (``ray.nodes()``), so a request larger than a node is still refused."""
    try:
        from ray._private.state import available_resources_per_node

        avail = available_resources_per_node()
    except Exception:  # noqa: BLE001 - a Ray without it: totals (capacity, not what is free)
        avail = {n["NodeID"]: dict(n.get("Resources", {})) for n in ray.nodes() if n.get("Alive")}
    return {n: {k: float(v) for k, v in avail.get(n, {}).items()} for n in nodes}


def total_resources(nodes: list[str]) -> dict[str, dict[str, float]]:
    """``{node id: {resource: total amount}}`` for ``nodes`` (``ray.nodes()``; a node not alive
    has none)."""
    tot = {n["NodeID"]: n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")}
    return {n: {k: float(v) for k, v in tot.get(n, {}).items()} for n in nodes}


def node_slots(
    nodes: list[str],
    request: dict[str, float],
    num_workers: int,
    slots_per_node: int | None,
    wait_s: float = 0.0,
    names: dict[str, str] | None = None,
) -> list[int]:
    """Ranks asking for ``request`` each node of ``nodes`` can take now (its free resources,
    :func:`stoker.cluster.capacity.rank_slots`, at most ``slots_per_node``), in the order of
    ``nodes``.

    Raises :class:`stoker.errors.CapacityError` at once when the nodes' total resources cannot
    hold ``num_workers`` ranks, and when their free resources still cannot after ``wait_s``
    seconds (other work, such as a job that just ended, may be giving its room back; polled every
    0.2 s). The message is :func:`stoker.cluster.capacity.refusal`'s (``names``: node id -> how it
    names the node), with the wait when there was one."""

    def fit(res: dict) -> dict:
        out = {n: rank_slots(res[n], request) for n in nodes}
        return out if slots_per_node is None else {n: min(k, int(slots_per_node)) for n, k in out.items()}

    total = total_resources(nodes)
    if sum(fit(total).values()) < num_workers:
        raise CapacityError(refusal(num_workers, request, total, fit(total), slots_per_node, "total", names))
    deadline = time.monotonic() + wait_s
    while True:
        free = free_resources(nodes)
        slots = fit(free)
        if sum(slots.values()) >= num_workers:
            return [slots[n] for n in nodes]
        if time.monotonic() >= deadline:
            waited = f" (waited {wait_s} s, the start timeout)" if wait_s > 0 else ""
            raise CapacityError(refusal(num_workers, request, free, slots, slots_per_node, "free", names) + waited)
        time.sleep(0.2)


def reserve(
    rank_nodes: list[str],
    request: dict[str, float],
    timeout_s: float,
    job: str = "job",
    names: list[str] | None = None,
):
    """Reserve ``request`` (a rank's resources, zero entries left out) on each rank's node
    (``rank_nodes``: node ids), all at once; returns the placement group (None when a rank asks
    for nothing: no reservation needed).

    Raises :class:`stoker.errors.CapacityError` when the reservation is not ready within
    ``timeout_s`` seconds (the placement group is removed first), naming the nodes as ``names``
    does (one per rank, :func:`stoker.cluster.identity.node_label`; None: the node ids).
    """
    if not request:
        return None
    pg = placement_group(
        [dict(request) for _ in rank_nodes],
        strategy="PACK",
        bundle_label_selector=[{NODE_ID_LABEL: n} for n in rank_nodes],
    )
    try:
        ray.get(pg.ready(), timeout=timeout_s)
    except (ray.exceptions.GetTimeoutError, ray.exceptions.RayError) as exc:
        remove_placement_group(pg)
        per_node: dict[str, int] = {}
        for n in rank_nodes if names is None else names:
            per_node[n] = per_node.get(n, 0) + 1
        raise CapacityError(
            f"job {job!r}: could not reserve {dict(request)} for each of {len(rank_nodes)} ranks "
            f"({', '.join(f'{k} on {_node_text(n)}' for n, k in per_node.items())}) within {timeout_s} s "
            f"(start timeout): other work holds the room; nothing was started ({type(exc).__name__})"
        ) from exc
    return pg


def release(pg) -> None:
    """Remove the placement group ``pg`` (None: nothing); a Ray that is gone is ignored."""
    if pg is None:
        return
    try:
        remove_placement_group(pg)
    except Exception as exc:  # noqa: BLE001 - Ray shut down: the group went with it
        log.debug("placement group not removed: %s", exc)


def task_options(rank: int, node_id: str, request: dict[str, float], pg) -> dict:
    """Ray task options of rank ``rank``: its resources, and its bundle of ``pg`` (or, without a
    reservation, hard affinity to ``node_id``); never retried (a rank is not run twice)."""
    res = dict(request)
    opts: dict = {"num_cpus": res.pop("CPU", 0), "num_gpus": res.pop("GPU", 0), "max_retries": 0}
    if res:
        opts["resources"] = res
    if pg is None:
        opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id, soft=False)
    else:
        opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            pg, placement_group_bundle_index=rank, placement_group_capture_child_tasks=False
        )
    return opts


class JobRefs(list):
    """The Ray object refs of a job's ranks (a list, in rank order, as ``ray.get`` takes them),
    as ``run(wait=False)`` returns them, with a watcher: a daemon thread of the driver that
    waits on the ranks and, when one fails, cancels the others (as :func:`gather` does), then
    releases the job's reservation. ``rank_nodes``: each rank's node as messages name it
    (:func:`stoker.cluster.identity.node_label`); ``error``: the first
    rank's failure once seen (None until then); :meth:`cancel` ends every rank now."""

    def __init__(self, refs: list, rank_nodes: list[str], pg=None, grace_s: float = 10.0, poll_s: float = 0.5):
        super().__init__(refs)
        self.rank_nodes = list(rank_nodes)
        self.error: BaseException | None = None
        self._pg, self._grace_s, self._poll_s = pg, float(grace_s), float(poll_s)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="stoker-job-watch", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        pending = list(self)
        try:
            while pending and not self._stop.is_set():
                done, pending = ray.wait(pending, num_returns=1, timeout=self._poll_s)
                for ref in done:
                    try:
                        ray.get(ref)
                    except Exception as exc:  # noqa: BLE001 - the job is over: cancel the rest
                        self.error = exc
                        _, pending = _settle(pending, SETTLE_S)
                        _cancel(pending, self._grace_s)
                        first, self.error = first_failure(self, ref, exc)
                        r = self.index(first)
                        log.warning(
                            "stoker.cluster: rank %d on %s failed first (%s); cancelled the other %d rank(s)",
                            r,
                            _node_text(self.rank_nodes[r]),
                            type(self.error).__name__,
                            len(pending),
                        )
                        return
        except Exception as exc:  # noqa: BLE001 - Ray shut down under the watcher
            log.debug("job watcher stopped: %s", exc)
        finally:
            release(self._pg)

    def cancel(self) -> None:
        """Cancel every rank still running (politely, then by force after the grace period)."""
        self._stop.set()
        _cancel(list(self), self._grace_s)

    def __reduce__(self):  # a plain list of refs when pickled (the watcher stays in the driver)
        return (list, (list(self),))


def gather(
    refs: list,
    rank_nodes: list[str] | None = None,
    timeout_s: float | None = None,
    grace_s: float = 10.0,
    settle_s: float = SETTLE_S,
) -> list:
    """The results of a job's ranks (``refs``: one Ray object ref per rank, as ``run(wait=False)``
    returns), in rank order; a job whose ranks are not all there is over.

    The first rank that fails (its error, a ``ray.exceptions.RayTaskError``, or
    ``NodeDiedError``/``WorkerCrashedError`` when its node or process died) ends the job: the other
    ranks are cancelled (``ray.cancel``: a ``KeyboardInterrupt`` in ``train_fn``, so its
    ``finally`` blocks run; a rank still running ``grace_s`` seconds later is stopped with
    ``force=True``) and the error that came first is raised (:func:`first_failure`: a peer whose
    collective failed because that rank left may report before it), with a note naming the rank and its node
    (``rank_nodes``: the name of each rank's node, :func:`stoker.cluster.identity.node_label`, or
    any name the caller gives; taken from ``refs`` when it is a :class:`JobRefs`). After
    ``timeout_s`` seconds (None: no limit) the ranks are cancelled the same way and
    ``ray.exceptions.GetTimeoutError`` is raised. Nobody is left running with no one waiting
    for it (a DDP job without one rank waits for it forever). Before the cancellation, the other
    ranks get ``settle_s`` seconds to end by themselves, so that one that failed first but is
    still tearing down reports its own error (a cancelled rank reports only its cancellation).
    """
    if rank_nodes is None and isinstance(refs, JobRefs):
        rank_nodes = refs.rank_nodes
    index = {ref: r for r, ref in enumerate(refs)}
    pending = list(refs)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while pending:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        done, pending = ray.wait(pending, num_returns=1, timeout=left)
        if not done:
            _cancel(pending, grace_s)
            raise ray.exceptions.GetTimeoutError(
                f"{len(pending)} of {len(refs)} ranks still running after {timeout_s} s; cancelled"
            )
        try:
            ray.get(done[0])
        except Exception as exc:
            _, pending = _settle(pending, settle_s)
            _cancel(pending, grace_s)
            first, err = first_failure(refs, done[0], exc)
            r = index[first]
            where = f" on {_node_text(rank_nodes[r])}" if rank_nodes else ""
            err.add_note(
                f"stoker.cluster: rank {r}{where} failed first; the other {len(pending)} running "
                f"rank(s) of the job were cancelled"
            )
            if err is exc:
                raise
            raise err from None
    return ray.get(list(refs))


def _node_text(name: str) -> str:
    """``name`` as a message's "on ..." says it: a :func:`stoker.cluster.identity.node_label`
    (``node-<host>-<slot>``, ``Ray node <id>``) as it is, any other name or id as ``node <name>``."""
    return name if name.startswith(("node-", "Ray node ")) else f"node {name}"


def _settle(refs: list, settle_s: float) -> tuple[list, list]:
    """``(done, pending)`` of ``refs`` after waiting up to ``settle_s`` seconds for all of them."""
    if not refs or settle_s <= 0:
        return [], list(refs)
    return ray.wait(list(refs), num_returns=len(refs), timeout=settle_s)


def _cancel(refs: list, grace_s: float) -> None:
    """Cancel the tasks of ``refs``: politely first (KeyboardInterrupt in the task), then, for the
    ones still running after ``grace_s`` seconds, by force."""
    for ref in refs:
        ray.cancel(ref, force=False)
    if not refs:
        return
    _, still = ray.wait(refs, num_returns=len(refs), timeout=grace_s)
    for ref in still:
        ray.cancel(ref, force=True)
