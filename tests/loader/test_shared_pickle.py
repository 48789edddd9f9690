"""Workers started by spawn or forkserver map the dataset's arrays from one shared file
(loader/workers/sharedpickle.py) instead of each unpickling its own copy: the object comes back
equal with its large arrays read-only views of the file, small ones inline; the file goes when the
training process closes it (and the workers' mappings); a full /dev/shm, or an object that
pickles only while a process starts, shares nothing (the dataset goes as before); a spawn Loader's
workers map the file and read every sample once."""

from __future__ import annotations

import errno
import os
import pickle
import subprocess
import sys
import textwrap

import numpy as np
import pyarrow as pa
import pytest

from stoker.loader.shm import shm_base
from stoker.loader.workers import sharedpickle
from stoker.loader.workers.sharedpickle import MIN_SHARED_BYTES, share


def our_files() -> list[str]:
    return [n for n in os.listdir(shm_base()) if n.startswith(f"stoker-{os.getpid()}-") and n.endswith("-dataset")]


def sample_object() -> dict:
    keys = pa.array([f"n{i:08d}/n{i:08d}_{i}" for i in range(20_000)])
    return {
        "big": np.arange(50_000, dtype=np.int64).reshape(2, -1),
        "strided": np.arange(40_000, dtype=np.int32)[::2],
        "small": np.arange(10, dtype=np.int16),
        "keys": keys,
        "text": "x",
    }


def test_large_arrays_come_back_as_read_only_views_of_the_shared_file():
    obj = sample_object()
    shared = share(obj)
    assert shared is not None
    try:
        assert shared.shared_bytes >= obj["big"].nbytes + obj["keys"].buffers()[2].size
        assert len(shared.data) < MIN_SHARED_BYTES  # the arrays are in the file, not the pickle
        back = pickle.loads(pickle.dumps(shared)).load()  # as a worker receives and loads it
        for name in ("big", "strided", "small"):
            assert np.array_equal(back[name], obj[name]) and back[name].dtype == obj[name].dtype
        assert not back["big"].flags.writeable and not back["strided"].flags.writeable
        assert back["small"].flags.writeable  # under MIN_SHARED_BYTES: pickled inline
        assert back["keys"].equals(obj["keys"]) and back["text"] == "x"
    finally:
        shared.close()
    assert our_files() == []
    shared.close()  # idempotent


def test_a_full_shared_memory_directory_shares_nothing(monkeypatch):
    """None: the caller sends the object itself, a copy per process, as before."""

    def no_room(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(sharedpickle.os, "posix_fallocate", no_room)
    assert share(sample_object()) is None and our_files() == []


def test_nothing_large_or_an_object_that_pickles_only_while_spawning_shares_nothing():
    import multiprocessing

    assert share({"small": np.arange(10)}) is None
    lock = multiprocessing.get_context("spawn").Lock()  # pickles only while a process is started
    assert share({"big": np.arange(50_000), "lock": lock}) is None
    assert our_files() == []


@pytest.mark.parametrize(("method", "cached"), [("spawn", False), ("forkserver", True)])
def test_spawned_workers_map_the_dataset_and_read_every_sample_once(tmp_path, method, cached):
    """With a node cache the prefetch process maps the same file."""
    cache = f"cache_dir={str(tmp_path / 'cache')!r}" if cached else "cache=False"
    script = textwrap.dedent(
        f"""
        import os
        import stoker
        from stoker.collate import raw_bytes

        if __name__ == "__main__":
            with stoker.Writer({str(tmp_path / "ds")!r}) as w:
                for i in range(20_000):
                    key = f"n{{i % 1000:08d}}/n{{i % 1000:08d}}_{{i:08d}}"
                    w.write({{"__key__": key, "bin": i.to_bytes(8, "little")}})
            ds = stoker.open_dataset({str(tmp_path / "ds")!r}, {cache})
            run = stoker.RunOptions(start_method={method!r})
            with stoker.Loader(ds, batch_size=500, collate=raw_bytes, num_workers=2, run=run) as loader:
                ids, mapped = [], []
                for batch in loader:
                    ids.extend(batch.ids.tolist())
                    if not mapped:
                        procs = loader.processes
                        for p in procs.workers + ((procs.prefetcher,) if procs.prefetcher is not None else ()):
                            with open(f"/proc/{{p.pid}}/maps") as f:
                                lines = [line.rstrip() for line in f]
                            mapped.append(any(x.endswith(("-dataset", "-dataset (deleted)")) for x in lines))
            assert sorted(ids) == list(range(20_000)), "not every sample once"
            assert mapped == [True] * (3 if {cached} else 2), mapped
            left = [n for n in os.listdir("/dev/shm") if n.startswith(f"stoker-{{os.getpid()}}-")]
            assert left == [], left
            print("ok")
        """
    )
    path = tmp_path / "spawned.py"
    path.write_text(script)
    out = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout + out.stderr
