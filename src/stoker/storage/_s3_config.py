"""The S3 settings of a dataset's storage options and the AWS environment, resolved by botocore,
for the native (obstore) reader.

s3fs hands its options to botocore, which fills in what they leave out from the environment and
the AWS config files: the endpoint (``AWS_ENDPOINT_URL_S3``, ``AWS_ENDPOINT_URL``, ``endpoint_url``
in the profile or its ``services`` section), the region, the profile (``AWS_PROFILE`` or the
``profile`` option), credentials (environment, credentials file, profile, process, SSO, instance
metadata), the addressing style (``s3.addressing_style``), a CA bundle (``AWS_CA_BUNDLE``) and
whether plain HTTP is used (an ``http://`` endpoint). :func:`resolve` asks botocore's own
configuration chain for each of these, so the native reader reads from exactly where s3fs would,
and returns ``S3Store`` arguments that set every one explicitly (obstore's own environment
reading, which differs, never decides).

Where a setting has no obstore equivalent (FIPS, dual-stack or accelerated endpoints,
an unknown option, no credentials at all) :func:`resolve` gives the reason instead, and the
dataset stays on s3fs; :func:`note_fallback` logs that once per process and reason.
"""

from __future__ import annotations

import datetime as _dt
import logging
import os
from urllib.parse import urlsplit, urlunsplit

from .retry import DEFAULT_CONNECT_TIMEOUT_S, DEFAULT_REQUEST_TIMEOUT_S

log = logging.getLogger(__name__)

__all__ = ["resolve", "note_fallback"]

_CLIENT_KEYS = {"endpoint_url", "region_name"}
_CONFIG_KEYS = {"connect_timeout", "read_timeout", "retries", "s3"}
_TOP_KEYS = {"endpoint_url", "key", "secret", "token", "anon", "client_kwargs", "config_kwargs", "profile"}
_S3_KEYS = {"addressing_style"}  # other ``s3`` settings (accelerate, dual-stack, ...) keep s3fs
_CREDENTIAL_TTL_S = 300.0  # refreshable credentials are asked for again after at most this long
_NOTED: set[str] = set()


def note_fallback(url: str, reason: str) -> None:
    """Log, once per process and reason, that ``url`` is read through s3fs and why."""
    if reason not in _NOTED:
        _NOTED.add(reason)
        log.warning("reading %s through s3fs, not the native S3 reader: %s", url, reason)


class _Credentials:
    """obstore credential provider: static keys (``expires_at`` None), or botocore credentials that
    refresh (SSO, assume-role, instance metadata), whose current frozen value is returned, valid for
    at most :data:`_CREDENTIAL_TTL_S` seconds before obstore asks again. Handing obstore a provider
    (never bare keys) keeps its own environment reading (``AWS_SESSION_TOKEN``, ...) out of it."""

    def __init__(self, credentials=None, key: str | None = None, secret: str | None = None, token: str | None = None):
        self._credentials, self._static = credentials, (key, secret, token)

    def __call__(self) -> dict:
        if self._credentials is None:
            key, secret, token = self._static
            return {"access_key_id": key, "secret_access_key": secret, "token": token, "expires_at": None}
        frozen = self._credentials.get_frozen_credentials()
        expires = (
            _dt.datetime.now(_dt.UTC) + _dt.timedelta(seconds=_CREDENTIAL_TTL_S)
            if hasattr(self._credentials, "refresh_needed")
            else None
        )
        return {
            "access_key_id": frozen.access_key,
            "secret_access_key": frozen.secret_key,
            "token": frozen.token,
            "expires_at": expires,
        }


def _unknown_options(opts: dict, client: dict, config: dict, s3: dict) -> list[str]:
    return (
        sorted(set(opts) - _TOP_KEYS)
        + [f"client_kwargs.{k}" for k in sorted(set(client) - _CLIENT_KEYS)]
        + [f"config_kwargs.{k}" for k in sorted(set(config) - _CONFIG_KEYS)]
        + [f"s3.{k}" for k in sorted(set(s3) - _S3_KEYS) if s3[k]]
    )


def resolve(bucket: str, storage_options: dict | None) -> tuple[dict | None, str | None]:
    """``(S3Store keyword arguments, None)`` for reading ``bucket`` as s3fs would with
    ``storage_options`` (fsspec/s3fs spelling) in this environment, or ``(None, reason)`` where
    the native reader cannot do the same (the reason says which setting).

    The keyword arguments: ``endpoint`` (custom endpoints only; with the bucket in the host for
    virtual-hosted addressing), ``region``, ``virtual_hosted_style_request``, ``client_options``
    (``allow_http``, and ``connect_timeout`` / ``read_timeout`` from ``config_kwargs`` in seconds,
    default :data:`stoker.storage.retry.DEFAULT_CONNECT_TIMEOUT_S` /
    :data:`~stoker.storage.retry.DEFAULT_REQUEST_TIMEOUT_S`), and either ``skip_signature``,
    static keys, or a ``credential_provider``. Raises nothing: a configuration botocore rejects
    (an unknown profile, a malformed file) is a reason, and s3fs reports it on first use.
    """
    opts = dict(storage_options or {})
    client = dict(opts.get("client_kwargs") or {})
    config = dict(opts.get("config_kwargs") or {})
    unknown = _unknown_options(opts, client, config, dict(config.get("s3") or {}))
    if unknown:
        return None, f"storage option(s) {', '.join(unknown)} have no native equivalent"
    try:
        import botocore.exceptions
        import botocore.session
        from botocore.configprovider import ConfiguredEndpointProvider
    except ImportError:
        return None, "botocore is not installed"
    try:
        session = botocore.session.Session(profile=opts.get("profile"))
        scoped = session.get_scoped_config()
        ca_bundle = session.get_config_variable("ca_bundle")
        for name in ("use_fips_endpoint", "use_dualstack_endpoint"):
            if session.get_config_variable(name):
                return None, f"the AWS setting {name} has no native equivalent"
        s3 = {**(session.get_config_variable("s3") or {}), **dict(config.get("s3") or {})}
        bad_s3 = [k for k in sorted(set(s3) - _S3_KEYS) if s3[k]]
        if bad_s3:
            return None, f"the AWS s3 setting(s) {', '.join(bad_s3)} have no native equivalent"
        endpoint = opts.get("endpoint_url") or client.get("endpoint_url")
        if not endpoint and not session.get_config_variable("ignore_configured_endpoint_urls"):
            endpoint = ConfiguredEndpointProvider(
                full_config=session.full_config, scoped_config=scoped, client_name="s3"
            ).provide()
        elif not endpoint and _env_endpoint():
            return None, "AWS endpoint URLs are ignored (ignore_configured_endpoint_urls) but set"
        region = client.get("region_name") or session.get_config_variable("region")
        credentials = None
        if not opts.get("anon") and not (opts.get("key") and opts.get("secret")):
            credentials = session.get_credentials()
            if credentials is None:
                return None, "botocore found no AWS credentials"
    except botocore.exceptions.BotoCoreError as exc:
        return None, f"botocore cannot read the AWS configuration: {exc}"
    try:
        read_s = float(config.get("read_timeout", DEFAULT_REQUEST_TIMEOUT_S))
        connect_s = float(config.get("connect_timeout", DEFAULT_CONNECT_TIMEOUT_S))
    except (TypeError, ValueError):
        return None, "config_kwargs timeouts are not numbers of seconds"
    kw: dict = {
        "client_options": {
            "read_timeout": f"{max(1, round(read_s * 1000))}ms",  # a stalled answer fails and is retried
            "connect_timeout": f"{max(1, round(connect_s * 1000))}ms",
            "allow_http": bool(endpoint) and str(endpoint).lower().startswith("http://"),
        }
    }
    if ca_bundle and not kw["client_options"]["allow_http"]:
        try:  # added to the system roots (botocore trusts only the bundle): reaches every store s3fs reaches
            with open(ca_bundle, "rb") as f:
                kw["client_options"]["root_certificate"] = f.read()
        except OSError as exc:
            return None, f"the AWS CA bundle {ca_bundle} cannot be read: {exc}"
    style = s3.get("addressing_style") or "auto"
    if endpoint:
        # botocore: with a custom endpoint, path style unless addressing_style is "virtual"
        virtual = style == "virtual"
        kw["endpoint"] = _with_bucket_host(str(endpoint), bucket) if virtual else str(endpoint).rstrip("/")
        region = region or "us-east-1"  # botocore signs for us-east-1 when no region is set
    else:
        virtual = style == "virtual" or (style == "auto" and _dns_compatible(bucket))
    kw["virtual_hosted_style_request"] = virtual
    if region:
        kw["region"] = region
    if opts.get("anon"):
        kw["skip_signature"] = True
    elif credentials is None:
        kw["credential_provider"] = _Credentials(key=opts["key"], secret=opts["secret"], token=opts.get("token"))
    else:
        kw["credential_provider"] = _Credentials(credentials)
    return kw, None


def _env_endpoint() -> bool:
    return bool(os.environ.get("AWS_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT_URL_S3"))


def _dns_compatible(bucket: str) -> bool:
    """Whether botocore would address ``bucket`` as a virtual host on AWS (no dots, a DNS label)."""
    from botocore.utils import check_dns_name

    return "." not in bucket and check_dns_name(bucket)


def _with_bucket_host(endpoint: str, bucket: str) -> str:
    parts = urlsplit(endpoint)
    return urlunsplit((parts.scheme, f"{bucket}.{parts.netloc}", parts.path.rstrip("/"), "", ""))
