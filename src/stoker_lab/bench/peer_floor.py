"""The floor of the peer stage of ``stoker bench io``: a bare TCP transfer of the same block bytes.

Two processes, each started with an optional argv prefix (``ip netns exec <ns>`` for the shaped
link between namespaces, nothing for loopback): a *server* that reads the block files the cache
service holds into memory (before any clock starts), listens on ``host`` and, for each of
``reps`` rounds, sends every block buffer in order with ``socket.sendall``; a *client* that
connects and receives each round into one preallocated buffer with ``socket.recv_into``.
A round starts when the client sends one byte and ends when the client has every byte and the
server has read the client's one-byte reply, so each end's CPU (``time.process_time`` around the
round, its kernel time included) covers the whole transfer and not the interpreter's start-up.
The round with the least CPU of both ends together is kept, as in the other stages.

The bytes are checked after the clocks stop: both ends report the xxh3-64 digest of what they
sent or received (the blocks in order), and :func:`transfer` raises when they differ.

``python -m stoker_lab.bench.peer_floor serve SPEC`` / ``fetch SPEC``: SPEC is a JSON file
(``serve``: ``{files, host, ready, reps}``; ``fetch``: ``{host, port, bytes, reps}``); each prints
one JSON line: ``{"cpu_s": [per round], "wall_s": [per round], "bytes", "digest"}``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time

#: Receive calls ask for at most this much at a time (the kernel hands over what it has).
_CHUNK = 4 << 20


def serve(files: list[str], host: str, ready: str, reps: int, timeout_s: float = 120.0) -> dict:
    """Send the contents of ``files`` (in order) ``reps`` times to the one client that connects to
    ``host`` (a free port, written to the JSON file ``ready`` as ``{"port"}``). Returns
    ``{cpu_s, wall_s, bytes, digest}`` (lists per round). OSError when the client goes away,
    TimeoutError after ``timeout_s`` seconds without it."""
    import xxhash

    blocks = []
    for path in files:
        with open(path, "rb") as f:
            blocks.append(f.read())
    nbytes = sum(len(b) for b in blocks)
    h = xxhash.xxh3_64()
    for b in blocks:
        h.update(b)
    with socket.create_server((host, 0)) as srv:
        srv.settimeout(timeout_s)
        tmp = f"{ready}.tmp"
        with open(tmp, "w") as f:
            json.dump({"port": srv.getsockname()[1]}, f)
        os.replace(tmp, ready)
        conn, _ = srv.accept()
    cpu, wall = [], []
    with conn:
        conn.settimeout(timeout_s)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(reps):
            if conn.recv(1) != b"g":
                raise OSError("the floor's client went away before a round")
            c0, t0 = time.process_time(), time.perf_counter()
            for b in blocks:
                conn.sendall(b)
            if conn.recv(1) != b"d":
                raise OSError("the floor's client went away during a round")
            cpu.append(time.process_time() - c0)
            wall.append(time.perf_counter() - t0)
    return {"cpu_s": cpu, "wall_s": wall, "bytes": nbytes, "digest": h.hexdigest()}


def fetch(host: str, port: int, nbytes: int, reps: int, timeout_s: float = 120.0) -> dict:
    """Receive ``nbytes`` bytes ``reps`` times from the server at ``host:port`` into one buffer
    allocated (and touched) before the first round. Returns ``{cpu_s, wall_s, bytes, digest}``
    (digest of the last round). OSError when the server closes early."""
    import xxhash

    buf = bytearray(nbytes)  # zero-filled: its pages exist before the clock starts
    view = memoryview(buf)
    cpu, wall = [], []
    with socket.create_connection((host, port), timeout=timeout_s) as conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(reps):
            c0, t0 = time.process_time(), time.perf_counter()
            conn.sendall(b"g")
            got = 0
            while got < nbytes:
                n = conn.recv_into(view[got : got + _CHUNK])
                if n == 0:
                    raise OSError(f"the floor's server closed after {got} of {nbytes} bytes")
                got += n
            conn.sendall(b"d")
            cpu.append(time.process_time() - c0)
            wall.append(time.perf_counter() - t0)
    return {"cpu_s": cpu, "wall_s": wall, "bytes": nbytes, "digest": xxhash.xxh3_64_hexdigest(view)}


def transfer(
    files: list[str],
    host: str,
    reps: int,
    server_prefix: tuple[str, ...] = (),
    client_prefix: tuple[str, ...] = (),
    timeout_s: float = 300.0,
) -> dict:
    """Run the floor: the server (argv prefix ``server_prefix``) on ``host``, the client
    (``client_prefix``) fetching from it, ``reps`` rounds. Returns ``{bytes, cpu_s, wall_s,
    server_cpu_s, client_cpu_s, digest, rounds}`` for the round with the least CPU of both ends
    (``rounds``: every round's ``[server_cpu_s, client_cpu_s, wall_s]``). Raises RuntimeError
    (with the process's error output) when an end fails or the two digests differ; both
    processes are ended on every exit path."""
    nbytes = sum(os.path.getsize(p) for p in files)
    with tempfile.TemporaryDirectory(prefix="stoker-floor-") as d:
        ready = os.path.join(d, "ready.json")
        sspec, cspec = os.path.join(d, "serve.json"), os.path.join(d, "fetch.json")
        with open(sspec, "w") as f:
            json.dump({"files": list(files), "host": host, "ready": ready, "reps": reps}, f)
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
            with open(cspec, "w") as f:
                json.dump({"host": host, "port": port, "bytes": nbytes, "reps": reps}, f)
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
            f"the floor's client received other bytes than the server sent ({c['digest']} != {s['digest']})"
        )
    rounds = [[sc, cc, w] for sc, cc, w in zip(s["cpu_s"], c["cpu_s"], c["wall_s"], strict=True)]
    best = min(rounds, key=lambda r: r[0] + r[1])
    return {
        "bytes": nbytes,
        "cpu_s": best[0] + best[1],
        "wall_s": best[2],
        "server_cpu_s": best[0],
        "client_cpu_s": best[1],
        "digest": s["digest"],
        "rounds": rounds,
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
        out = serve(spec["files"], spec["host"], spec["ready"], int(spec["reps"]))
    elif kind == "fetch":
        out = fetch(spec["host"], int(spec["port"]), int(spec["bytes"]), int(spec["reps"]))
    else:
        raise SystemExit(f"unknown command {kind!r}: serve or fetch")
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
