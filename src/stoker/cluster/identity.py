"""A node's cache identity: which directory under the cluster cache root belongs to this node.

Ray gives every node a new random id each time Ray starts, so a cache directory named by it
would be a new, empty cache after every restart (``stoker warm`` would fetch everything again).
The identity here comes from the host instead: ``$NODE_NAME`` (the Kubernetes node name, set
through the downward API) or else the host name, plus a slot number ``k`` for hosts that run more
than one Ray node (simulated clusters, tests). The directory is ``<root>/node-<host>-<k>``.

A slot is held by an exclusive ``flock`` on ``<root>/.node-<host>-<k>.lock`` for the lifetime of
the cache service process; the kernel drops it when the process ends, however it ends, so a slot
is never taken by two live services and never stays taken by a dead one. A service takes:

1. the slot whose lock file records its ``owner`` token (the Ray node id: a service that Ray
   restarted in the same session gets its old directory back, waiting up to ``wait_s`` for the
   old process to let go);
2. else the lowest free slot of its host (so one Ray node per host always gets slot 0: the same
   directory across Ray restarts);
3. else a new slot.

flock works on local file systems and on NFSv4; the host name in the directory name keeps hosts
that share one root (NFS) apart. The directory's name is also how cluster mode's warnings and
errors name the node (:func:`node_label`). Standard library only; no Ray.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import socket
import time

from ..cache.perms import ensure_dir, parse_mode

log = logging.getLogger(__name__)

#: Environment variable naming the node (Kubernetes downward API ``spec.nodeName``).
NODE_NAME_ENV = "NODE_NAME"
#: Most slots a host may take under one root (a guard against a runaway loop; seconds of tries).
MAX_SLOTS = 4096


def host_name(name: str | None = None) -> str:
    """``name``, else ``$NODE_NAME``, else the host name, reduced to ``[A-Za-z0-9._-]`` (others
    become ``_``)."""
    name = name or os.environ.get(NODE_NAME_ENV) or socket.gethostname() or "localhost"
    return re.sub(r"[^A-Za-z0-9._-]", "_", name)[:100]


def cache_key(host: str, slot: int) -> str:
    """The cache directory's name and placement key of ``host``'s slot ``slot``: ``node-<host>-<slot>``
    (``host`` as :func:`host_name` gives it)."""
    return f"node-{host}-{slot}"


class NodeCacheClaim:
    """A held slot: ``path`` (the node's cache directory), ``key`` (its name, ``node-<host>-<k>``:
    unique in the cluster, stable across Ray restarts; used as the node's placement key).
    The slot is held until :meth:`release` or until the process ends."""

    def __init__(self, path: str, key: str, fd: int):
        self.path, self.key = path, key
        self._fd: int | None = fd  # None once released

    def release(self) -> None:
        """Give the slot up (closing the lock file drops the lock)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __repr__(self) -> str:
        return f"NodeCacheClaim({self.path!r})"


def _mode() -> int:
    """The node caches' file mode: ``$STOKER_CACHE_MODE`` or 0600 (:func:`stoker.cache.perms.parse_mode`)."""
    return parse_mode(None)


def _try_lock(lock_path: str) -> int | None:
    """An fd holding an exclusive flock on ``lock_path`` (created if missing), or None if another holds it."""
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, _mode())
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return fd


def _owner(lock_path: str) -> str:
    try:
        with open(lock_path) as f:
            return f.read().strip()
    except OSError:
        return ""


def claim_cache_dir(cache_root: str, owner: str = "", wait_s: float = 10.0, host: str | None = None) -> NodeCacheClaim:
    """Take this node's cache directory under ``cache_root`` (created if missing); see the module doc.

    ``owner``: a token recorded in the slot (the Ray node id), so that the same owner gets the same
    slot back; ``wait_s``: how long (seconds) to wait for the slot recorded for ``owner`` while the
    process that held it ends; ``host``: the host part of the name (default :func:`host_name`).
    Raises OSError if ``cache_root`` cannot be created or written, RuntimeError if
    :data:`MAX_SLOTS` slots of the host are all held.
    """
    root = os.path.abspath(os.path.expanduser(cache_root))
    ensure_dir(root, _mode())  # private (or the cache mode), refused if another user can redirect it
    host = host or host_name()
    prefix = f".node-{host}-"

    def slot_path(k: int) -> str:
        return os.path.join(root, f"{prefix}{k}.lock")

    def take(k: int, fd: int) -> NodeCacheClaim:
        if owner:
            os.ftruncate(fd, 0)
            os.pwrite(fd, owner.encode(), 0)
        key = cache_key(host, k)
        path = os.path.join(root, key)
        ensure_dir(path, _mode(), parents=False)
        return NodeCacheClaim(path, key, fd)

    if owner:
        mine = [
            int(n[len(prefix) : -5])
            for n in os.listdir(root)
            if n.startswith(prefix)
            and n.endswith(".lock")
            and n[len(prefix) : -5].isdigit()
            and _owner(os.path.join(root, n)) == owner
        ]
        deadline = time.monotonic() + wait_s
        for k in sorted(mine)[:1]:
            while True:
                fd = _try_lock(slot_path(k))
                if fd is not None:
                    return take(k, fd)
                if time.monotonic() >= deadline:
                    log.warning("cache slot %s of %s is still held after %.0f s; taking another", k, owner, wait_s)
                    break
                time.sleep(0.1)
    for k in range(MAX_SLOTS):
        fd = _try_lock(slot_path(k))
        if fd is not None:
            return take(k, fd)
    raise RuntimeError(f"{root}: all {MAX_SLOTS} cache slots of host {host} are held by live services")


def node_label(node_id: str, services: dict | None = None, host: str | None = None) -> str:
    """How warnings and errors name the Ray node ``node_id``: the name of its cache directory,
    ``node-<host>-<slot>`` (its cache service's ``cache_key`` in ``services``, ``{node id: info()}``),
    which is what ``stoker cache status`` prints for that node's cache under the cluster cache
    root; Ray's random node id means nothing there. A node whose service has not answered has no
    known directory yet: ``Ray node <id>``, with ``on host <host>`` when the caller knows the host
    Ray reports for it."""
    key = ((services or {}).get(node_id) or {}).get("cache_key")
    if key:
        return str(key)
    return f"Ray node {node_id}" + (f" on host {host}" if host else "")


def node_labels(nodes: list[str], services: dict | None) -> list[str]:
    """:func:`node_label` of each of ``nodes`` (node ids), in order."""
    return [node_label(n, services) for n in nodes]
