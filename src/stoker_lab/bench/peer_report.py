"""The report rows of the peer stage of ``stoker bench io`` (:mod:`stoker_lab.bench.peer_stage`):
stoker's figures beside the floor's, and over 2x an ``exception`` that says why."""

from __future__ import annotations

from .peer_profile import PROFILE_S, profile

GB = 1e9
STAGE = "peer cache service->rank"
#: Processes whose CPU is counted, by role.
COUNTED = ("rank", "service", "raylet A", "raylet B")
#: The two ways a rank reads from the peer (the :class:`stoker_lab.bench.peer_rank.PeerRank` method
#: of a pass): in its Ray worker (the BlockRouter's call), or from a child process through the
#: rank's relay (a Loader's prefetcher and decode workers).
VIAS = {"direct": "read_blocks", "relay": "read_blocks_relay"}


def counted_roles(via: str) -> tuple[str, ...]:
    """The processes whose CPU a pass ``via`` counts: :data:`COUNTED`, and the relay's reader."""
    return COUNTED + (("relay child",) if via == "relay" else ())


def profile_pass(rank, via: str):
    """A function that runs one more pass ``via`` on ``rank`` (for :func:`profile`)."""
    import ray

    method = getattr(rank, VIAS[via])
    return lambda: ray.get(method.remote(), timeout=600)


def peer_rows(
    link: str, m: dict, floor: dict, floor_what: str, rank=None, profile_s: float = PROFILE_S, **extra
) -> list:
    """The report rows of the stage over ``link`` (``"loopback"``, ``"netns, 1000 Mbit/s"``), one
    per way of reading measured in ``m`` (:func:`measure`): stoker's figures, the floor's
    (:func:`stoker_lab.bench.peer_floor.transfer`), their ratio; over 2x a profile of
    ``profile_s`` seconds of passes on ``rank`` (:func:`profile`; none without ``rank`` or with
    ``profile_s`` 0) and an ``exception`` built from it and the CPU of each process."""
    nbytes = m["bytes"]
    fcpu = floor["cpu_s"] / (nbytes / GB)
    rows = []
    for via in VIAS:
        side = m.get(via)
        if side is None:
            continue
        ratio = side["cpu_s_per_GB"] / fcpu if fcpu > 0 else None
        prof: dict | str | None = None
        exception = None
        if ratio is not None and ratio > 2:
            if rank is None or profile_s <= 0:
                prof = "no profile taken (profile_s=0)" if rank is not None else "no profile taken"
            else:
                # the relay row: the processes it adds to the direct path (the rest is the direct row's)
                roles = ("rank", "relay child") if via == "relay" and "direct" in m else counted_roles(via)
                prof = profile({k: m["pids"][k] for k in roles}, profile_pass(rank, via), profile_s)
            exception = explain(via, side, ratio, prof, m.get("calls"), m["blocks"])
        rows.append(
            {
                "stage": f"{STAGE} ({link}{', via the relay' if via == 'relay' else ''})",
                "bytes": nbytes,
                "cpu_s": side["cpu_s"],
                "wall_s": side["wall_s"],
                "cpu_s_per_GB": side["cpu_s_per_GB"],
                "GBps": side["GBps"],
                "floor": {
                    "what": floor_what,
                    "cpu_s": floor["cpu_s"],
                    "cpu_s_per_GB": fcpu,
                    "GBps": nbytes / GB / floor["wall_s"] if floor["wall_s"] > 0 else 0.0,
                    "server_cpu_s": floor["server_cpu_s"],
                    "client_cpu_s": floor["client_cpu_s"],
                },
                "ratio": ratio,
                "exception": exception,
                "read": READ[via].format(blocks=m["blocks"], concurrency=m["concurrency"]),
                "counted": COUNTED_TEXT
                + (" and the relay's reader child" if via == "relay" else "")
                + "; the GCS and the driver apart (apart_cpu_s)",
                "cpu_s_by_process": side["by_process"],
                "idle_cpu_s_per_s": m["idle_cpu_s_per_s"],
                "cpu_s_per_block": side["cpu_s"] / m["blocks"],
                "calls": m.get("calls"),
                "apart_cpu_s": side["apart_cpu_s"],
                "passes": side["passes"],
                "digest": side["digest"],
                "digest_matches_floor": side["digest"] == floor["digest"],
                "peer_bytes": side["counters"].get("fetch_peer", 0),
                "fallbacks": side["counters"].get("fallbacks", 0),
                "fill": {k: m["fill"][k] for k in ("filled", "cached", "origin_bytes", "seconds")},
                "profile": prof,
                **extra,
            }
        )
    return rows


#: What a pass reads, per way (:data:`VIAS`).
READ = {
    "direct": "every block of the dataset, whole ({blocks} blocks), {concurrency} at a time, by "
    "BlockRouter.read(block=True) in the rank's Ray worker (one call of the cache service's read per block)",
    "relay": "every block of the dataset, whole ({blocks} blocks), {concurrency} at a time, by "
    "BlockRouter.read(block=True) in a child process of the rank, through the rank's relay (a Unix "
    "socket to the Ray worker, which makes the call): a cluster-mode Loader's prefetcher path",
}
COUNTED_TEXT = (
    "CPU time (/proc/<pid>/task/*/schedstat) of the rank's Ray worker, the cache service's Ray worker and "
    "both raylets (each holds its node's object store and object manager)"
)


def explain(via: str, side: dict, ratio: float, prof: dict | str | None, calls: dict | None, blocks: int) -> str:
    """Why the stage is over 2x its floor: what each block costs on the way, the share of each
    counted process, what a call costs without the bytes (``calls``, :func:`_calls`), and the top
    frames of the profile (``prof``: :func:`profile`'s result, or why there is none)."""
    by, total = side["by_process"], side["cpu_s"] or 1e-9
    shares = ", ".join(f"{k} {100 * v / total:.0f}%" for k, v in sorted(by.items(), key=lambda kv: -kv[1]))
    text = (
        f"{ratio:.1f}x its floor: each block is one Ray actor call; the service copies it out of the cache "
        f"into a bytes object, Ray pickles it into node A's object store, the raylets' object managers "
        f"move it in gRPC chunks into node B's object store and the rank unpickles it into a new bytes "
        f"object"
        + (", which the relay copies again over a Unix socket to the child" if via == "relay" else "")
        + f"; {1e3 * total / blocks:.1f} ms CPU per block, by process: {shares}"
    )
    if calls:
        text += (
            f"; the same call for 1 KiB (inline in Ray's reply, no object store) costs "
            f"{1e3 * calls['cpu_s_per_call']:.1f} ms CPU"
        )
    if isinstance(prof, str) or prof is None:
        return text + f"; {prof or 'no profile taken'}"
    parts = []
    for role in sorted(prof, key=lambda r: -by.get(r, 0)):
        for kind in ("perf", "py-spy"):
            v = prof[role].get(kind)
            if isinstance(v, list) and v:
                parts.append(f"{role} {kind}: " + "; ".join(f"{s:g}% {f}" for s, f in v[:3]))
            elif isinstance(v, str):
                parts.append(f"{role} {kind}: {v}")
    if not parts:
        return text + "; the profile caught no frames"
    which = " of the processes the relay adds (the others as in the direct row)" if "raylet A" not in prof else ""
    return text + f"; top frames{which} (own samples; " + PERF_NOTE + "): " + " | ".join(parts)


#: How to read perf's kernel frames when it samples on the cpu-clock timer (no hardware counters).
PERF_NOTE = (
    "perf on the cpu-clock timer: a sample taken while interrupts are off lands where they come back on, so "
    "finish_task_switch and _raw_spin_unlock_irq* stand for context switches and wake-ups; clear_page_erms "
    "is the zeroing of fresh pages, a new buffer per block; py-spy: Python stacks holding the GIL"
)


def not_measured(why: str, link: str | None = None) -> dict:
    """The row of a peer stage (over ``link``, if given) that was not measured, ``exception`` saying why."""
    return {
        "stage": STAGE if link is None else f"{STAGE} ({link})",
        "bytes": 0,
        "cpu_s_per_GB": None,
        "GBps": None,
        "floor": {"what": "a bare TCP transfer of the same bytes", "cpu_s_per_GB": None, "GBps": None},
        "ratio": None,
        "exception": why,
    }
