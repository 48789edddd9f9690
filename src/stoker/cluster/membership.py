"""Which nodes a dataset's blocks are placed on (its *members*), and when that set grows.

The first job of a dataset records its members (the nodes already holding it, else the job's
nodes: a new dataset's cache goes where its jobs run). The set then follows the cluster and the
jobs (:func:`widen`): a node that joined the cluster after the record is added, and when the
members' budgets together cannot hold the dataset, the nodes of the job at hand are added,
then other nodes by budget, until they can. Placement is rendezvous hashing
(:mod:`stoker.cluster.placement`), so a larger set moves only the blocks the new members win.
Members are never dropped here (a member that is gone is left out of one job's placement by the
caller). The record also keeps ``previous``, the members before the last growth (:func:`after_growth`):
a block whose owner changed with that growth is filled from its owner under those members (a
*handoff*, :mod:`stoker.cluster.handoff`) rather than from the origin. Every service keeps a
record; :func:`merge` joins theirs. Pure: standard library only.
"""

from __future__ import annotations


def widen(
    members: list[str], known: list[str], budgets: dict[str, int], dataset_bytes: int, job_nodes: list[str]
) -> list[str]:
    """The members after growth (a superset of ``members``, sorted).

    ``members``: recorded member node ids; ``known``: the nodes the record has seen (a node with
    a service that is not in it has joined since); ``budgets``: ``{node id: cache bytes}`` of the
    nodes with a service now; ``dataset_bytes``: the dataset's size; ``job_nodes``: the nodes of
    the job being placed (tried first when room is short).
    """
    out = set(members) | {n for n in budgets if n not in set(known)}

    def room() -> int:
        return sum(int(budgets.get(m, 0)) for m in out)

    for n in list(dict.fromkeys(job_nodes)) + sorted(budgets, key=lambda n: (-int(budgets[n]), n)):
        if room() >= dataset_bytes:
            break
        if n in budgets and int(budgets[n]) > 0:
            out.add(n)
    return sorted(out)


#: The sets of a record, each sorted; every one only grows, so records merge by union.
RECORD_SETS = ("members", "known", "previous")


def merge(records: list[dict]) -> dict:
    """One record from the records several services hold (``{"members", "known", "previous"}``,
    lists of node ids; a record written before ``previous`` existed has none): the union of each
    set, sorted. Every set only grows (``previous`` too: the members before a later growth hold
    those before an earlier one), so the union is the newest record any service saw, also when
    a service missed a write."""
    return {k: sorted(set().union(*(r.get(k, ()) for r in records))) for k in RECORD_SETS}


def after_growth(members: list[str], grown: list[str], previous: list[str]) -> list[str]:
    """The ``previous`` to record once ``members`` became ``grown`` (:func:`widen`): ``members``
    when the set grew (the blocks the new members win were placed by it until now), else
    ``previous`` unchanged (sorted)."""
    return sorted(members) if set(grown) != set(members) else sorted(previous)
