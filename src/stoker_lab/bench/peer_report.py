"""The report rows of the peer stage of ``stoker bench io`` (:mod:`stoker_lab.bench.peer_stage`):
each end's CPU per GB (sender, receiver, their sum) beside the floor's, and over 2x an ``exception``
that says why.

Who counts where (:func:`ends`): the **sender** is node A's cache service (its whole process: the
data endpoint's threads and the Ray worker's own) plus the *increment* of node A's raylet; the
**receiver** is the reading process (the rank's Ray worker for ``direct``; for ``worker`` the child
and the rank that started it) plus the increment of node B's raylet. A raylet's increment is its
CPU over the pass less its own CPU at rest over the same span (measured with no pass running),
never below 0: Ray takes part in a read only for its control plane (the driver's one call per pass,
the rank's one ``ray.nodes()`` per ``retry_s``), so the increment says whether anything of the
bytes' path went through Ray after all.
"""

from __future__ import annotations

from .peer_profile import PROFILE_S, profile

GB = 1e9
STAGE = "peer cache service->rank"
#: The ways a rank reads from the peer: the :class:`stoker_lab.bench.peer_rank.PeerRank` method of a pass.
VIAS = {"direct": "read_blocks", "worker": "read_blocks_worker"}
#: Each end's processes, by role (a raylet counts its increment only; module doc).
SENDER = ("service", "raylet A")
RECEIVER = {"direct": ("rank", "raylet B"), "worker": ("worker", "rank", "raylet B")}
RAYLETS = ("raylet A", "raylet B")


def counted_roles(via: str) -> tuple[str, ...]:
    """The processes whose CPU a pass ``via`` counts (:data:`SENDER` and :data:`RECEIVER`)."""
    return SENDER + RECEIVER[via]


def ends(via: str, by: dict, idle_per_s: dict, span_s: float, nbytes: int) -> tuple[dict, dict]:
    """``(sender, receiver)`` of one pass ``via`` that moved ``nbytes`` bytes: each ``{cpu_s,
    cpu_s_per_GB, by_process}`` from ``by`` (``{role: CPU-s over the pass}``), a raylet counted by its
    increment over its rest rate ``idle_per_s`` (``{role: CPU-s per s}``) times ``span_s`` (the
    pass's span between the CPU marks, seconds), with ``raylet`` ``{role, cpu_s, rest_cpu_s,
    increment_cpu_s}`` saying how (module doc)."""
    out = []
    for roles in (SENDER, RECEIVER[via]):
        procs, raylet = {}, None
        for r in roles:
            if r in RAYLETS:
                rest = idle_per_s.get(r, 0.0) * span_s
                inc = max(0.0, by.get(r, 0.0) - rest)
                raylet = {"role": r, "cpu_s": by.get(r, 0.0), "rest_cpu_s": rest, "increment_cpu_s": inc}
                procs[f"{r} (increment)"] = inc
            else:
                procs[r] = by.get(r, 0.0)
        cpu = sum(procs.values())
        out.append({"cpu_s": cpu, "cpu_s_per_GB": cpu / (nbytes / GB), "by_process": procs, "raylet": raylet})
    return out[0], out[1]


def profile_pass(rank, via: str):
    """A function that runs one more pass ``via`` on ``rank`` (for :func:`profile`)."""
    import ray

    method = getattr(rank, VIAS[via])
    return lambda: ray.get(method.remote(), timeout=600)


def floor_fields(floor: dict, what: str) -> dict:
    """The ``floor`` object of a row from :func:`stoker_lab.bench.peer_floor.transfer`'s result."""
    gb = floor["bytes"] / GB
    return {
        "what": what,
        "bytes": floor["bytes"],
        "cpu_s": floor["cpu_s"],
        "cpu_s_per_GB": floor["cpu_s"] / gb,
        "GBps": gb / floor["wall_s"] if floor["wall_s"] > 0 else 0.0,
        "sender": {"cpu_s": floor["server_cpu_s"], "cpu_s_per_GB": floor["server_cpu_s"] / gb},
        "receiver": {"cpu_s": floor["client_cpu_s"], "cpu_s_per_GB": floor["client_cpu_s"] / gb},
        "rounds": floor["rounds"],
    }


def peer_rows(
    link: str, m: dict, floor: dict, floor_what: str, rank=None, profile_s: float = PROFILE_S, **extra
) -> list:
    """The report rows of the stage over ``link`` (``"loopback"``, ``"netns, 1000 Mbit/s"``), one
    per way of reading measured in ``m`` (:func:`stoker_lab.bench.peer_stage.measure`): each end's
    figures and their sum, the floor's (:func:`stoker_lab.bench.peer_floor.transfer` of the same
    blocks, as many times, with as many requests in flight), their ratios; over 2x a profile of
    ``profile_s`` seconds of passes on ``rank`` (:func:`profile`; none without ``rank`` or with
    ``profile_s`` 0) and an ``exception`` built from it and the CPU of each process."""
    fl = floor_fields(floor, floor_what)
    rows = []
    for via in VIAS:
        side = m.get(via)
        if side is None:
            continue
        ratio = side["cpu_s_per_GB"] / fl["cpu_s_per_GB"] if fl["cpu_s_per_GB"] > 0 else None
        prof: dict | str | None = None
        exception = None
        if ratio is not None and ratio > 2:
            if rank is None or profile_s <= 0:
                prof = "no profile taken (profile_s=0)" if rank is not None else "no profile taken"
            else:
                prof = profile({k: m["pids"][k] for k in counted_roles(via)}, profile_pass(rank, via), profile_s)
            exception = explain(side, ratio, prof, m)
        rows.append(
            {
                "stage": f"{STAGE} ({link}{', a worker process' if via == 'worker' else ''})",
                "via": via,
                "bytes": side["bytes"],
                "rounds": m["rounds"],
                "cpu_s": side["cpu_s"],
                "wall_s": side["wall_s"],
                "cpu_s_per_GB": side["cpu_s_per_GB"],
                "GBps": side["GBps"],
                "sender": side["sender"],
                "receiver": side["receiver"],
                "floor": fl,
                "ratio": ratio,
                "ratio_sender": _over(side["sender"], fl["sender"]),
                "ratio_receiver": _over(side["receiver"], fl["receiver"]),
                "vs_floor_GBps": side["GBps"] / fl["GBps"] if fl["GBps"] > 0 else None,
                "exception": exception,
                "read": READ[via].format(blocks=m["blocks"], concurrency=m["concurrency"], rounds=m["rounds"]),
                "counted": COUNTED_TEXT,
                "cpu_s_by_process": side["by_process"],
                "idle_cpu_s_per_s": m["idle_cpu_s_per_s"],
                "cpu_s_per_block": side["cpu_s"] / (m["blocks"] * m["rounds"]),
                "verify_cpu_s_per_GB": m.get("verify_cpu_s_per_GB"),
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
        rate = (extra.get("network") or {}).get("link_GBps")
        if rate:  # a shaped link: the share of its rate each got (payload bytes; the rate counts headers too)
            rows[-1]["link_fraction"] = side["GBps"] / rate
            rows[-1]["floor"]["link_fraction"] = fl["GBps"] / rate
    return rows


def _over(side: dict, floor_side: dict) -> float | None:
    return side["cpu_s_per_GB"] / floor_side["cpu_s_per_GB"] if floor_side["cpu_s_per_GB"] > 0 else None


#: What a pass reads, per way (:data:`VIAS`).
READ = {
    "direct": "every block of the dataset, whole ({blocks} blocks), {rounds} times over, {concurrency} at a time, "
    "as a cluster-mode Loader fetches a peer's block (BlockReader.fetch_block: BlockRouter.read(block=True) over "
    "the rank's connection to the service's data endpoint, then the index check of every sample), in the "
    "rank's Ray worker",
    "worker": "the same, in a child process of the rank (spawned with a pickled copy of the router, as a "
    "Loader's prefetcher and decode workers get one), over its own connection to the data endpoint",
}
COUNTED_TEXT = (
    "CPU time (/proc/<pid>/task/*/schedstat) of the sender (the cache service's whole process, plus node A's "
    "raylet's increment over its rest) and the receiver (the reading process, the rank too when a child reads, "
    "plus node B's raylet's increment); the GCS and the driver apart (apart_cpu_s)"
)


def explain(side: dict, ratio: float, prof: dict | str | None, m: dict) -> str:
    """Why a row is over 2x its floor: the CPU per block, the share of each counted process, what
    the index check and a request without its bytes cost (``m``'s ``verify_cpu_s_per_GB`` and
    ``calls``), and the top frames of the profile (``prof``: :func:`profile`'s result, or why
    there is none)."""
    by, total = side["by_process"], side["cpu_s"] or 1e-9
    blocks = m["blocks"] * m["rounds"]
    shares = ", ".join(f"{k} {100 * v / total:.0f}%" for k, v in sorted(by.items(), key=lambda kv: -kv[1]))
    text = f"{ratio:.1f}x its floor: {1e3 * total / blocks:.2f} ms CPU per block, by process: {shares}"
    if m.get("verify_cpu_s_per_GB") is not None:
        text += f"; the index check alone {m['verify_cpu_s_per_GB']:.3f} CPU-s/GB"
    calls = m.get("calls")
    if calls:
        text += f"; a request for 1 KiB costs {1e3 * calls['cpu_s_per_call']:.3f} ms CPU"
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
    return text + "; top frames (own samples; " + PERF_NOTE + "): " + " | ".join(parts)


#: How to read perf's kernel frames when it samples on the cpu-clock timer (no hardware counters).
PERF_NOTE = (
    "perf on the cpu-clock timer: a sample taken while interrupts are off lands where they come back on, so "
    "finish_task_switch and _raw_spin_unlock_irq* stand for context switches and wake-ups; clear_page_erms "
    "is the zeroing of fresh pages; py-spy: Python stacks holding the GIL"
)


def not_measured(why: str, link: str | None = None) -> dict:
    """The row of a peer stage (over ``link``, if given) that was not measured, ``exception`` saying why."""
    return {
        "stage": STAGE if link is None else f"{STAGE} ({link})",
        "bytes": 0,
        "cpu_s_per_GB": None,
        "GBps": None,
        "sender": {"cpu_s_per_GB": None},
        "receiver": {"cpu_s_per_GB": None},
        "floor": {"what": "a bare TCP transfer of the same bytes", "cpu_s_per_GB": None, "GBps": None},
        "ratio": None,
        "exception": why,
    }
