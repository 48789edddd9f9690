"""The data plane's wire format: how block bytes travel between nodes (no Ray, no pickle).

A cache service's data endpoint (:mod:`stoker.cluster.service.endpoint`) and the processes that
read from it (:mod:`stoker.cluster.service.peerlinks`) speak this over one TCP connection:

1. **Mutual HMAC challenge** (the server speaks first; nothing else is read before it passes):

   - server -> client: ``b"STK1"`` and a fresh 32-byte nonce ``ns``;
   - client -> server: its own nonce ``nc`` and ``HMAC-SHA256(secret, b"client" + ns + nc)``;
   - server -> client: ``HMAC-SHA256(secret, b"server" + nc + ns)`` when the client's proof is
     right, else the server closes the connection without a byte.

   ``secret`` is the cluster's data-plane key (:func:`cluster_secret`), which services and ranks
   are given by a detached Ray actor over Ray's own authenticated channel. A captured exchange is
   worth nothing on a later connection: each side's nonce is fresh, and each proof covers both.
   The client checks the server's proof too, so a process that took over the port cannot feed
   it bytes (these are also checked against the index checksums by the reader).
2. **Requests** (:data:`REQUEST`, 96 bytes, little-endian): op, request id, dataset key
   (:func:`dataset_key`), block, start, stop (shard byte offsets), the block's previous owner
   (a Ray node id, zeros: none) and how long the server may wait for it (seconds, 0: its
   default). An ``OPEN`` request carries a body: the dataset's reference as JSON.
3. **Replies** (:data:`REPLY`, 16 bytes): request id, status, body length; then the raw body
   (the bytes; for ``ERROR`` a UTF-8 message). Replies may come in another order than the
   requests (a block the server must fill first waits while hits go on).

The format is a fixed binary header and a raw body, as the distributed caches that moved block
bytes off RPC frameworks do (Alluxio's Netty data path, JuiceFS's cache protocol): the body is
sent with ``sendfile`` from the cache file and received with ``recv_into`` into its final buffer.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct
from typing import Any

import numpy as np

from ...errors import PeerUnavailable

MAGIC = b"STK1"
NONCE_BYTES = 32
PROOF_BYTES = 32  # HMAC-SHA256

#: op, request id, dataset key, block, start, stop, previous owner (node id), its wait (s)
REQUEST = struct.Struct("<B3xI16sqqq32sf4x")
#: request id, status, body length (bytes)
REPLY = struct.Struct("<IB3xQ")

# ops
READ = 1  #: bytes of a block the server's node owns: from its cache, else filled (origin / previous owner)
CACHED = 2  #: bytes only if the server's cache holds the block (a handoff); never the origin
PING = 3  #: an empty answer: the endpoint is up and the connection authenticated
OPEN = 4  #: body: the dataset's reference (JSON): the server opens it, answers ``OK``

# statuses
FROM_CACHE, FROM_ORIGIN, FROM_HANDOFF, NOT_HELD, ERROR, UNKNOWN_DATASET, OK = range(7)
#: The source a reader counts a reply's bytes as, by status (:class:`stoker.cluster.counters.ByteCounters`).
SOURCES = {FROM_CACHE: "cache", FROM_ORIGIN: "origin", FROM_HANDOFF: "handoff"}
STATUS_OF = {v: k for k, v in SOURCES.items()}

#: Longest body a request may ask for, bytes (a block is at most a few hundred MiB).
MAX_BODY = 1 << 31
#: The Ray actor that keeps the cluster's data-plane secret (:class:`SecretKeeper`), in the namespace ``stoker``.
SECRET_ACTOR = "stoker-data-secret"


def dataset_key(version: str, block_bytes: int) -> bytes:
    """The 16-byte key a request names its dataset by: BLAKE2b of the content version and block
    size (both sides must cut the dataset into the same blocks)."""
    return hashlib.blake2b(f"{version}/{int(block_bytes)}".encode(), digest_size=16).digest()


def node_bytes(node_id: str | None) -> bytes:
    """A Ray node id (hex) as the 32 bytes of a request's previous-owner field (zeros: None)."""
    raw = bytes.fromhex(node_id) if node_id else b""
    if len(raw) > 32:
        raise ValueError(f"node id {node_id!r} is longer than 32 bytes")
    return raw.ljust(32, b"\0")


def node_id(raw: bytes) -> str | None:
    """The inverse of :func:`node_bytes`."""
    raw = raw.rstrip(b"\0")
    return raw.hex() if raw else None


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    """``n`` bytes from ``sock``; PeerUnavailable when it closes first."""
    buf = bytearray(n)
    recv_into_exactly(sock, memoryview(buf))
    return bytes(buf)


def body_buffer(n: int) -> memoryview:
    """A writable buffer of ``n`` bytes for a reply's body, *not* zeroed first (``numpy.empty``:
    ``bytearray(n)`` would write 1 MiB of zeros under the GIL before the kernel writes the body
    over them, the receiver's largest cost after the copy itself): a flat ``memoryview`` of format
    ``B``, which compares, slices and converts (``bytes(view)``) as bytes do."""
    return np.empty(n, dtype=np.uint8).data


def recv_into_exactly(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock`` (``recv_into``: no copy, the GIL released while it waits);
    PeerUnavailable when the connection closes first. On a blocking socket each call asks for
    the rest with ``MSG_WAITALL``, so a body usually takes one system call and one GIL hand-back
    however many segments it came in (a socket with a timeout returns what it has, as before)."""
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:], n - got, socket.MSG_WAITALL)
        if k == 0:
            raise PeerUnavailable(f"connection closed after {got} of {n} bytes")
        got += k


def _proof(secret: bytes, who: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.new(secret, who + first + second, hashlib.sha256).digest()


def server_handshake(sock: socket.socket, secret: bytes) -> bool:
    """The server's side of the challenge (module doc); False when the client's proof is wrong
    (the caller closes the connection without a word). PeerUnavailable/OSError when the client
    leaves or stalls past the socket's timeout."""
    ns = os.urandom(NONCE_BYTES)
    sock.sendall(MAGIC + ns)
    reply = recv_exactly(sock, NONCE_BYTES + PROOF_BYTES)
    nc, proof = reply[:NONCE_BYTES], reply[NONCE_BYTES:]
    if not hmac.compare_digest(proof, _proof(secret, b"client", ns, nc)):
        return False
    sock.sendall(_proof(secret, b"server", nc, ns))
    return True


def client_handshake(sock: socket.socket, secret: bytes) -> None:
    """The client's side of the challenge (module doc). PeerUnavailable when the server is not a
    stoker data endpoint, refuses this client's proof (a wrong secret) or proves a wrong one."""
    hello = recv_exactly(sock, len(MAGIC) + NONCE_BYTES)
    if hello[: len(MAGIC)] != MAGIC:
        raise PeerUnavailable(f"not a stoker data endpoint (greeting {hello[:4]!r})")
    ns, nc = hello[len(MAGIC) :], os.urandom(NONCE_BYTES)
    sock.sendall(nc + _proof(secret, b"client", ns, nc))
    try:
        proof = recv_exactly(sock, PROOF_BYTES)
    except PeerUnavailable as exc:
        raise PeerUnavailable("the data endpoint refused this client's proof (another cluster's secret?)") from exc
    if not hmac.compare_digest(proof, _proof(secret, b"server", nc, ns)):
        raise PeerUnavailable("the data endpoint's proof is wrong: it does not hold this cluster's secret")


class SecretKeeper:
    """The holder of the cluster's data-plane secret: a detached Ray actor named
    :data:`SECRET_ACTOR` in the namespace ``stoker``, made by the first process that asks with a
    fresh random secret; Ray restarts it with the same constructor argument, so the secret
    outlives it, and ``stop_services`` leaves it alone."""

    def __init__(self, secret: bytes):
        self._secret = bytes(secret)

    def secret(self) -> bytes:
        return self._secret


def cluster_secret(timeout_s: float = 120.0) -> bytes:
    """The cluster's data-plane secret (32 random bytes), asked of the :class:`SecretKeeper` over
    Ray's authenticated channel (the keeper is started by the first process that asks: the same
    secret for every later one, the services' restarts included). Needs a connected Ray (a
    driver, worker or actor); raises Ray's errors, and ``GetTimeoutError`` after ``timeout_s``."""
    import ray

    keeper: Any = (
        ray.remote(num_cpus=0, max_restarts=-1)(SecretKeeper)
        .options(name=SECRET_ACTOR, namespace="stoker", lifetime="detached", get_if_exists=True)
        .remote(os.urandom(32))
    )
    return bytes(ray.get(keeper.secret.remote(), timeout=timeout_s))
