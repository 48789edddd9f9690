"""`stoker bench faults`, the origin and lease cases: an ``http://`` origin that compresses ranged
answers (when asked, and whatever is asked), one that stalls a ranged GET for 60 s, and a second
packer whose clock runs an hour ahead of the first's.

The HTTP cases read, with the lifecycle training script
(:func:`stoker_lab.bench.fault_lifecycle.launch`), a dataset of the lifecycle's shape whose samples
do not compress (:func:`incompressible`: like photographs, so a gzipped shard is as long as the
shard and a compressed answer is a 206 slice, not a 416) from a web server on 127.0.0.1
(:class:`stoker_lab.bench.httporigin.RangeFileServer`), through the fault proxy
(:class:`stoker_lab.bench.faultproxy.FaultProxy`) for the stall. The clock case runs each packer
as a child process with a hard timeout; the second moves its ``time.time()`` before it imports
stoker, as a host whose clock disagrees would.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time

from .fault_harness import aggregate, child_env, run_child
from .fault_lifecycle import launch, packed, run_row
from .faultproxy import Fault, FaultProxy
from .httporigin import RangeFileServer

#: Lease length of the clock case's first packer (seconds): it renews every third of it.
LEASE_S = 3.0

_OWNER = """
import os, sys, time
from stoker.storage import Origin
from stoker.store.lease import PackLease
dst, ready, stop, renew = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "renew"
lease = PackLease(Origin(dst), ttl_s=float(sys.argv[5]))
if renew:
    lease.__enter__()  # renews from a thread
else:
    lease.acquire()  # never renewed: a packer that froze
open(ready, "w").close()
t0 = time.monotonic()
while not os.path.exists(stop) and time.monotonic() - t0 < 120:
    time.sleep(0.05)
if renew:
    lease.check()  # raises PackLeaseLostError (exit 1) if the other packer took it over
    lease.release()
"""

_SKEWED = """
import sys, time
real = time.time
time.time = lambda: real() + 3600.0  # this host's clock runs an hour ahead
from stoker.cli import main
sys.exit(main(sys.argv[1:]))
"""


def incompressible(work: str) -> str:
    """The dataset under ``work/org/packed`` (made once, :func:`packed`): ``N_SAMPLES`` files
    ``s0000.bin`` ... whose bytes are the id, a dot, and 1200 pseudo-random bytes (seeded by the
    id), 64 KiB shards; the lifecycle script's decode reads the id. Returns its path."""
    return packed(work, "org", lambda i: f"{i}.".encode() + random.Random(i).randbytes(1200))


def compressed_ranges(ctx) -> dict:
    """A web server that gzips every GET whose ``Accept-Encoding`` allows it, applying ``Range`` to
    the gzipped bytes (RFC 9110 allows it). Right: stoker asks for ``identity``, so no answer is
    compressed; every sample once (2 workers)."""
    with RangeFileServer(os.path.dirname(incompressible(ctx.work)), gzip="asked") as srv:
        run = launch(ctx, "epoch", "compressed_ranges", 120, spec={"url": srv.url("packed")})
        problems = []
        if srv.compressed_ranges:
            problems.append(f"{srv.compressed_ranges} ranged answers went out gzipped: a GET did not ask for identity")
        if not srv.identity_gets:
            problems.append("no ranged GET asked for identity")
        row = run_row("compressed_ranges", "completed", [run], problems=problems)
        row["faults_injected"] = srv.identity_gets  # ranged GETs the server would have compressed
    return row


def compressed_ranges_refused(ctx) -> dict:
    """A web server (or proxy) that gzips every GET, even one that asks for ``identity``. Right: the
    epoch ends at the first ranged GET, not retried, in an error saying that the server compressed a
    ranged answer, naming the URL (2 workers, then 0). Not retried: each process that read the
    block tried once (with workers, the prefetcher's fill and then the worker that waited for it:
    the error counts both, one each)."""
    with RangeFileServer(os.path.dirname(incompressible(ctx.work)), gzip="always") as srv:
        must = [srv.url("packed/shards/"), "compressed a ranged answer"]
        run = launch(ctx, "origin_error", "compressed_refused", 180, spec={"url": srv.url("packed"), "must_name": must})
        retried = [r["error"] for r in run["rounds"] if _retried(r.get("error", ""))]
        row = run_row("compressed_ranges_refused", "clean_error", [run], problems=[f"retried: {e}" for e in retried])
        row["faults_injected"] = srv.compressed_ranges
    return row


def _retried(error: str) -> bool:
    """Whether an origin error's text says some process tried its read more than once: "after N
    attempt(s)" with N > 1 and no per-process split, or a process's own count above 1 in the split
    ("[the prefetcher (pid 7): 1 in 0.0 s; then worker 0 (pid 9), having waited for it: 1 in ...]")."""
    total = re.search(r"after (\d+) attempt", error)
    split = re.findall(r": (\d+) in \d", error)
    if split:
        return any(int(n) > 1 for n in split)
    return total is not None and int(total.group(1)) > 1


def stalled_http_read(ctx) -> dict:
    """The first ranged GET from a web server sends its head, then nothing for 60 s. Right: after the
    read timeout (10 s, as on S3) the GET is dropped and sent again; every sample once (2 workers,
    ``timeout_s`` 60)."""
    with RangeFileServer(os.path.dirname(incompressible(ctx.work))) as srv:
        with FaultProxy(srv.url().rstrip("/")) as proxy:
            proxy.set_fault(Fault("stall", count=1, stall_s=60.0))
            url = f"{proxy.endpoint_url}/packed"
            t0 = time.monotonic()
            run = launch(ctx, "epoch", "stalled_http_read", 150, spec={"url": url})
            seconds = round(time.monotonic() - t0, 1)
            injected = proxy.stats()["faults_injected"]
    row = run_row("stalled_http_read", "completed", [run], problems=[] if injected else ["no GET was stalled"])
    row["faults_injected"] = injected
    row["details"]["epoch_s"] = seconds
    return row


def _owner(dst: str, d: str, renew: bool) -> subprocess.Popen:
    """The first packer's lease holder, started and ready (its ``ready`` file made)."""
    ready, stop = os.path.join(d, "ready"), os.path.join(d, "stop")
    argv = [sys.executable, "-c", _OWNER, dst, ready, stop, "renew" if renew else "frozen", str(LEASE_S)]
    p = subprocess.Popen(
        argv, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True, env=child_env()
    )
    t0 = time.monotonic()
    while not os.path.exists(ready) and p.poll() is None and time.monotonic() - t0 < 60:
        time.sleep(0.02)
    return p


def _end(p: subprocess.Popen, d: str) -> tuple[int | None, str]:
    """Tell the lease holder to stop; its exit code (None: killed after 30 s) and stderr tail."""
    open(os.path.join(d, "stop"), "w").close()
    try:
        _, err = p.communicate(timeout=30)
        return p.returncode, err.decode(errors="replace")[-300:]
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        return None, p.communicate()[1].decode(errors="replace")[-300:]


def _clock_round(ctx, tag: str, renew: bool) -> dict:
    """One round: the first packer holds the lease (renewing it, or frozen); a second ``stoker pack``
    of the same destination runs with its clock an hour ahead."""
    d = os.path.join(ctx.work, "cases", "clock", tag)
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    dst, src = os.path.join(d, "dst"), os.path.join(os.path.dirname(packed(ctx.work)), "src")
    owner = _owner(dst, d, renew)
    rc, err = run_child(
        [sys.executable, "-c", _SKEWED, "pack", src, dst, "--source", "files", "--no-progress"], 120, child_env()
    )
    owner_rc, owner_err = _end(owner, d)
    rec = {"outcome": "failed", "error": None, "lost": 0, "duplicated": 0, "signal_deaths": 0, "faults_injected": 1}
    if rc is None or owner_rc is None:
        rec["outcome"], rec["error"] = "hang", f"{tag}: a packer did not end (second rc {rc}, first rc {owner_rc})"
    elif renew:  # right: refused, naming the destination; the first packer keeps its lease
        if rc == 2 and f"{dst}: another pack is writing this destination" in err and owner_rc == 0:
            rec["outcome"], rec["error"] = "clean_error", err.strip()[-300:]
        else:
            second = f"second packer exit {rc} ({err.strip()[-200:]!r})"
            rec["error"] = f"{tag}: {second}; first packer exit {owner_rc} ({owner_err.strip()!r})"
    elif rc == 0:  # right: taken over after the lease time, a whole dataset
        from stoker.store.dataset import open_dataset

        n = len(open_dataset(dst, cache=False))
        rec["outcome"] = "completed" if n == len(os.listdir(src)) else "failed"
        rec["lost"] = max(0, len(os.listdir(src)) - n)
    else:
        rec["error"] = f"{tag}: the frozen packer was not taken over: exit {rc} ({err.strip()[-200:]!r})"
    return rec


def skewed_clock(ctx) -> dict:
    """A second ``stoker pack`` into one destination, on a clock an hour ahead of the first's: while
    the first renews its lease (every second), and after it froze (stopped renewing). Right: refused
    with ``PackLeaseError`` while the first renews (not a take-over: liveness is judged by the
    lease's changes, not by comparing clocks); the frozen one taken over after its lease time
    (3 s), the dataset whole."""
    return aggregate(
        "skewed_clock", "clean_error", [_clock_round(ctx, "renewing", True), _clock_round(ctx, "frozen", False)]
    )


CASES = {  # name -> (function, part of --quick)
    "compressed_ranges": (compressed_ranges, True),
    "compressed_ranges_refused": (compressed_ranges_refused, True),
    "stalled_http_read": (stalled_http_read, True),
    "skewed_clock": (skewed_clock, True),
}
