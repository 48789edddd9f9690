"""``stoker top DIR``: a live terminal view of one node's cache and the jobs reading through it,
refreshed every second (in the spirit of htop / nvtop), drawn with ``rich`` (the ``metrics`` extra).

It reads the same shared state as ``stoker cache status`` (:func:`stoker.cache.status.status`:
the job records, usage per dataset, the memory tier), plus the live figures each running loader
writes beside its job record every second (:mod:`stoker.loader.live`). ``--once`` draws one
frame; ``--json`` prints the snapshot (:func:`snapshot`) as JSON instead, for scripts (needs no
``rich``).
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import sys
import time

from ..cache.layout import namespace_dirs
from ..cache.status import status, tree_bytes
from ..storage import absolute_url
from .args import size_arg


def _live_records(root: str, pid: int, namespace: str) -> list[dict]:
    """The live-figures files of the loaders of process ``pid`` on ``namespace`` (unreadable ones skipped)."""
    out = []
    for path in sorted(glob.glob(os.path.join(glob.escape(root), ".jobs", f"{pid}-{glob.escape(namespace)}.*.live"))):
        try:
            with open(path) as f:
                rec = json.load(f)
        except (OSError, ValueError):
            continue  # being replaced, or half written by a dying process
        if isinstance(rec, dict):
            out.append(rec)
    return out


def _memory_usage(path: str) -> dict[str, int]:
    """{dataset version: bytes} the memory tier at ``path`` holds."""
    return {ns: tree_bytes(d) for ns, d in namespace_dirs(path)}


def _name(url: str | None, version: str) -> str:
    """What the view calls a dataset: its URL (as the metrics and ``stoker cache status`` do), or
    ``version <v>`` where no URL is known."""
    return absolute_url(url) if url else f"version {version}"


#: The figures a job's row takes from its loader's live-figures file (None without one).
_LIVE_FIELDS = (
    "rank",
    "epoch",
    "samples",
    "samples_per_s",
    "stall_fraction",
    "first_batch_s",
    "origin_bytes_per_s",
    "cache_hit_ratio",
    "prefetch_depth_bytes",
)


def _job_row(rec: dict, live: dict | None, now: float, urls: dict[str, str]) -> dict:
    """One job of the view: its record and, when a loader publishes, its live figures."""
    row = {"pid": rec["pid"], "dataset": None, "version": rec["namespace"], "dataset_bytes": rec.get("dataset_bytes")}
    row.update(url=urls.get(rec["namespace"]), **dict.fromkeys(_LIVE_FIELDS), age_s=None)
    if live is not None:
        row.update({k: live.get(k) for k in _LIVE_FIELDS}, url=live.get("url") or row["url"])
        row["age_s"] = round(now - float(live.get("time", now)), 3)
    row["dataset"] = _name(row["url"], rec["namespace"])
    return row


def snapshot(root: str, budget_bytes: int | None = None) -> dict:
    """What ``stoker top`` shows for the node cache at ``root``, as plain data.

    ``{"root", "time" (Unix s), "caches": [{"root", "used_bytes", "capacity_bytes" (the budget:
    ``budget_bytes`` or the one the running loaders report; None if unknown), "datasets":
    [{"dataset" (its URL, as ``stoker cache status`` and the metrics name it; ``"version <v>"``
    where the cache recorded none), "version" (content version), "url" (or None), "used_bytes"
    (disk tier), "memory_bytes" (memory tier), "share_bytes" (the future policy's split of the
    budget, None without one)}], "memory_tier": {"path", "used_bytes", "capacity_bytes"} or None,
    "jobs": [{"pid", "dataset", "version", "url", "rank", "epoch", "samples_per_s", "stall_fraction" (0..1),
    "first_batch_s", "origin_bytes_per_s", "cache_hit_ratio" (0..1), "prefetch_depth_bytes",
    "age_s" (seconds since the figures were written), ...}]}]}``; the epoch figures are the
    current epoch's so far, with :class:`stoker.EpochStats`' definitions. One entry in
    ``caches`` for ``root`` and one for each cache directly below it. Raises what
    :func:`stoker.cache.status.status` raises (FileNotFoundError, NotACacheError).
    """
    st = status(root, budget_bytes)
    now = time.time()
    caches = []
    for c in [st, *st["nested"]]:
        if not c["namespaces"] and not c["jobs"] and c is st and st["nested"]:
            continue  # a directory that only holds caches
        jobs, capacity, mem_capacity = [], budget_bytes, None
        urls = {ns: d["url"] for ns, d in c.get("datasets", {}).items() if d.get("url")}
        for rec in sorted(c["jobs"], key=lambda r: (r["namespace"], r["pid"])):
            lives: list[dict | None] = list(_live_records(c["root"], rec["pid"], rec["namespace"]))
            for live in lives or [None]:
                jobs.append(_job_row(rec, live, now, urls))
                if live is not None:
                    capacity = capacity or live.get("cache_capacity_bytes")
                    mem_capacity = mem_capacity or live.get("memory_capacity_bytes")
        capacity = capacity or c.get("budget_bytes")  # no live job: the budget the cache recorded
        mem = c["stores"].get("memory tier")
        in_mem = _memory_usage(mem["path"]) if mem is not None else {}
        caches.append(
            {
                "root": c["root"],
                "used_bytes": c["used_bytes"],
                "capacity_bytes": capacity,
                "datasets": [
                    {
                        "dataset": _name(urls.get(ns), ns),
                        "version": ns,
                        "url": urls.get(ns),
                        "used_bytes": c["namespaces"].get(ns, 0),
                        "memory_bytes": in_mem.get(ns, 0),
                        "share_bytes": c["quotas"].get(ns),
                    }
                    for ns in sorted(set(c["namespaces"]) | set(in_mem))
                ],
                "memory_tier": None
                if mem is None
                else {"path": mem["path"], "used_bytes": mem["bytes"], "capacity_bytes": mem_capacity},
                "jobs": jobs,
            }
        )
    return {"root": st["root"], "time": now, "caches": caches}


def _mb(n) -> str:
    return "-" if n is None else f"{n / 1e6:,.1f}"


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _num(x, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


#: The jobs table of :func:`render`: (header, the cell of a job row).
_JOB_COLUMNS = (
    ("pid", lambda j: str(j["pid"])),
    ("rank", lambda j: _num(j["rank"], "d")),
    ("dataset", lambda j: j["dataset"]),
    ("epoch", lambda j: _num(j["epoch"], "d")),
    ("samples/s", lambda j: _num(j["samples_per_s"], ",.1f")),
    ("stall", lambda j: _pct(j["stall_fraction"])),
    ("first batch s", lambda j: _num(j["first_batch_s"], ".2f")),
    ("origin MB/s", lambda j: _mb(j["origin_bytes_per_s"])),
    ("hit ratio", lambda j: _pct(j["cache_hit_ratio"])),
    ("prefetch MB", lambda j: _mb(j["prefetch_depth_bytes"])),
)


def render(snap: dict):
    """The rich renderable of a :func:`snapshot` (tables of jobs, datasets and the memory tier)."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    parts: list = [
        Text(f"stoker top  {snap['root']}  {time.strftime('%H:%M:%S', time.localtime(snap['time']))}", style="bold")
    ]
    for c in snap["caches"]:
        cap = c["capacity_bytes"]
        head = f"cache {c['root']}: {_mb(c['used_bytes'])} MB" + (f" of {_mb(cap)} MB" if cap else "")
        parts.append(Text(head))
        jobs = Table(title="jobs", title_justify="left", expand=False)
        for col, _ in _JOB_COLUMNS:
            jobs.add_column(col, justify="left" if col == "dataset" else "right")
        for j in c["jobs"]:
            jobs.add_row(*(cell(j) for _, cell in _JOB_COLUMNS))
        if not c["jobs"]:
            jobs.add_row("-", "", "no live job", *[""] * 7)
        parts.append(jobs)
        ds = Table(title="cache per dataset", title_justify="left")
        for col in ("dataset", "version", "disk MB", "memory MB", "share MB", "disk of budget"):
            ds.add_column(col, justify="left" if col in ("dataset", "version") else "right")
        for d in c["datasets"]:
            ds.add_row(
                d["dataset"],
                d["version"][:12],
                _mb(d["used_bytes"]),
                _mb(d["memory_bytes"]),
                _mb(d["share_bytes"]),
                _pct(d["used_bytes"] / cap) if cap else "-",
            )
        parts.append(ds)
        mem = c["memory_tier"]
        parts.append(
            Text(
                "memory tier: "
                + (
                    "none"
                    if mem is None
                    else f"{_mb(mem['used_bytes'])} MB"
                    + (f" of {_mb(mem['capacity_bytes'])} MB" if mem["capacity_bytes"] else "")
                    + f" in {mem['path']}"
                )
            )
        )
    return Group(*parts)


def _rich():
    try:
        import rich  # noqa: F401
    except ImportError:
        raise ValueError(
            "stoker top needs rich (the metrics extra): pip install -e '.[metrics]' in the stoker "
            "checkout (or use --json)"
        ) from None


def cmd_top(a) -> int:
    """``stoker top DIR``: the live view until Ctrl-C (exit 0); ``--once`` one frame; ``--json`` JSON."""
    if a.interval <= 0:
        raise ValueError(f"--interval must be > 0 seconds, got {a.interval}")
    if a.json:
        while True:
            print(json.dumps(snapshot(a.dir, a.budget), indent=None if not a.once else 2), flush=True)
            if a.once:
                return 0
            try:
                time.sleep(a.interval)
            except KeyboardInterrupt:
                return 0
    _rich()
    from rich.console import Console
    from rich.live import Live

    console = Console()
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console = Console(width=160)  # piped or to a file: rich's 80 columns would cut the figures
    if a.once or not console.is_terminal:
        console.print(render(snapshot(a.dir, a.budget)))
        return 0
    with contextlib.suppress(KeyboardInterrupt):
        with Live(render(snapshot(a.dir, a.budget)), console=console, screen=False, auto_refresh=False) as live:
            while True:
                time.sleep(a.interval)
                live.update(render(snapshot(a.dir, a.budget)), refresh=True)
    sys.stdout.flush()
    return 0


def add_parsers(sub) -> None:
    """Register ``stoker top`` on the top-level subparsers ``sub``."""
    p = sub.add_parser(
        "top", help="live view of a node cache: jobs (samples/s, stall, hit ratio), cache per dataset, memory tier"
    )
    p.add_argument("dir", help="node cache directory (as for `stoker cache status`)")
    p.add_argument(
        "--budget", type=size_arg, help="cache budget to show use against (default: the one the running loaders report)"
    )
    p.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes (default 1)")
    p.add_argument("--once", action="store_true", help="draw one frame and exit")
    p.add_argument("--json", action="store_true", help="print the snapshot as JSON (with --once: once)")
    p.set_defaults(fn=cmd_top)
