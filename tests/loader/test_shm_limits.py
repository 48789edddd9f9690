"""Batch slots and a small /dev/shm: space is reserved before any page is touched, so a shortage
is an error naming the directory and the bytes (or a smaller ring that copies batches out), never
a SIGBUS in a worker or in the training process."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from stoker.loader import ImageOptions, Loader, ReadOptions, RunOptions
from stoker.loader import shm as ring_mod
from stoker.loader.shm import SharedMemoryError, SlotRing, slot_layout
from stoker.store.dataset import open_dataset


def _room_for(monkeypatch, n_slots: int) -> list:
    """Make the next reservations fail with ENOSPC after ``n_slots`` succeed (a full /dev/shm)."""
    real, calls = os.posix_fallocate, []

    def fake(fd, offset, length):
        calls.append(length)
        if len(calls) > n_slots:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, offset, length)

    monkeypatch.setattr(ring_mod.os, "posix_fallocate", fake)
    return calls


def _slot_files(ring) -> list[str]:
    return [n for n in os.listdir(ring.base) if n.startswith(ring.prefix)]


def test_ring_shrinks_to_what_fits_and_copies(monkeypatch):
    calls = _room_for(monkeypatch, 2)
    ring = SlotRing(4, 8, 5, unlink_early=False)  # named files, to count them (test_lifecycle_exit.py: unlinked)
    try:
        total = slot_layout(4, 8)[2]
        assert calls[0] == total  # every slot reserved in full before it is mapped
        assert len(ring.paths) == 2 and ring.limited and len(_slot_files(ring)) == 2
        a, b = ring.acquire(), ring.acquire()
        assert ring.try_acquire() is None
        with pytest.raises(SharedMemoryError) as err:
            ring.acquire()
        assert err.value.errno == errno.ENOSPC and isinstance(err.value, OSError)
        assert ring.base in str(err.value) and f"needs {total} bytes" in str(err.value)
        assert err.value.needed_bytes == total
        imgs, labels = ring.views(a)
        imgs[:] = 7
        labels[:] = np.arange(4)
        out, lab = ring.batch(a, 3)  # a copy: the slot is free again at once
        assert a in ring.free and out.shape == (3, 3, 8, 8) and (out == 7).all() and list(lab) == [0, 1, 2]
        ring.views(a)[0][:] = 0
        assert (out == 7).all()
        ring.release(b)
    finally:
        ring.close()
    assert _slot_files(ring) == []


def test_no_room_for_one_slot_is_a_clear_error(monkeypatch):
    _room_for(monkeypatch, 0)
    before = set(os.listdir(ring_mod.shm_base()))
    with pytest.raises(SharedMemoryError, match=r"has -?\d+ bytes free but one batch slot needs 1232 bytes"):
        SlotRing(4, 10, 3)
    assert not [n for n in set(os.listdir(ring_mod.shm_base())) - before if n.startswith("stoker-")]


def test_private_slots_use_no_shared_memory(monkeypatch):
    _room_for(monkeypatch, 0)  # any reservation would fail
    ring = SlotRing(4, 8, 3, shared=False)
    i = ring.acquire()
    ring.views(i)[0][:] = 1
    assert ring.paths == [None, None, None] and not ring.limited
    ring.close()


def test_loader_completes_epochs_with_one_slot(monkeypatch, packed_local):
    _room_for(monkeypatch, 1)
    ds = open_dataset(packed_local)
    with Loader(
        ds,
        batch_size=16,
        num_workers=2,
        transform="eval",
        shuffle=False,
        image=ImageOptions(image_size=32),
        run=RunOptions(timeout_s=60),
    ) as ld:
        for _ in range(2):
            labels = np.concatenate([lab.numpy() for _, lab in ld])
            assert len(labels) == len(ds)
            assert (labels == ds.index.labels[ld.plan(ld.epoch - 1)]).all()
        assert ld.pipeline.ring.limited and len(ld.pipeline.ring.paths) == 1


def test_held_batches_in_a_full_ring_raise_not_hang(monkeypatch, packed_local):
    """Every slot held by a batch the caller keeps and no room for another: an error, not a stall."""
    ds = open_dataset(packed_local)
    with Loader(
        ds,
        batch_size=16,
        num_workers=1,
        transform="eval",
        read=ReadOptions(prefetch_batches=1, prefetch_next_epoch=False),
        image=ImageOptions(image_size=32),
        run=RunOptions(timeout_s=60),
    ) as ld:
        it = iter(ld)
        kept = [next(it)]  # zero-copy: holds its slot
        _room_for(monkeypatch, 0)
        with pytest.raises(SharedMemoryError, match="one batch slot needs"):
            while True:
                kept.append(next(it))
        assert len(kept) >= 1


CHILD = """
import os, sys, stoker
ds = stoker.open_dataset(sys.argv[1])
for workers, size in ((1, 160), (0, 224), (1, 224)):
    try:
        with stoker.Loader(ds, batch_size=8, num_workers=workers, transform="eval",
                           image=stoker.ImageOptions(image_size=size), run=stoker.RunOptions(timeout_s=60)) as ld:
            print(workers, size, sum(len(lab) for _, lab in ld), flush=True)
    except stoker.loader.shm.SharedMemoryError as exc:
        print(workers, size, "error", exc, flush=True)
print("left", [n for n in os.listdir("/dev/shm") if n.startswith("stoker-")], flush=True)
"""


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="needs root and unshare -m")
def test_tiny_dev_shm_never_kills_by_signal(packed_local, tmp_path):
    """A 1 MiB /dev/shm in a private mount namespace: a 0.6 MB slot fits once (the epoch completes
    with one slot), 1.2 MB slots fit not at all (workers: SharedMemoryError naming /dev/shm; no
    workers: private memory, the epoch completes). Before, the trainer or the worker died by SIGBUS."""
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(CHILD))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    cmd = f"mount -t tmpfs -o size=1m tmpfs /dev/shm && exec {sys.executable} {script} {packed_local}"
    r = subprocess.run(["unshare", "-m", "sh", "-c", cmd], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr[-2000:])
    lines = r.stdout.splitlines()
    assert lines[0] == "1 160 120" and lines[1] == "0 224 120", lines
    assert lines[2].startswith("1 224 error") and "/dev/shm" in lines[2] and "needs 1204288 bytes" in lines[2]
    assert lines[3] == "left []"
    assert "continuing with 1 slot(s)" in r.stderr
