"""An ``http://`` origin that compresses or stalls: ranged GETs ask for ``Accept-Encoding:
identity``, a 206 that is compressed anyway fails at once with an error that says so, and a GET
that sends nothing for the read timeout is dropped and sent again, as on S3.

The origin is a small web server on 127.0.0.1 (``_origins.FileServer``): it gzips like a server
with gzip on (whole file gzipped, ``Range`` applied to the gzipped bytes) when a request accepts
gzip, or always; or it stalls one ranged GET for 60 s after half its body. Each epoch runs in a
forked child with a hard limit, so a read that is never bounded fails the test instead of hanging it.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

import stoker
from _helpers import in_child, pack_id_dataset
from _origins import FileServer, S3Proxy, shard_gets
from stoker.errors import OriginError
from stoker.loader import RunOptions
from stoker.storage import Origin, url_to_fs
from stoker.storage.retry import DEFAULT_CONNECT_TIMEOUT_S, DEFAULT_REQUEST_TIMEOUT_S, classify

N, SIZE = 48, 3000


def checked_id(fields, rng):
    """A Loader ``decode=``: the sample's id, after checking every byte of it (-1 if any is wrong)."""
    data = bytes(fields["bin"])
    i = int(data.split(b".")[0])
    return np.array([i if data == f"{i}".encode().ljust(SIZE, b".") else -1], np.int64)


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """A directory served over HTTP whose ``packed/`` is a dataset of N id samples (several shards)."""
    root = tmp_path_factory.mktemp("site")
    pack_id_dataset(root, N, size=SIZE, shard_bytes=32 << 10)
    return root


def _epoch(url: str, cache_dir: str, workers: int, retry_budget_s: float = 30.0) -> dict:
    """One epoch over ``url``: the ids delivered, in order, and ``exactly_once``."""
    ds = stoker.open_dataset(url, cache_dir=cache_dir, retry_budget_s=retry_budget_s)
    with stoker.Loader(
        ds, batch_size=8, num_workers=workers, seed=0, decode=checked_id, run=RunOptions(timeout_s=90)
    ) as loader:
        ids = [int(v) for b in loader for v in np.asarray(b).reshape(-1)]
    return {"ids": ids, "exactly_once": loader.stats.exactly_once, "retries": loader.stats.origin_retries}


def _first_shard_get(action):
    """A rule that answers the first ranged shard GET with ``action``, every other request properly."""
    lock, left = threading.Lock(), [1]

    def rule(method, path, headers, n):
        if not shard_gets(method, path, headers):
            return None
        with lock:
            if left[0]:
                left[0] -= 1
                return action
        return None

    return rule


def test_http_timeouts_are_the_s3_settings_with_the_same_defaults():
    """``config_kwargs`` ``read_timeout`` / ``connect_timeout`` (seconds) mean the same on ``http://`` as
    on S3: aiohttp's per-read and connect timeouts, with no limit on a whole answer that keeps coming."""
    fs, _ = url_to_fs("http://127.0.0.1:9/ds")
    t = fs.client_kwargs["timeout"]
    assert (t.sock_read, t.sock_connect, t.total) == (DEFAULT_REQUEST_TIMEOUT_S, DEFAULT_CONNECT_TIMEOUT_S, None)
    fs, _ = url_to_fs("http://127.0.0.1:9/ds", {"config_kwargs": {"read_timeout": 2.5, "connect_timeout": 1}})
    assert (fs.client_kwargs["timeout"].sock_read, fs.client_kwargs["timeout"].sock_connect) == (2.5, 1.0)
    with pytest.raises(ValueError, match="read_timeout"):
        url_to_fs("http://127.0.0.1:9/ds", {"config_kwargs": {"read_timeout": "soon"}})
    with pytest.raises(ValueError, match="retries"):
        url_to_fs("http://127.0.0.1:9/ds", {"config_kwargs": {"retries": {"total_max_attempts": 3}}})


@pytest.mark.parametrize("workers", [0, 2])
def test_a_server_that_gzips_when_asked_serves_every_sample(site, tmp_path, workers):
    """Every ranged GET asks for identity, so the server never compresses one: every sample right,
    exactly once. (aiohttp's default ``Accept-Encoding: gzip, deflate`` got slices of a gzip stream,
    which failed to decode and were retried until the budget was spent.)"""
    with FileServer(str(site), rule=lambda m, p, h, n: "gzip" if shard_gets(m, p, h) else None) as server:
        out = in_child(_epoch, server.url("packed"), str(tmp_path / "cache"), workers, 5.0, timeout_s=120)
        asked = sum(1 for m, p, r, a in server.log if a == "gzip")
        assert asked > 0 and server.compressed == 0
    assert sorted(out["ids"]) == list(range(N)) and out["exactly_once"] and out["retries"] == 0


def _read_compressed(url: str, workers: int) -> dict:
    """An epoch against a server that compresses every ranged answer: the error and its type."""
    ds = stoker.open_dataset(url, cache=False, retry_budget_s=30)
    try:
        with stoker.Loader(
            ds, batch_size=8, num_workers=workers, seed=0, decode=checked_id, run=RunOptions(timeout_s=90)
        ) as loader:
            for _ in loader:
                pass
    except Exception as exc:  # noqa: BLE001 - the test reads it
        attempts = getattr(exc, "attempts", None)
        return {
            "type": type(exc).__name__,
            "text": str(exc),
            "attempts": attempts,
            "origin": isinstance(exc, OriginError),
        }
    return {"type": None}


@pytest.mark.parametrize("workers", [0, 2])
def test_a_compressed_ranged_answer_fails_at_once_saying_so(site, workers):
    """A server that gzips ranged answers although identity was asked: the read fails on its first
    try (a compressed slice cannot be decoded, and the same request gets the same answer), with an
    error that names the URL, the byte range and the compression."""
    with FileServer(str(site), rule=lambda m, p, h, n: "gzip-always" if shard_gets(m, p, h) else None) as server:
        url = server.url("packed")
        origin = Origin(url, retry_budget_s=30)
        name = stoker.open_dataset(url, cache=False).index.shard_name(0)
        with pytest.raises(OriginError) as err:
            origin.read_range(name, 100, 612)
        assert err.value.attempts == 1 and origin.counters.retries == 0
        text = str(err.value)
        assert f"{url}/{name} bytes 100-612" in text, text
        assert "compressed a ranged answer" in text and "Content-Encoding: gzip" in text, text
        assert "Accept-Encoding: identity" in text and "not retried" in text, text
        out = in_child(_read_compressed, url, workers, timeout_s=120)
    assert out["type"] == ("OriginError" if workers == 0 else "WorkerError"), out
    assert "compressed a ranged answer" in out["text"] and f"{url}/shards/" in out["text"], out
    if workers == 0:
        assert out["attempts"] == 1, out


def test_a_payload_that_cannot_be_decoded_is_not_retried():
    """aiohttp's ClientPayloadError for a body it cannot decode (a slice of a gzip stream) is the same
    on every try: not retried. One for a body cut short (the connection closed) can clear."""
    from aiohttp import ClientPayloadError
    from aiohttp.http_exceptions import ContentEncodingError, ContentLengthError

    bad = ClientPayloadError("400, message:\n  Can not decode content-encoding: gzip")
    bad.__cause__ = ContentEncodingError("Can not decode content-encoding: gzip")
    assert not classify(bad).retry
    cut = ClientPayloadError("Response payload is not completed")
    cut.__cause__ = ContentLengthError("Not enough data to satisfy content length header.")
    assert classify(cut).retry


@pytest.mark.parametrize("workers", [0, 2])
def test_a_ranged_get_stalled_for_60_s_is_dropped_and_sent_again(site, tmp_path, workers):
    """The first ranged GET sends its head and half its body, then nothing for 60 s: after the read
    timeout (10 s, as on S3) it is dropped and sent again; the epoch delivers every sample right,
    exactly once. (With aiohttp's own limit, 300 s for a whole answer, it ran into the Loader's
    ``timeout_s``; the child's hard limit bounds the test either way.)"""
    with FileServer(str(site), rule=_first_shard_get(("stall", 60.0))) as server:
        out = in_child(_epoch, server.url("packed"), str(tmp_path / "cache"), workers, timeout_s=150)
        assert server.faults == 1
    assert sorted(out["ids"]) == list(range(N)) and out["exactly_once"], out
    assert out["retries"] >= 1


def _read_after_held_head(url: str, name: str) -> dict:
    origin = Origin(url, {"config_kwargs": {"read_timeout": 0.5}}, retry_budget_s=20)
    data = bytes(origin.read_range(name, 0, 1000))
    return {"n": len(data), "retries": origin.counters.retries}


def test_a_get_whose_head_never_comes_is_dropped_too(site):
    """A server that takes the request and never answers (not even the head): the same read timeout
    drops it (here 0.5 s, set as on S3 with ``config_kwargs``)."""
    with FileServer(str(site), rule=_first_shard_get(("stall", 60.0, "head"))) as server:
        name = stoker.open_dataset(server.url("packed"), cache=False).index.shard_name(0)
        out = in_child(_read_after_held_head, server.url("packed"), name, timeout_s=60)
    assert out == {"n": 1000, "retries": 1}


def _accept_encodings(endpoint: str, url: str, opts: dict, native: bool) -> dict:
    """The ``Accept-Encoding`` of one ranged read of shard 0 through a proxy, on s3fs or obstore."""
    seen: list = []

    def rule(method, path, headers, n):
        if shard_gets(method, path, headers):
            seen.append(headers.get("Accept-Encoding"))
        return None

    with S3Proxy(endpoint, rule) as proxy:
        origin = Origin(url, {**opts, "endpoint_url": proxy.endpoint_url})
        on = origin.use_native() if native else False
        n = len(origin.read_range("shards/shard-000000.tar", 0, 100))
    return {"native": on, "n": n, "seen": seen}


@pytest.mark.parametrize("native", [False, True], ids=["s3fs", "obstore"])
def test_s3_ranged_gets_ask_for_identity_on_every_read_path(s3_origin, site, native):
    """botocore sends ``Accept-Encoding: identity`` and does not decode; obstore sent no
    ``Accept-Encoding`` at all (any coding acceptable, RFC 9110) and now asks for identity too."""
    if native:
        pytest.importorskip("obstore")
    from stoker_lab.bench.origin import upload_tree

    opts = s3_origin.storage_options(throttled=False)
    url = s3_origin.url("http-origin/identity")
    upload_tree(str(site / "packed"), url, opts)
    out = in_child(_accept_encodings, opts["endpoint_url"], url, opts, native, timeout_s=60)
    assert out == {"native": native, "n": 100, "seen": ["identity"]}
