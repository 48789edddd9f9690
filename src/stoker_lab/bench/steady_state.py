"""The steady state of a reader: CPU and wall time per sample as the difference of two runs.

The method of ``benchmarks/bytes_only_steady.py``. A reader runs, on one iterator set-up (its
worker processes started once): a first epoch (the cold fill for a cached reader; start-up for
every reader), ``first_warm`` warm epochs, then a *short* run of ``S`` epochs and a *long* run of
``S + W`` epochs, back to back. The training process and every process below it are snapshotted
only at those boundaries (:func:`mark`: wall clock, CPU of the whole process tree, CPU of the
training process alone, samples and bytes so far): never inside a run, so a snapshot's own cost
(a walk of ``/proc``) is the same in both runs. The steady-state figures are

    (long run - short run) / (samples of the long run - samples of the short run),

so whatever a run pays once (its first batches, work the pipeline does past the run's end for the
next epoch, the snapshots) cancels, and ``W`` epochs of CPU stand behind each figure. ``W`` is the
larger of ``min_epochs`` and the epochs needed for ``min_cpu_s`` of CPU at the last warm epoch's
rate (:func:`window`), bounded by ``max_epochs``.

Standard library only: DLIO's runner (:mod:`stoker_lab.bench.dlio_runner`) runs this arithmetic
on its marks too, under a Python where stoker is not installed.
"""

from __future__ import annotations

import math
import os
import time

GB = 1e9
_TICK = os.sysconf("SC_CLK_TCK")


def process_cpu_s(pid: int) -> float:
    """utime + stime of process ``pid`` (every thread), in seconds; 0.0 if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICK


def mark(at: int, samples: int, nbytes: int, tree_cpu_s) -> dict:
    """A boundary snapshot before epoch ``at`` (0-based): ``{"kind": "mark", "at", "samples",
    "bytes" (so far), "t" (perf_counter, s), "cpu_s" (``tree_cpu_s()``: every process of the run),
    "training_cpu_s" (this process alone)}``."""
    return {
        "kind": "mark",
        "at": at,
        "samples": int(samples),
        "bytes": int(nbytes),
        "t": time.perf_counter(),
        "cpu_s": tree_cpu_s(),
        "training_cpu_s": process_cpu_s(os.getpid()),
    }


def window(cpu_s_per_epoch: float, min_epochs: int, min_cpu_s: float, max_epochs: int) -> tuple[int, int]:
    """``(S, W)``: the short run's epochs and the long run's extra epochs. ``W`` = max(``min_epochs``,
    epochs for ``min_cpu_s`` CPU-s at ``cpu_s_per_epoch``), at most ``max_epochs``; ``S`` = max(2,
    ceil(W / 4)). Raises ValueError for ``min_epochs < 1``."""
    if min_epochs < 1:
        raise ValueError(f"min_epochs must be >= 1, got {min_epochs}")
    if min_cpu_s <= 0:
        need = 0
    else:  # an epoch under one clock tick of CPU: as many epochs as allowed
        need = math.ceil(min_cpu_s / cpu_s_per_epoch) if cpu_s_per_epoch > 0 else max_epochs
    w = max(min_epochs, min(max_epochs, need))
    return max(2, math.ceil(w / 4)), w


def boundaries(first_warm: int, short: int, extra: int) -> list[int]:
    """The epochs before which a mark is taken, and the total after the last: ``[0, 1, ..,
    1 + first_warm, 1 + first_warm + S, 1 + first_warm + 2S + W]``."""
    head = list(range(first_warm + 2))
    return head + [head[-1] + short, head[-1] + 2 * short + extra]


def span(a: dict, b: dict) -> dict:
    """Figures between two marks: samples, bytes, seconds, cpu_s (every process), training_cpu_s."""
    return {k: b[k] - a[k] for k in ("samples", "bytes", "cpu_s", "training_cpu_s")} | {"seconds": b["t"] - a["t"]}


def per_sample(s: dict) -> dict:
    """A :func:`span`'s rates: samples/s, samples per CPU-second (every process), CPU-s/GB, and
    microseconds of CPU per sample in the training process and in the others (its workers)."""
    n, c = s["samples"], s["cpu_s"]
    return s | {
        "samples_per_s": n / s["seconds"] if s["seconds"] > 0 else None,
        "samples_per_cpu_s": n / c if c > 0 else None,
        "cpu_s_per_GB": c / (s["bytes"] / GB) if s["bytes"] > 0 else None,
        "us_per_sample": {
            "training": 1e6 * s["training_cpu_s"] / n if n else None,
            "workers": 1e6 * (c - s["training_cpu_s"]) / n if n else None,
            "all": 1e6 * c / n if n else None,
        },
    }


def figures(marks: list[dict], first_warm: int) -> dict:
    """The report of one reader from its marks (:func:`mark`, at :func:`boundaries`): ``first``
    (epoch 0), ``first_warm`` (each of the next epochs, apart), ``runs`` (short, long) and
    ``steady`` (their difference, :func:`per_sample`) with ``warm_epochs`` and ``cpu_s`` behind it.
    Raises ValueError when a mark is missing (the reader died: its error says why)."""
    if len(marks) != first_warm + 4:
        raise ValueError(f"expected {first_warm + 4} marks, got {len(marks)}")
    m = marks
    short, long_ = span(m[-3], m[-2]), span(m[-2], m[-1])
    diff = {k: long_[k] - short[k] for k in short}
    return {
        "first": per_sample(span(m[0], m[1])),
        "first_warm": [per_sample(span(m[k], m[k + 1])) for k in range(1, first_warm + 1)],
        "runs": {
            "short": short | {"epochs": m[-2]["at"] - m[-3]["at"]},
            "long": long_ | {"epochs": m[-1]["at"] - m[-2]["at"]},
        },
        "steady": per_sample(diff) | {"warm_epochs": (m[-1]["at"] - m[-2]["at"]) - (m[-2]["at"] - m[-3]["at"])},
    }
