"""Origins whose listings or answers are not what S3 gives: a listing fsspec cached before another
process re-packed the dataset, an HTTP server (no sizes in its listing), answers of the wrong
length and ranged GETs answered with the whole object, on every read path."""

from __future__ import annotations

import logging

import numpy as np
import pytest

import stoker
from _helpers import in_child, make_image_folder
from _origins import FileServer, S3Proxy, shard_gets
from stoker.errors import DatasetChangedError, OriginError
from stoker.storage import Origin

N = 24


def _tree(root, version: int):
    """N samples ``s0000.bin``... whose bytes say their version and id, all of one size per id."""
    fill = b"ab"[version - 1 : version]
    return make_image_folder(root, {f"s{i:04d}.bin": f"v{version}:{i}:".encode().ljust(3000, fill) for i in range(N)})


def _pack(src, dst, opts=None):
    stoker.pack(
        str(src), dst, source="files", shard_bytes=32 << 10, overwrite=True, storage_options=opts, progress=False
    )


def _versions(ds) -> set[int]:
    return {int(bytes(ds.read_fields(i)["bin"]).split(b":")[0][1:]) for i in range(len(ds))}


# -- metadata: never a cached listing ----------------------------------------------------------


def test_a_reopen_lists_the_origin_again_after_another_process_repacked(s3_origin, tmp_path):
    """A long-lived process opened v1; another process re-packed the same URL to v2 (same keys
    and sizes, other content and ETags). The next open in the first process must see v2, not
    compare the new index with the listing fsspec cached at the first open."""
    opts = s3_origin.storage_options(throttled=False)
    url = s3_origin.url("odd/repacked")
    _pack(_tree(tmp_path / "v1", 1), url, opts)
    first = stoker.open_dataset(url, storage_options=opts, cache=False)
    assert _versions(first) == {1}
    in_child(_pack, _tree(tmp_path / "v2", 2), url, opts)  # its writes do not touch this process's caches
    again = stoker.open_dataset(url, storage_options=opts, cache=False)
    assert again.version != first.version
    assert _versions(again) == {2}


# -- an HTTP origin --------------------------------------------------------------------------


@pytest.fixture
def http_packed(tmp_path):
    _pack(_tree(tmp_path / "src", 1), str(tmp_path / "site" / "ds"))
    return tmp_path / "site"


def test_http_dataset_opens_and_reads_with_defaults(http_packed, tmp_path):
    """`http://` with no options: the open checks every shard's size with a HEAD (its listing,
    an HTML page of links, has none), and every sample reads back right."""
    with FileServer(str(http_packed)) as server:
        ds = stoker.open_dataset(server.url("ds"), cache_dir=str(tmp_path / "cache"))
        heads = [p for m, p, _, _ in server.log if m == "HEAD" and "/shards/" in p]
        assert len(heads) == len(ds.index.shards)
        assert _versions(ds) == {1}
        with stoker.Loader(ds, batch_size=5, num_workers=0, seed=0, decode=lambda f, rng: np.int64(0)) as loader:
            assert sum(len(b) for b in loader) == N
        assert loader.stats.exactly_once


def test_http_open_still_finds_a_shard_of_another_size(http_packed):
    shard = sorted((http_packed / "ds" / "shards").glob("*.tar"))[0]
    with FileServer(str(http_packed)) as server:
        stoker.open_dataset(server.url("ds"), cache=False)
        shard.write_bytes(shard.read_bytes() + bytes(512))
        with pytest.raises(DatasetChangedError, match=shard.name):
            stoker.open_dataset(server.url("ds"), cache=False)


def test_http_open_without_sizes_is_skipped_with_a_note(http_packed, caplog):
    """A server that sends no Content-Length (HEAD and listing without sizes): the check is
    skipped with one note in the log; the samples are still checked when read."""
    import stoker.store.verify as verify

    with FileServer(str(http_packed)) as server:
        origin = Origin(server.url("ds"))
        index = stoker.open_dataset(server.url("ds"), cache=False, check=False).index
        plain = origin.info

        def sizeless(rel):
            return {**plain(rel), "size": None}

        origin.info = sizeless  # the HEADs of a server without Content-Length
        verify._NOTED.discard(origin.url)
        with caplog.at_level(logging.WARNING, logger="stoker.store.verify"):
            verify.check_shards(origin, index)
        assert any("were not checked" in r.getMessage() for r in caplog.records)


def test_http_503_is_retried(http_packed):
    """An HTTP server's 503 (aiohttp's error under fsspec) is retried as S3's is."""
    with FileServer(str(http_packed)) as server:
        origin = Origin(server.url("ds"), retry_budget_s=10)
        name = stoker.open_dataset(server.url("ds"), cache=False).index.shard_name(0)
        want = bytes(origin.read_range(name, 0, 100))
        server.rule = lambda m, p, h, n: 503 if shard_gets(m, p, h) and server.faults < 1 else None
        assert bytes(origin.read_range(name, 0, 100)) == want
        assert server.faults == 1 and origin.counters.retries == 1


def test_an_origin_that_never_honours_range_gets_an_error_saying_so(http_packed):
    with FileServer(
        str(http_packed), rule=lambda m, p, h, n: "ignore-range" if shard_gets(m, p, h) else None
    ) as server:
        ds = stoker.open_dataset(server.url("ds"), cache=False, retry_budget_s=0.5)
        with pytest.raises(OriginError, match="ignored Range.*never honours Range") as info:
            ds[0]
        assert info.value.attempts > 1  # retried within the budget first


# -- wrong answers, on every read path ---------------------------------------------------------


def _read_through_proxy(upstream_opts: dict, url: str, native: bool, action) -> dict:
    """One ranged read of shard 0 through a proxy that answers the first shard GET with
    ``action``; the read path is obstore's (``native``) or fsspec's."""
    first = {"left": 1}

    def rule(method, path, headers, n):
        if shard_gets(method, path, headers) and first["left"]:
            first["left"] -= 1
            return action
        return None

    with S3Proxy(upstream_opts["endpoint_url"], rule) as proxy:
        origin = Origin(url, {**upstream_opts, "endpoint_url": proxy.endpoint_url}, retry_budget_s=10)
        on = origin.use_native() if native else False
        plain = Origin(url, upstream_opts)
        want = bytes(plain.read_range("shards/shard-000000.tar", 512, 2512))
        got = bytes(origin.read_range("shards/shard-000000.tar", 512, 2512))
        return {"same": got == want, "faults": proxy.faults, "retries": origin.counters.retries, "native": on}


@pytest.fixture(scope="module")
def s3_files(s3_origin, tmp_path_factory):
    opts = s3_origin.storage_options(throttled=False)
    url = s3_origin.url("odd/answers")
    _pack(_tree(tmp_path_factory.mktemp("answers"), 1), url, opts)
    return url, opts


@pytest.mark.parametrize("native", [False, True], ids=["fsspec", "obstore"])
@pytest.mark.parametrize("action", ["ignore-range", ("extra", 64), ("short", 100)], ids=["whole", "long", "short"])
def test_a_wrong_answer_is_retried_on_every_read_path(s3_files, native, action):
    url, opts = s3_files
    out = in_child(_read_through_proxy, opts, url, native, action, timeout_s=60)
    assert out["native"] == native
    assert out == {"same": True, "faults": 1, "retries": 1, "native": native}


def _epoch_with_a_whole_object_answer(url: str, opts: dict, cache_dir: str) -> dict:
    def rule(method, path, headers, n):
        if shard_gets(method, path, headers) and not rule.done:
            rule.done = True
            return "ignore-range"
        return None

    rule.done = False
    with S3Proxy(opts["endpoint_url"], rule) as proxy:
        ds = stoker.open_dataset(url, storage_options={**opts, "endpoint_url": proxy.endpoint_url}, cache_dir=cache_dir)
        with stoker.Loader(ds, batch_size=6, num_workers=0, seed=0, decode=lambda f, rng: np.int64(0)) as loader:
            n = sum(len(b) for b in loader)
        return {"n": n, "exactly_once": loader.stats.exactly_once, "faults": proxy.faults}


def test_zero_workers_ride_out_a_ranged_get_answered_with_the_whole_object(s3_files, tmp_path):
    """The training process's own read path (num_workers=0) retries as the workers do."""
    url, opts = s3_files
    out = in_child(_epoch_with_a_whole_object_answer, url, opts, str(tmp_path / "cache"), timeout_s=60)
    assert out == {"n": N, "exactly_once": True, "faults": 1}
