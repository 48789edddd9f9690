"""The floor of the peer stage of ``stoker bench io``: a bare TCP transfer of the same blocks.

Two processes, each started with an optional argv prefix (``ip netns exec <ns>`` for the shaped
link between namespaces, nothing for loopback), doing the least a peer read can do in Python:

- a *server* that opens the block files the cache service holds and listens on ``host``; for each
  request (a 4-byte block number) it sends that block with ``os.sendfile`` from its file (the
  kernel copies it from the page cache to the socket);
- a *client* that connects and, each round, asks for every block in order with ``inflight``
  requests outstanding (the stage's fetches in flight), receiving each block with
  ``socket.recv_into`` into its place in one buffer allocated (and touched) before the first round.

A round repeats the dataset ``rounds`` times (so that it has seconds of CPU behind it). It starts
when the server reads the client's start mark and ends when it reads the client's end mark (sent
once the client has every byte), so each end's CPU (``time.process_time`` around the round, its
kernel time included) covers the whole transfer and not the interpreter's start-up. ``reps``
rounds are run; the one with the least CPU of both ends together is kept, as in the other stages.

The bytes are checked after the clocks stop: both ends report the xxh3-64 digest of the blocks in
order (the server of its files, the client of its buffer after the last round), and
:func:`transfer` raises when they differ.

``python -m stoker_lab.bench.peer_floor serve SPEC`` / ``fetch SPEC``: SPEC is a JSON file
(``serve``: ``{files, host, ready}``; ``fetch``: ``{host, port, sizes, reps, rounds, inflight}``);
each prints one JSON line: ``{"cpu_s": [per round], "wall_s": [per round], "bytes", "digest"}``.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections import deque

#: A request: the number of a block, or one of the marks below.
_REQ = struct.Struct("<I")
#: The client's marks: a round starts, a round ends (every block received), no more rounds.
START, END, BYE = 0xFFFFFFFF, 0xFFFFFFFE, 0xFFFFFFFD


def _recv_into_exactly(conn: socket.socket, view: memoryview) -> None:
    got, n = 0, len(view)
    while got < n:
        k = conn.recv_into(view[got:], n - got)
        if k == 0:
            raise OSError(f"the floor's peer closed after {got} of {n} bytes")
        got += k


def serve(files: list[str], host: str, ready: str, timeout_s: float = 120.0) -> dict:
    """Serve the blocks ``files`` (in order) to the one client that connects to ``host`` (a free
    port, written to the JSON file ``ready`` as ``{"port"}``), one ``os.sendfile`` per request,
    until the client says bye. Returns ``{cpu_s, wall_s, bytes, digest}`` (lists per round, from
    each start mark to its end mark). OSError when the client goes away, TimeoutError after
    ``timeout_s`` seconds without it; ValueError for a request of a block it does not have."""
    import xxhash

    fds = [os.open(path, os.O_RDONLY) for path in files]
    try:
        sizes = [os.fstat(fd).st_size for fd in fds]
        h = xxhash.xxh3_64()
        for fd, size in zip(fds, sizes, strict=True):
            h.update(os.pread(fd, size, 0))  # also brings every block into the page cache
        with socket.create_server((host, 0)) as srv:
            srv.settimeout(timeout_s)
            tmp = f"{ready}.tmp"
            with open(tmp, "w") as f:
                json.dump({"port": srv.getsockname()[1]}, f)
            os.replace(tmp, ready)
            conn, _ = srv.accept()
        cpu: list[float] = []
        wall: list[float] = []
        with conn:
            # blocking (os.sendfile on a socket with a timeout, which Python makes non-blocking,
            # fails with EAGAIN); transfer() ends a server that waits too long
            conn.settimeout(None)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            _serve_requests(conn, fds, sizes, cpu, wall)
        return {"cpu_s": cpu, "wall_s": wall, "bytes": sum(sizes), "digest": h.hexdigest()}
    finally:
        for fd in fds:
            os.close(fd)


def _serve_requests(conn: socket.socket, fds: list[int], sizes: list[int], cpu: list, wall: list) -> None:
    head = memoryview(bytearray(_REQ.size))
    out = conn.fileno()
    c0 = t0 = 0.0
    while True:
        _recv_into_exactly(conn, head)
        (b,) = _REQ.unpack(head)
        if b == START:
            c0, t0 = time.process_time(), time.perf_counter()
        elif b == END:
            cpu.append(time.process_time() - c0)
            wall.append(time.perf_counter() - t0)
        elif b == BYE:
            return
        elif b >= len(fds):
            raise ValueError(f"the floor's client asked for block {b} of {len(fds)}")
        else:
            sent, n = 0, sizes[b]
            while sent < n:
                k = os.sendfile(out, fds[b], sent, n - sent)
                if k == 0:
                    raise OSError(f"block file {b} ended {n - sent} bytes short")
                sent += k


def fetch(
    host: str, port: int, sizes: list[int], reps: int, rounds: int, inflight: int, timeout_s: float = 120.0
) -> dict:
    """``reps`` rounds of ``rounds`` times every block (of ``sizes`` bytes each), ``inflight``
    requests outstanding, from the server at ``host:port``, each block received into its place in
    one buffer allocated (and touched) before the first round. Returns ``{cpu_s, wall_s, bytes,
    digest}`` (bytes of one round; digest of the buffer after the last). OSError when the server
    closes early."""
    import xxhash

    offsets = [0]
    for n in sizes:
        offsets.append(offsets[-1] + n)
    buf = bytearray(offsets[-1])  # zero-filled: its pages exist before the clock starts
    view = memoryview(buf)
    order = list(range(len(sizes))) * max(1, rounds)
    cpu, wall = [], []
    with socket.create_connection((host, port), timeout=timeout_s) as conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(reps):
            c0, t0 = time.process_time(), time.perf_counter()
            conn.sendall(_REQ.pack(START))
            waiting: deque[int] = deque()
            todo = iter(order)
            for b in todo:
                conn.sendall(_REQ.pack(b))
                waiting.append(b)
                if len(waiting) >= inflight:
                    break
            while waiting:
                b = waiting.popleft()
                _recv_into_exactly(conn, view[offsets[b] : offsets[b + 1]])
                nxt = next(todo, None)
                if nxt is not None:
                    conn.sendall(_REQ.pack(nxt))
                    waiting.append(nxt)
            conn.sendall(_REQ.pack(END))
            cpu.append(time.process_time() - c0)
            wall.append(time.perf_counter() - t0)
        conn.sendall(_REQ.pack(BYE))
    return {
        "cpu_s": cpu,
        "wall_s": wall,
        "bytes": offsets[-1] * max(1, rounds),
        "digest": xxhash.xxh3_64_hexdigest(view),
    }


def transfer(
    files: list[str],
    host: str,
    reps: int,
    rounds: int = 1,
    inflight: int = 8,
    server_prefix: tuple[str, ...] = (),
    client_prefix: tuple[str, ...] = (),
    timeout_s: float = 300.0,
) -> dict:
    """Run the floor (module doc): the server (argv prefix ``server_prefix``) on ``host``, the
    client (``client_prefix``) fetching every block of ``files`` ``rounds`` times per round with
    ``inflight`` requests outstanding, ``reps`` rounds. Returns ``{bytes (moved per round),
    cpu_s, wall_s, server_cpu_s, client_cpu_s, digest, rounds}`` for the round with the least CPU
    of both ends (``rounds``: every round's ``[server_cpu_s, client_cpu_s, wall_s]``). Raises
    RuntimeError (with the process's error output) when an end fails or the two digests differ;
    both processes are ended on every exit path."""
    sizes = [os.path.getsize(p) for p in files]
    nbytes = sum(sizes) * max(1, rounds)
    with tempfile.TemporaryDirectory(prefix="stoker-floor-") as d:
        ready = os.path.join(d, "ready.json")
        sspec, cspec = os.path.join(d, "serve.json"), os.path.join(d, "fetch.json")
        with open(sspec, "w") as f:
            json.dump({"files": list(files), "host": host, "ready": ready}, f)
        procs: list[subprocess.Popen] = []
        try:
            server = _start([*server_prefix, sys.executable, "-m", __name__, "serve", sspec], d, "server")
            procs.append(server)
            deadline = time.monotonic() + timeout_s
            while not os.path.exists(ready):
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the floor's server did not start: {_err(server, d, 'server')}")
                time.sleep(0.02)
            with open(ready) as f:
                port = json.load(f)["port"]
            spec = {"host": host, "port": port, "sizes": sizes, "reps": reps, "rounds": rounds, "inflight": inflight}
            with open(cspec, "w") as f:
                json.dump(spec, f)
            client = _start([*client_prefix, sys.executable, "-m", __name__, "fetch", cspec], d, "client")
            procs.append(client)
            outs = {}
            for name, p in (("client", client), ("server", server)):
                try:
                    p.wait(timeout=max(1.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    raise RuntimeError(f"the floor's {name} ran past {timeout_s} s") from None
                if p.returncode != 0:
                    raise RuntimeError(f"the floor's {name} failed: {_err(p, d, name)}")
                with open(os.path.join(d, f"{name}.out")) as f:
                    outs[name] = json.loads(f.read().strip().splitlines()[-1])
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    s, c = outs["server"], outs["client"]
    if s["digest"] != c["digest"] or c["bytes"] != nbytes:
        raise RuntimeError(
            f"the floor's client received other bytes than the server sent ({c['digest']} != {s['digest']}, "
            f"{c['bytes']} bytes of {nbytes})"
        )
    per_round = [[sc, cc, w] for sc, cc, w in zip(s["cpu_s"], c["cpu_s"], c["wall_s"], strict=True)]
    best = min(per_round, key=lambda r: r[0] + r[1])
    return {
        "bytes": nbytes,
        "cpu_s": best[0] + best[1],
        "wall_s": best[2],
        "server_cpu_s": best[0],
        "client_cpu_s": best[1],
        "digest": s["digest"],
        "rounds": per_round,
    }


def _start(argv: list[str], d: str, name: str) -> subprocess.Popen:
    env = dict(os.environ)
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [here, env.get("PYTHONPATH")]))
    with open(os.path.join(d, f"{name}.out"), "wb") as out, open(os.path.join(d, f"{name}.err"), "wb") as err:
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=env)


def _err(p: subprocess.Popen, d: str, name: str) -> str:
    try:
        with open(os.path.join(d, f"{name}.err"), errors="replace") as f:
            tail = f.read()[-2000:].strip()
    except OSError:
        tail = ""
    return f"exit code {p.poll()}: {tail}"


def main(argv: list[str]) -> int:
    """``serve SPEC`` or ``fetch SPEC`` (see the module doc); prints the result as one JSON line."""
    kind, path = argv
    with open(path) as f:
        spec = json.load(f)
    if kind == "serve":
        out = serve(spec["files"], spec["host"], spec["ready"])
    elif kind == "fetch":
        sizes = [int(n) for n in spec["sizes"]]
        out = fetch(
            spec["host"], int(spec["port"]), sizes, int(spec["reps"]), int(spec["rounds"]), int(spec["inflight"])
        )
    else:
        raise SystemExit(f"unknown command {kind!r}: serve or fetch")
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
