"""Behaviour of the emulated remote origin (moto + fast ranged GETs + throttling proxy)."""
from __future__ import annotations

import os
import time

import numpy as np
import pytest

from stoker.bench.origin import LocalS3Origin, upload_tree

SIZE = 4 * 1024 * 1024 + 123


def _fs(options: dict):
    import s3fs

    return s3fs.S3FileSystem(skip_instance_cache=True, **options)


def _client(origin: LocalS3Origin, throttled: bool = True):
    import boto3
    from botocore.config import Config

    opts = origin.storage_options(throttled)
    return boto3.client("s3", endpoint_url=opts["endpoint_url"], aws_access_key_id=opts["key"],
                        aws_secret_access_key=opts["secret"], region_name="us-east-1",
                        config=Config(retries={"total_max_attempts": 1, "mode": "standard"}))


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
    ranges = [(0, 1), (0, 10), (5, 1 << 20), (SIZE - 1, SIZE), (SIZE - 100, None),
              (1000, SIZE + 50), (123_456, 3_000_001)]
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
    client = _client(s3_origin, throttled=False)
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


def test_fault_injection_then_recovery(s3_origin, blob):
    from botocore.exceptions import ClientError

    path, data = blob
    client = _client(s3_origin)
    key = path.split("/", 1)[1]
    s3_origin.inject_faults(503, count=2)
    try:
        for _ in range(2):
            with pytest.raises(ClientError) as err:
                client.get_object(Bucket=s3_origin.bucket, Key=key, Range="bytes=0-9")
            assert err.value.response["ResponseMetadata"]["HTTPStatusCode"] == 503
            assert err.value.response["Error"]["Code"] == "SlowDown"
        body = client.get_object(Bucket=s3_origin.bucket, Key=key, Range="bytes=0-9")["Body"]
        assert body.read() == data[:10]

        s3_origin.inject_faults(500)  # until cleared
        for _ in range(3):
            with pytest.raises(ClientError):
                client.get_object(Bucket=s3_origin.bucket, Key=key)
    finally:
        s3_origin.clear_faults()
    assert client.get_object(Bucket=s3_origin.bucket, Key=key)["Body"].read() == data
    assert s3_origin.stats()["faults_served"] >= 5


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
