"""Behaviour of the emulated remote origin (moto + fast ranged GETs + throttling proxy)."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from stoker_lab.bench.origin import LocalS3Origin, upload_tree

SIZE = 4 * 1024 * 1024 + 123


def _fs(options: dict):
    import s3fs

    return s3fs.S3FileSystem(skip_instance_cache=True, **options)


def _client(opts: dict):
    """A boto3 S3 client for the storage options ``opts`` that tries each request once."""
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3",
        endpoint_url=opts["endpoint_url"],
        aws_access_key_id=opts["key"],
        aws_secret_access_key=opts["secret"],
        region_name="us-east-1",
        config=Config(retries={"total_max_attempts": 1, "mode": "standard"}),
    )


@pytest.fixture(scope="module")
def blob(s3_origin):
    data = np.random.default_rng(7).integers(0, 256, SIZE, dtype=np.uint8).tobytes()
    path = f"{s3_origin.bucket}/blobs/random.bin"
    _fs(s3_origin.storage_options(throttled=False)).pipe_file(path, data)
    return path, data


def test_storage_options_plain_and_url(s3_origin):
    import pickle

    opts = s3_origin.storage_options()
    assert pickle.loads(pickle.dumps(opts)) == opts
    assert opts["endpoint_url"] == s3_origin.endpoint_url != s3_origin.direct_url
    assert s3_origin.storage_options(throttled=False)["endpoint_url"] == s3_origin.direct_url
    assert s3_origin.url("a/b") == f"s3://{s3_origin.bucket}/a/b"


def test_ranged_reads_are_byte_identical_and_use_fast_path(s3_origin, blob):
    path, data = blob
    fs = _fs(s3_origin.storage_options())
    ranges = [
        (0, 1),
        (0, 10),
        (5, 1 << 20),
        (SIZE - 1, SIZE),
        (SIZE - 100, None),
        (1000, SIZE + 50),
        (123_456, 3_000_001),
    ]
    before = s3_origin.stats()
    for start, end in ranges:
        assert fs.cat_file(path, start=start, end=end) == data[start:end], (start, end)
    after = s3_origin.stats()
    assert after["ranged_gets"] - before["ranged_gets"] >= len(ranges)
    assert after["proxy_requests"] > before["proxy_requests"]
    with pytest.raises(OSError):
        fs.cat_file(path, start=SIZE + 10, end=SIZE + 20)


def test_fast_path_headers_match_moto(s3_origin, blob):
    path, data = blob
    client = _client(s3_origin.storage_options(throttled=False))
    key = path.split("/", 1)[1]
    resp = client.get_object(Bucket=s3_origin.bucket, Key=key, Range="bytes=10-19")
    head = client.head_object(Bucket=s3_origin.bucket, Key=key)
    assert resp["Body"].read() == data[10:20]
    assert resp["ContentRange"] == f"bytes 10-19/{SIZE}"
    assert resp["ContentLength"] == 10
    assert resp["ETag"] == head["ETag"]
    assert resp["LastModified"] == head["LastModified"]
    assert resp["AcceptRanges"] == "bytes"
    whole = client.get_object(Bucket=s3_origin.bucket, Key=key)["Body"].read()
    assert whole == data


def test_fault_injection_then_recovery(s3_origin, origin_faults, blob):
    """Through the fault proxy in front of the origin: two 503 SlowDown answers, then the range;
    500 InternalError on every object GET, ranged or not, until cleared, then the whole object.
    The proxy counts exactly the 5 faults it answered."""
    from botocore.exceptions import ClientError

    from stoker_lab.bench.faultproxy import Fault, object_gets

    path, data = blob
    proxy, options = origin_faults
    client = _client(options)
    key = path.split("/", 1)[1]
    proxy.set_fault(Fault("status", 503, count=2, match=object_gets))
    for _ in range(2):
        with pytest.raises(ClientError) as err:
            client.get_object(Bucket=s3_origin.bucket, Key=key, Range="bytes=0-9")
        assert err.value.response["ResponseMetadata"]["HTTPStatusCode"] == 503
        assert err.value.response["Error"]["Code"] == "SlowDown"
    body = client.get_object(Bucket=s3_origin.bucket, Key=key, Range="bytes=0-9")["Body"]
    assert body.read() == data[:10]

    proxy.set_fault(Fault("status", 500, match=object_gets))  # until cleared
    for _ in range(3):
        with pytest.raises(ClientError) as err:
            client.get_object(Bucket=s3_origin.bucket, Key=key)
        assert err.value.response["ResponseMetadata"]["HTTPStatusCode"] == 500
        assert err.value.response["Error"]["Code"] == "InternalError"
    proxy.set_fault(None)
    assert client.get_object(Bucket=s3_origin.bucket, Key=key)["Body"].read() == data
    assert proxy.stats()["faults_injected"] == 5


def test_upload_tree(s3_origin, tmp_path):
    for rel, payload in {"a/x.bin": b"x" * 10, "a/b/y.bin": b"yy", "z.txt": b""}.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(payload)
    opts = s3_origin.storage_options(throttled=False)
    summary = upload_tree(str(tmp_path), s3_origin.url("tree"), opts, max_workers=4)
    assert summary["files"] == 3 and summary["bytes"] == 12
    fs = _fs(opts)
    assert fs.cat_file(f"{s3_origin.bucket}/tree/a/b/y.bin") == b"yy"
    assert fs.cat_file(f"{s3_origin.bucket}/tree/z.txt") == b""
    with pytest.raises(FileNotFoundError):
        upload_tree(str(tmp_path / "missing"), s3_origin.url("x"), opts)


def test_latency_and_bandwidth_cap_are_applied():
    with LocalS3Origin(latency_ms=50, bandwidth_MBps=20) as origin:
        data = os.urandom(16 * 1000 * 1000)
        path = f"{origin.bucket}/big.bin"
        _fs(origin.storage_options(throttled=False)).pipe_file(path, data)
        fs = _fs(origin.storage_options())
        fs.cat_file(path, start=0, end=10)  # connect
        t0 = time.perf_counter()
        for i in range(20):
            fs.cat_file(path, start=i, end=i + 100)
        assert time.perf_counter() - t0 >= 1.0  # 20 x 50 ms

        t0 = time.perf_counter()
        assert fs.cat_file(path) == data
        rate = len(data) / (time.perf_counter() - t0)
        assert 0.25 * 20e6 < rate < 1.5 * 20e6, rate


def test_the_emulated_origin_runs_niced_unless_told_otherwise():
    from stoker_lab.bench.origin import ORIGIN_NICE

    mine = os.getpriority(os.PRIO_PROCESS, 0)
    with LocalS3Origin(latency_ms=0, bandwidth_MBps=0) as origin:
        assert os.getpriority(os.PRIO_PROCESS, origin.pid) == min(19, mine + ORIGIN_NICE)
    with LocalS3Origin(latency_ms=0, bandwidth_MBps=0, nice=0) as origin:
        assert os.getpriority(os.PRIO_PROCESS, origin.pid) == mine


def test_start_failure_and_stop():
    with pytest.raises(RuntimeError, match="not ready"):
        LocalS3Origin(start_timeout_s=0.001).start()
    origin = LocalS3Origin(latency_ms=0, bandwidth_MBps=0).start()
    pid = origin.pid
    assert pid is not None and origin.stats()["requests"] == 0
    origin.stop()
    origin.stop()  # idempotent
    assert origin.pid is None
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_connections_are_reused(s3_origin, blob):
    """waitress keeps connections alive, so s3fs (aiohttp) reuses them through the proxy."""
    from concurrent.futures import ThreadPoolExecutor

    path, data = blob
    fs = _fs(s3_origin.storage_options())
    fs.cat_file(path, start=0, end=1)
    before = s3_origin.stats()
    offsets = [(i * 65_537) % (SIZE - 4096) for i in range(200)]
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda o: fs.cat_file(path, start=o, end=o + 4096), offsets))
    assert all(g == data[o : o + 4096] for g, o in zip(got, offsets))
    after = s3_origin.stats()
    requests = after["proxy_requests"] - before["proxy_requests"]
    connections = after["proxy_connections"] - before["proxy_connections"]
    assert requests >= 200
    assert connections <= 20, (connections, requests)


def test_latency_is_per_request_on_a_persistent_connection():
    with LocalS3Origin(latency_ms=50, bandwidth_MBps=0) as origin:
        path = f"{origin.bucket}/small.bin"
        _fs(origin.storage_options(throttled=False)).pipe_file(path, b"z" * 1000)
        fs = _fs(origin.storage_options())
        fs.cat_file(path, start=0, end=10)  # connect
        before = origin.stats()
        t0 = time.perf_counter()
        for i in range(20):
            assert fs.cat_file(path, start=i, end=i + 10) == b"z" * 10
        elapsed = time.perf_counter() - t0
        after = origin.stats()
        assert after["proxy_connections"] == before["proxy_connections"]  # one connection
        assert after["proxy_requests"] - before["proxy_requests"] == 20
        assert 1.0 <= elapsed < 3.0, elapsed  # 20 x 50 ms, once each

        # A large upload arrives in many TCP reads but is one request: latency once.
        body = os.urandom(8 * 1000 * 1000)
        client = _client(origin.storage_options())
        before = origin.stats()
        client.put_object(Bucket=origin.bucket, Key="up.bin", Body=body)
        after = origin.stats()
        assert after["proxy_requests"] - before["proxy_requests"] == 1
        assert after["proxy_bytes_up"] - before["proxy_bytes_up"] > len(body)
        got = client.get_object(Bucket=origin.bucket, Key="up.bin")["Body"].read()
        assert got == body


def _feed_in_pieces(stream: bytes, cut: int) -> list[int]:
    from stoker_lab.bench.throttle import _RequestFramer

    framer, starts = _RequestFramer(), []
    for i in range(0, len(stream), cut):
        starts += [i + s for s in framer.feed(stream[i : i + cut])]
    assert not framer.lost
    return starts


def test_request_framer_finds_request_boundaries():
    get = b"GET /b/k HTTP/1.1\r\nHost: x\r\nRange: bytes=0-9\r\n\r\n"
    put = b"PUT /b/k HTTP/1.1\r\nHost: x\r\ncontent-length: 11\r\n\r\nhello\r\n\r\nxx"
    chunked = (
        b"PUT /b/c HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"5;ext=1\r\nhello\r\n3\r\n\r\n\n\r\n0\r\nx-trailer: 1\r\n\r\n"
    )
    stream = get + put + chunked + get
    expected = [0, len(get), len(get + put), len(get + put + chunked)]
    for cut in (1, 2, 3, 7, 64, len(stream)):
        assert _feed_in_pieces(stream, cut) == expected, cut


def test_request_framer_gives_up_on_garbage():
    from stoker_lab.bench.throttle import _RequestFramer

    framer = _RequestFramer()
    assert framer.feed(b"PUT / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n") == [0]
    assert framer.lost
    assert framer.feed(b"GET / HTTP/1.1\r\n\r\n") == []


def test_configuration_errors_are_not_retried(tmp_path):
    """A storage-client configuration error (botocore's ProfileNotFound, ...) is reported at once as an
    OriginError naming the URL, not retried like a transient failure; a reset is retried until the
    retry budget is spent."""
    from stoker.storage import Origin, OriginError

    class ProfileNotFound(Exception):  # botocore's name; the check is by class name
        pass

    calls = []

    def bad_profile():
        calls.append(1)
        raise ProfileNotFound("The config profile (p) could not be found")

    o = Origin(str(tmp_path), backoff_s=0.001, retry_budget_s=0.2)
    with pytest.raises(OriginError, match=r"s3://x/y.*ProfileNotFound.*not retried"):
        o.retry("s3://x/y", bad_profile)
    assert len(calls) == 1 and o.counters.retries == 0

    def flaky():
        calls.append(2)
        raise ConnectionResetError("reset")

    with pytest.raises(OriginError, match="retry budget 0.2 s spent"):
        o.retry("s3://x/z", flaky)
    assert calls.count(2) >= 2
