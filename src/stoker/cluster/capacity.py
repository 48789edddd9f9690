"""How many training ranks each node can run now: co-location is a preference, capacity a limit.

A rank asks for Ray resources (``{"CPU": 2, "GPU": 1, ...}``); a node can run as many ranks as
its *free* resources hold (the smallest ``floor(free / asked)`` over the resources a rank asks
for; a resource a node lacks gives 0). :func:`stoker.cluster.schedule.choose_nodes` takes these
counts as its ``slots``, so ranks go where the data is *and* where there is room, and a job the
cluster cannot run now is refused at once (:func:`refusal` says why) instead of ranks waiting
pinned behind each other (a start barrier such as DDP's init would wait for ever).
Pure: standard library only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

#: Slots of a node for a rank that asks for no resource at all (no limit from resources).
UNLIMITED = 1 << 30


def rank_request(resources_per_worker: Mapping[str, float] | None) -> dict[str, float]:
    """The resources one rank asks for: ``resources_per_worker`` (default ``{"CPU": 1}``) with the
    zero entries left out. Raises ValueError for a negative amount, naming the resource."""
    req = dict(resources_per_worker or {"CPU": 1})
    for k, v in req.items():
        if v < 0:
            raise ValueError(f"resources_per_worker[{k!r}] must be >= 0, got {v}")
    return {k: float(v) for k, v in req.items() if v > 0}


def rank_slots(free: Mapping[str, float], request: Mapping[str, float]) -> int:
    """How many ranks asking for ``request`` fit in a node's ``free`` resources (both
    ``{resource name: amount}``, Ray's units: CPUs, GPUs, bytes of memory). A resource the node
    does not list counts as 0; a request of nothing fits :data:`UNLIMITED` times."""
    n = UNLIMITED
    for k, v in request.items():
        if v > 0:
            n = min(n, math.floor(float(free.get(k, 0.0)) / v + 1e-9))
    return max(0, int(n))


def refusal(
    num_workers: int,
    request: Mapping[str, float],
    free: Mapping[str, Mapping[str, float]],
    slots: Mapping[str, int],
    per_node_limit: int | None = None,
    kind: str = "free",
    names: Mapping[str, str] | None = None,
) -> str:
    """The message of a job that does not fit: what one rank asks for, and per node its ``kind``
    (``"free"`` or ``"total"``) resources (those the rank asks for) and how many ranks fit
    there. ``free`` and ``slots`` are keyed by node id; ``names``: node id -> how the message
    names the node (:func:`stoker.cluster.identity.node_label`; a node not in it: ``node <id>``)."""
    rows = []
    for name, node in sorted(((names or {}).get(node) or f"node {node}", node) for node in slots):
        have = {k: round(float(free.get(node, {}).get(k, 0.0)), 3) for k in request}
        rows.append(f"{name}: {kind} {have or '{}'} -> {slots[node]} rank(s)")
    limit = "" if per_node_limit is None else f", at most {per_node_limit} per node (slots_per_node)"
    return (
        f"{num_workers} ranks asking for {dict(request)} each do not fit in the cluster's {kind} "
        f"resources ({sum(slots.values())} fit{limit}): "
        + "; ".join(rows)
        + (
            ". Ask for fewer ranks or smaller ones."
            if kind == "total"
            else ". Ask for fewer ranks or smaller ones, or wait for other work to finish."
        )
    )
