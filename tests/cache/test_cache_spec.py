"""One node-cache spec, :class:`stoker.CacheOptions`, and the cluster's own group,
:class:`stoker.cluster.ClusterOptions`: their checks, the five entry points that take them, the
shortcut ``cache_dir=``/``cache_bytes=``, the old keywords (still taken, with a warning), and a
walk of ``cache_bytes`` through the product: stored once, in the option object, and read where
the budget is enforced."""

from __future__ import annotations

import ast
import inspect
import pathlib

import pytest

import stoker
from stoker import CacheOptions
from stoker.cache import TieredCache
from stoker.cache.readonly import ReadOnlyCache
from stoker.cluster import ClusterOptions
from stoker.cluster.settings import FIELDS, cluster_door

SRC = pathlib.Path(stoker.__file__).parent


# -- the options --------------------------------------------------------------------------------
def test_cache_options_parse_sizes_and_modes_once():
    c = CacheOptions(cache_dir=pathlib.Path("/c"), cache_bytes="64MiB", memory_bytes="1GiB", cache_mode="0640")
    assert (c.cache_dir, c.cache_bytes, c.memory_bytes, c.cache_mode) == ("/c", 64 << 20, 1 << 30, 0o640)
    assert CacheOptions(cache_bytes={"n1": "1GiB", "n2": 0}).cache_bytes == {"n1": 1 << 30, "n2": 0}
    assert CacheOptions() == CacheOptions(cache_policy="future")  # None: the defaults, resolved where used


@pytest.mark.parametrize(
    "kw, err, match",
    [
        ({"cache_bytes": "lots"}, ValueError, r"CacheOptions\.cache_bytes.*'lots'"),
        ({"cache_bytes": -1}, ValueError, r"CacheOptions\.cache_bytes must not be negative"),
        ({"cache_bytes": {"n1": "x"}}, ValueError, r"CacheOptions\.cache_bytes\['n1'\]"),
        ({"cache_bytes": {"n1": 0}}, ValueError, "cache_bytes must give some node a budget above 0"),
        ({"memory_bytes": True}, TypeError, r"CacheOptions\.memory_bytes"),
        ({"cache_policy": "fifo"}, ValueError, r"CacheOptions\.cache_policy must be one of .*'lru'.*'fifo'"),
        ({"cache_mode": "0666"}, ValueError, r"CacheOptions\.cache_mode: .*not allowed"),
        ({"cache_read_only": "yes"}, TypeError, r"CacheOptions\.cache_read_only must be True, False or None"),
        ({"cache_dir": 3}, TypeError, r"CacheOptions\.cache_dir must be a directory path"),
        ({"memory_bytes": "8MiB", "cache_read_only": True}, ValueError, r"CacheOptions\.cache_read_only=True cannot"),
    ],
)
def test_cache_options_refuse_a_bad_field_by_name(kw, err, match):
    with pytest.raises(err, match=match):
        CacheOptions(**kw)


def test_for_node_gives_each_node_its_budget():
    assert CacheOptions().for_node("a").cache_bytes == 8 << 30
    spec = CacheOptions(cache_dir="/r", cache_bytes={"a": "1GiB", "b": 0})
    assert spec.for_node("a") == CacheOptions(cache_dir="/r", cache_bytes=1 << 30)
    assert spec.for_node("b") is None and spec.for_node("c") is None


@pytest.mark.parametrize(
    "kw, err, match",
    [
        ({"placement": "nearby"}, ValueError, r"ClusterOptions\.placement must be one of"),
        ({"slots_per_node": 0}, ValueError, r"ClusterOptions\.slots_per_node must be >= 1"),
        ({"seed": 1.5}, TypeError, r"ClusterOptions\.seed must be an integer"),
        ({"peer_timeout_s": 0}, ValueError, r"ClusterOptions\.peer_timeout_s must be > 0"),
        ({"retry_s": -1}, ValueError, r"ClusterOptions\.retry_s must be >= 0"),
        ({"timeout_s": "1h"}, TypeError, r"ClusterOptions\.timeout_s must be a number of seconds"),
        ({"wait": 0}, TypeError, r"ClusterOptions\.wait must be True or False"),
        ({"job": 7}, TypeError, r"ClusterOptions\.job must be a name"),
        ({"process_group": "mpi"}, ValueError, r"ClusterOptions\.process_group must be one of"),
    ],
)
def test_cluster_options_refuse_a_bad_field_by_name(kw, err, match):
    with pytest.raises(err, match=match):
        ClusterOptions(**kw)


# -- the entry points ---------------------------------------------------------------------------
def _entry_points():
    from stoker.cluster.jobs.job import run
    from stoker.cluster.service.warmup import warm
    from stoker.cluster.train.hint import placement_hint
    from stoker.cluster.train.rankdata import rank_context

    return {"open_dataset": stoker.open_dataset, "run": run, "warm": warm}, {
        "rank_context": rank_context,
        "placement_hint": placement_hint,
    }


def test_each_entry_point_takes_cache_and_its_shortcut_in_at_most_ten_parameters():
    plain, cluster = _entry_points()
    for name, fn in {**plain, **cluster}.items():
        params = inspect.signature(fn).parameters
        named = [p for p in params.values() if p.kind is not p.VAR_KEYWORD]
        assert len(named) <= 10, f"{name}: {len(named)} parameters"
        assert {"cache", "cache_dir", "cache_bytes"} <= set(params), name
    for name in ("run", "rank_context", "placement_hint"):
        assert "cluster" in inspect.signature({**plain, **cluster}[name]).parameters, name


def test_open_dataset_reads_the_spec_whole(packed_local, tmp_path):
    spec = CacheOptions(cache_dir=tmp_path / "c", cache_bytes="64MiB", memory_bytes="8MiB", memory_dir=tmp_path / "m")
    ds = stoker.open_dataset(packed_local, cache=spec, block_bytes="64KiB")
    assert isinstance(ds.cache, TieredCache)
    assert (ds.cache.disk.capacity_bytes, ds.cache.memory.capacity_bytes) == (64 << 20, 8 << 20)
    assert ds.cache.memory.root == str(tmp_path / "m") and ds.cache.disk.root == str(tmp_path / "c")
    short = stoker.open_dataset(packed_local, str(tmp_path / "s"), "32MiB", cache=CacheOptions(cache_policy="lru"))
    assert (short.cache.capacity_bytes, short.cache.policy) == (32 << 20, "lru")
    assert stoker.open_dataset(packed_local, cache=False).cache is None
    ro = stoker.open_dataset(packed_local, cache=CacheOptions(cache_dir=tmp_path / "c", cache_read_only=True))
    assert isinstance(ro.cache, ReadOnlyCache)
    with pytest.raises(ValueError, match="cannot have a memory tier"):
        stoker.open_dataset(
            packed_local, cache=CacheOptions(cache_dir=tmp_path / "c", cache_read_only=True, memory_bytes=1)
        )
    with pytest.raises(TypeError, match="by node id is for stoker.cluster"):
        stoker.open_dataset(packed_local, cache=CacheOptions(cache_dir=tmp_path / "c", cache_bytes={"n": 1}))


def test_a_shortcut_and_the_same_field_of_cache_is_a_type_error(packed_local, tmp_path):
    with pytest.raises(TypeError, match=r"cache_dir= and cache=CacheOptions\(cache_dir=...\) were both given"):
        stoker.open_dataset(packed_local, str(tmp_path / "a"), cache=CacheOptions(cache_dir=str(tmp_path / "b")))
    with pytest.raises(TypeError, match=r"cache_bytes= and cache=CacheOptions\(cache_bytes=...\) were both given"):
        cluster_door("run", CacheOptions(cache_bytes=1), None, 2, None, {}, FIELDS)
    with pytest.raises(TypeError, match="cache must be a stoker.CacheOptions"):
        stoker.open_dataset(packed_local, cache={"cache_dir": "/c"})
    with pytest.raises(TypeError, match="cluster must be a stoker.cluster.ClusterOptions"):
        cluster_door("run", None, None, None, {"job": "x"}, {}, FIELDS)


def test_the_old_open_dataset_keywords_warn_and_still_work(packed_local, tmp_path):
    with pytest.warns(DeprecationWarning) as got:
        ds = stoker.open_dataset(
            packed_local, str(tmp_path / "c"), "64MiB", memory_bytes="8MiB", memory_dir=str(tmp_path / "m")
        )
    assert [str(w.message) for w in got] == [
        "memory_bytes= is deprecated; use cache=CacheOptions(memory_bytes=...)",
        "memory_dir= is deprecated; use cache=CacheOptions(memory_dir=...)",
    ]
    assert isinstance(ds.cache, TieredCache) and ds.cache.memory.capacity_bytes == 8 << 20
    with pytest.warns(DeprecationWarning, match=r"cache_policy= is deprecated"):
        assert stoker.open_dataset(packed_local, str(tmp_path / "d"), cache_policy="noevict").cache.policy == "noevict"
    with pytest.raises(TypeError, match=r"cache_mode= and cache= were both given"):
        stoker.open_dataset(packed_local, cache=CacheOptions(), cache_mode="0640")
    with pytest.raises(TypeError, match=r"open_dataset\(\) got an unexpected keyword argument 'cache_size'"):
        stoker.open_dataset(packed_local, cache_size=1)


def test_the_cluster_entry_points_take_the_groups_and_their_old_keywords(monkeypatch):
    """``run``, ``warm``, ``rank_context`` and ``placement_hint`` turn their keywords into one
    CacheOptions (what the services get: ``prepare`` records it here) and one ClusterOptions; an
    old keyword warns in the house's words, before anything starts."""
    pytest.importorskip("ray")
    from stoker.cluster.jobs import job
    from stoker.cluster.service import warmup
    from stoker.cluster.train import hint, rankdata

    seen: list = []

    class Stop(Exception):
        pass

    def prepare(url, opts, cache, block_bytes, **kw):
        seen.append(cache)
        raise Stop()

    for mod in (job, warmup, hint):
        monkeypatch.setattr(mod, "prepare", prepare)
    spec = CacheOptions(cache_bytes="64MiB", memory_bytes="1GiB")
    with pytest.raises(Stop):
        job.run(lambda ctx: None, "s3://b/d", 1, cache_dir="/c", cache=spec, cluster=ClusterOptions(job="j"))
    with pytest.raises(Stop):
        warmup.warm("s3://b/d", cache=spec)
    with pytest.raises(Stop):
        hint.placement_hint("s3://b/d", 1, cache_dir="/c", cache_bytes={"n1": "1GiB"})
    assert seen == [
        CacheOptions(cache_dir="/c", cache_bytes=64 << 20, memory_bytes=1 << 30),
        spec,
        CacheOptions(cache_dir="/c", cache_bytes={"n1": 1 << 30}),
    ]
    with pytest.warns(DeprecationWarning, match=r"slots_per_node= is deprecated; use cluster=ClusterOptions\("):
        with pytest.raises(Stop):
            hint.placement_hint("s3://b/d", 1, slots_per_node=2)
    with pytest.warns(DeprecationWarning, match=r"job= is deprecated; use cluster=ClusterOptions\(job=...\)"):
        with pytest.raises(Stop):
            job.run(lambda ctx: None, "s3://b/d", 1, job="old")
    with pytest.warns(DeprecationWarning, match="detached= is deprecated; cache services are always detached"):
        with pytest.raises(Stop):
            warmup.warm("s3://b/d", detached=True)
    with pytest.raises(TypeError, match=r"job= and cluster= were both given"):
        job.run(lambda ctx: None, "s3://b/d", 1, job="old", cluster=ClusterOptions())
    with pytest.raises(TypeError, match=r"warm\(\) got an unexpected keyword argument 'job'"):
        warmup.warm("s3://b/d", job="x")
    with pytest.raises(TypeError, match=r"rank_context\(\) got an unexpected keyword argument 'placement'"):
        rankdata.rank_context("s3://b/d", placement="random")
    with pytest.warns(DeprecationWarning, match=r"timeout_s= is deprecated"):
        with pytest.raises(RuntimeError, match="after ray.init"):  # no Ray here: the door ran first
            rankdata.rank_context("s3://b/d", 0, 1, timeout_s=5)


def test_cluster_door_moves_the_old_keywords_into_the_groups():
    with pytest.warns(DeprecationWarning) as got:
        cache, cluster = cluster_door(
            "run", None, None, "1GiB", None, {"job": "a", "seed": 2, "cache_root": "/r"}, FIELDS
        )
    assert cache == CacheOptions(cache_dir="/r", cache_bytes=1 << 30)
    assert cluster == ClusterOptions(job="a", seed=2)
    assert sorted(str(w.message).split("=")[0] for w in got) == ["cache_root", "job", "seed"]


# -- the walk of cache_bytes --------------------------------------------------------------------
#: The option object's own module: the one place the value is stored (and parsed).
HOME = pathlib.Path("cache") / "spec.py"
#: Calls that turn a value into a copy of itself.
CONVERTERS = {"int", "float", "parse_size", "dict"}
#: The doors through which an entry point's ``cache_bytes`` goes into the option object.
DOORS = {"with_shortcuts", "cluster_door"}
#: The entry points (module under the product, function) that take the shortcut ``cache_bytes``.
ENTRY_POINTS = [
    ("store/dataset.py", "open_dataset"),
    ("cluster/jobs/job.py", "run"),
    ("cluster/service/warmup.py", "warm"),
    ("cluster/train/rankdata.py", "rank_context"),
    ("cluster/train/hint.py", "placement_hint"),
    ("cluster/service/cache_service.py", "start_services"),
]


def _is_budget(node: ast.AST) -> bool:
    return (isinstance(node, ast.Name) and node.id == "cache_bytes") or (
        isinstance(node, ast.Attribute) and node.attr == "cache_bytes"
    )


def _carries(node: ast.AST | None) -> bool:
    """Whether the value of expression ``node`` is (a copy of) a ``cache_bytes``: the name or
    attribute itself, or through a conditional, a container, arithmetic, a subscript or a
    converter; a call of anything else takes it as an argument and is where it is used."""
    if node is None:
        return False
    if _is_budget(node):
        return True
    if isinstance(node, ast.Call):
        name = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
        return name in CONVERTERS and any(_carries(a) for a in [*node.args, *(k.value for k in node.keywords)])
    if isinstance(node, ast.IfExp):
        return _carries(node.body) or _carries(node.orelse)
    if isinstance(node, ast.BoolOp):
        return any(_carries(v) for v in node.values)
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_carries(e) for e in node.elts)
    if isinstance(node, ast.Dict):
        return any(_carries(v) for v in node.values)
    if isinstance(node, (ast.DictComp, ast.ListComp, ast.SetComp, ast.GeneratorExp)):
        parts = [node.key, node.value] if isinstance(node, ast.DictComp) else [node.elt]
        return any(_carries(p) for p in parts) or any(_carries(g.iter) for g in node.generators)
    if isinstance(node, (ast.BinOp, ast.UnaryOp, ast.Starred, ast.Subscript, ast.NamedExpr)):
        return any(_carries(getattr(node, f, None)) for f in ("left", "right", "operand", "value"))
    return False


def walk_cache_bytes(src: pathlib.Path) -> list[str]:
    """Where the product at ``src`` stores ``cache_bytes`` outside the option object, copies it
    into another name, takes it in an entry point other than through the door, or does not read
    it at the node cache's construction; ``[]`` when it travels as it should."""
    bad = []
    for path in sorted(src.rglob("*.py")):
        rel = path.relative_to(src)
        if rel == HOME:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            where = f"{rel}:{getattr(node, 'lineno', '?')}"
            if isinstance(node, ast.Attribute) and node.attr == "cache_bytes" and isinstance(node.ctx, ast.Store):
                bad.append(f"{where}: stored in an attribute ({ast.unparse(node)} = ...)")
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.NamedExpr)) and _carries(node.value):
                bad.append(f"{where}: copied under another name ({ast.unparse(node)[:80]})")
            elif isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) in (
                "setattr",
                "__setattr__",
            ):
                if any(isinstance(a, ast.Constant) and a.value == "cache_bytes" for a in node.args):
                    bad.append(f"{where}: stored with setattr")
    for rel, name in ENTRY_POINTS:
        if not (src / rel).exists():
            bad.append(f"{rel}: missing")
            continue
        tree = ast.parse((src / rel).read_text())
        fn = next((n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name), None)
        if fn is None:
            bad.append(f"{rel}: no {name}()")
            continue
        uses = [n for n in ast.walk(fn) if isinstance(n, ast.Name) and n.id == "cache_bytes"]
        doors = [
            n
            for n in ast.walk(fn)
            if isinstance(n, ast.Call)
            and getattr(n.func, "id", None) in DOORS
            and any(isinstance(a, ast.Name) and a.id == "cache_bytes" for a in n.args)
        ]
        if len(uses) != 1 or len(doors) != 1:
            bad.append(
                f"{rel}: {name}() reads cache_bytes {len(uses)} time(s); once, by one of {sorted(DOORS)}, is all"
            )
    # read where the budget is enforced: the node cache is built from the option object's field
    tree = ast.parse((src / "store" / "dataset.py").read_text())
    built = False
    for fn in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)):
        specs = {
            a.arg for a in fn.args.args if a.annotation is not None and "CacheOptions" in ast.unparse(a.annotation)
        }
        for call in (n for n in ast.walk(fn) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "DiskCache"):
            capacity = call.args[1] if len(call.args) > 1 else None
            reads = [n for n in ast.walk(capacity) if _is_budget(n)] if capacity is not None else []
            built |= any(isinstance(r, ast.Attribute) and ast.unparse(r.value) in specs for r in reads)
    if not built:
        bad.append("store/dataset.py: no DiskCache built with <CacheOptions>.cache_bytes as its budget")
    return bad


def test_cache_bytes_is_stored_once_in_the_option_object_and_read_where_the_budget_is_enforced():
    assert [f.name for f in CacheOptions.__dataclass_fields__.values()].count("cache_bytes") == 1
    assert walk_cache_bytes(SRC) == []


def test_the_walk_catches_a_copy(tmp_path):
    """The walk is not vacuous: a copy in an attribute, an alias and an entry point that keeps
    the keyword itself are each found."""
    (tmp_path / "store").mkdir()
    (tmp_path / "store" / "dataset.py").write_text(
        "def open_dataset(url, cache_bytes=None):\n"
        "    budget = DEFAULT if cache_bytes is None else parse_size(cache_bytes)\n"
        "    return DiskCache(url, budget)\n"
    )
    (tmp_path / "service.py").write_text("class S:\n    def __init__(self, c):\n        self.cache_bytes = int(c)\n")
    found = "\n".join(walk_cache_bytes(tmp_path))
    assert "dataset.py:2: copied under another name" in found
    assert "service.py:3: stored in an attribute" in found
    assert "open_dataset() reads cache_bytes 2 time(s)" in found
    assert "no DiskCache built with <CacheOptions>.cache_bytes" in found


def test_a_cluster_option_the_entry_point_does_not_read_is_refused_not_ignored():
    with pytest.raises(ValueError, match=r"placement_hint reads only slots_per_node.*placement='random'"):
        cluster_door("placement_hint", None, None, None, ClusterOptions(placement="random"), {}, ("slots_per_node",))
    _, cluster = cluster_door(
        "placement_hint", None, None, None, ClusterOptions(slots_per_node=2), {}, ("slots_per_node",)
    )
    assert cluster.slots_per_node == 2


def test_open_dataset_refuses_what_it_would_ignore_and_takes_a_path(packed_local, tmp_path):
    with pytest.raises(TypeError, match="pass a CacheOptions as cache="):
        stoker.open_dataset(packed_local, CacheOptions(cache_dir=str(tmp_path / "c")))
    with pytest.raises(TypeError, match=r"cache=False reads no node cache, but cache_dir"):
        stoker.open_dataset(packed_local, cache=False, cache_dir=str(tmp_path / "c"))
    ds = stoker.open_dataset(pathlib.Path(packed_local), cache=False)  # a pathlib.Path is a local path
    assert len(ds) > 0 and ds[0]
