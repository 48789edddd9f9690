"""Property test (Hypothesis) over Loader lifecycles: random sequences of create, iter, next,
drain, break, close and drop over 1-3 Loaders sharing one Dataset object and one node cache
smaller than the dataset (so blocks go through the staging area), with 0-2 workers.

Every epoch that runs to its end delivers every sample exactly once (checked from the sample ids
the user's decode returns, not from stoker's counters), and when the sequence is over and its
Loaders are closed or dropped, nothing is left: no process of the test's, no new stoker file in
/dev/shm named after one of its processes (or after none: other jobs share /dev/shm), no staged
block. ``STOKER_LIFECYCLE_EXAMPLES`` sets the number of sequences (default
6 in ``make test``; ``stoker bench faults`` style long runs set more).
"""

from __future__ import annotations

import glob
import os
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from _helpers import in_child
from stoker import Loader, open_dataset
from stoker.cache.tiered import default_memory_root
from stoker.store.dataset import ID_FIELD
from stoker_lab.bench.fault_lifecycle_child import children

OPS = ("create", "iter", "next", "drain", "break", "close", "drop")
EXAMPLES = int(os.environ.get("STOKER_LIFECYCLE_EXAMPLES", "6"))


def sample_id(fields, rng):
    """The decode: the sample's id, so every delivered batch names its samples."""
    return np.int64(fields[ID_FIELD])


def _shm() -> set:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def _ours(name: str, pids: set, memory_root: str) -> bool:
    """Whether a new /dev/shm entry may be this sequence's: stoker's (``stoker-*``), where its name
    carries pids one of ours, and of the memory-tier directories (``stoker-cache-*``) only this
    cache's (other jobs on the machine make theirs at the same time)."""
    if name.startswith("stoker-cache-"):
        return name == os.path.basename(memory_root)
    named = {int(t) for t in name.split("-") if t.isdigit()}
    return name.startswith("stoker-") and (not named or bool(named & pids))


def _staged(cache_dir: str) -> list[str]:
    return [p for p in glob.glob(os.path.join(cache_dir, ".staging", "**"), recursive=True) if os.path.isfile(p)]


def _run_sequence(url: str, cache_dir: str, ops: list, workers: int) -> dict:
    """Run ``ops`` in this (child) process; returns what was checked and what was left."""
    shm_before = _shm()
    ds = open_dataset(url, cache_dir=cache_dir, cache_bytes=256 << 10, block_bytes=64 << 10)
    n = len(ds)
    loaders: list = [None, None, None]
    iters: list = [None, None, None]
    got: list = [[], [], []]
    epochs_checked = 0

    def finish(k):
        nonlocal epochs_checked
        ids = sorted(got[k])
        assert ids == list(range(n)), f"loader {k}: an epoch delivered {len(ids)} ids for {n} samples"
        epochs_checked += 1
        iters[k] = None

    pids = {os.getpid()}
    for op, k in ops:
        pids.update(p for ld in loaders if ld is not None for p in ld.processes.pids())
        if op == "create" and loaders[k] is None:
            loaders[k] = Loader(ds, 8, seed=k, num_workers=workers, decode=sample_id)
        elif loaders[k] is None:
            continue
        elif op == "iter":
            iters[k], got[k] = iter(loaders[k]), []
        elif op in ("next", "drain") and iters[k] is not None:
            for batch in iters[k]:
                got[k].extend(int(i) for i in batch)
                if op == "next":
                    break
            else:
                finish(k)
        elif op == "break":
            iters[k] = None
        elif op == "close":
            loaders[k].close()
            loaders[k] = iters[k] = None
        elif op == "drop":
            loaders[k] = iters[k] = None
    pids.update(p for ld in loaders if ld is not None for p in ld.processes.pids())
    for k in range(3):  # the end: half closed, half dropped
        if loaders[k] is not None and k % 2 == 0:
            loaders[k].close()
    loaders = iters = []  # no gc.collect(): a dropped Loader must stop without a cyclic collection
    deadline = time.monotonic() + 10
    while children(os.getpid()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return {
        "epochs": epochs_checked,
        "children": children(os.getpid()),
        "shm": sorted(n for n in _shm() - shm_before if _ours(n, pids, default_memory_root(cache_dir))),
        "staged": _staged(cache_dir),
    }


@pytest.fixture(scope="module")
def packed(packed_local):
    return packed_local


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    ops=st.lists(st.tuples(st.sampled_from(OPS), st.integers(0, 2)), min_size=1, max_size=14),
    workers=st.sampled_from([0, 1, 2]),
)
def test_any_lifecycle_is_exactly_once_and_leaves_nothing(packed, tmp_path_factory, ops, workers):
    cache_dir = str(tmp_path_factory.mktemp("lifecycle-cache"))
    ops = [("create", 0), ("iter", 0)] + ops  # at least one Loader with an open epoch
    out = in_child(_run_sequence, packed, cache_dir, ops, workers, timeout_s=240)
    assert out["children"] == [], out
    assert out["shm"] == [], out
    assert out["staged"] == [], out
