"""`stoker bench faults`, the cases that are not one loader run: cache ownership, concurrent pack,
stray ImageFolder folders and a warm-up that meets a failing shard.

Each function takes a :class:`Context` and returns a report row (:func:`stoker_lab.bench.fault_harness.aggregate`
plus ``details``); ``details["problems"]`` lists what went wrong beyond the outcome (user files
changed, labels shifted, a false success), and a row with problems is not ``ok``. Every command
runs as a child with a hard timeout (:func:`stoker_lab.bench.fault_harness.run_child`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tarfile
from dataclasses import dataclass

from .fault_harness import LoaderRunner, Scenario, aggregate, child_env, run_child
from .faultproxy import Fault

_CLI = [sys.executable, "-m", "stoker.cli"]


@dataclass
class Context:
    """What every case gets: the work directory, the packed dataset (``local``, label = index,
    ``n_samples``), the origin and the fault proxy in front of it (``url``, ``storage_options``
    through the proxy), ``quick`` and whether Ray may be started (``ray``)."""

    work: str
    local: str
    n_samples: int
    origin: object
    proxy: object
    url: str
    storage_options: dict
    quick: bool = False
    ray: bool = True


def _photos(ctx: Context) -> list[str]:
    raw = os.path.join(ctx.work, "raw", "train")
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(raw) for f in fs)


def _digest_tree(root: str, tops: list[str]) -> dict[str, str]:
    out = {}
    for top in tops:
        for d, _, fs in os.walk(os.path.join(root, top)):
            for f in fs:
                p = os.path.join(d, f)
                with open(p, "rb") as fh:
                    out[os.path.relpath(p, root)] = hashlib.sha256(fh.read()).hexdigest()
    return out


def cache_ownership(ctx: Context) -> dict:
    """Failure 1: ``cache_dir`` also holds the user's WebDataset tars, a packed dataset (the
    job's own ``file://`` origin) and notes; the budget is half of what is on disk. Two epochs
    (policy ``future``, and ``lru`` unless quick), then ``stoker cache clear`` on it, then on a
    plain directory that was never a cache. Right: every user file byte-identical, the plain
    clear refused (exit 2)."""
    base = os.path.join(ctx.work, "cases", "owner")
    shutil.rmtree(base, ignore_errors=True)
    nvme = os.path.join(base, "nvme")
    os.makedirs(os.path.join(nvme, "wds-src"))
    photos = _photos(ctx)
    for s in range(4):
        with tarfile.open(os.path.join(nvme, "wds-src", f"{s:03d}.tar"), "w") as tar:
            for i, p in enumerate(photos[s::4][:8]):
                tar.add(p, arcname=f"s{s}_{i:03d}.jpg")
    shutil.copytree(ctx.local, os.path.join(nvme, "mydata"))
    os.makedirs(os.path.join(nvme, "notes"))
    with open(os.path.join(nvme, "notes", "todo.txt"), "w") as f:
        f.write("my own notes\n")
    tops = ["wds-src", "mydata", "notes"]
    before = _digest_tree(nvme, tops)
    total = sum(os.path.getsize(os.path.join(nvme, k)) for k in before)
    runner = LoaderRunner(base, os.path.join(nvme, "mydata"), {}, ctx.n_samples, ctx.proxy)
    rounds, problems, leftovers = [], [], [0, 0]
    for policy in ("future",) if ctx.quick else ("future", "lru"):
        row = runner.run(
            Scenario(
                f"owner-{policy}",
                spec={
                    "cache_dir": nvme,
                    "epochs": 2,
                    "open_kw": {"cache_bytes": total // 2, "cache_policy": policy},
                    "loader_kw": {"num_workers": 1, "staging_bytes": 4 << 20},
                },
            )
        )
        rounds.append(row)
        leftovers[0] += row["leftover_files"]
        leftovers[1] += row["leftover_shm"]
        changed = sorted(k for k, v in before.items() if _digest_tree(nvme, tops).get(k) != v)
        if changed:
            problems.append(f"policy {policy}: {len(changed)} user file(s) changed or deleted, e.g. {changed[:3]}")
            break
    rc, err = run_child(_CLI + ["cache", "clear", nvme], 60, child_env())
    changed = sorted(k for k, v in before.items() if _digest_tree(nvme, tops).get(k) != v)
    if changed:
        problems.append(f"cache clear (rc {rc}): {len(changed)} user file(s) changed or deleted, e.g. {changed[:3]}")
    plain = os.path.join(base, "plain")
    for rel, data in (("photos/a.jpg", b"x" * 100), ("thesis/draft.txt", b"y" * 50)):
        os.makedirs(os.path.dirname(os.path.join(plain, rel)), exist_ok=True)
        with open(os.path.join(plain, rel), "wb") as f:
            f.write(data)
    plain_before = _digest_tree(plain, ["photos", "thesis"])
    rc_plain, err_plain = run_child(_CLI + ["cache", "clear", plain], 60, child_env())
    gone = sorted(k for k, v in plain_before.items() if _digest_tree(plain, ["photos", "thesis"]).get(k) != v)
    if rc_plain != 2 or gone:
        problems.append(
            f"cache clear on a directory that is no cache: exit {rc_plain} (want 2), {len(gone)} of "
            f"{len(plain_before)} files deleted or changed ({err_plain.strip()[-160:]!r})"
        )
    row = _combine("cache_ownership", "completed", rounds, faults=len(before) + 2)
    row["leftover_files"], row["leftover_shm"] = leftovers
    row["details"]["problems"] = problems
    return row


def _combine(name: str, expected: str, rows: list[dict], faults: int) -> dict:
    """One row from several loader rows (worst outcome, summed counts)."""
    out = aggregate(name, expected, [], faults)
    order = ("signal_death", "hang", "failed", "skipped", "clean_error", "completed")
    outs = [r["outcome"] for r in rows] or ["failed"]
    out["outcome"] = min(outs, key=order.index)
    for r in rows:
        for k, v in r["outcomes"].items():
            out["outcomes"][k] = out["outcomes"].get(k, 0) + v
        for k in ("samples_lost", "samples_duplicated", "signal_deaths"):
            out[k] += r[k]
        out["_round_s"] += r.get("_round_s", [])
        out["details"].setdefault("errors", []).extend(r["details"].get("errors", []))
    return out


def concurrent_pack(ctx: Context) -> dict:
    """Failure 5: two ``stoker pack`` runs of different sources into one destination at once
    (1 trial with quick, else 3). Right: one refuses at once naming the destination (or its
    lease), the other's dataset verifies and holds each of its samples once."""
    base = os.path.join(ctx.work, "cases", "cpack")
    shutil.rmtree(base, ignore_errors=True)
    photos = _photos(ctx)
    srcs = {}
    for tag, pick in (("A", photos), ("B", photos[::2])):
        for p in pick:
            rel = os.path.relpath(p, os.path.join(ctx.work, "raw", "train"))
            os.makedirs(os.path.dirname(os.path.join(base, tag, rel)), exist_ok=True)
            shutil.copyfile(p, os.path.join(base, tag, rel))
        srcs[tag] = len(pick)
    rounds, env = [], child_env()
    import subprocess

    for trial in range(1 if ctx.quick else 3):
        dst = os.path.join(base, f"dst{trial}")
        procs = [
            subprocess.Popen(
                _CLI + ["pack", os.path.join(base, t), dst, "--shard-size", "64KiB", "--no-progress"],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,
                env=env,
            )
            for t in srcs
        ]
        rcs, errs = [], []
        for p in procs:
            try:
                errs.append(p.communicate(timeout=180)[1])
                rcs.append(p.returncode)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, 9)
                errs.append(p.communicate()[1])
                rcs.append(None)
        rec = {
            "outcome": "failed",
            "error": None,
            "lost": 0,
            "duplicated": 0,
            "signal_deaths": sum(1 for rc in rcs if rc is not None and rc < 0),
            "faults_injected": 1,
        }
        rc_v, err_v = run_child(_CLI + ["verify", dst], 120, env)
        if None in rcs:
            rec["outcome"] = "hang"
        elif rec["signal_deaths"]:
            rec["outcome"] = "signal_death"
        elif sorted(rcs) != [0, 2] and sorted(rcs) != [0, 1]:
            rec["error"] = f"pack exit codes {rcs} (one must refuse); verify exit {rc_v}"
        elif rc_v != 0:
            rec["error"] = f"verify exit {rc_v}: {err_v.strip()[-200:]}"
        else:
            loser = errs[rcs.index(0) ^ 1].strip()
            winner = list(srcs)[rcs.index(0)]
            rec["outcome"] = "clean_error" if dst in loser else "failed"
            rec["error"] = loser[-300:]
            from stoker.store.dataset import open_dataset

            ds = open_dataset(dst, cache=False)
            keys = [ds.key(i) for i in range(len(ds))]
            rec["lost"] = max(0, srcs[winner] - len(set(keys)))
            rec["duplicated"] = len(keys) - len(set(keys))
        rounds.append(rec)
    return aggregate("concurrent_pack", "clean_error", rounds)


def imagefolder_strays(ctx: Context) -> dict:
    """Failure 7: ``.ipynb_checkpoints/`` with an image copy, ``__MACOSX/`` with an AppleDouble
    ``._*`` file, and a validation split with an empty class folder packed with ``--classes``
    (the train dataset's list). Right: same samples and the same class -> label map as the
    clean tree; train and val agree."""
    base = os.path.join(ctx.work, "cases", "ifolder")
    shutil.rmtree(base, ignore_errors=True)
    photos, classes = _photos(ctx), ("cat", "dog", "owl")
    tree = {f"{c}/img{i}.jpg": photos[3 * k + i] for k, c in enumerate(classes) for i in range(3)}

    def write(tag: str, extra: dict, drop: str | None = None) -> str:
        root = os.path.join(base, tag, "src")
        for rel, src in {**tree, **extra}.items():
            if drop and rel.startswith(drop + "/"):
                continue
            os.makedirs(os.path.dirname(os.path.join(root, rel)), exist_ok=True)
            if isinstance(src, bytes):
                with open(os.path.join(root, rel), "wb") as f:
                    f.write(src)
            else:
                shutil.copyfile(src, os.path.join(root, rel))
        if drop:
            os.makedirs(os.path.join(root, drop), exist_ok=True)
        return root

    def pack_map(tag: str, root: str, *args: str) -> tuple[dict | None, int, str]:
        dst = os.path.join(base, tag, "packed")
        rc, err = run_child(_CLI + ["pack", root, dst, "--no-progress", *args], 120, child_env())
        if rc != 0:
            return None, 0, f"pack {tag}: exit {rc}: {err.strip()[-200:]}"
        from stoker.store.dataset import open_dataset

        ds = open_dataset(dst, cache=False)
        labels: dict[str, set] = {}
        for i in range(len(ds)):
            labels.setdefault(ds.key(i).split("/")[0], set()).add(int(ds[i][1]))
        return labels, len(ds), ""

    clean, n_clean, err = pack_map("clean", write("clean", {}))
    problems, rounds = [], []
    if clean is None:
        return {
            **aggregate("imagefolder_strays", "completed", [{"outcome": "failed", "error": err}]),
            "faults_injected": 0,
        }
    variants = {
        "ipynb_checkpoints": ({".ipynb_checkpoints/img0-checkpoint.jpg": tree["cat/img0.jpg"]}, None, ()),
        "macosx": ({"__MACOSX/cat/._img0.jpg": b"\x00\x05\x16\x07" + b"\x00" * 60}, None, ()),
        "val_empty_class": ({}, "dog", ("--classes", os.path.join(base, "clean", "packed"))),
    }
    for tag, (extra, drop, args) in variants.items():
        got, n, err = pack_map(tag, write(tag, extra, drop), *args)
        rec = {
            "outcome": "completed" if got is not None else "failed",
            "error": err or None,
            "lost": 0,
            "duplicated": 0,
            "faults_injected": 1,
        }
        if got is not None:
            want = n_clean - (3 if drop else 0)
            rec["lost"], rec["duplicated"] = max(0, want - n), max(0, n - want)
            shifted = {c: (sorted(clean.get(c, ())), sorted(v)) for c, v in got.items() if clean.get(c) != v}
            if shifted:
                problems.append(f"{tag}: labels differ from the clean tree's {shifted}")
        rounds.append(rec)
    row = aggregate("imagefolder_strays", "completed", rounds)
    row["details"]["problems"] = problems
    return row


def warm_failing_shard(ctx: Context) -> dict:
    """Failure 8: ``stoker warm --ray-address local`` while every ranged GET of one shard gets
    503, then a rerun without faults. Right: a non-zero exit with a partial report naming the
    shard, and a rerun that completes, fetching less than the whole dataset again."""
    if not ctx.ray:
        return {
            **aggregate("warm_failing_shard", "clean_error", []),
            "outcome": "skipped",
            "details": {"reason": "--no-ray"},
        }
    try:
        import ray  # noqa: F401
    except ImportError:
        return {
            **aggregate("warm_failing_shard", "clean_error", []),
            "outcome": "skipped",
            "details": {"reason": "ray is not installed"},
        }
    shards = sorted(f for f in os.listdir(os.path.join(ctx.local, "shards")) if f.endswith(".tar"))
    bad = shards[len(shards) // 2]
    cache = os.path.join(ctx.work, "cases", "warm", "cache")
    shutil.rmtree(cache, ignore_errors=True)
    argv = _CLI + [
        "warm",
        ctx.url,
        "--ray-address",
        "local",
        "--cache-dir",
        cache,
        "--cache-bytes",
        "256MiB",
        "--storage-options",
        json.dumps(ctx.storage_options),
        "--no-progress",
    ]
    before = ctx.proxy.stats()["faults_injected"]
    ctx.proxy.set_fault(Fault("status", 503, match=lambda m, p, h: m == "GET" and "range" in h and bad in p))
    try:
        rc, out, err = _run_out(argv, 300)
    finally:
        ctx.proxy.set_fault(None)
    rec = {"outcome": "failed", "error": None, "lost": 0, "duplicated": 0, "signal_deaths": 0}
    rep = _json_in(out)
    problems = []
    if rc is None:
        rec["outcome"] = "hang"
    elif rc < 0:
        rec["outcome"], rec["signal_deaths"] = "signal_death", 1
    elif rc == 0:
        rec["error"] = "exit 0 although a shard could not be read"
    elif rep is not None and bad in json.dumps(rep):
        rec["outcome"] = "clean_error"
    else:
        rec["error"] = f"exit {rc}, no report naming {bad}; stderr: {err.strip()[-200:]}"
    rc2, out2, err2 = _run_out(argv, 300)
    rep2 = _json_in(out2)
    data_bytes = sum(os.path.getsize(os.path.join(ctx.local, "shards", s)) for s in shards)
    if rc2 != 0:
        problems.append(f"rerun without faults: exit {rc2} ({err2.strip()[-160:]!r})")
    elif rep2 is None:
        problems.append("rerun without faults printed no report")
    elif rep2 and rep2.get("origin_bytes", 0) >= data_bytes:
        problems.append(f"rerun fetched {rep2.get('origin_bytes')} bytes again (dataset {data_bytes})")
    row = aggregate("warm_failing_shard", "clean_error", [rec], ctx.proxy.stats()["faults_injected"] - before)
    row["details"]["problems"] = problems
    return row


def _run_out(argv: list[str], timeout_s: float) -> tuple[int | None, str, str]:
    """Like :func:`run_child`, keeping stdout too: (rc or None on timeout, stdout, stderr tail)."""
    import subprocess
    import tempfile

    with tempfile.TemporaryFile() as out:
        p = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.PIPE, start_new_session=True, env=child_env()
        )
        try:
            _, err = p.communicate(timeout=timeout_s)
            rc = p.returncode
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, 9)
            _, err = p.communicate()
            rc = None
        out.seek(0)
        return rc, out.read().decode(errors="replace"), err.decode(errors="replace")[-2000:]


def _json_in(text: str) -> dict | None:
    try:
        return json.loads(text[text.index("{") : text.rindex("}") + 1])
    except ValueError:
        return None


CASES = {  # name -> (function, part of --quick)
    "cache_ownership": (cache_ownership, True),
    "concurrent_pack": (concurrent_pack, True),
    "imagefolder_strays": (imagefolder_strays, True),
    "warm_failing_shard": (warm_failing_shard, False),
}
