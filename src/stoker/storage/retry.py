"""Which origin failures are retried, how long to wait, and a back-off shared by threads.

Retries are bounded by time, not by count: a read keeps trying for ``retry_budget_s`` seconds
(default :data:`DEFAULT_RETRY_BUDGET_S`, or ``$STOKER_RETRY_BUDGET_S``) and then raises
:class:`stoker.storage.OriginError`. Waits between tries follow "full jitter" from the AWS
Architecture Blog post "Exponential Backoff and Jitter" (M. Brooker, 2015):
``sleep = uniform(0, min(cap_s, base_s * 2**attempt))``; a ``Retry-After`` header, where the
client exposes it, replaces the drawn wait.

Only failures that can clear are retried (:func:`classify`): throttling (HTTP 429, 503 and the S3
codes ``SlowDown``, ``Throttling``, ...), other 5xx answers, ``RequestTimeout``, connection resets
and timeouts, and answers that are wrong in transit (:func:`wrong_answer`: a ranged GET answered
with another length, e.g. by a proxy that dropped ``Range`` and sent the whole object; a body
whose checksum header does not match). 400, 403, 404 and the other 4xx answers fail at once,
keeping the S3 error code. HTTP origins (fsspec's ``http://``) report their status the same way.
Answers that break the protocol the same way on every try fail at once too
(:func:`protocol_fault`: a ranged answer compressed although identity was asked; a body aiohttp
cannot decode, ``ContentEncodingError``), while a body cut short can clear and is retried.

While the origin throttles, the threads of one process that read through one origin back off
as a whole (:class:`SharedBackoff`): one request at a time probes whether it has recovered,
the others wait, so N prefetch threads do not multiply the request rate the origin refused.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from email.utils import parsedate_to_datetime

#: Seconds one read keeps retrying before :class:`stoker.storage.OriginError` (S3 re-partitions a
#: throttled prefix within seconds to minutes; 30 s rides out short outages without hanging a job).
DEFAULT_RETRY_BUDGET_S = 30.0
#: Environment variable that overrides :data:`DEFAULT_RETRY_BUDGET_S` (seconds).
RETRY_BUDGET_ENV = "STOKER_RETRY_BUDGET_S"
#: First back-off ceiling in seconds (the wait after the first failure is uniform in [0, 0.2 s]).
DEFAULT_BACKOFF_S = 0.1
#: Largest back-off ceiling in seconds (the AWS SDKs cap theirs at 20 s; a 5 s cap keeps the
#: recovery from a short burst quick, and throttling brings one probe per process, not N).
#: A budget under 20 s lowers it to a quarter of the budget, so that a read gets several tries.
BACKOFF_CAP_S = 5.0

#: Seconds an S3 request may wait for the next bytes of its answer (botocore's and obstore's
#: ``read_timeout``) before it counts as stalled and is retried: S3 answers in well under a second,
#: so 10 s without a byte is a stall, not a slow origin.
DEFAULT_REQUEST_TIMEOUT_S = 10.0
#: Seconds to open a connection (botocore's and obstore's ``connect_timeout``).
DEFAULT_CONNECT_TIMEOUT_S = 10.0

#: S3 (and other object stores') error codes that mean "slow down".
THROTTLE_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "ThrottledException",
        "RequestThrottled",
        "RequestLimitExceeded",
        "TooManyRequests",
        "TooManyRequestsException",
        "ProvisionedThroughputExceededException",
        "BandwidthLimitExceeded",
        "EC2ThrottledException",
        "PriorRequestNotComplete",
    }
)
#: Error codes that clear by themselves although some stores send them with a 4xx status.
TRANSIENT_CODES = frozenset(
    {
        "RequestTimeout",
        "RequestTimeoutException",
        "InternalError",
        "ServiceUnavailable",
        "OperationAborted",
        "IDPCommunicationError",
    }
)
#: Storage-client configuration errors (botocore's names): reported at once, never retried.
CONFIG_ERRORS = frozenset(
    {
        "ProfileNotFound",
        "NoCredentialsError",
        "PartialCredentialsError",
        "NoRegionError",
        "InvalidConfigError",
        "UnknownConfigurationKeyError",
    }
)
#: S3 error codes that mean the request's credentials are wrong, expired or not allowed (S3 sends
#: some with 400, not 403): never retried; the error says where the credentials were read.
CREDENTIAL_CODES = frozenset(
    {
        "AccessDenied",
        "AllAccessDisabled",
        "AuthorizationHeaderMalformed",
        "ExpiredToken",
        "InvalidAccessKeyId",
        "InvalidClientTokenId",
        "InvalidSecurity",
        "InvalidToken",
        "MissingSecurityHeader",
        "RequestTimeTooSkewed",
        "SignatureDoesNotMatch",
        "TokenRefreshRequired",
        "NoCredentialsError",
        "PartialCredentialsError",
    }
)
#: Programming errors: they propagate unchanged.
BUGS = (TypeError, AttributeError, NameError)
#: Exception class names (anywhere in the cause chain) of network failures that can clear:
#: resets, timeouts, truncated or unparsable answers (aiohttp, botocore, urllib3, http.client).
_NETWORK_NAME = re.compile(
    r"Timeout|Connection|Disconnect|Reset|Payload|IncompleteRead|ResponseParser|"
    r"HTTPClientError|ProtocolError|ReadError|BrokenPipe|EndpointConnection|FlexibleChecksumError"
)
#: Exception class names (anywhere in the cause chain) of answers that the same request gets again:
#: aiohttp's body it cannot decode (the payload error's cause; its message says "content-encoding").
_DETERMINISTIC_NAMES = frozenset({"ContentEncodingError"})
_DETERMINISTIC_TEXT = re.compile(r"Can not decode content-encoding", re.IGNORECASE)
# No connection at all: refused, or a host name that does not resolve.
_UNREACHABLE = re.compile(
    r"Connection refused|Cannot connect to host|Could not connect to the endpoint|"
    r"Name or service not known|nodename nor servname|Temporary failure in name resolution|"
    r"dns error|failed to lookup address"
)
#: Seconds an origin that has never answered this process is retried when it cannot be reached at
#: all (refused connection, unknown host): that is usually a wrong URL or port, and a user should
#: hear so at once, not after the whole retry budget. An origin that answered before (a server
#: restarting) gets the whole budget.
UNREACHABLE_BUDGET_S = 3.0
# obstore (object_store) reports HTTP answers in its message only.
_STATUS_RE = re.compile(r"status code: (\d{3})|\bstatus: (\d{3})\b")
_CODE_RE = re.compile(r"<Code>([^<]{1,100})</Code>")


class _WrongAnswer(OSError):
    """The error to raise, inside a try of :meth:`stoker.storage.Origin.retry`, for a ranged GET of
    bytes ``[start, end)`` (``expected`` bytes) answered with ``got`` bytes (None: unknown): the
    retry loop sends the read again, and its message ends up in the
    :class:`stoker.errors.OriginError` when the retry budget is spent.

    ``range_ignored``: the answer was the whole object (None: taken from the lengths, an answer that
    runs past ``end``): the origin, or a proxy in front of it, does not honour ``Range``. An origin
    that never does cannot serve stoker, which reads byte ranges; the message says so.
    ``object_bytes``: the object's size, when a short answer was explained by asking for it: an
    object shorter than ``end`` is not an answer that can clear (``retry`` False, :func:`classify`):
    it changed or was cut since the index was written."""

    bare = True  # errors quote its message without its class name (it says what happened)

    def __init__(
        self,
        got: int | None,
        expected: int,
        start: int,
        end: int,
        range_ignored: bool | None = None,
        object_bytes: int | None = None,
    ):
        if range_ignored is None:
            range_ignored = got is not None and got > expected and got >= end
        self.got, self.expected, self.range_ignored = got, int(expected), bool(range_ignored)
        self.start, self.end, self.object_bytes = int(start), int(end), object_bytes
        self.retry = object_bytes is None or object_bytes >= end
        if not self.retry:
            what = (
                f"short read: the object is {object_bytes} bytes, bytes up to {end} asked "
                "(object changed or truncated since the index was written?)"
            )
        elif self.range_ignored:
            whole = "the whole object" + (f" ({got} bytes)" if got is not None else "")
            what = (
                f"the origin ignored Range: {expected} bytes asked, {whole} sent; stoker reads byte "
                "ranges, and an origin that never honours Range (a plain `python -m http.server`) cannot serve it"
            )
        else:
            what = f"wrong length: {expected} bytes asked, {got} sent (a proxy cut or padded the answer?)"
        super().__init__(what)

    def __reduce__(self):
        return (type(self), (self.got, self.expected, self.start, self.end, self.range_ignored, self.object_bytes))


#: The error to raise for a wrong answer, made with :class:`_WrongAnswer`'s arguments (public: other
#: modules raise it, the class stays private to this one).
wrong_answer = _WrongAnswer


class _ProtocolFault(OSError):
    """An answer that breaks the protocol in a way the same request meets again (a 206 whose
    body is compressed although ``Accept-Encoding: identity`` was asked): never retried."""

    bare = True  # errors quote its message without its class name (it says what happened)
    retry = False


def protocol_fault(message: str) -> OSError:
    """The error to raise, inside a try of :meth:`stoker.storage.Origin.retry`, for an answer that
    the same request would get again; :func:`classify` does not retry it, and ``message`` (what the
    server did, and what to change) ends up in the :class:`stoker.errors.OriginError`."""
    return _ProtocolFault(message)


@dataclass(frozen=True)
class Failure:
    """What one failed request says about the origin.

    ``retry``: another try can succeed; ``throttled``: the origin asks for fewer requests
    (429, 503, 5xx or a throttling code: the process backs off as a whole); ``status``: HTTP
    status or None; ``code``: the S3 error code (``SlowDown``, ``AccessDenied``, ``NoSuchKey``,
    ...) or None; ``retry_after_s``: the server's ``Retry-After`` in seconds, or None.
    """

    retry: bool
    throttled: bool = False
    status: int | None = None
    code: str | None = None
    retry_after_s: float | None = None
    unreachable: bool = False  # no connection at all (refused, no such host): often a wrong URL

    @property
    def credentials(self) -> bool:
        """Whether the origin refused the request's credentials (HTTP 401/403 or a code in
        :data:`CREDENTIAL_CODES`, such as ``InvalidAccessKeyId`` or ``ExpiredToken``)."""
        return self.status in (401, 403) or self.code in CREDENTIAL_CODES

    def label(self) -> str:
        """``"SlowDown (HTTP 503)"``, ``"HTTP 500"``, ``"NoSuchKey"`` or ``""``."""
        if self.code and self.status:
            return f"{self.code} (HTTP {self.status})"
        return self.code or (f"HTTP {self.status}" if self.status else "")


def _chain(exc: BaseException | None, depth: int = 8) -> Iterator[BaseException]:
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen and len(seen) < depth:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def _retry_after_s(value) -> float | None:
    """Seconds from a ``Retry-After`` header (delta-seconds or an HTTP date), or None."""
    if value is None:
        return None
    with contextlib.suppress(TypeError, ValueError):
        return max(0.0, float(value))
    try:
        return max(0.0, parsedate_to_datetime(str(value)).timestamp() - time.time())
    except (TypeError, ValueError, IndexError, OverflowError):
        return None


def http_details(exc: BaseException) -> tuple[int | None, str | None, float | None]:
    """(status, code, retry_after_s) from the first exception in the cause chain that has them:
    botocore's ``ClientError.response`` (s3fs wraps it as the cause of an OSError), else an
    HTTP client error's ``status`` and ``headers`` (aiohttp's, under fsspec's ``http://``), else
    obstore's message ("... non-2xx status code: 503 Service Unavailable: <Error><Code>...")."""
    for e in _chain(exc):
        resp = getattr(e, "response", None)
        if isinstance(resp, dict) and ("Error" in resp or "ResponseMetadata" in resp):
            meta = resp.get("ResponseMetadata") or {}
            headers = {str(k).lower(): v for k, v in (meta.get("HTTPHeaders") or {}).items()}
            status = meta.get("HTTPStatusCode")
            code = (resp.get("Error") or {}).get("Code") or None
            if code and code.isdigit():  # botocore's stand-in for an answer without a body (a HEAD)
                code = None
            return (int(status) if status else None), code, _retry_after_s(headers.get("retry-after"))
    for e in _chain(exc):  # aiohttp's ClientResponseError (fsspec's http://): .status, .headers
        st = getattr(e, "status", None)
        if isinstance(st, int) and not isinstance(st, bool) and 100 <= st < 600 and type(e).__name__.endswith("Error"):
            hdrs = getattr(e, "headers", None) or {}
            try:
                after = hdrs.get("Retry-After")
            except AttributeError:
                after = None
            return st, None, _retry_after_s(after)
    status = code = None
    for e in _chain(exc):  # a wrapper's message may be cut short: the cause has the whole text
        text = str(e)
        m = _STATUS_RE.search(text) if status is None else None
        if m:
            status = int(m.group(1) or m.group(2))
        c = _CODE_RE.search(text) if code is None else None
        if c:
            code = c.group(1).strip()
    return (status, code, None) if status is not None else (None, None, None)


def classify(exc: BaseException) -> Failure:
    """Decide whether ``exc`` (raised by s3fs, obstore, a local filesystem, ...) can clear.

    HTTP answers (from botocore's error response or obstore's message): 429, 5xx and the codes
    in :data:`THROTTLE_CODES` / :data:`TRANSIENT_CODES` are retried, every other status is not.
    Without an HTTP answer: ``FileNotFoundError``, ``PermissionError``, configuration errors
    (:data:`CONFIG_ERRORS`) and programming errors are not retried; timeouts, resets and other
    network failures (``OSError``, or a class name such as ``ServerDisconnectedError``,
    ``ReadTimeoutError``) are; obstore's errors without a status are network failures. A body
    that cannot be decoded (aiohttp's ``ContentEncodingError``) and :func:`protocol_fault` are not.
    """
    if isinstance(exc, (_WrongAnswer, _ProtocolFault)):
        return Failure(retry=exc.retry)
    status, code, retry_after = http_details(exc)
    if status is not None or code is not None:
        throttled = code in THROTTLE_CODES or status in (429, 503)
        transient = throttled or code in TRANSIENT_CODES or (status is not None and 500 <= status < 600)
        return Failure(
            retry=transient,
            throttled=transient and (throttled or (status or 0) >= 500),
            status=status,
            code=code,
            retry_after_s=retry_after,
        )
    if isinstance(exc, BUGS + (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)):
        return Failure(retry=False)
    names = [type(e).__name__ for e in _chain(exc)]
    if any(n in CONFIG_ERRORS for n in names):
        return Failure(retry=False, code=next(n for n in names if n in CONFIG_ERRORS))
    if _DETERMINISTIC_NAMES.intersection(names) or any(_DETERMINISTIC_TEXT.search(str(e)) for e in _chain(exc)):
        return Failure(retry=False)
    if (
        any(isinstance(e, (OSError, TimeoutError)) for e in _chain(exc))
        or any(_NETWORK_NAME.search(n) for n in names)
        or type(exc).__module__.startswith("obstore")
    ):
        unreachable = any(isinstance(e, (ConnectionRefusedError, socket.gaierror)) for e in _chain(exc)) or any(
            _UNREACHABLE.search(str(e)) for e in _chain(exc)
        )
        return Failure(retry=True, unreachable=unreachable)
    return Failure(retry=False)


def full_jitter_s(attempt: int, base_s: float = DEFAULT_BACKOFF_S, cap_s: float = BACKOFF_CAP_S, rng=random) -> float:
    """Wait before try ``attempt + 1`` (``attempt`` >= 1 failures so far), in seconds:
    ``uniform(0, min(cap_s, base_s * 2**attempt))`` ("full jitter", AWS Architecture Blog)."""
    return rng.uniform(0.0, min(cap_s, base_s * 2.0 ** min(attempt, 60)))


def resolve_retry_budget_s(value: float | None) -> float:
    """The retry budget in seconds: ``value``, else ``$STOKER_RETRY_BUDGET_S``, else
    :data:`DEFAULT_RETRY_BUDGET_S`. Raises ValueError (naming the setting) for a negative,
    non-finite or non-numeric value; 0 means a single try."""
    source = "retry_budget_s"
    given: float | str
    if value is not None:
        given = value
    else:
        env = os.environ.get(RETRY_BUDGET_ENV)
        if env is None or not env.strip():
            return DEFAULT_RETRY_BUDGET_S
        source = f"${RETRY_BUDGET_ENV}"
        given = env
    try:
        budget_s = float(given)
    except (TypeError, ValueError):
        raise ValueError(f"{source} must be a number of seconds, got {given!r}") from None
    if not 0.0 <= budget_s < float("inf"):
        raise ValueError(f"{source} must be >= 0 and finite (seconds), got {given!r}")
    return budget_s


class SharedBackoff:
    """Back-off state shared by the threads of one process that read through one origin.

    While the origin throttles (a :class:`Failure` with ``throttled``), requests wait at
    :meth:`wait_turn` until the current back-off (full jitter on the number of throttled
    rounds, or the server's ``Retry-After``) has passed; then one request at a time probes the
    origin. The first success from any thread opens the gate for all. A throttled answer raises
    the back-off only for a request sent after the last back-off began, so N requests refused
    together count as one round, not N. Thread-safe; not shared across processes (each process
    starts its own when an :class:`stoker.storage.Origin` is unpickled).
    """

    def __init__(self, base_s: float = DEFAULT_BACKOFF_S, cap_s: float = BACKOFF_CAP_S):
        self.base_s, self.cap_s = float(base_s), float(cap_s)
        self._cond = threading.Condition()
        self._rounds = 0  # throttled rounds in a row (0: the origin is not throttling)
        self._not_before = 0.0  # monotonic seconds before which no request starts
        self._since = 0.0  # monotonic time the current back-off began
        self._probing = False  # a request is testing whether the origin recovered
        self.cancelled = False  # the process is stopping: waits end at once
        self.last: Failure | None = None

    @property
    def throttled(self) -> bool:
        """Whether the origin is throttling now (callers may hold back new work)."""
        return self._rounds > 0

    def wait_turn(self, deadline: float, first: bool = False) -> tuple[bool, bool]:
        """Block until this thread may send a request or ``deadline`` (monotonic s) passes.

        ``first``: the caller has not sent any request yet; it then gets one try at its
        deadline even if the back-off lasts longer (when no other probe is in flight), so
        every operation reports an answer of its own. Returns (go, probe): ``go`` False when
        the deadline came first; ``probe`` True when this request is the one probing a
        throttling origin (pass it to :meth:`done`).
        """
        with self._cond:
            while self._rounds > 0 and not self.cancelled:
                now = time.monotonic()
                if not self._probing and (now >= self._not_before or (first and now >= deadline)):
                    self._probing = True
                    return True, True
                if now >= deadline and not (first and self._probing):
                    return False, False
                wake = deadline if self._probing else min(deadline, self._not_before)
                # past its deadline, a first try waits for the probe in flight (done() notifies)
                self._cond.wait(max(0.001, wake - now) if wake > now else 0.05)
            return not self.cancelled, False

    def pause(self, seconds: float) -> None:
        """Sleep ``seconds`` (a back-off between tries), or less if :meth:`cancel` is called."""
        with self._cond:
            end = time.monotonic() + seconds
            while not self.cancelled and time.monotonic() < end:
                self._cond.wait(end - time.monotonic())

    def cancel(self) -> None:
        """End every wait now and refuse new turns: the process is stopping (its reads fail
        at their next wait instead of holding the process for the rest of their budget)."""
        with self._cond:
            self.cancelled = True
            self._cond.notify_all()

    def done(self, sent_at: float, probe: bool, failure: Failure | None, cap_s: float | None = None) -> None:
        """Record the outcome of a request sent at ``sent_at`` (monotonic s): None for success
        (the gate opens), else its :class:`Failure` (a throttled one starts a new round, whose
        wait is drawn with ceiling ``cap_s``, default the instance's)."""
        with self._cond:
            if probe:
                self._probing = False
            if failure is None:
                self._rounds = 0
            elif failure.throttled:
                self.last = failure
                if sent_at >= self._since or self._rounds == 0:
                    self._rounds += 1
                    now = time.monotonic()
                    wait_s = failure.retry_after_s
                    if wait_s is None:
                        wait_s = full_jitter_s(self._rounds, self.base_s, self.cap_s if cap_s is None else cap_s)
                    self._since, self._not_before = now, max(self._not_before, now + wait_s)
            self._cond.notify_all()
