"""The pack lease: one writer per destination at a time, on local files and on S3.

``stoker pack`` holds a lease object ``<dst>/_stoker_pack.lease`` (JSON: owner host,
pid and run id, start, renewal and expiry times in Unix seconds, a renewal count, the
lease length) for as long as it writes. A second pack into the same destination that
finds it refuses with :class:`PackLeaseError` naming the owner. The holder renews the
lease every ``ttl_s / 3`` seconds from a background thread; before it installs the
index it renews once more and stops if the lease is no longer its own, so a run
that lost its lease (it was frozen longer than ``ttl_s``, another run took over)
never installs an index.

Whether the owner still lives is judged by change, not by comparing clocks (hosts'
clocks may disagree by minutes or hours; a reader whose clock ran an hour ahead used to
take over a live, renewing pack):

* an owner that ran on this host (same host name and pid namespace) whose process is
  gone is dead at once;
* an owner whose own times say it renewed within its lease length, read on a clock
  that agrees with this one to :data:`CLOCK_SKEW_S`, is alive: refused at once;
* any other lease (it ran out by this host's clock, or the two clocks disagree) is
  watched on this process's monotonic clock for the owner's lease length: a lease
  that changes meanwhile (the owner renewed it) is alive, one that stays the same is
  taken over. This is how Kubernetes' leader election judges a leader (client-go,
  ``tools/leaderelection``: the candidate notes when it last saw the record change, on
  its own clock, and takes over a lease duration later); only the clocks' rates must
  agree, never their readings.

A pack that died on another host therefore blocks for its lease length after its last
renewal (as before), plus up to one lease length of watching by the next pack.

Every change of the lease is a conditional write, so that of two racing writers
exactly one wins:

* local paths (``file://``): created by ``link(2)`` of a complete temporary file,
  which fails if the name exists (the O_EXCL rule, and safe on NFS); replaced
  (renewal, take-over) by renaming the old lease away to a unique name, which only
  one renamer can do, then checking that it was the lease expected;
* S3 (s3fs): ``PutObject`` with ``If-None-Match: *`` to create, with ``If-Match:
  <ETag>`` to replace, ``DeleteObject`` with ``If-Match`` to release (AWS S3 since
  2024, MinIO, moto >= 5);
* any other filesystem, or an S3 store that ignores the conditions: a documented
  best effort: write, read back, and go on only if the owner read back is this run.
  Two writers that start within one round trip of each other can then both
  believe they hold it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid

import fsspec.asyn

from .._atomic import umask_mode, write_atomic
from .._procs import pid_alive
from ..errors import OriginError, OriginNotFoundError, OriginPermissionError, PackLeaseError, PackLeaseLostError
from ..storage import Origin

log = logging.getLogger(__name__)

LEASE_NAME = "_stoker_pack.lease"
#: Lease length in seconds; renewed every third of it, so a holder survives two lost renewals.
DEFAULT_LEASE_S = 60.0
#: Seconds by which an owner's clock may run ahead of this host's while its times are still
#: believed (a lease renewed "in the future" by more is watched instead). Hosts kept by NTP agree
#: to milliseconds; a host that is minutes off is judged by the lease's changes alone.
CLOCK_SKEW_S = 5.0
#: Longest watch of a lease, in seconds, whatever lease length its record claims.
MAX_WATCH_S = 3600.0


class _Conflict(Exception):
    """A conditional write lost its race."""


def _when(t) -> str:
    if not t:
        return "?"
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(float(t)))


def _taken_by(owner: dict) -> str:
    """``"taken over by the pack on host 'n1', pid 7, run ab12, since 2025-...Z"``."""
    return (
        f"taken over by the pack on host {owner.get('host')!r}, pid {owner.get('pid')}, run "
        f"{owner.get('run')}, since {_when(owner.get('started_unix'))}"
    )


def _pid_namespace() -> str:
    """This process's pid namespace ("pid:[4026531836]"): containers that share a host name
    (host networking) have different ones, so their pids are not compared."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


class _Local:
    """Conditional create/replace/delete of one local file; the token is the content."""

    def __init__(self, path: str):
        self.path = path

    def read(self):
        try:
            with open(self.path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return None, None
        return data, data

    def create(self, data: bytes):
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        if not write_atomic(
            self.path, data, mode=umask_mode(), replace=False, fsync=True, tmp_prefix=f"{self.path}.new-"
        ):
            raise _Conflict()
        return data

    def _take(self, token) -> str:
        """Rename the lease away if it is still ``token``; returns the moved path."""
        moved = f"{self.path}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            os.rename(self.path, moved)
        except FileNotFoundError:
            raise _Conflict() from None
        with open(moved, "rb") as f:
            if f.read() != token:  # not the lease we read: put it back untouched
                with contextlib.suppress(FileExistsError):
                    os.link(moved, self.path)
                os.unlink(moved)
                raise _Conflict()
        return moved

    def replace(self, data: bytes, token):
        moved = self._take(token)
        try:
            return self.create(data)
        finally:
            os.unlink(moved)

    def delete(self, token) -> None:
        os.unlink(self._take(token))


class _S3:
    """Conditional PutObject/DeleteObject through s3fs; the token is the ETag. ``what``: what
    errors name (the destination, not the lease object)."""

    def __init__(self, fs, path: str, what: str):
        self.fs, self.what = fs, what
        self.bucket, self.key = path.split("/", 1)

    def _call(self, op: str, **kw):
        """One S3 call on the lease object. Raises _Conflict for a failed condition (412/409),
        else :class:`stoker.OriginError` (``OriginNotFoundError`` for a missing bucket or object,
        ``OriginPermissionError`` for a denial) naming the destination."""
        url = self.what
        try:
            return self.fs.call_s3(op, Bucket=self.bucket, Key=self.key, **kw)
        except FileNotFoundError as exc:
            missing = (
                f"the destination bucket {self.bucket!r} does not exist (create it, or check the "
                f"endpoint in the storage options or the AWS environment): {exc}"
            )
            raise OriginNotFoundError(url, missing if "bucket" in str(exc).lower() else str(exc)) from exc
        except PermissionError as exc:
            raise OriginPermissionError(url, str(exc)) from exc
        except Exception as exc:  # noqa: BLE001 - s3fs maps 412/409 to several OSError types
            text = f"{type(exc).__name__} {exc} {getattr(exc, '__cause__', '')}"
            if any(s in text for s in ("PreconditionFailed", "412", "ConditionalRequestConflict", "409")):
                raise _Conflict() from exc
            if isinstance(exc, OriginError):
                raise
            raise OriginError(url, f"{type(exc).__name__}: {exc}") from exc

    def read(self):
        async def get():
            out = await self.fs._call_s3("get_object", Bucket=self.bucket, Key=self.key)
            async with out["Body"] as body:
                return await body.read(), out.get("ETag")

        try:
            return fsspec.asyn.sync(self.fs.loop, get)
        except FileNotFoundError:
            return None, None

    def create(self, data: bytes):
        return self._call("put_object", Body=data, IfNoneMatch="*").get("ETag")

    def replace(self, data: bytes, token):
        try:
            return self._call("put_object", Body=data, IfMatch=token).get("ETag")
        except FileNotFoundError:  # the lease is gone (another run released it): not the one expected
            raise _Conflict() from None

    def delete(self, token) -> None:
        try:
            self._call("delete_object", IfMatch=token)
        except FileNotFoundError:
            raise _Conflict() from None


class _BestEffort:
    """Any other fsspec filesystem: plain writes (checked by reading back, see the module doc)."""

    def __init__(self, fs, path: str):
        self.fs, self.path = fs, path

    def read(self):
        try:
            data = self.fs.cat_file(self.path)
        except FileNotFoundError:
            return None, None
        return data, data

    def create(self, data: bytes):
        if self.fs.exists(self.path):
            raise _Conflict()
        self.fs.pipe_file(self.path, data)
        return data

    def replace(self, data: bytes, token):
        if self.read()[1] != token:
            raise _Conflict()
        self.fs.pipe_file(self.path, data)
        return data

    def delete(self, token) -> None:
        if self.read()[1] == token:
            self.fs.rm(self.path)


def _backend(dest: Origin):
    fs, path = dest.fs, dest.path(LEASE_NAME)
    if dest.is_local:
        return _Local(path)
    if hasattr(fs, "call_s3"):
        return _S3(fs, path, f"{dest.url} (marking it as being packed)")
    return _BestEffort(fs, path)


def _fresh(owner: dict) -> bool:
    """Whether ``owner``'s own times say it renewed within its lease length, read on a clock that
    agrees with this host's: renewed at most :data:`CLOCK_SKEW_S` ahead of now, expiry not passed
    (False for a record without those times)."""
    try:
        renewed, expires = float(owner["renewed_unix"]), float(owner["expires_unix"])
    except (KeyError, TypeError, ValueError):
        return False
    return renewed - CLOCK_SKEW_S <= time.time() <= expires


def _lease_s(owner: dict, default_s: float) -> float:
    """The lease length ``owner``'s record gives (seconds; ``default_s`` when it gives none), at
    most :data:`MAX_WATCH_S`."""
    try:
        ttl_s = float(owner.get("ttl_s") or default_s)
    except (TypeError, ValueError):
        ttl_s = default_s
    return min(ttl_s, MAX_WATCH_S) if ttl_s > 0 else default_s


class PackLease:
    """The lease of one pack on destination ``dest`` (a :class:`stoker.storage.Origin`).

    Use as a context manager: entering acquires it (raises :class:`PackLeaseError` when
    another live pack holds it) and starts renewal every ``ttl_s / 3`` seconds; leaving
    stops renewal and deletes the lease if it is still this run's. :meth:`check` raises
    :class:`PackLeaseLostError` once the lease is no longer this run's.
    """

    def __init__(self, dest: Origin, ttl_s: float = DEFAULT_LEASE_S):
        if ttl_s <= 0:
            raise ValueError(f"lease ttl_s must be positive, got {ttl_s}")
        self.dest, self.ttl_s = dest, float(ttl_s)
        self.url = dest.url  # what messages name: the destination (the lease object is ours alone)
        self.run = uuid.uuid4().hex
        self.started_unix = time.time()
        self._io = _backend(dest)
        self._token: object = None  # the store's version of the lease object (S3: its ETag)
        self._lost: str | None = None
        self._renewed_mono = time.monotonic()
        self._renewals = 0  # in the record, so that every renewal changes it (its time may not)
        self._lost_after_s = 0.0  # seconds since the last renewal when the loss was found
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _body(self) -> bytes:
        now = time.time()
        return json.dumps(
            {
                "host": socket.gethostname(),
                "pidns": _pid_namespace(),
                "pid": os.getpid(),
                "run": self.run,
                "started_unix": self.started_unix,
                "renewed_unix": now,
                "renewals": self._renewals,
                "expires_unix": now + self.ttl_s,
                "ttl_s": self.ttl_s,
            }
        ).encode()

    def _read_owner(self) -> tuple[dict | None, object]:
        data, token = self._io.read()
        if data is None:
            return None, None
        try:
            owner = json.loads(data)
            if not isinstance(owner, dict):
                raise ValueError("not an object")
        except ValueError:
            # a lease we cannot parse is treated as one that has expired
            owner = {"host": "?", "pid": 0, "run": "?", "expires_unix": 0}
        return owner, token

    def _judge(self, owner: dict, token) -> tuple[str | None, dict | None, object]:
        """Whether the pack holding the lease (``owner``, read as ``token``) is gone, judged by
        change rather than by comparing clocks (see the module docstring). Returns ``(why, owner,
        token)``: ``why`` None while that pack may be alive, else why it is dead; ``owner`` and
        ``token`` as last read (``owner`` None: the lease was released meanwhile). May watch the
        lease for up to the owner's lease length (seconds, at most :data:`MAX_WATCH_S`)."""
        if owner.get("host") == socket.gethostname() and owner.get("pidns") == _pid_namespace():
            try:
                if not pid_alive(int(owner.get("pid") or 0)):
                    return "its process is gone from this host", owner, token
            except (TypeError, ValueError):
                pass
        if _fresh(owner):
            return None, owner, token
        ttl_s = _lease_s(owner, self.ttl_s)
        log.warning(
            "%s: the pack on host %r, pid %s, run %s claims this destination; by this host's clock its claim "
            "ran out %s, or the two clocks disagree: watching it for up to %g s to see whether that pack "
            "still renews it",
            self.url,
            owner.get("host"),
            owner.get("pid"),
            owner.get("run"),
            _when(owner.get("expires_unix")),
            ttl_s,
        )
        poll_s = min(max(ttl_s / 12, 0.05), 2.0)
        end = time.monotonic() + ttl_s
        while True:
            time.sleep(max(0.0, min(poll_s, end - time.monotonic())))
            now_owner, now_token = self._read_owner()
            if now_owner is None or now_token != token:
                return None, now_owner, now_token  # renewed (or released, or taken) meanwhile
            if time.monotonic() >= end:
                renewed = owner.get("renewed_unix")
                return (
                    f"its claim did not change for {ttl_s:g} s, watched on this host's clock (its own clock "
                    f"says it last renewed at {_when(renewed)})",
                    owner,
                    token,
                )

    def acquire(self) -> None:
        """Take the lease (creating it, or taking over a dead owner's). Raises :class:`PackLeaseError`.
        Finding a lease whose owner's liveness its times cannot tell, it watches the lease for
        up to the owner's lease length first (see the module docstring)."""
        for _ in range(3):
            with contextlib.suppress(_Conflict):
                self._token = self._io.create(self._body())
                break
            owner, token = self._read_owner()
            if owner is None:
                continue  # released in between: try to create again
            watched = not _fresh(owner)
            why, owner, token = self._judge(owner, token)
            if owner is None:
                continue  # released while watched
            if why is None:
                raise PackLeaseError(self.url, owner, watched=watched and not _fresh(owner))
            log.warning(
                "%s: taking over from a pack that died while writing it (host %r, pid %s, run %s): %s",
                self.url,
                owner.get("host"),
                owner.get("pid"),
                owner.get("run"),
                why,
            )
            try:
                self._token = self._io.replace(self._body(), token)
                break
            except _Conflict:
                continue
        else:
            owner, _ = self._read_owner()
            raise PackLeaseError(self.url, owner or {})
        self._confirm()

    def _confirm(self) -> None:
        """Read the lease back: the owner must be this run (covers stores that ignore conditions)."""
        owner, token = self._read_owner()
        if owner is None:
            raise PackLeaseLostError(
                f"{self.url}: this pack's claim on the destination vanished right after it was written "
                "(the store ignores conditional writes, or another run removed it); pack again"
            )
        if owner.get("run") != self.run:
            raise PackLeaseError(self.url, owner)
        self._token = token
        self._renewed_mono = time.monotonic()

    def renew(self) -> None:
        """Extend the expiry to now + ``ttl_s``. Raises :class:`PackLeaseLostError` if the lease
        is no longer this run's."""
        with self._lock:
            if self._lost is None:
                self._renewals += 1
                try:
                    self._token = self._io.replace(self._body(), self._token)
                    self._renewed_mono = time.monotonic()
                except _Conflict:
                    self._lost_after_s = time.monotonic() - self._renewed_mono
                    owner, _ = self._read_owner()
                    self._lost = _taken_by(owner) if owner else "its claim was removed by another run"
            if self._lost is not None:
                raise PackLeaseLostError(self._lost_message())

    def check(self) -> None:
        """Raise :class:`PackLeaseLostError` if the lease is no longer this run's. Makes no request
        while the last renewal is under ``ttl_s / 2`` old; past that (the process was frozen, or
        renewals failed) it renews first, so a run that slept through its expiry stops here."""
        if self._lost is None and time.monotonic() - self._renewed_mono > self.ttl_s / 2:
            self.renew()
        if self._lost is not None:
            raise PackLeaseLostError(self._lost_message())

    def _lost_message(self) -> str:
        return (
            f"{self.url}: this pack lost its claim on the destination ({self._lost}); its last renewal "
            f"had been {self._lost_after_s:.0f} s before, and the claim lasts {self.ttl_s:g} s (the process "
            "was frozen, or the store unreachable, that long?); it stops without installing an index. "
            "Pack again once the other pack has finished"
        )

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            try:
                self.renew()
            except PackLeaseLostError:
                return
            except Exception as exc:  # noqa: BLE001 - a failed renewal is retried next period
                log.warning("%s: renewing this pack's claim on the destination failed (retried): %s", self.url, exc)

    def release(self) -> None:
        """Stop renewal and delete the lease if it is still this run's (no error if it is not)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            if self._lost is None and self._token is not None:
                try:
                    self._io.delete(self._token)
                except _Conflict:
                    pass
                except Exception as exc:  # noqa: BLE001 - it expires by itself
                    log.warning(
                        "%s: could not clear this pack's claim on the destination (it runs out by itself in %g s): %s",
                        self.url,
                        self.ttl_s,
                        exc,
                    )
            self._token = None

    def __enter__(self) -> "PackLease":
        self.acquire()
        self._thread = threading.Thread(target=self._renew_loop, name="stoker-pack-lease", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
