"""The native S3 reader takes its endpoint, region, profile, credentials, plain-http allowance and
addressing style from the storage options and the AWS environment and config files, as botocore
does for s3fs; where it cannot, the dataset stays on s3fs and that is logged once.

Reads through obstore run in a child process (see test_native_s3.py)."""

from __future__ import annotations

import logging
import os

import pytest

from _helpers import in_child

pytest.importorskip("obstore")

from stoker.storage import Origin  # noqa: E402
from stoker.storage._s3_config import resolve  # noqa: E402

_AWS_VARS = (
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_PROFILE",
    "AWS_DEFAULT_PROFILE",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_CA_BUNDLE",
    "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS",
)


@pytest.fixture
def aws_env(tmp_path, monkeypatch):
    """A clean AWS environment: empty config and credentials files under tmp_path."""
    for name in _AWS_VARS:
        monkeypatch.delenv(name, raising=False)
    config, creds = tmp_path / "aws-config", tmp_path / "aws-credentials"
    config.write_text("")
    creds.write_text("")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(creds))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    return config, creds


def _creds(kw):
    return kw["credential_provider"]()


def test_endpoint_from_environment_with_plain_http(aws_env, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9000")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AK")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "SK")
    kw, reason = resolve("bkt", {})
    assert reason is None
    assert kw["endpoint"] == "http://127.0.0.1:9000" and kw["client_options"]["allow_http"] is True
    assert kw["virtual_hosted_style_request"] is False and kw["region"] == "us-east-1"
    assert _creds(kw)["access_key_id"] == "AK" and _creds(kw)["secret_access_key"] == "SK"
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "https://minio.example:9000")  # the S3-specific one wins
    kw, _ = resolve("bkt", {})
    assert kw["endpoint"] == "https://minio.example:9000" and kw["client_options"]["allow_http"] is False
    kw, _ = resolve("bkt", {"endpoint_url": "http://10.0.0.1:1"})  # the options win over the environment
    assert kw["endpoint"] == "http://10.0.0.1:1"
    kw, _ = resolve("bkt", {"client_kwargs": {"endpoint_url": "http://10.0.0.2:1", "region_name": "eu-west-1"}})
    assert kw["endpoint"] == "http://10.0.0.2:1" and kw["region"] == "eu-west-1"


def test_profile_from_config_files(aws_env, monkeypatch):
    config, creds = aws_env
    config.write_text(
        "[profile lab]\nregion = eu-central-1\nendpoint_url = https://s3.lab.example\n"
        "s3 =\n  addressing_style = virtual\n\n"
        "[profile svc]\nservices = svc-s3\n[services svc-s3]\ns3 =\n  endpoint_url = http://svc:9000\n"
    )
    creds.write_text(
        "[lab]\naws_access_key_id = LABKEY\naws_secret_access_key = LABSECRET\n"
        "[svc]\naws_access_key_id = SVCKEY\naws_secret_access_key = SVCSECRET\n"
    )
    kw, reason = resolve("bkt", {"profile": "lab"})
    assert reason is None
    assert kw["endpoint"] == "https://bkt.s3.lab.example" and kw["virtual_hosted_style_request"] is True
    assert kw["region"] == "eu-central-1" and _creds(kw)["access_key_id"] == "LABKEY"
    monkeypatch.setenv("AWS_PROFILE", "svc")
    kw, reason = resolve("bkt", {})
    assert reason is None and kw["endpoint"] == "http://svc:9000" and kw["client_options"]["allow_http"]
    assert kw["virtual_hosted_style_request"] is False and _creds(kw)["access_key_id"] == "SVCKEY"
    kw, _ = resolve("bkt", {"config_kwargs": {"s3": {"addressing_style": "virtual"}}})
    assert kw["endpoint"] == "http://bkt.svc:9000" and kw["virtual_hosted_style_request"] is True


def test_aws_itself_and_what_stays_on_s3fs(aws_env, monkeypatch):
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-west-2")
    kw, reason = resolve("bkt", {"anon": True})
    assert reason is None and kw["skip_signature"] and "endpoint" not in kw
    assert kw["region"] == "us-west-2" and kw["virtual_hosted_style_request"] is True  # botocore: virtual on AWS
    assert resolve("my.dotted.bucket", {"anon": True})[0]["virtual_hosted_style_request"] is False
    assert "no AWS credentials" in resolve("bkt", {})[1]
    assert "requester_pays" in resolve("bkt", {"anon": True, "requester_pays": True})[1]
    assert "client_kwargs.verify" in resolve("bkt", {"anon": True, "client_kwargs": {"verify": False}})[1]
    assert "nope" in resolve("bkt", {"anon": True, "profile": "nope"})[1]  # botocore: profile not found
    monkeypatch.setenv("AWS_USE_FIPS_ENDPOINT", "true")
    assert "use_fips_endpoint" in resolve("bkt", {"anon": True})[1]


def _reads_with_endpoint_from(url, opts, env, extra):
    os.environ.update(env)
    nat, ref = Origin(url, extra, retry_budget_s=5), Origin(url, opts)
    assert nat.use_native(), "native reader refused"
    shard = "shards/shard-000000.tar"
    assert nat.read_range(shard, 100, 5000) == ref.read_range(shard, 100, 5000)


@pytest.mark.parametrize(
    "how",
    ["AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "config-file", "profile-option", "storage_options", "client_kwargs"],
)
def test_native_reads_with_the_endpoint_given_each_way(s3_packed, aws_env, how):
    """The endpoint (plain http) given in the environment, a config file, a profile or the options:
    the native reader reads the same bytes as s3fs given the options."""
    url, opts = s3_packed
    config, creds = aws_env
    env = {"AWS_ACCESS_KEY_ID": opts["key"], "AWS_SECRET_ACCESS_KEY": opts["secret"]}
    extra: dict = {}
    if how.startswith("AWS_ENDPOINT"):
        env[how] = opts["endpoint_url"]
    elif how in ("config-file", "profile-option"):
        config.write_text(f"[profile minio]\nendpoint_url = {opts['endpoint_url']}\nregion = us-east-1\n")
        creds.write_text(f"[minio]\naws_access_key_id = {opts['key']}\naws_secret_access_key = {opts['secret']}\n")
        if how == "config-file":
            env["AWS_PROFILE"] = "minio"
        else:
            extra = {"profile": "minio"}
    elif how == "storage_options":
        extra = {"endpoint_url": opts["endpoint_url"]}
    else:
        extra = {"client_kwargs": {"endpoint_url": opts["endpoint_url"]}}
    in_child(_reads_with_endpoint_from, url, opts, env, extra)


def test_fallback_to_s3fs_is_logged_once(aws_env, caplog):
    from stoker.storage._native_s3 import NativeS3Reader

    caplog.set_level(logging.WARNING, logger="stoker.storage._s3_config")
    for _ in range(3):
        assert NativeS3Reader.create("s3://bkt/ds", {"anon": True, "requester_pays": True}) is None
    lines = [r.getMessage() for r in caplog.records if "through s3fs" in r.getMessage()]
    assert len(lines) == 1 and "s3://bkt/ds" in lines[0] and "requester_pays" in lines[0]
