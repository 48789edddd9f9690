"""Ctrl-C: the training process alone turns SIGINT into one KeyboardInterrupt. The workers and the
prefetcher ignore it, so a terminal's Ctrl-C (sent to the whole process group) gives one traceback
and a prompt exit with nothing left, and a caught one leaves the Loader as it was: the next epoch
is exactly once, with the same processes."""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from stoker.loader.shm import shm_base
from stoker_lab.bench.fault_lifecycle_child import session_members

#: A training script: 3 epochs, 2 workers and a prefetcher (node cache); "mid-epoch" once batch 1
#: of epoch 1 is out; with CATCH, a caught Ctrl-C is followed by one more whole epoch.
SCRIPT = """
import json, sys, time
from stoker import ImageOptions, Loader, RunOptions, open_dataset
ds = open_dataset(sys.argv[1], cache_dir=sys.argv[2], cache_bytes=64 << 20)
ld = Loader(ds, 8, num_workers=int(sys.argv[3]), image=ImageOptions(image_size=32), run=RunOptions(timeout_s=60))
sum(len(y) for _, y in ld)
before = ld.processes.pids()
try:
    for epoch in range(3):
        for i, (x, y) in enumerate(ld):
            if epoch == 0 and i == 1:
                print("mid-epoch", flush=True)
            time.sleep(0.05)
except KeyboardInterrupt:
    if not CATCH:
        raise
    n = sum(len(y) for _, y in ld)
    st = ld.stats
    print(json.dumps(dict(n=n, total=len(ds), once=st.exactly_once, restarts=[st.worker_restarts,
          st.prefetcher_restarts], same=ld.processes.pids() == before)), flush=True)
    ld.close()
"""


def _ctrl_c(packed: str, cache: str, workers: int, catch: bool):
    """Run SCRIPT, Ctrl-C its whole process group mid-epoch; (rc, stdout lines, stderr, slot
    files of its pid, processes of its session left)."""
    code = textwrap.dedent(SCRIPT).replace("CATCH", repr(catch))
    p = subprocess.Popen(
        [sys.executable, "-c", code, packed, cache, str(workers)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert p.stdout.readline().strip() == "mid-epoch"
        os.killpg(p.pid, signal.SIGINT)  # what a terminal does on Ctrl-C
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
    slots = glob.glob(os.path.join(shm_base(), f"stoker-{p.pid}-*"))
    return p.returncode, out.splitlines(), err, slots, session_members(p.pid)


def test_ctrl_c_gives_one_traceback_and_leaves_nothing(packed_local, tmp_path):
    rc, out, err, slots, left = _ctrl_c(packed_local, str(tmp_path / "cache"), 2, catch=False)
    assert rc == -signal.SIGINT, err  # Python ends by the signal after its traceback
    assert err.count("Traceback (most recent call last)") == 1, err
    assert err.count("KeyboardInterrupt") == 1 and "Process stoker-" not in err, err
    assert slots == [] and left == []


@pytest.mark.parametrize("workers", [2, 0])
def test_a_caught_ctrl_c_leaves_the_loader_as_it_was(packed_local, tmp_path, workers):
    import json

    rc, out, err, slots, left = _ctrl_c(packed_local, str(tmp_path / "cache"), workers, catch=True)
    assert rc == 0, err
    assert "Traceback" not in err, err
    got = json.loads(out[-1])
    assert got["n"] == got["total"] and got["once"], got  # the next epoch: every sample once
    assert got["restarts"] == [0, 0] and got["same"], got  # no worker or prefetcher was hit
    assert slots == [] and left == []


def test_a_sigint_inside_held_is_raised_when_the_block_ends():
    from stoker.loader.workers import interrupts

    seen = []
    with pytest.raises(KeyboardInterrupt):
        with interrupts.held():
            signal.raise_signal(signal.SIGINT)
            seen.append("the block went on")
    assert seen == ["the block went on"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


#: A Ctrl-C that lands while close() runs: Run.close sends SIGINT to this process before it
#: stops anything. HOW: "plain" (close() at the end of training), "except" (close() in the
#: handler of an earlier KeyboardInterrupt), "with" (a with block left by one).
SECOND = """
import json, os, signal, sys
from stoker import ImageOptions, Loader, open_dataset
from stoker._procs import pid_alive
from stoker.loader.pipeline.run import Run

original = Run.close
def close_hit_by_ctrl_c(self):
    os.kill(os.getpid(), signal.SIGINT)
    original(self)
Run.close = close_hit_by_ctrl_c

ds = open_dataset(sys.argv[1], cache_dir=sys.argv[2], cache_bytes=64 << 20)
ld = Loader(ds, 8, num_workers=2, image=ImageOptions(image_size=32))
next(iter(ld))
pids = ld.processes.pids()
how, raised = sys.argv[3], []
try:
    if how == "plain":
        ld.close()
    elif how == "except":
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt:
            ld.close()
    else:
        try:
            with ld:
                raise KeyboardInterrupt("first")
        except KeyboardInterrupt as exc:
            raised.append(str(exc))
except KeyboardInterrupt as exc:
    raised.append("after close: " + str(exc))
print(json.dumps(dict(raised=raised, alive=[p for p in pids if pid_alive(p)])), flush=True)
"""


@pytest.mark.parametrize(
    "how, raised",
    [("plain", ["after close: "]), ("except", []), ("with", ["first"])],
)
def test_a_ctrl_c_during_close_waits_for_it_and_is_raised_once(packed_local, tmp_path, how, raised):
    """A second Ctrl-C never stops close() halfway; it is raised after a plain close() and dropped
    when the close is the work of an earlier KeyboardInterrupt (one traceback)."""
    import json

    p = subprocess.run(
        [sys.executable, "-c", SECOND, packed_local, str(tmp_path / "cache"), how],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out == {"raised": raised, "alive": []}, p.stderr
    assert "Traceback" not in p.stderr
