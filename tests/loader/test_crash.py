"""A loader killed with SIGKILL leaves nothing that blocks (or leaks into) the next run; jobs share one cache."""

import contextlib
import glob
import os
import signal
import subprocess
import sys
import time

import pytest

from stoker import Loader, RunOptions, open_dataset
from stoker.loader.shm import SHM_DIR

CHILD = """
import sys, time
from stoker import Loader, open_dataset
ds = open_dataset(sys.argv[1], cache_dir=sys.argv[2], cache_bytes=64 << 20, block_bytes=64 << 10)
loader = Loader(ds, 8, num_workers=2, transform="eval")
for i, _ in enumerate(loader):
    if i == 2:
        print("running", flush=True)
        time.sleep(60)
"""


def test_sigkilled_loader_leaves_nothing_blocking(packed_local, tmp_path):
    cache = str(tmp_path / "cache")
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, packed_local, cache], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    assert proc.stdout.readline().strip() == "running"
    shm = SHM_DIR or "/tmp"
    held = []  # its batch slots while it runs: open, their names already unlinked (loader/shm.py)
    for fd in os.listdir(f"/proc/{proc.pid}/fd"):
        try:
            target = os.readlink(f"/proc/{proc.pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith(os.path.join(shm, f"stoker-{proc.pid}-")):
            held.append(target)
    assert held and all(t.endswith(" (deleted)") for t in held), held
    assert glob.glob(os.path.join(shm, f"stoker-{proc.pid}-*")) == []
    os.killpg(proc.pid, signal.SIGKILL)  # the loader, its workers and its prefetcher
    proc.wait(10)
    time.sleep(0.2)
    ds = open_dataset(packed_local, cache_dir=cache, cache_bytes=64 << 20, block_bytes=64 << 10)
    with Loader(ds, 8, num_workers=2, transform="eval", run=RunOptions(timeout_s=30)) as loader:
        assert sum(len(y) for _, y in loader) == len(ds)
        assert loader.stats.exactly_once
        # the dead loader's shared-memory slots were found and removed
        assert glob.glob(os.path.join(shm, f"stoker-{proc.pid}-*")) == []
    assert not [p for p in glob.glob(os.path.join(cache, "*", ".tmp-*"))]
    assert ds.cache.used_bytes() <= 64 << 20


JOB = """
import sys
from stoker import Loader, open_dataset
ds = open_dataset(sys.argv[1], cache_dir=sys.argv[2], cache_bytes=64 << 20, block_bytes=64 << 10)
with Loader(ds, 8, num_workers=2, transform="eval", seed=int(sys.argv[3])) as loader:
    for _ in loader:
        pass
    st = loader.stats
print(st.origin_requests, st.samples, st.exactly_once, st.origin_bytes)
"""


def test_two_concurrent_jobs_read_each_block_once(packed_local, tmp_path):
    cache = str(tmp_path / "cache")
    jobs = [
        subprocess.Popen([sys.executable, "-c", JOB, packed_local, cache, str(seed)], stdout=subprocess.PIPE, text=True)
        for seed in (1, 2)
    ]
    outs = [j.communicate(timeout=120)[0].split() for j in jobs]
    assert all(j.returncode == 0 for j in jobs)
    ds = open_dataset(packed_local, cache=False, block_bytes=64 << 10)
    # every block fetched once across both jobs: its bytes once (a merged GET of adjacent blocks
    # also reads the tar headers between them), in at most one request a block
    own = int((ds.blocks.end - ds.blocks.start).sum())
    same_shard = ds.blocks.shard[1:] == ds.blocks.shard[:-1]
    gaps = int((ds.blocks.start[1:] - ds.blocks.end[:-1])[same_shard].sum())
    assert own <= sum(int(o[3]) for o in outs) <= own + gaps
    assert 0 < sum(int(o[0]) for o in outs) <= len(ds.blocks)
    assert all(o[1] == str(len(ds)) and o[2] == "True" for o in outs)


ORPHAN = """
import sys, time
from stoker import Loader, RunOptions, open_dataset
ds = open_dataset(sys.argv[1], cache_dir=sys.argv[2], cache_bytes=64 << 20)
loader = Loader(ds, 8, num_workers=2, transform="eval", run=RunOptions(start_method=sys.argv[3]))
it = iter(loader)
next(it)
print(" ".join(str(pid) for pid in loader.processes.pids()), flush=True)
time.sleep(60)
"""


def _alive(pid):
    from stoker._procs import pid_alive

    return pid_alive(pid)


def _ppid(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


@pytest.mark.parametrize(
    "method, sig", [("fork", signal.SIGKILL), ("forkserver", signal.SIGKILL), ("forkserver", signal.SIGTERM)]
)
def test_workers_exit_when_the_training_process_is_killed(packed_local, tmp_path, method, sig):
    """Only the training process is killed. Under forkserver the workers' OS parent is the fork
    server, which lives while they do: they watched it, and all of them (and the fork server)
    were left running, idle, holding their memory and cache files."""
    proc = subprocess.Popen(
        [sys.executable, "-c", ORPHAN, packed_local, str(tmp_path), method], stdout=subprocess.PIPE, text=True
    )
    children: list[int] = []
    parents: set[int] = set()
    try:
        children = [int(p) for p in proc.stdout.readline().split()]
        assert len(children) == 3 and all(_alive(p) for p in children)
        parents = {_ppid(p) for p in children} - {proc.pid}  # the fork server, under forkserver
        assert len(parents) == (1 if method == "forkserver" else 0)
        proc.send_signal(sig)  # only the training process
        proc.wait(10)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and any(_alive(p) for p in children + list(parents)):
            time.sleep(0.1)
        assert not any(_alive(p) for p in children), [p for p in children if _alive(p)]
        assert not any(_alive(p) for p in parents)  # the fork server ends with its last child
    finally:  # nothing of a failed run left running (what the bug left: the workers and the fork server)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in [*children, *parents]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
