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

:func:`credential_hint` asks the same chain where the credentials of a refused request came from,
for the "check your credentials" of :class:`stoker.OriginPermissionError`.
"""

from __future__ import annotations

import datetime as _dt
import logging
import os
from urllib.parse import urlsplit, urlunsplit

from .retry import DEFAULT_CONNECT_TIMEOUT_S, DEFAULT_REQUEST_TIMEOUT_S

log = logging.getLogger(__name__)

__all__ = ["resolve", "note_fallback", "credential_hint"]

_CLIENT_KEYS = {"endpoint_url", "region_name"}
_CONFIG_KEYS = {"connect_timeout", "read_timeout", "retries", "s3"}
_TOP_KEYS = {"endpoint_url", "key", "secret", "token", "anon", "client_kwargs", "config_kwargs", "profile"}
_S3_KEYS = {"addressing_style"}  # other ``s3`` settings (accelerate, dual-stack, ...) keep s3fs
_CREDENTIAL_TTL_S = 300.0  # refreshable credentials are asked for again after at most this long
_NOTED: set[str] = set()
_HINTS: dict[tuple, str] = {}  # credential_hint per (options, AWS environment), in this process
#: Where every S3 client (s3fs, botocore, obstore through botocore) looks for credentials, in order.
_ALL_SOURCES = (
    "storage_options key/secret/token or profile, then AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY/"
    "AWS_SESSION_TOKEN, AWS_PROFILE, ~/.aws/credentials, ~/.aws/config, an instance role"
)


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


def _mask(key_id: str | None) -> str:
    """An access key id as ``'...WXYZ'`` (its last four characters; never the secret)."""
    return f"'...{key_id[-4:]}'" if key_id else "''"


def _credential_source(opts: dict) -> str:
    """Where botocore (hence s3fs and the native reader) takes this dataset's credentials from."""
    if opts.get("anon"):
        return "none: storage_options anon=True sends unsigned requests"
    if opts.get("key") or opts.get("secret"):
        token = "/token" if opts.get("token") else ""
        return f"storage_options key/secret{token}, key id {_mask(opts.get('key'))}"
    import botocore.exceptions
    import botocore.session

    profile = opts.get("profile")
    try:
        session = botocore.session.Session(profile=profile)
        profile = profile or session.get_config_variable("profile")
        named = (
            f"storage_options profile={profile!r}"
            if opts.get("profile")
            else (f"AWS_PROFILE={profile!r}" if os.environ.get("AWS_PROFILE") else f"profile {profile or 'default'!r}")
        )
        creds = session.get_credentials()
    except botocore.exceptions.BotoCoreError as exc:
        return f"the AWS configuration cannot be read: {exc}"
    if creds is None:
        return "none found"
    key = _mask(getattr(creds, "access_key", None))
    method = getattr(creds, "method", "") or ""
    where = {
        "env": "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY"
        + ("/AWS_SESSION_TOKEN" if os.environ.get("AWS_SESSION_TOKEN") else "")
        + " in the environment",
        "shared-credentials-file": f"{named} in {session.get_config_variable('credentials_file')}",
        "config-file": f"{named} in {session.get_config_variable('config_file')}",
        "assume-role": f"the role that {named} assumes",
        "assume-role-with-web-identity": "AWS_ROLE_ARN/AWS_WEB_IDENTITY_TOKEN_FILE",
        "sso": f"the SSO login of {named}",
        "custom-process": f"the credential_process of {named}",
        "container-role": "the container's role (AWS_CONTAINER_CREDENTIALS_*)",
        "iam-role": "the instance's IAM role (instance metadata)",
    }.get(method, f"botocore's {method or 'credential chain'}")
    return f"{where}, key id {key}"


def credential_hint(storage_options: dict | None) -> str:
    """The advice an S3 credentials refusal (403, ``InvalidAccessKeyId``, ``ExpiredToken``, ...)
    gives: ``"check your credentials (used: <where>, key id '...WXYZ'; looked for in: <the
    options and variables, in order>)"``. ``<where>`` is where botocore, hence s3fs and the native
    reader, found them for ``storage_options`` in this environment (the options' ``key``/``secret``,
    ``AWS_ACCESS_KEY_ID``, a profile in a named file, an instance role, ...). Only the last four
    characters of the access key id are shown, never a secret. Remembered per options and AWS
    environment in this process (every sample of a job with wrong keys fails the same way).
    Raises nothing."""
    opts = dict(storage_options or {})
    env = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("AWS_")))
    memo = (repr(sorted(opts.items(), key=lambda kv: kv[0])), env)
    hint = _HINTS.get(memo)
    if hint is None:
        try:
            source = _credential_source(opts)
        except Exception as exc:  # noqa: BLE001 - advice only: never hide the origin's own error
            source = f"unknown ({type(exc).__name__}: {exc})"
        hint = _HINTS[memo] = f"check your credentials (used: {source}; looked for in: {_ALL_SOURCES})"
    return hint


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
    client_options, reason = _client_options(config, endpoint, ca_bundle)
    if client_options is None:
        return None, reason
    kw: dict = {"client_options": client_options}
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


def _client_options(config: dict, endpoint, ca_bundle: str | None) -> tuple[dict | None, str | None]:
    """``(obstore client options, None)``: ``config_kwargs``' timeouts, ``allow_http`` for an
    ``http://`` endpoint, the CA bundle's certificates (added to the system roots: reaches every
    store s3fs reaches), ``Accept-Encoding: identity`` on every request; or ``(None, reason)``."""
    try:
        read_s = float(config.get("read_timeout", DEFAULT_REQUEST_TIMEOUT_S))
        connect_s = float(config.get("connect_timeout", DEFAULT_CONNECT_TIMEOUT_S))
    except (TypeError, ValueError):
        return None, "config_kwargs timeouts are not numbers of seconds"
    options: dict = {
        "read_timeout": f"{max(1, round(read_s * 1000))}ms",  # a stalled answer fails and is retried
        "connect_timeout": f"{max(1, round(connect_s * 1000))}ms",
        "allow_http": bool(endpoint) and str(endpoint).lower().startswith("http://"),
        # object_store sends no Accept-Encoding (RFC 9110: any coding is then acceptable) and does
        # not decode: ask for the stored bytes, as botocore does
        "default_headers": {"Accept-Encoding": "identity"},
    }
    if ca_bundle and not options["allow_http"]:
        try:
            with open(ca_bundle, "rb") as f:
                options["root_certificate"] = f.read()
        except OSError as exc:
            return None, f"the AWS CA bundle {ca_bundle} cannot be read: {exc}"
    return options, None


def _env_endpoint() -> bool:
    return bool(os.environ.get("AWS_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT_URL_S3"))


def _dns_compatible(bucket: str) -> bool:
    """Whether botocore would address ``bucket`` as a virtual host on AWS (no dots, a DNS label)."""
    from botocore.utils import check_dns_name

    return "." not in bucket and check_dns_name(bucket)


def _with_bucket_host(endpoint: str, bucket: str) -> str:
    parts = urlsplit(endpoint)
    return urlunsplit((parts.scheme, f"{bucket}.{parts.netloc}", parts.path.rstrip("/"), "", ""))
