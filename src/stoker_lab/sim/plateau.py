"""Which assumption holds ``stoker plan``'s GPU utilisation under the target where it levels off,
named with the ``stoker plan`` flag that changes it (:func:`bound`).

The search for the level is :func:`stoker_lab.sim.plan.levels_off`; this module says what to try
there and judges the answers. Each assumption of :data:`KNOBS` that the level's warm epoch depends
on (:func:`knobs`: a link it moved bytes on, a latency it waited on, decode cores it used) is
relaxed in turn, a rate doubled or a latency halved (:func:`relaxed`), and the model run again at
the same cache per node. The one whose change raises the utilisation most bounds it; a rise under
:data:`MIN_GAIN` of itself from every one says none of them does (the epoch's first and last chunks, or the
GPUs themselves). A what-if run, not a guess from busy fractions: where two limits share the
epoch (the origin link and the cache reads both about 0.8 busy) neither is full, yet relaxing one
still shows which moves the answer.
"""

from __future__ import annotations

from dataclasses import replace

#: The utilisation "levels off" at the smallest cache per node whose GPU utilisation is within this
#: fraction of the best found: at least ``best x (1 - PLATEAU_TOLERANCE)`` (0.01: 1%, 0.85 against
#: a best of 0.86). 1% is about the step between neighbouring points of the model's curve (its
#: chunks start and end epochs in steps).
PLATEAU_TOLERANCE = 0.01
#: The user's own cache per node gets a bound of its own where its utilisation is under the best
#: by at least this fraction of the best (0.1: 10%; the model's curve wobbles by a few percent
#: between neighbouring sizes).
AT_GIVEN_GAP = 0.1
#: A what-if that raises the utilisation by less than this fraction of itself binds nothing.
MIN_GAIN = 0.01
#: The assumptions the what-if runs change: ``{name: (TdcsConfig field, flag, factor, needs)}``, a
#: rate doubled or a latency halved; ``needs``: the warm epoch's bytes (a ``run_setup`` row's
#: ``bytes`` kinds) or decode cores (``decode``) without which the knob cannot matter (None: always
#: tried).
KNOBS: dict[str, tuple[str, str, float, tuple[str, ...] | None]] = {
    "origin link": ("store_gbit", "--origin-bandwidth", 2.0, ("origin",)),
    "NICs": ("nic_gbit", "--nic", 2.0, ("origin", "host_to_host")),
    "cache reads": ("cache_read_GBps", "--cache-read", 2.0, ("local", "host_to_host")),
    "decode cores": ("decode_rate", "--decode-rate (or --decode-cores)", 2.0, ("decode",)),
    "origin latency": ("store_latency_ms", "--origin-latency", 0.5, ("origin",)),
    "peer latency": ("peer_latency_ms", "--peer-latency", 0.5, ("host_to_host",)),
}
#: The resource of :func:`stoker_lab.sim.tdcs.bottleneck` whose busy fraction a knob's line shows.
_BUSY_AS = {"origin link": ("origin link",), "NICs": ("NIC receive", "NIC send"), "cache reads": ("cache reads",)}
_BUSY_AS["decode cores"] = ("decode cores",)


def knobs(row: dict, cfg) -> list[str]:
    """The names of :data:`KNOBS` that can change the warm epoch ``row`` (a
    :func:`stoker_lab.sim.tdcs.run_setup` row) of config ``cfg``: those whose bytes it moved, and the
    decode cores when ``cfg.decode_cores`` > 0 (0: decoding is free)."""
    has = {k for k, v in row["bytes"].items() if v > 0}
    if cfg.decode_cores > 0:
        has.add("decode")
    return [k for k, (_, _, _, needs) in KNOBS.items() if needs is None or has & set(needs)]


def relaxed(cfg, name: str):
    """``cfg`` (a ``TdcsConfig``) with knob ``name``'s field times its factor."""
    field, _, factor, _ = KNOBS[name]
    return replace(cfg, **{field: getattr(cfg, field) * factor})


def bound(row: dict, at: float, what_if: dict[str, float], given) -> dict:
    """What bounds the utilisation ``at`` of the warm epoch ``row``, from ``what_if`` (``{knob:
    utilisation with it relaxed}``) on the user's figures ``given`` (a ``TdcsConfig``):
    ``{resource, assumption, value, flag, relaxed_value, relaxed_utilization, busy, what_if, why}``.
    ``resource``: the knob whose change raised the utilisation most, if by :data:`MIN_GAIN` of ``at``
    or more;
    else None (and the assumption, value, flag fields None). ``busy``: that resource's busy
    fraction in ``row`` (None for a latency). ``why``: one line for people."""
    gains = {k: (u - at) / at if at > 0 else u for k, u in what_if.items()}
    name = max(gains, key=lambda k: gains[k], default=None)
    if name is None or gains[name] < MIN_GAIN:
        tried = ", ".join(KNOBS[k][1] for k in what_if) or "nothing applies"
        return {
            "resource": None,
            "assumption": None,
            "value": None,
            "flag": None,
            "relaxed_value": None,
            "relaxed_utilization": None,
            "busy": None,
            "what_if": what_if,
            "why": f"no assumption tried moves it by {MIN_GAIN:.0%} ({tried}, each rate doubled or latency halved): "
            "the epoch's first and last chunks hold it",
        }
    field, flag, factor, _ = KNOBS[name]
    util = row["bottleneck"]["utilization"]
    busy = max((util.get(r, 0.0) for r in _BUSY_AS.get(name, ())), default=None)
    value = getattr(given, field)
    why = f"the {name}" + (f", busy {busy:.0%} of the warm epoch there" if busy is not None else "")
    gives = shown_utilization(what_if[name])
    why += f": at {value * factor:.6g} instead of {value:.6g} ({field}) the model gives {gives}"
    return {
        "resource": name,
        "assumption": field,
        "value": value,
        "flag": flag,
        "relaxed_value": value * factor,
        "relaxed_utilization": what_if[name],
        "busy": busy,
        "what_if": what_if,
        "why": why,
    }


def shown_utilization(x: float) -> str:
    """A utilisation for people: 2 decimals, or 2 significant digits under 0.01."""
    return f"{x:.2f}" if x >= 0.01 else f"{x:.2g}"
