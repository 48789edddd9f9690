"""A dataset's placement members, recorded on every cache service so that any one answers.

The record of a dataset version (``{"members", "known", "previous"}``, see
:mod:`stoker.cluster.membership`) lives on every service: :func:`settle_record` asks every service,
merges what they hold (the sets only grow, so a merge is their union), grows the result with
:func:`stoker.cluster.membership.widen` and writes it back to every service. The first job of a
dataset, which finds no record anywhere, claims on the service of the lowest node id (first claim
wins), so two first jobs at once agree.
"""

from __future__ import annotations

import logging
import time

import ray

from ..identity import node_label
from ..membership import after_growth, merge, widen
from .cache_service import get_service

log = logging.getLogger(__name__)

#: Tries of a call to a cache service that is restarting (Ray restarts it: ``max_restarts=-1``),
#: and the pause before each retry, seconds (times the try number).
SERVICE_TRIES = 4
RETRY_PAUSE_S = 0.5


def call(method, *args, tries: int = SERVICE_TRIES, pause_s: float = RETRY_PAUSE_S, timeout_s: float | None = None):
    """``ray.get(method.remote(*args))``, called again (``tries`` in all) while the service is
    restarting (``ray.exceptions.RayActorError``: ``ActorUnavailableError``, or ``ActorDiedError``
    for a call in flight when it died). ``timeout_s``: the longest wait for one answer (None: no
    limit), then ``ray.exceptions.GetTimeoutError``, not retried. Raises the last error."""
    for k in range(tries):
        try:
            return ray.get(method.remote(*args), timeout=timeout_s)
        except ray.exceptions.RayActorError:
            if k == tries - 1:
                raise
            time.sleep(pause_s * (k + 1))


def settle_record(services: dict, version: str, dataset_bytes: int, proposal: list[str], job_nodes: list[str]) -> dict:
    """The record of dataset ``version`` for the job at hand: ``{"members", "previous"}`` (node
    ids, sorted): the placement members, and the members before their last growth (``[]`` when
    they never grew since the first claim: :func:`stoker.cluster.membership.after_growth`).

    ``services``: ``{node id: info()}`` of the services that answer now (at least one);
    ``dataset_bytes``: the dataset's size; ``proposal``: the members to record when no service
    holds a record (the nodes holding the dataset, else the job's nodes); ``job_nodes``: the
    nodes of the job (tried first when the members' budgets are short). The result is a
    superset of every record found, and it is recorded on every service before returning. A
    service that does not answer is left out of the merge and of the write (it learns the record
    from the next job). Raises ``ray.exceptions.RayActorError`` only when the claim on the first
    service fails after its retries.
    """
    nodes = list(services)
    records = []
    asked = {}  # every service asked at once: one round trip for the cluster, not one per node
    for n in nodes:
        try:
            asked[n] = get_service(n).record.remote(version)
        except ValueError as exc:
            log.warning("cache service of %s gave no record of %s: %s", node_label(n, services), version, exc)
    for n, ref in asked.items():
        try:
            records.append(ray.get(ref))
        except ray.exceptions.RayActorError:
            try:  # restarting: ask it again, with the retries of :func:`call`
                records.append(call(get_service(n).record, version))
            except (ray.exceptions.RayActorError, ValueError) as exc:
                log.warning("cache service of %s gave no record of %s: %s", node_label(n, services), version, exc)
    found = [r for r in records if r]
    if found:
        rec = merge(found)
        members, known, previous = rec["members"], rec["known"], rec["previous"]
    else:
        keeper = get_service(nodes[0])
        members = call(keeper.claim, version, proposal, nodes)
        known, previous = call(keeper.known, version), []
    grown = widen(members, known, {n: int(services[n]["cache_bytes"]) for n in nodes}, int(dataset_bytes), job_nodes)
    # a first claim's members placed nothing yet: a growth right after it moves no cached block
    previous = after_growth(members, grown, previous) if found else []
    seen = sorted(set(known) | set(nodes))
    refs = {n: get_service(n).widen.remote(version, grown, seen, previous) for n in nodes}
    for n, ref in refs.items():
        try:
            grown = sorted(set(grown) | set(ray.get(ref)))  # a job that widened at the same time
        except ray.exceptions.RayActorError as exc:
            log.warning(
                "cache service of %s did not record the members of %s: %s", node_label(n, services), version, exc
            )
    return {"members": grown, "previous": previous}
