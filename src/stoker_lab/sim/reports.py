"""The measured reports ``stoker simulate --validate`` and ``tdcs`` read, checked before any model runs.

Each loader reads one JSON report and checks every field the model reads from it (present, of
the right type and range, consistent with the rest of the report), so that a wrong file, a
truncated one or one of another kind is refused with one line naming the file and what is wrong
instead of failing deep in the model. All of them raise ValueError with that line.

- :func:`load_json`: any report (the file exists, is JSON and holds an object);
- :func:`load_netns`: a ``stoker bench cluster --netns`` report, its ``peer_probe`` included
  (:func:`check_peer_probe`); :func:`netns_repeats`: such a report cut into one report per
  repeat (a report of ``--repeats N`` holds N; one made before repeats, one);
- :func:`load_demo`: a ``stoker demo --json`` report; :func:`load_decode`: a ``stoker bench
  decode --json`` report;
- :func:`default_path`: where a default report is looked for (the source checkout, else the
  current directory).
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

NETNS = "`stoker bench cluster --netns`"
DEMO = "`stoker demo --json`"
DECODE = "`stoker bench decode --json`"


def source_root(package_dir: str | os.PathLike | None = None) -> str | None:
    """The source checkout this package runs from: the directory above the package (``stoker/``,
    or ``src/stoker/``) whose ``pyproject.toml`` names the project ``stoker``; None for an
    installed package (e.g. under site-packages). ``package_dir`` defaults to this package's."""
    pkg = Path(package_dir) if package_dir is not None else Path(__file__).resolve().parents[1]
    for root in (pkg.parent, pkg.parent.parent):
        try:
            text = (root / "pyproject.toml").read_text()
        except OSError:
            continue
        if re.search(r'^name\s*=\s*["\']stoker["\']\s*$', text, re.M):
            return str(root)
    return None


def default_path(relative: str) -> str:
    """A default report path (relative, e.g. ``docs/demo.json``) resolved against the source
    checkout (:func:`source_root`) when the package runs from one, else the current directory;
    given relative to the current directory when it lies below it (as it is named in reports)."""
    root = source_root()
    if not root:
        return relative
    path = os.path.join(root, relative)
    rel = os.path.relpath(path)
    return path if rel.startswith(os.pardir) else rel


def load_json(path: str, option: str) -> dict:
    """The JSON object in ``path``, a report given by ``option`` (e.g. ``--netns``). Raises
    ValueError naming the option and path when there is no such file (or it is a directory or
    unreadable), and naming the path when the text is not JSON (e.g. truncated) or not an object."""
    if not os.path.exists(path):
        raise ValueError(f"{option} {path}: no such file")
    if os.path.isdir(path):
        raise ValueError(f"{option} {path}: is a directory, not a report file")
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise ValueError(f"{option} {path}: cannot read it ({e.strerror or e})") from None
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a report (a JSON {type(data).__name__}, not an object)")
    return data


def _get(obj: dict, dotted: str, path: str, kind: str, where: str = ""):
    cur = obj
    for part in dotted.split("."):
        if not isinstance(cur, dict) or part not in cur:
            raise ValueError(f"{path}: not a {kind} report (missing '{where}{dotted}')")
        cur = cur[part]
    return cur


def _num(
    value,
    name: str,
    path: str,
    low: float | None = None,
    strict: bool = False,
    integer: bool = False,
    high: float | None = None,
) -> float:
    """``value`` checked: a finite number (an integer with ``integer``) >= ``low`` (> with
    ``strict``) and < ``high``; ValueError naming ``path`` and the field ``name`` otherwise."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or (integer and value != int(value)):
        raise ValueError(f"{path}: {name} is {value!r}, not {'an integer' if integer else 'a number'}")
    if low is not None and (value <= low if strict else value < low):
        raise ValueError(f"{path}: {name} must be {'>' if strict else '>='} {low:g}, got {value!r}")
    if high is not None and value >= high:
        raise ValueError(f"{path}: {name} must be < {high:g}, got {value!r}")
    return value


def _field(obj: dict, dotted: str, path: str, kind: str, where: str = "", **check) -> float:
    return _num(_get(obj, dotted, path, kind, where), where + dotted, path, **check)


def _list(value, name: str, path: str, length: int | None = None) -> list:
    if not isinstance(value, list) or (length is not None and len(value) != length):
        want = f"a list of {length}" if length is not None else "a list"
        got = f"{len(value)} items" if isinstance(value, list) else repr(value)
        raise ValueError(f"{path}: {name} is not {want} ({got})")
    return value


def load_netns(path: str, option: str = "--netns") -> dict:
    """A ``stoker bench cluster --netns`` report (:mod:`stoker_lab.bench.netcluster_driver`), every
    field the model reads checked: ``hosts`` and one ``links`` entry ``h0`` .. ``h<hosts-1>`` each
    plus ``origin`` (rates in Mbit/s > 0), ``origin.latency_ms``, ``machine.cores``, ``config``
    (jobs, ranks per job, epochs, shard, block and cache bytes), ``dataset`` (samples, bytes,
    blocks) and ``runs`` (each of a known placement, a job ``job1`` .. ``job<jobs>`` and an epoch
    in ``0 .. epochs-1``, its ranks, samples, seconds and byte counts; its ``rank_hosts`` and
    ``rank_start_s``, when present, one per rank); ``control`` rank hosts and ``peer_probe``
    (:func:`check_peer_probe`) when present. Raises ValueError naming ``path`` (and ``option`` for
    a missing file): "PATH: not a `stoker bench cluster --netns` report (missing 'X')" for a
    report of another kind, else what is wrong."""
    from .decide import SETUPS

    rep = load_json(path, option)
    n = int(_field(rep, "hosts", path, NETNS, low=1, integer=True))
    links = _get(rep, "links", path, NETNS)
    if not isinstance(links, dict):
        raise ValueError(f"{path}: links is not an object")
    _get(rep, "links.origin", path, NETNS)
    want = [f"h{i}" for i in range(n)]
    if sorted(k for k in links if k != "origin") != sorted(want):
        have = ", ".join(sorted(k for k in links if k != "origin")) or "none"
        raise ValueError(f"{path}: hosts is {n} but its links name the hosts {have} (want h0..h{n - 1} and origin)")
    for name in [*want, "origin"]:
        _field(rep, f"links.{name}.mbit", path, NETNS, low=0, strict=True)
    for name in want:
        if not isinstance(_get(rep, f"links.{name}.ns", path, NETNS), str):
            raise ValueError(f"{path}: links.{name}.ns is not a namespace name")
    _field(rep, "origin.latency_ms", path, NETNS, low=0)
    _field(rep, "machine.cores", path, NETNS, low=0, strict=True)
    for key in ("jobs", "ranks_per_job", "epochs", "shard_bytes", "block_bytes"):
        _field(rep, f"config.{key}", path, NETNS, low=1, integer=True)
    _field(rep, "config.cache_bytes_per_node", path, NETNS, low=0)
    if "seed" in rep["config"]:
        _field(rep, "config.seed", path, NETNS, low=0, integer=True)
    samples = int(_field(rep, "dataset.samples", path, NETNS, low=1, integer=True))
    for key in ("bytes", "blocks"):
        _field(rep, f"dataset.{key}", path, NETNS, low=1, integer=True)
    runs = _list(_get(rep, "runs", path, NETNS), "runs", path)
    if not runs:
        raise ValueError(f"{path}: no runs (no epoch to model)")
    jobs, epochs = {f"job{j + 1}" for j in range(int(rep["config"]["jobs"]))}, int(rep["config"]["epochs"])
    repeats = int(_field(rep, "config.repeats", path, NETNS, low=1, integer=True)) if "repeats" in rep["config"] else 1
    for key in ("consumer_rate",):
        if key in rep["config"]:
            _field(rep, f"config.{key}", path, NETNS, low=0)
    for i, r in enumerate(runs):
        _check_run(r, f"runs[{i}].", path, n, jobs, epochs, SETUPS)
        if "repeat" in r:
            _field(r, "repeat", path, NETNS, f"runs[{i}].", low=0, integer=True, high=repeats)
    _check_probes(rep, "", path, n, samples)
    probes = rep.get("repeat_probes")
    if probes is not None:
        for k, probe in enumerate(_list(probes, "repeat_probes", path)):
            if not isinstance(probe, dict) or probe.get("repeat") != k:
                raise ValueError(f"{path}: repeat_probes[{k}] is not the probes of repeat {k}")
            _check_probes(probe, f"repeat_probes[{k}].", path, n, samples)
    if rep.get("decode_probe") is not None:
        _field(rep, "decode_probe.cpu_s_per_sample", path, NETNS, low=0, strict=True)
    return rep


def _check_probes(rep: dict, where: str, path: str, hosts: int, samples: int) -> None:
    """A report's (or one repeat's, ``where``) control rank hosts and peer and local probes."""
    for placement, ctl in (rep.get("control") or {}).items():
        got = ctl.get("rank_hosts") if isinstance(ctl, dict) else None
        if got is not None:
            for h in _list(got, f"{where}control.{placement}.rank_hosts", path):
                _num(h, f"{where}control.{placement}.rank_hosts", path, low=-1, integer=True, high=hosts)
    for kind in ("peer", "local"):
        if rep.get(f"{kind}_probe"):
            check_peer_probe(rep[f"{kind}_probe"], f"{path}: {where[:-1]}" if where else path, hosts, samples, kind)


def run_repeat(row: dict) -> int:
    """The repeat a ``--netns`` row belongs to: its ``repeat``, 0 for a row of a report made
    before repeats."""
    return int(row.get("repeat", 0))


def netns_repeats(report: dict) -> list[tuple[int, dict]]:
    """A ``--netns`` report (:func:`load_netns`) cut by repeat: ``[(repeat, report of that repeat
    alone)]`` in repeat order, each a shallow copy with only that repeat's ``runs`` and that
    repeat's ``control``, ``idle_busy_cores``, ``peer_probe`` and ``local_probe`` (from
    ``repeat_probes``; the report's own for repeat 0 when it has none). A report made before
    repeats (rows without ``repeat``) is one repeat, 0, and comes back unchanged."""
    found = sorted({run_repeat(r) for r in report["runs"]})
    if found == [0] and not report.get("repeat_probes"):
        return [(0, report)]
    probes = {int(p["repeat"]): p for p in report.get("repeat_probes") or []}
    out = []
    for k in found:
        sub = dict(report, runs=[r for r in report["runs"] if run_repeat(r) == k])
        for key in ("control", "idle_busy_cores", "peer_probe", "local_probe"):
            sub[key] = probes[k].get(key) if k in probes else (report.get(key) if k == 0 else None)
        out.append((k, sub))
    return out


def _check_run(r, where: str, path: str, hosts: int, jobs: set[str], epochs: int, setups: tuple[str, ...]) -> None:
    """One row of a ``--netns`` report's ``runs`` (:func:`load_netns`)."""
    if not isinstance(r, dict):
        raise ValueError(f"{path}: {where[:-1]} is not an object")
    placement, job = _get(r, "placement", path, NETNS, where), _get(r, "job", path, NETNS, where)
    if placement not in setups:
        raise ValueError(f"{path}: {where}placement {placement!r} is none of {', '.join(setups)}")
    if job not in jobs:
        raise ValueError(
            f"{path}: {where}job {job!r} is none of the config's {len(jobs)} jobs ({', '.join(sorted(jobs))})"
        )
    _field(r, "epoch", path, NETNS, where, low=0, integer=True, high=epochs)
    ranks = int(_field(r, "ranks", path, NETNS, where, low=1, integer=True))
    _field(r, "samples", path, NETNS, where, low=1, integer=True)
    _field(r, "seconds", path, NETNS, where, low=0)
    for key in ("stoker.origin_bytes", "stoker.peer_bytes", "kernel.origin_link_bytes", "kernel.host_link_bytes"):
        _field(r, key, path, NETNS, where, low=0)
    if "rank_hosts" in r:
        for h in _list(r["rank_hosts"], f"{where}rank_hosts", path, ranks):
            _num(h, f"{where}rank_hosts", path, low=-1, integer=True, high=hosts)
    elif placement == "random":  # the host order is read off the kernel's per-host counts
        for i in range(hosts):
            _field(r, f"kernel.links.h{i}.rx_bytes", path, NETNS, where, low=0)
    if "rank_start_s" in r:
        for s in _list(r["rank_start_s"], f"{where}rank_start_s", path, ranks):
            _num(s, f"{where}rank_start_s", path, low=0)


def check_peer_probe(probe, path: str, hosts: int, samples: int, kind: str = "peer") -> None:
    """A ``--netns`` report's ``peer_probe`` or, with ``kind="local"``, ``local_probe``
    (``stoker_lab.bench.netcluster_driver``): ``seconds`` > 0;
    per rank one host in ``0 .. hosts-1`` (``rank_hosts``), one start offset >= 0 s
    (``rank_start_s``) and one list of sample ids in ``0 .. samples-1`` (``ids``), each list at most
    ``samples_per_rank`` long where the report gives it (the driver reads that many of the samples
    a rank's peers hold, fewer when they hold fewer), some ids read in all; ``rank_seconds`` one
    per rank where present. Raises ValueError "PATH: peer_probe: <what is wrong>"."""

    def bad(what: str) -> ValueError:
        return ValueError(f"{path}: {kind}_probe: {what}")

    if not isinstance(probe, dict):
        raise bad(f"is {type(probe).__name__}, not an object")
    for key in ("seconds", "rank_hosts", "rank_start_s", "ids"):
        if key not in probe:
            raise bad(f"missing '{key}'")
    secs = probe["seconds"]
    if isinstance(secs, bool) or not isinstance(secs, (int, float)) or not math.isfinite(secs) or secs <= 0:
        raise bad(f"seconds must be a number > 0, got {secs!r}")
    rank_hosts = probe["rank_hosts"]
    if not isinstance(rank_hosts, list) or not rank_hosts:
        raise bad(f"rank_hosts must be a list of one host per rank, got {rank_hosts!r}")
    if not all(isinstance(h, int) and not isinstance(h, bool) and 0 <= h < hosts for h in rank_hosts):
        raise bad(f"rank_hosts {rank_hosts}: each must be a host in 0..{hosts - 1} (-1: a rank on no recorded host)")
    ranks = len(rank_hosts)
    for key in ("rank_start_s", "rank_seconds"):
        vals = probe.get(key)
        if key not in probe and key == "rank_seconds":
            continue
        if (
            not isinstance(vals, list)
            or len(vals) != ranks
            or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0 for v in vals
            )
        ):
            raise bad(f"{key} must be {ranks} numbers >= 0 (one per rank of rank_hosts), got {vals!r}")
    ids = probe["ids"]
    if not isinstance(ids, list) or len(ids) != ranks or not all(isinstance(x, list) for x in ids):
        raise bad(f"ids must be {ranks} lists of sample ids (one per rank of rank_hosts)")
    most = probe.get("samples_per_rank")
    if most is not None and (isinstance(most, bool) or not isinstance(most, int) or most < 1):
        raise bad(f"samples_per_rank must be an integer >= 1, got {most!r}")
    for rank, mine in enumerate(ids):
        if most is not None and len(mine) > most:
            raise bad(f"rank {rank} read {len(mine)} ids, more than samples_per_rank {most}")
        for i in mine:
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < samples:
                raise bad(f"rank {rank}: id {i!r} is not a sample of the dataset (0..{samples - 1})")
    if not any(ids):
        raise bad(f"no ids read (nothing to fit the {kind} read time on)")


def load_demo(path: str, option: str = "--demo") -> dict:
    """A ``stoker demo --json`` report, every field the model reads checked: ``dataset`` (samples,
    bytes), ``config`` (shard and block bytes, workers, batch size, epochs), ``origin``
    (bandwidth_MBps > 0, latency_ms), ``limits.decode_per_core`` > 0 and at least one ``stoker``
    row in ``runs`` (consumer rate, an epoch in ``0 .. epochs-1``, seconds, origin bytes; with
    ``cpu_s``, ``machine.cores``). Raises ValueError naming ``path`` as :func:`load_netns` does."""
    rep = load_json(path, option)
    for key in ("samples", "bytes"):
        _field(rep, f"dataset.{key}", path, DEMO, low=1, integer=True)
    for key in ("shard_bytes", "block_bytes", "workers", "batch_size", "epochs"):
        _field(rep, f"config.{key}", path, DEMO, low=1, integer=True)
    _field(rep, "origin.bandwidth_MBps", path, DEMO, low=0, strict=True)
    _field(rep, "origin.latency_ms", path, DEMO, low=0)
    _field(rep, "limits.decode_per_core", path, DEMO, low=0, strict=True)
    runs = _list(_get(rep, "runs", path, DEMO), "runs", path)
    mine = [(i, r) for i, r in enumerate(runs) if isinstance(r, dict) and r.get("loader") == "stoker"]
    if not mine:
        raise ValueError(f"{path}: no runs of loader 'stoker' (nothing to validate)")
    epochs = int(rep["config"]["epochs"])
    for i, r in mine:
        where = f"runs[{i}]."
        _field(r, "consumer_rate", path, DEMO, where, low=0)
        _field(r, "epoch", path, DEMO, where, low=0, integer=True, high=epochs)
        _field(r, "seconds", path, DEMO, where, low=0)
        _field(r, "origin_bytes", path, DEMO, where, low=0)
        if "cpu_s" in r:
            if not isinstance(r["cpu_s"], dict):
                raise ValueError(f"{path}: {where}cpu_s is not an object of seconds per process")
            for k, v in r["cpu_s"].items():
                _num(v, f"{where}cpu_s.{k}", path, low=0)
            _field(rep, "machine.cores", path, DEMO, low=0, strict=True)
    return rep


def load_decode(path: str, option: str = "--decode") -> dict:
    """A ``stoker bench decode --json`` report: ``per_core.stoker`` (samples/s per core, > 0) and
    ``loader`` rows (``workers`` >= 1, ``samples_per_s`` > 0). Raises ValueError naming ``path``
    as :func:`load_netns` does."""
    rep = load_json(path, option)
    _field(rep, "per_core.stoker", path, DECODE, low=0, strict=True)
    rows = _list(_get(rep, "loader", path, DECODE), "loader", path)
    if not rows:
        raise ValueError(f"{path}: loader has no rows")
    for i, r in enumerate(rows):
        if not isinstance(r, dict):
            raise ValueError(f"{path}: loader[{i}] is not an object")
        _field(r, "workers", path, DECODE, f"loader[{i}].", low=1, integer=True)
        _field(r, "samples_per_s", path, DECODE, f"loader[{i}].", low=0, strict=True)
    return rep
