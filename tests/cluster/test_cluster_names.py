"""One pair of names for the node cache's place and size: ``cache_dir``/``cache_bytes`` in
``open_dataset``, ``stoker.cluster.run``, ``warm`` and ``stoker warm --cache-dir/--cache-bytes``.
The old ``cache_root=`` and ``--cache-size`` still work, with a deprecation warning.

No Ray cluster is started: ``prepare`` (the services' start, the first thing both calls do with
the cache settings) is replaced by one that records what it was given."""

from __future__ import annotations

import inspect

import pytest

pytest.importorskip("ray")

import stoker  # noqa: E402
from stoker.cli import build_parser  # noqa: E402
from stoker.cluster.jobs import job
from stoker.cluster.service import warmup


class _Stop(Exception):
    pass


@pytest.fixture
def seen(monkeypatch):
    """What ``prepare`` was given by ``run`` / ``warm``: ``[(cache_dir, cache_bytes)]`` of its
    :class:`stoker.CacheOptions`."""
    got: list = []

    def prepare(url, opts, cache, *rest, **kw):
        got.append((cache.cache_dir, cache.cache_bytes))
        raise _Stop()

    monkeypatch.setattr(job, "prepare", prepare)
    monkeypatch.setattr(warmup, "prepare", prepare)
    return got


def test_the_api_names_are_cache_dir_and_cache_bytes():
    for fn in (stoker.open_dataset, job.run, warmup.warm):
        params = inspect.signature(fn).parameters
        assert "cache_dir" in params and "cache_bytes" in params, fn


@pytest.mark.parametrize("call", ["run", "warm"])
def test_cache_dir_goes_through_and_the_old_name_warns(seen, call):
    fn = (
        (lambda **kw: job.run(lambda ctx: None, "s3://b/d", 1, **kw))
        if call == "run"
        else (lambda **kw: warmup.warm("s3://b/d", **kw))
    )
    with pytest.raises(_Stop):
        fn(cache_dir="/c/new", cache_bytes="64MiB")
    with pytest.warns(DeprecationWarning, match=r"cache_root= is deprecated; use cache_dir="):
        with pytest.raises(_Stop):
            fn(cache_root="/c/old", cache_bytes="64MiB")
    assert seen == [("/c/new", 64 << 20), ("/c/old", 64 << 20)]
    with pytest.raises(TypeError, match="cache_root= and cache_dir= were both given"):
        fn(cache_root="/c/old", cache_dir="/c/new")


def test_stoker_warm_takes_cache_bytes_and_the_old_flag_says_so(capsys):
    a = build_parser().parse_args(["warm", "s3://b/d", "--cache-dir", "/c", "--cache-bytes", "64MiB"])
    assert (a.cache_dir, a.cache_bytes) == ("/c", 64 << 20)
    assert capsys.readouterr().err == ""
    a = build_parser().parse_args(["warm", "s3://b/d", "--cache-size", "1GiB"])
    assert a.cache_bytes == 1 << 30
    assert "stoker: --cache-size is deprecated; use --cache-bytes" in capsys.readouterr().err
