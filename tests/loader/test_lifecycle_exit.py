"""Every exit path leaves nothing behind: a script that ends without ``close()``, a Loader dropped
(re-bound) without ``close()`` (its processes end at once, with no cyclic garbage collection), and
the batch slots, whose names leave ``/dev/shm`` as soon as they are made."""

from __future__ import annotations

import gc
import glob
import os
import signal
import subprocess
import sys
import time
import weakref

from _helpers import in_child
from stoker import ImageOptions, Loader, ReadOptions, open_dataset
from stoker._procs import pid_alive
from stoker.loader.shm import SlotRing, shm_base
from stoker_lab.bench.fault_lifecycle_child import children

NO_CLOSE = """
import sys
from stoker import ImageOptions, Loader, ReadOptions, open_dataset
ds = open_dataset(sys.argv[1], cache_dir=sys.argv[2], cache_bytes=64 << 20)
ld = Loader(ds, 8, num_workers=2, image=ImageOptions(image_size=32))
for epoch in range(2):
    n = sum(len(y) for _, y in ld)
it = iter(ld)
next(it)  # an epoch left open too
print(" ".join(str(p) for p in ld.processes.pids()), flush=True)
"""


def test_a_script_that_never_closes_leaves_no_slot_and_no_process(packed_local, tmp_path):
    p = subprocess.Popen(
        [sys.executable, "-c", NO_CLOSE, packed_local, str(tmp_path / "cache")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
    assert p.returncode == 0 and "Traceback" not in err, err
    pids = [int(x) for x in out.split()]
    assert len(pids) == 3
    deadline = time.monotonic() + 10
    while any(pid_alive(x) for x in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [x for x in pids if pid_alive(x)]
    assert glob.glob(os.path.join(shm_base(), f"stoker-{p.pid}-*")) == []


def _drop_loaders(packed: str, cache: str) -> dict:
    """Loaders re-bound without close(), the cyclic collector off: after each re-bind, the
    children alive and whether the dropped Loader still exists."""
    gc.collect()
    gc.disable()
    try:
        ds = open_dataset(packed, cache_dir=cache, cache_bytes=64 << 20)
        me, peak, alive = os.getpid(), 0, []
        ld = None
        for seed in range(4):
            ld = Loader(ds, 8, num_workers=2, seed=seed, image=ImageOptions(image_size=32))
            for _x, _y in ld:
                break
            ref = weakref.ref(ld)
            del _x, _y
            ld = None  # the user's name re-bound; no close()
            alive.append(ref() is not None)
            time.sleep(0.2)
            peak = max(peak, len(children(me)))
        deadline = time.monotonic() + 10
        while children(me) and time.monotonic() < deadline:
            time.sleep(0.05)
        return dict(alive=alive, peak=peak, left=children(me), slots=glob.glob(f"{shm_base()}/stoker-{me}-*"))
    finally:
        gc.enable()


def test_a_dropped_loader_stops_its_processes_without_a_gc(packed_local, tmp_path):
    got = in_child(_drop_loaders, packed_local, str(tmp_path / "cache"), timeout_s=120)
    assert got["alive"] == [False] * 4  # no reference cycle keeps a dropped Loader
    assert got["peak"] <= 3 and got["left"] == [] and got["slots"] == [], got


def _unnamed_loader(packed: str) -> tuple:
    """``for batch in Loader(...)``: the Loader bound to no name lives while its epoch is iterated."""
    ds = open_dataset(packed, cache=False)
    n = 0
    for _x, y in Loader(ds, 16, num_workers=2, image=ImageOptions(image_size=32)):
        gc.collect()
        n += len(y)
    return n, len(ds)


def test_a_loader_bound_to_no_name_serves_its_whole_epoch(packed_local):
    n, total = in_child(_unnamed_loader, packed_local, timeout_s=120)
    assert n == total


def test_slot_names_leave_shm_at_once_and_workers_still_open_them():
    ring = SlotRing(4, 8, 3)
    try:
        assert ring.unlinked  # Linux: the slots are open here, by no name in /dev/shm
        assert glob.glob(os.path.join(shm_base(), ring.prefix + "*")) == []
        code = (
            "import sys; from stoker.loader.shm import map_slot;"
            "mm, images, labels = map_slot(sys.argv[1], 4, 8); images[:] = 5; labels[:] = 7"
        )
        subprocess.run([sys.executable, "-c", code, ring.paths[0]], check=True, timeout=60)  # another process
        images, labels = ring.views(0)
        assert (images == 5).all() and (labels == 7).all()
    finally:
        ring.close()


NAMED = """
import sys
from stoker.loader.shm import SlotRing
ring = SlotRing(4, 8, 3, unlink_early=False)
print(ring.prefix, len(ring.paths), flush=True)
if sys.argv[1] == "sigint":
    import signal
    signal.raise_signal(signal.SIGINT)
"""


def test_named_slots_are_unlinked_at_exit_without_close():
    """Where slots keep their names (no /proc), the ring's finalizer unlinks them at exit, also
    when the script ends by an uncaught KeyboardInterrupt."""
    for how in ("end", "sigint"):
        p = subprocess.run([sys.executable, "-c", NAMED, how], capture_output=True, text=True, timeout=60)
        prefix, n = p.stdout.split()
        assert int(n) == 3 and p.returncode == (0 if how == "end" else -signal.SIGINT), p.stderr
        assert glob.glob(os.path.join(shm_base(), prefix + "*")) == []


def _fork_closes_its_copy(packed: str) -> tuple:
    """A process forked from the training process that closes its copy of the Loader (as its
    exit handlers would: the Loader's finalizer, its ring's) leaves the parent's pipeline alone."""
    ds = open_dataset(packed, cache=False)
    with Loader(ds, 8, num_workers=2, image=ImageOptions(image_size=32), read=ReadOptions(prefetch_batches=2)) as ld:
        it = iter(ld)
        n = len(next(it)[1])
        ring = ld.pipeline.ring
        pid = os.fork()
        if pid == 0:  # the child
            try:
                ring.close()
                ld.close()
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
        n += sum(len(y) for _, y in it)
        return n, len(ds), ld.stats.exactly_once, ld.stats.worker_restarts


def test_a_forked_child_closing_its_copy_leaves_the_parents_loader_alone(packed_local):
    n, total, once, restarts = in_child(_fork_closes_its_copy, packed_local, timeout_s=120)
    assert n == total and once and restarts == 0
