"""Helpers shared by test modules (imported as ``from _helpers import ...``; a conftest module
cannot be imported by name once test folders have conftests of their own)."""

from __future__ import annotations

import multiprocessing as mp
import traceback
from pathlib import Path


def make_image_folder(root: Path, files: dict[str, bytes]) -> Path:
    """Write ``{relative path: bytes}`` under ``root`` and return it."""
    for rel, data in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    return root


def pack_id_dataset(root: Path, n: int, size: int = 3000, shard_bytes: int = 128 << 10) -> str:
    """Pack ``n`` samples ``s0000.bin`` .. of ``size`` bytes, each starting with its own id in ASCII
    (then dots), with ``--source files`` (field ``bin``) into ``root/packed``; returns its path.
    :func:`sample_id` decodes them, :func:`batch_ids` reads a batch of those."""
    from stoker.store.pack import pack

    make_image_folder(root / "src", {f"s{i:04d}.bin": f"{i}".encode().ljust(size, b".") for i in range(n)})
    pack(str(root / "src"), str(root / "packed"), source="files", shard_bytes=shard_bytes, progress=False)
    return str(root / "packed")


def sample_id(fields, rng):
    """A Loader ``decode=`` for :func:`pack_id_dataset`'s samples: the id their bytes start with,
    as a one-element int64 array."""
    import numpy as np

    return np.array([int(fields["bin"].split(b".")[0])], np.int64)


def batch_ids(batch) -> list[int]:
    """The sample ids of a batch of :func:`sample_id` arrays (a tensor or an array)."""
    import numpy as np

    return [int(v) for v in np.asarray(batch).reshape(-1)]


def in_child(fn, *args, timeout_s: float = 120.0):
    """Run ``fn(*args)`` in a forked child and return what it returns (it must pickle), or
    re-raise its failure here (with its traceback). A child that has not answered within
    ``timeout_s`` is killed, so a hang fails the test and leaves no process behind.

    For code that uses obstore: a process that forks after a tokio runtime started can crash its
    children, so the test process itself never starts one (``tests/conftest.py`` checks it after
    every module)."""
    import queue as queue_mod

    ctx = mp.get_context("fork")
    q = ctx.Queue()

    def target():
        try:
            q.put((None, fn(*args)))
        except BaseException:  # noqa: BLE001
            q.put((traceback.format_exc(), None))

    p = ctx.Process(target=target)
    p.start()
    try:
        err, result = q.get(timeout=timeout_s)
    except queue_mod.Empty:
        p.kill()
        p.join(10)
        raise AssertionError(
            f"{getattr(fn, '__name__', fn)} did not finish within {timeout_s:g} s in a child"
        ) from None
    p.join(30)
    if p.is_alive():
        p.kill()
        p.join(10)
    assert err is None, err
    return result


def require(what: str, module: str | None = None, path: str | None = None):
    """The imported ``module`` (or None) once ``module`` imports and ``path`` exists; otherwise the
    test is skipped with the reason, or fails under ``CI=true`` (``make test`` installs them)."""
    import importlib
    import os

    import pytest

    reason = None
    mod = None
    if module is not None:
        try:
            mod = importlib.import_module(module)
        except ImportError as exc:
            reason = f"{what}: python package {module!r} is missing ({exc})"
    if reason is None and path is not None and not os.path.exists(path):
        reason = f"{what}: {path} is missing (Debian package alsa-utils; scripts/system_deps.sh)"
    if reason is not None:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(reason + " (CI=true: real-data tests must not skip)")
        pytest.skip(reason)
    return mod


def fault_proxy(options: dict):
    """``(proxy, options through it)``: a running :class:`stoker_lab.bench.faultproxy.FaultProxy` in
    front of the endpoint of the S3 storage options ``options`` (the emulated origin's, throttled
    or direct), and a copy of ``options`` whose ``endpoint_url`` is the proxy's. It forwards
    everything until ``proxy.set_fault``; its faults are counted in ``proxy.stats()``. The caller
    stops it (``proxy.stop()``, or ``with proxy:``). Safe to call in a forked child (the proxy's
    thread is then the child's own)."""
    from stoker_lab.bench.faultproxy import FaultProxy

    proxy = FaultProxy(options["endpoint_url"])
    return proxy, {**options, "endpoint_url": proxy.endpoint_url}


class SpeechDecode:
    """A user decode for speech samples (``utt.wav`` + ``utt.txt`` packed with ``--source
    files``): ``{"audio": float32 (n,) mono, "text": the transcript (str)}``, ``n`` drawn by the
    sample's rng between 10 ms and ``max_seconds`` (so batches differ in width and slots grow).
    A class at module level: it pickles to the workers under every start method."""

    def __init__(self, max_seconds: float = 0.3):
        self.max_seconds = float(max_seconds)

    def __call__(self, fields: dict, rng) -> dict:
        import io

        import soundfile as sf

        data, rate = sf.read(io.BytesIO(fields["wav"]), dtype="float32", always_2d=True)
        n = int(rng.integers(rate // 100, int(self.max_seconds * rate)))
        return {"audio": data.mean(axis=1)[:n].copy(), "text": fields["txt"].decode()}


def flow_finish_times(caps: dict, flows: list[tuple[float, dict]], **net_options) -> list[float]:
    """Finish times (s) of flows ``(start_s, {link: bytes})`` on a :class:`stoker_lab.sim.FlowNetwork`
    with link capacities ``caps`` (bytes/s) and ``net_options`` (``incremental=``, ``buckets=``)."""
    import simpy

    from stoker_lab.sim import FlowNetwork

    env = simpy.Environment()
    net = FlowNetwork(env, caps, **net_options)
    done: list[float] = [0.0] * len(flows)

    def one(i, start, parts):
        yield env.timeout(start)
        yield net.transfer(parts)
        done[i] = env.now

    for i, (start, parts) in enumerate(flows):
        env.process(one(i, start, parts))
    env.run()
    return done


def loader_epoch(ctx):
    """A cluster rank's train function: one epoch through ``ctx.loader`` with a decode worker and a
    prefetcher (forked children: each opens its own connections to the peers' data endpoints);
    returns the rank's epoch records (``ctx.epochs``). Sent to the Ray workers by value
    (tests/cluster/conftest.py)."""
    from stoker import ImageOptions, ReadOptions

    loader = ctx.loader(
        8, num_workers=1, transform="eval", image=ImageOptions(image_size=32), read=ReadOptions(prefetch_bytes=1 << 20)
    )
    try:
        for _ in loader:
            pass
    finally:
        loader.close()
    return ctx.epochs


def damage_cached_blocks(cache_dir: Path, offset: int, larger_than: int = 100_000) -> list[Path]:
    """Flip one byte at ``offset`` of every block file under ``cache_dir`` larger than
    ``larger_than`` bytes (a cache whose bytes changed on disk); returns the files (at least one:
    asserted)."""
    files = [p for p in Path(cache_dir).rglob("*") if p.is_file() and p.stat().st_size > larger_than]
    assert files, f"no cached block over {larger_than} bytes under {cache_dir}"
    for p in files:
        with open(p, "r+b") as f:
            f.seek(offset)
            byte = f.read(1)
            f.seek(offset)
            f.write(bytes([byte[0] ^ 0xFF]))
    return files


def pack_killed_before_index(monkeypatch, src: str, dst: str, **kwargs) -> None:
    """Run ``stoker.pack(src, dst, **kwargs)`` as if it were killed just before its index: every
    shard and manifest written, no index (a finished pack removes its manifests)."""
    import importlib

    import pytest

    pack_module = importlib.import_module("stoker.store.pack")

    def killed(*_args, **_kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(pack_module, "install_index", killed)
        with pytest.raises(KeyboardInterrupt):
            pack_module.pack(src, dst, **kwargs)
