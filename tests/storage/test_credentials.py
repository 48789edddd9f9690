"""Wrong S3 credentials: the error keeps the S3 code (``InvalidAccessKeyId``, also where the refused
request was a HEAD, whose answer has no body) and says "check your credentials", naming where they
were read (the storage options, ``AWS_ACCESS_KEY_ID``, a profile in a named file), never a secret.

The emulated origin accepts any signature, so a fault proxy in front of it refuses, as S3 does,
every request signed with another access key id than the origin's (403 ``InvalidAccessKeyId``).
Reads run in a child process: obstore's must (a process that used it must not fork), and s3fs's
filesystem cache and botocore read the environment each test sets there.
"""

from __future__ import annotations

import os

import pytest

from _helpers import fault_proxy, in_child
from stoker import OriginPermissionError
from stoker.storage import Origin
from stoker.storage.retry import classify
from stoker_lab.bench.faultproxy import Fault

_AWS_VARS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_DEFAULT_PROFILE")


def _not_the_origins_key(method: str, path: str, headers: dict) -> bool:
    """Every request not signed with the emulated origin's access key id ("testing")."""
    return "Credential=testing/" not in headers.get("authorization", "")


def _refusing_proxy(opts: dict):
    proxy, popts = fault_proxy(opts)
    proxy.set_fault(Fault("status", 403, match=_not_the_origins_key, code="InvalidAccessKeyId"))
    return proxy, popts


def _clean_aws_env(tmp: str) -> None:
    for name in _AWS_VARS:
        os.environ.pop(name, None)
    for name, text in (("AWS_CONFIG_FILE", ""), ("AWS_SHARED_CREDENTIALS_FILE", "")):
        path = os.path.join(tmp, name.lower())
        with open(path, "w") as f:
            f.write(text)
        os.environ[name] = path
    os.environ["AWS_EC2_METADATA_DISABLED"] = "true"


def _wrong_keys_in_options(url: str, opts: dict, tmp: str, native: bool) -> list[str]:
    """Wrong key/secret in the storage options: open_dataset (a HEAD of the index through s3fs)
    and a ranged read (s3fs or obstore) each fail with the code and the hint."""
    from stoker.store.dataset import open_dataset

    _clean_aws_env(tmp)
    messages = []
    with _refusing_proxy(opts)[0] as proxy:
        bad = {**{k: v for k, v in opts.items()}, "endpoint_url": proxy.endpoint_url}
        bad.update(key="AKIDWRONGKEY1234", secret="the-wrong-secret")
        if not native:
            with pytest.raises(OriginPermissionError) as err:
                open_dataset(url, storage_options=bad)
            messages.append(_check(err.value, "index.parquet"))
        origin = Origin(url, bad)
        if native:
            assert origin.use_native()
        with pytest.raises(OriginPermissionError) as err:
            origin.read_range("shards/shard-000000.tar", 0, 100)
        messages.append(_check(err.value, "shard-000000.tar bytes 0-100"))
        for m in messages:
            assert "storage_options key/secret" in m and "'...1234'" in m
            assert "AKIDWRONGKEY" not in m and "the-wrong-secret" not in m
    return messages


def _check(err: OriginPermissionError, what: str) -> str:
    text = str(err)
    assert (err.code, err.status, err.attempts) == ("InvalidAccessKeyId", 403, 1), text
    assert what in text and "InvalidAccessKeyId (HTTP 403)" in text, text
    assert "check your credentials" in text and "AWS_ACCESS_KEY_ID" in text and "AWS_PROFILE" in text, text
    return text


def test_wrong_keys_in_options_through_s3fs(s3_packed, tmp_path):
    url, opts = s3_packed
    messages = in_child(_wrong_keys_in_options, url, opts, str(tmp_path), False)
    assert len(messages) == 2


def test_wrong_keys_in_options_through_obstore(s3_packed, tmp_path):
    pytest.importorskip("obstore")
    url, opts = s3_packed
    assert len(in_child(_wrong_keys_in_options, url, opts, str(tmp_path), True)) == 1


def _wrong_keys_from(url: str, opts: dict, tmp: str, where: str, native: bool) -> str:
    """Keys from the environment (``where="env"``) or a profile in the credentials file
    (``"profile"``): the hint names that place."""
    _clean_aws_env(tmp)
    if where == "env":
        os.environ.update(AWS_ACCESS_KEY_ID="AKIDFROMENV0000", AWS_SECRET_ACCESS_KEY="env-secret")
    else:
        with open(os.environ["AWS_SHARED_CREDENTIALS_FILE"], "w") as f:
            f.write("[training]\naws_access_key_id = AKIDPROFILE9999\naws_secret_access_key = prof-secret\n")
        os.environ["AWS_PROFILE"] = "training"
    with _refusing_proxy(opts)[0] as proxy:
        plain = {k: v for k, v in opts.items() if k not in ("key", "secret")}
        origin = Origin(url, {**plain, "endpoint_url": proxy.endpoint_url})
        if native:
            assert origin.use_native()
        with pytest.raises(OriginPermissionError) as err:
            origin.read_range("shards/shard-000000.tar", 0, 100)
    text = _check(err.value, "shard-000000.tar")
    assert "secret" not in text.split("check your credentials")[1].split("looked for in")[0]
    return text


@pytest.mark.parametrize("native", [False, True], ids=["s3fs", "obstore"])
def test_wrong_keys_from_environment_are_named(s3_packed, tmp_path, native):
    if native:
        pytest.importorskip("obstore")
    url, opts = s3_packed
    text = in_child(_wrong_keys_from, url, opts, str(tmp_path), "env", native)
    assert "used: AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY in the environment, key id '...0000'" in text


def test_wrong_keys_from_a_profile_name_profile_and_file(s3_packed, tmp_path):
    url, opts = s3_packed
    text = in_child(_wrong_keys_from, url, opts, str(tmp_path), "profile", False)
    assert f"used: AWS_PROFILE='training' in {tmp_path / 'aws_shared_credentials_file'}, key id '...9999'" in text


def _client_error(status: int, code: str):
    from botocore.exceptions import ClientError

    err = ClientError(
        {"Error": {"Code": code, "Message": f"injected {code}"}, "ResponseMetadata": {"HTTPStatusCode": status}},
        "GetObject",
    )
    wrapped = OSError(5, f"injected {code}")
    wrapped.__cause__ = err
    return wrapped


@pytest.mark.parametrize("status, code", [(400, "ExpiredToken"), (403, "SignatureDoesNotMatch"), (403, "AccessDenied")])
def test_credential_codes_are_permission_errors_with_the_hint(tmp_path, status, code):
    """S3 sends ExpiredToken with 400: it is still a credentials refusal, kept with its code."""
    o = Origin("s3://bucket/ds", {"key": "AKIDEXPIRED42", "secret": "s"}, retry_budget_s=30)

    def refused():
        raise _client_error(status, code)

    with pytest.raises(OriginPermissionError) as err:
        o.retry("s3://bucket/ds/index.parquet", refused)
    assert (err.value.code, err.value.status) == (code, status)
    assert f"{code} (HTTP {status})" in str(err.value) and "check your credentials" in str(err.value)
    assert "'...ED42'" in str(err.value)
    assert ("check the URL too" in str(err.value)) == (code == "AccessDenied")


def test_a_bodyless_403_has_no_numeric_code():
    """botocore gives a refused HEAD the code "403": that is no S3 code, so none is reported."""
    failure = classify(_client_error(403, "403"))
    assert (failure.status, failure.code, failure.label()) == (403, None, "HTTP 403")


def test_hint_for_unsigned_requests_and_no_credentials(tmp_path, monkeypatch):
    from stoker.storage._s3_config import credential_hint

    for name in _AWS_VARS:
        monkeypatch.delenv(name, raising=False)
    for name in ("AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE"):
        (tmp_path / name).write_text("")
        monkeypatch.setenv(name, str(tmp_path / name))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    assert "used: none: storage_options anon=True" in credential_hint({"anon": True})
    assert "used: none found;" in credential_hint({})
