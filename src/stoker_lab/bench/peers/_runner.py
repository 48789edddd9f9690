"""What every peer runner shares: the config, the epoch loop, CPU and origin accounting.

Standard library only: the runners of Streaming, LitData and DALI run under the Python of
their own virtual environments, where stoker is not installed. The measuring loop is
:func:`stoker_lab.bench.harness.measure`, loaded from its file so that every loader is timed by
the same code. A runner is a script ``run_<loader>.py`` that calls :func:`main` with

* ``convert(src, out, cfg) -> None``: write the peer's format for the ImageFolder tree ``src``
  into the local folder ``out`` with the peer's own tool (``python run_<loader>.py convert SRC OUT CFG``);
* ``build(cfg) -> obj`` and ``epoch(obj, e) -> iterable of (images, labels)``
  (``python run_<loader>.py read CFG``): one JSON line per epoch on stdout;
* ``about``: what the report says of the peer: ``packages`` (distributions whose installed
  versions are recorded), ``recipe`` (the documented recipe followed, and where it is written),
  ``cache`` and ``resume`` (what it has of each; "none" where it cannot).

CPU is counted over the runner's whole process tree (itself, its workers, their children, and
the children already reaped: ``/proc/<pid>/stat`` utime+stime+cutime+cstime of every live
process in the tree; the runner makes itself a child subreaper so orphans stay in it). A process
that ended without being reaped inside the tree takes its CPU out of the count: an epoch's
``cpu_s`` is then a lower bound, flagged by a positive ``cpu_unaccounted_s``
(:func:`tree_cpu_delta_s`). The emulated origin's CPU is measured separately from its pid,
never charged to a loader.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import math
import os
import random
import sys
import time
import urllib.request

_HERE = os.path.dirname(os.path.abspath(__file__))
_TICK = os.sysconf("SC_CLK_TCK")


def _load_measure():
    spec = importlib.util.spec_from_file_location("_stoker_harness", os.path.join(_HERE, "..", "harness.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod.measure


def _stat(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def tree_ticks(root: int | None = None) -> dict[tuple[int, int], tuple[int, int]]:
    """Process ``root`` (default: this one) and all its descendants, live now:
    ``{(pid, start time): (own ticks, reaped children's ticks)}`` (``/proc/<pid>/stat``
    utime+stime and cutime+cstime, in clock ticks; the start time tells a reused pid apart).
    Empty where /proc is missing."""
    root = os.getpid() if root is None else root
    children: dict[int, list[int]] = {}
    rows: dict[int, tuple[int, int, int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        f = _stat(int(name))
        if f is None:
            continue
        pid, ppid = int(name), int(f[1])
        children.setdefault(ppid, []).append(pid)
        rows[pid] = (int(f[19]), int(f[11]) + int(f[12]), int(f[13]) + int(f[14]))
    out: dict[tuple[int, int], tuple[int, int]] = {}
    todo = [root]
    while todo:
        pid = todo.pop()
        if pid in rows:
            start, own, reaped = rows[pid]
            out[(pid, start)] = (own, reaped)
        todo.extend(children.get(pid, ()))
    return out


def tree_cpu_s(root: int | None = None) -> float:
    """CPU seconds (user+system) of process ``root`` (default: this one) and all its descendants,
    including children they have reaped. 0.0 where /proc is missing."""
    return sum(own + reaped for own, reaped in tree_ticks(root).values()) / _TICK


def tree_cpu_delta_s(before: dict, after: dict) -> tuple[float, float]:
    """The tree's CPU seconds between two :func:`tree_ticks`, and how much of it is a lower bound.

    A process of ``before`` gone by ``after`` took its ticks out of the tree's sum; its parent
    put them back, and those it used since, when it reaped it (cutime). A parent that lets the
    kernel reap its children (SIGCHLD ignored: Ray's raylet does so with its workers) puts
    nothing back, and the plain difference of the sums lost them, down to a negative figure.
    Returns ``(seconds, unaccounted_s)``: the difference with the ticks such processes had in
    ``before`` added back, so that they count as 0 rather than minus their past, and those
    added ticks in seconds. With ``unaccounted_s`` 0.0 (every process that ended was reaped
    inside the tree) ``seconds`` is exact; otherwise it is a lower bound (what those processes
    used after ``before`` is not known).
    """
    total = lambda ticks: sum(own + reaped for own, reaped in ticks.values())  # noqa: E731
    gone = total({k: v for k, v in before.items() if k not in after})
    reaped_since = sum(after[k][1] - before[k][1] for k in before.keys() & after.keys())
    lost = max(0, gone - reaped_since)  # ticks of ended processes nobody in the tree reaped
    return (total(after) - total(before) + lost) / _TICK, lost / _TICK


def process_cpu_s(pid: int | None) -> float:
    """utime+stime of one process (seconds); 0.0 if it is gone or ``pid`` is None."""
    f = _stat(pid) if pid else None
    return (int(f[11]) + int(f[12])) / _TICK if f else 0.0


def origin_stats(control_url: str | None) -> dict:
    """The emulated origin's counters (``GET <direct_url>/__stoker__/stats``); {} without one."""
    if not control_url:
        return {}
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(f"{control_url}/__stoker__/stats", timeout=10) as resp:
        return json.loads(resp.read())


def subreaper() -> None:
    """Make this process a child subreaper (Linux), so orphaned descendants stay in its tree's CPU."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        pass


class _Snapshot:
    def __init__(self, cfg: dict):
        self.t = time.perf_counter()
        self.ticks = tree_ticks()
        self.origin_cpu = process_cpu_s(cfg.get("origin_pid"))
        self.stats = origin_stats(cfg.get("control_url"))

    def delta(self, before: "_Snapshot") -> dict:
        d = lambda k: int(self.stats.get(k, 0)) - int(before.stats.get(k, 0))  # noqa: E731
        cpu_s, unaccounted_s = tree_cpu_delta_s(before.ticks, self.ticks)
        return {
            "cpu_s": cpu_s,
            "cpu_unaccounted_s": unaccounted_s,
            "origin_cpu_s": self.origin_cpu - before.origin_cpu,
            "origin_bytes": d("bytes_served"),
            "origin_requests": d("requests"),
        }


def emit(row: dict) -> None:
    """Print one JSON line (what the parent collects)."""
    print(json.dumps(row), flush=True)


def versions(packages) -> dict:
    """``{distribution: installed version or None}`` for each name in ``packages``."""
    out: dict[str, str | None] = {}
    for name in packages:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def describe(cfg: dict, about: dict | None, obj=None) -> dict:
    """The peer as the report records it: ``about`` without its package list, the installed
    ``versions`` of those packages, the Python, and the loader's own ``settings()`` if it has one."""
    about = dict(about or {})
    out = {k: v for k, v in about.items() if k != "packages"}
    out["versions"] = versions(about.get("packages", ()))
    out["python"] = sys.version.split()[0]
    settings = getattr(obj, "settings", None)
    if callable(settings):
        out["settings"] = settings()
    return out


def read_epochs(cfg: dict, build, epoch, about: dict | None = None) -> None:
    """Build the loader, then measure ``cfg['epochs']`` epochs, printing a JSON line for the
    set-up (with the peer's :func:`describe`) and one per epoch (samples, seconds, samples_per_s,
    stall_fraction, first_batch_s, cpu_s, cpu_unaccounted_s, cpu_s_per_1000, origin_bytes,
    origin_requests, origin_cpu_s)."""
    measure = _load_measure()
    s0 = _Snapshot(cfg)
    obj = build(cfg)
    s1 = _Snapshot(cfg)
    emit({"kind": "setup", "seconds": s1.t - s0.t, **s1.delta(s0), "peer": describe(cfg, about, obj)})
    for e in range(int(cfg["epochs"])):
        before = _Snapshot(cfg)
        m = measure(epoch(obj, e), float(cfg.get("consumer_rate", 0.0)))
        after = _Snapshot(cfg)
        d = after.delta(before)
        per_k = 1000.0 / m.samples if m.samples else 0.0
        emit(
            {
                "kind": "epoch",
                "epoch": e,
                "samples": m.samples,
                "seconds": m.seconds,
                "samples_per_s": m.samples_per_s,
                "stall_fraction": m.stall_fraction,
                "first_batch_s": m.first_batch_s,
                "cpu_s_per_1000": d["cpu_s"] * per_k,
                "origin_cpu_s_per_1000": d["origin_cpu_s"] * per_k,
                **d,
            }
        )
    close = getattr(obj, "close", None)
    if callable(close):
        close()


def main(convert, build, epoch, about: dict | None = None) -> None:
    """Command line of a runner: ``convert SRC OUT CFG_JSON`` or ``read CFG_JSON``; ``about``:
    see the module's docstring."""
    subreaper()
    cmd = sys.argv[1] if len(sys.argv) > 1 else ""
    if cmd == "convert" and len(sys.argv) == 5:
        with open(sys.argv[4]) as f:
            cfg = json.load(f)
        t = time.perf_counter()
        convert(sys.argv[2], sys.argv[3], cfg)
        emit({"kind": "convert", "seconds": time.perf_counter() - t})
    elif cmd == "read" and len(sys.argv) == 3:
        with open(sys.argv[2]) as f:
            cfg = json.load(f)
        read_epochs(cfg, build, epoch, about)
    else:
        sys.exit(f"usage: {sys.argv[0]} convert SRC OUT CFG_JSON | read CFG_JSON")


def image_folder(src: str) -> list[tuple[str, int, str]]:
    """(path, label, key) of every image under ``src/<class>/``, sorted; labels follow sorted
    class names (as torchvision's ImageFolder and ``stoker pack`` number them)."""
    classes = sorted(d for d in os.listdir(src) if os.path.isdir(os.path.join(src, d)))
    out = []
    for label, c in enumerate(classes):
        for name in sorted(os.listdir(os.path.join(src, c))):
            if name.lower().endswith((".jpeg", ".jpg", ".png")):
                out.append((os.path.join(src, c, name), label, f"{c}/{os.path.splitext(name)[0]}"))
    return out


def crop_box(width: int, height: int, rng: random.Random) -> tuple[int, int, int, int]:
    """A RandomResizedCrop(scale 0.08-1, ratio 3/4-4/3) box ``(left, top, w, h)`` in pixels, drawn
    as torchvision's ``RandomResizedCrop.get_params`` draws it (10 tries, then a centre crop of
    the whole image clamped to the ratio range), for peers whose own operators take a fixed box."""
    area = width * height
    lo, hi = math.log(3 / 4), math.log(4 / 3)
    for _ in range(10):
        target = area * rng.uniform(0.08, 1.0)
        aspect = math.exp(rng.uniform(lo, hi))
        w = int(round(math.sqrt(target * aspect)))
        h = int(round(math.sqrt(target / aspect)))
        if 0 < w <= width and 0 < h <= height:
            return rng.randint(0, width - w), rng.randint(0, height - h), w, h
    ratio = width / height
    if ratio < 3 / 4:
        w, h = width, int(round(width / (3 / 4)))
    elif ratio > 4 / 3:
        w, h = int(round(height * (4 / 3))), height
    else:
        w, h = width, height
    return (width - w) // 2, (height - h) // 2, w, h
