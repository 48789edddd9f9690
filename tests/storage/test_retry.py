"""Origin retries: bounded by time, only for failures that can clear, with the S3 error code kept,
a back-off shared by threads, ``Retry-After`` honoured and a per-request timeout for stalled GETs.

The end-to-end tests put stoker's fault-injecting proxy (``stoker_lab.bench.faultproxy``) in front of the emulated S3
origin on 127.0.0.1 and read through s3fs and through obstore (obstore in a child process: a
process that used obstore must not fork).
"""

from __future__ import annotations

import threading
import time

import pytest
from _helpers import fault_proxy, in_child

from stoker_lab.bench.faultproxy import Fault
from stoker.storage.retry import DEFAULT_REQUEST_TIMEOUT_S, SharedBackoff, classify, resolve_retry_budget_s
from stoker.storage import Origin, OriginError, OriginNotFoundError, OriginPermissionError, url_to_fs


def _client_error(status: int, code: str, retry_after: str | None = None):
    """A botocore ClientError as s3fs raises it: an OSError whose cause carries the response."""
    from botocore.exceptions import ClientError

    headers = {"retry-after": retry_after} if retry_after is not None else {}
    err = ClientError(
        {
            "Error": {"Code": code, "Message": f"injected {code}"},
            "ResponseMetadata": {"HTTPStatusCode": status, "HTTPHeaders": headers},
        },
        "GetObject",
    )
    wrapped = OSError(5, f"injected {code}")
    wrapped.__cause__ = err
    return wrapped


OBSTORE_503 = (
    "Generic S3 error: Error performing GET http://127.0.0.1:1/b/k in 1ms - Server returned "
    'non-2xx status code: 503 Service Unavailable: <?xml version="1.0"?><Error><Code>SlowDown'
    "</Code><Message>Please reduce your request rate.</Message></Error>\n\nDebug source: ..."
)


@pytest.mark.parametrize(
    "exc, retry, throttled, status, code",
    [
        (_client_error(503, "SlowDown"), True, True, 503, "SlowDown"),
        (_client_error(429, "TooManyRequests"), True, True, 429, "TooManyRequests"),
        (_client_error(500, "InternalError"), True, True, 500, "InternalError"),
        (_client_error(400, "RequestTimeout"), True, False, 400, "RequestTimeout"),
        (_client_error(400, "InvalidRequest"), False, False, 400, "InvalidRequest"),
        (_client_error(403, "AccessDenied"), False, False, 403, "AccessDenied"),
        (_client_error(404, "NoSuchKey"), False, False, 404, "NoSuchKey"),
        (OSError(OBSTORE_503), True, True, 503, "SlowDown"),
        (ConnectionResetError("reset by peer"), True, False, None, None),
        (TimeoutError("read timed out"), True, False, None, None),
        (FileNotFoundError("gone"), False, False, None, None),
        (PermissionError("denied"), False, False, None, None),
        (TypeError("a bug"), False, False, None, None),
        (ValueError("not storage"), False, False, None, None),
    ],
)
def test_classify(exc, retry, throttled, status, code):
    f = classify(exc)
    assert (f.retry, f.throttled, f.status, f.code) == (retry, throttled, status, code)


def test_retry_after_is_read_from_the_answer():
    assert classify(_client_error(503, "SlowDown", "2")).retry_after_s == 2.0
    assert classify(_client_error(503, "SlowDown")).retry_after_s is None


def test_retry_budget_setting(monkeypatch):
    monkeypatch.delenv("STOKER_RETRY_BUDGET_S", raising=False)
    assert resolve_retry_budget_s(None) == 30.0
    assert resolve_retry_budget_s(2.5) == 2.5
    monkeypatch.setenv("STOKER_RETRY_BUDGET_S", "7")
    assert resolve_retry_budget_s(None) == 7.0 and Origin("/tmp/x").retry_budget_s == 7.0
    assert Origin("/tmp/x", retry_budget_s=1).retry_budget_s == 1.0  # the dataset's own wins
    monkeypatch.setenv("STOKER_RETRY_BUDGET_S", "soon")
    with pytest.raises(ValueError, match="STOKER_RETRY_BUDGET_S"):
        Origin("/tmp/x")
    with pytest.raises(ValueError, match="retry_budget_s"):
        Origin("/tmp/x", retry_budget_s=-1)


def _throttled_for(seconds: float, calls: list):
    t0 = time.monotonic()

    def fn():
        calls.append(time.monotonic())
        if time.monotonic() - t0 < seconds:
            raise _client_error(503, "SlowDown")
        return b"ok"

    return fn


def test_a_short_burst_is_ridden_out(tmp_path):
    """1.5 s of 503 SlowDown on every request: the read succeeds (4 tries over 0.7 s did not)."""
    calls: list = []
    o = Origin(str(tmp_path), retry_budget_s=20)
    assert o.retry("s3://b/k", _throttled_for(1.5, calls)) == b"ok"
    assert len(calls) >= 2 and o.counters.retries == len(calls) - 1


def test_sustained_throttling_ends_in_origin_error_with_the_code(tmp_path):
    calls: list = []
    o = Origin(str(tmp_path), retry_budget_s=0.5)
    with pytest.raises(OriginError) as err:
        o.retry("s3://b/shards/s.tar", _throttled_for(1e9, calls), 0, 100)
    e = err.value
    assert (e.code, e.status) == ("SlowDown", 503) and e.elapsed_s >= 0.5
    assert "s3://b/shards/s.tar bytes 0-100" in str(e) and "SlowDown (HTTP 503)" in str(e)
    assert "retry budget 0.5 s" in str(e) and len(calls) >= 2


def _refused(calls, until_s=1e9):
    t0 = time.monotonic()

    def fn():
        calls.append(time.monotonic())
        if time.monotonic() - t0 < until_s:
            raise ConnectionRefusedError(111, "Connection refused")
        return b"ok"

    return fn


def test_an_origin_never_reached_is_given_up_quickly(tmp_path, monkeypatch):
    """A refused connection to an origin that never answered is most likely a wrong URL or port:
    it ends after UNREACHABLE_BUDGET_S with an error that says so, not after the whole budget."""
    monkeypatch.setattr("stoker.storage.UNREACHABLE_BUDGET_S", 0.3)
    calls: list = []
    o = Origin(str(tmp_path), retry_budget_s=30)
    with pytest.raises(OriginError, match="never reached: check the URL") as err:
        o.retry("http://127.0.0.1:1/ds/index.parquet", _refused(calls))
    assert 0.3 <= err.value.elapsed_s < 5 and len(calls) >= 2


def test_an_origin_that_answered_before_gets_the_whole_budget(tmp_path, monkeypatch):
    """A server that answered and then refuses is restarting: it is retried for the whole budget."""
    monkeypatch.setattr("stoker.storage.UNREACHABLE_BUDGET_S", 0.1)
    o = Origin(str(tmp_path), retry_budget_s=20)
    assert o.retry("http://h/ok", lambda: b"first") == b"first"
    calls: list = []
    assert o.retry("http://h/k", _refused(calls, until_s=0.8)) == b"ok"
    assert calls[-1] - calls[0] >= 0.8


@pytest.mark.parametrize(
    "status, code, cls",
    [
        (403, "AccessDenied", OriginPermissionError),
        (404, "NoSuchKey", OriginNotFoundError),
        (400, "InvalidRequest", OriginError),
    ],
)
def test_errors_that_cannot_clear_fail_at_once(tmp_path, status, code, cls):
    calls = []

    def fn():
        calls.append(1)
        raise _client_error(status, code)

    o = Origin(str(tmp_path), retry_budget_s=30)
    with pytest.raises(cls) as err:
        o.retry("s3://b/k", fn)
    assert len(calls) == 1 and err.value.code == code and err.value.status == status
    assert f"{code} (HTTP {status})" in str(err.value) and "s3://b/k" in str(err.value)
    assert isinstance(err.value, {403: PermissionError, 404: FileNotFoundError, 400: OSError}[status])


def test_retry_after_is_honoured(tmp_path):
    calls: list = []

    def fn():
        calls.append(time.monotonic())
        if len(calls) == 1:
            raise _client_error(503, "SlowDown", retry_after="0.6")
        return b"ok"

    assert Origin(str(tmp_path), retry_budget_s=10).retry("s3://b/k", fn) == b"ok"
    assert calls[1] - calls[0] >= 0.6  # full jitter alone would have waited at most 0.2 s


def test_threads_back_off_as_a_whole(tmp_path):
    """8 threads reading while the origin throttles: after the first refusals, one probe at a
    time reaches the origin, not 8; every read succeeds once the origin recovers."""
    o = Origin(str(tmp_path), retry_budget_s=20)
    lock = threading.Lock()
    state = {"inflight": 0, "max_after_refusal": 0, "refused_at": None, "requests": 0}
    t0 = time.monotonic()

    def fn():
        with lock:
            state["requests"] += 1
            state["inflight"] += 1
            now = time.monotonic()
            # requests sent after the first refusal was seen, while the origin still refuses
            if state["refused_at"] is not None and state["refused_at"] + 0.05 < now < t0 + 1.15:
                state["max_after_refusal"] = max(state["max_after_refusal"], state["inflight"])
        try:
            time.sleep(0.02)
            if time.monotonic() - t0 < 1.2:
                with lock:
                    if state["refused_at"] is None:
                        state["refused_at"] = time.monotonic()
                raise _client_error(503, "SlowDown")
            return b"ok"
        finally:
            with lock:
                state["inflight"] -= 1

    results: list = []
    threads = [threading.Thread(target=lambda: results.append(o.retry("s3://b/k", fn))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == [b"ok"] * 8
    assert state["max_after_refusal"] == 1, state
    assert not o.backoff.throttled


def test_shared_backoff_cancel_ends_waits():
    b = SharedBackoff()
    b.done(time.monotonic(), False, classify(_client_error(503, "SlowDown", retry_after="60")))
    assert b.throttled
    out = []
    t = threading.Thread(target=lambda: out.append(b.wait_turn(time.monotonic() + 60)))
    t.start()
    b.cancel()
    t.join(10)
    assert out == [(False, False)]


# --- end to end: the emulated S3 origin behind a fault-injecting proxy ----------------------------


@pytest.fixture(scope="module")
def uploaded(s3_origin, packed_local):
    """(dataset URL, direct storage options) of a packed dataset on the emulated S3 origin."""
    from stoker_lab.bench.origin import upload_tree

    direct = s3_origin.storage_options(throttled=False)
    url = s3_origin.url("retry/packed")
    upload_tree(packed_local, url, direct)
    return url, direct


@pytest.fixture
def faults(uploaded):
    """(proxy, storage options through it) for the dataset of ``uploaded``."""
    proxy, options = fault_proxy(uploaded[1])
    with proxy:
        yield proxy, options


SHARD = "shards/shard-000000.tar"


def _check_origin_paths(url, direct, native: bool):
    proxy, options = fault_proxy(direct)
    # a budget of several backoff steps: one slow answer on a busy machine (1.2 s seen under CI)
    # must still leave room for the retry the test asks for
    o = Origin(url, options, retry_budget_s=3.0)
    if native:
        assert o.use_native()
    assert len(o.read_range(SHARD, 0, 10)) == 10  # the client is set up (s3fs: about 1 s)
    # sustained throttling: a clear OriginError with the S3 code, within the budget
    proxy.set_fault(Fault("status", 503))
    with pytest.raises(OriginError) as err:
        o.read_range(SHARD, 0, 100)
    assert (err.value.code, err.value.status) == ("SlowDown", 503) and err.value.attempts >= 2
    assert f"{url}/{SHARD} bytes 0-100" in str(err.value)
    # a burst shorter than the budget is ridden out
    o.retry_budget_s = 20
    proxy.set_fault(Fault("status", 503, burst_s=1.0))  # from the first shard GET on
    assert len(o.read_range(SHARD, 0, 100)) == 100
    # denied and missing: at once, with the code
    for status, code, cls in ((403, "AccessDenied", OriginPermissionError), (404, "NoSuchKey", OriginNotFoundError)):
        proxy.set_fault(Fault("status", status, code=code))
        errors = o.counters.errors
        with pytest.raises(cls) as err:
            o.read_range(SHARD, 0, 100)
        assert (err.value.code, err.value.status, o.counters.errors - errors) == (code, status, 1)
    # a connection reset is retried
    proxy.set_fault(Fault("reset", count=1))
    assert len(o.read_range(SHARD, 100, 200)) == 100
    assert proxy.stats()["faults_injected"] >= 1
    proxy.stop()


def _check_stalled_get_is_retried(url, direct, native: bool):
    """Headers, then nothing: the request times out (read_timeout) and the retry succeeds while
    the stalled answer is still open."""
    proxy, options = fault_proxy(direct)
    o = Origin(url, {**options, "config_kwargs": {"read_timeout": 0.5}}, retry_budget_s=20)
    if native:
        assert o.use_native()
    assert len(o.read_range(SHARD, 0, 10)) == 10  # the client is set up
    released = threading.Event()
    proxy.set_fault(Fault("stall", count=1, stall_s=60, released=released))
    assert len(o.read_range(SHARD, 0, 100)) == 100
    assert o.counters.retries >= 1 and proxy.stats()["stalls_open"] == 1
    released.set()  # the stall ends now, not after its 60 s
    deadline = time.monotonic() + 30
    while proxy.stats()["stalls_open"] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert proxy.stats()["stalls_open"] == 0
    proxy.stop()


def test_s3fs_path_keeps_codes_and_rides_out_bursts(uploaded):
    _check_origin_paths(*uploaded, native=False)


def test_obstore_path_keeps_codes_and_rides_out_bursts(uploaded):
    pytest.importorskip("obstore")
    in_child(_check_origin_paths, *uploaded, True)


def test_request_timeout_defaults():
    fs, _ = url_to_fs("s3://bucket/x", {"endpoint_url": "http://127.0.0.1:9"})
    assert fs.config_kwargs["read_timeout"] == DEFAULT_REQUEST_TIMEOUT_S < 20


@pytest.mark.parametrize("native", [False, True])
def test_stalled_get_is_retried(uploaded, native):
    if native:
        pytest.importorskip("obstore")
        in_child(_check_stalled_get_is_retried, *uploaded, True)
    else:
        _check_stalled_get_is_retried(*uploaded, False)


@pytest.mark.parametrize("workers", [0, 2])
def test_loader_rides_out_a_throttling_burst(uploaded, faults, tmp_path, workers):
    """503 SlowDown on every shard GET for 1.5 s: the epoch completes, every sample exactly once."""
    from stoker.loader import Loader
    from stoker.loader import ImageOptions, RunOptions
    from stoker.store.dataset import open_dataset

    url, _ = uploaded
    proxy, options = faults
    ds = open_dataset(
        url, cache_dir=str(tmp_path / "cache"), cache_bytes=64 << 20, storage_options=options, retry_budget_s=20
    )
    assert ds.origin.retry_budget_s == 20
    proxy.set_fault(Fault("status", 503, burst_s=1.5))
    with Loader(
        ds, 16, num_workers=workers, transform="eval", image=ImageOptions(image_size=32), run=RunOptions(timeout_s=60)
    ) as loader:
        assert sum(len(y) for _, y in loader) == len(ds) and loader.stats.exactly_once
    assert proxy.stats()["faults_injected"] > 0


def test_a_read_that_waited_for_another_fill_gets_the_rest_of_the_budget(tmp_path):
    """Time spent inside ``shared_budget`` (waiting for another process's fill of the block)
    counts: the read then tries once and reports, instead of starting a fresh budget."""
    calls: list = []
    o = Origin(str(tmp_path), retry_budget_s=0.3)
    with o.shared_budget():
        time.sleep(0.35)  # what a wait on a busy fetch lock spends
        with pytest.raises(OriginError, match="SlowDown"):
            o.retry("s3://b/k", _throttled_for(1e9, calls))
    assert len(calls) == 1
    assert o.retry("s3://b/k", lambda: b"ok") == b"ok"  # outside, a budget of its own again


@pytest.mark.parametrize("workers", [0, 2])
def test_loader_sustained_throttling_ends_in_origin_error(uploaded, faults, tmp_path, workers):
    """Every shard GET refused: the epoch ends with an error naming the object, the range and
    SlowDown (OriginError itself with 0 workers), not a hang or a signal."""
    from stoker.loader import Loader, WorkerError
    from stoker.loader import ImageOptions, RunOptions
    from stoker.store.dataset import open_dataset

    url, _ = uploaded
    proxy, options = faults
    ds = open_dataset(
        url, cache_dir=str(tmp_path / "cache"), cache_bytes=64 << 20, storage_options=options, retry_budget_s=1
    )
    proxy.set_fault(Fault("status", 503))
    with Loader(
        ds, 16, num_workers=workers, transform="eval", image=ImageOptions(image_size=32), run=RunOptions(timeout_s=60)
    ) as loader:
        with pytest.raises(OriginError if workers == 0 else WorkerError) as err:
            for _ in loader:
                pass
    assert "SlowDown (HTTP 503)" in str(err.value) and "/shards/shard-" in str(err.value)
