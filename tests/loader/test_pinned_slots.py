"""The pinned-slot path of ``RunOptions(device="cuda")`` (loader/device/transfer.py), run on the CPU
with a stand-in for the CUDA runtime: each slot registered once (again when it grows) and
unregistered on every way out, copies made from the slot itself, and a slot given back to the
workers only after the event recorded after its copy says the copy has completed."""

from __future__ import annotations

import gc
import mmap

import numpy as np
import pytest
import torch

from stoker.collate import RawBatch, raw_bytes
from stoker.loader import Loader, RunOptions
from stoker.loader.device.cuda_host import SURFACE
from stoker.loader.device.transfer import DeviceTransfer
from stoker.loader.shm import SlotRing
from stoker.loader.workers.batches import SlotWriter, rebuild
from stoker.store.dataset import open_dataset


class FakeEvent:
    """An event on the stand-in's one stream: completing it runs the copies issued before it."""

    def __init__(self, rt: FakeCuda, copies: list, lag: int | None):
        self.rt, self.copies, self.lag = rt, copies, lag
        self.done = False
        self.polls = 0

    def query(self) -> bool:
        self.polls += 1
        if self.lag is not None and self.polls > self.lag:
            self.synchronize()
        return self.done

    def synchronize(self) -> None:
        for ev in self.rt.events:  # one stream: the earlier events complete first
            if not ev.done:
                for host, dev in ev.copies:
                    dev.copy_(host)  # the "DMA" reads the slot now, not when the copy was issued
                ev.done = True
            if ev is self:
                break


class FakeCuda:
    """A stand-in for :class:`stoker.loader.device.cuda_host.CudaRuntime` on the CPU. A copy is
    asynchronous: its "device" tensor is filled from the host memory only when an event recorded
    after it completes (``lag`` polls after it was recorded, or at once when waited for; ``lag``
    None: only when waited for). So a slot handed back to the workers before its copy completed
    would show as a batch with another batch's bytes."""

    device = torch.device("cpu")

    def __init__(self, lag: int | None = None):
        self.lag = lag
        self.live: dict[int, int] = {}  # address -> bytes, registered now
        self.log: list[tuple] = []  # ("register", address, bytes) / ("unregister", address)
        self.pending: list = []  # copies issued since the last event
        self.events: list[FakeEvent] = []
        self.pinned_copies = self.unpinned_copies = self.handoffs = 0

    def register(self, ptr: int, nbytes: int) -> None:
        assert ptr not in self.live, "a range registered twice"
        assert ptr % mmap.PAGESIZE == 0 and nbytes % mmap.PAGESIZE == 0
        self.live[ptr] = nbytes
        self.log.append(("register", ptr, nbytes))

    def unregister(self, ptr: int) -> None:
        assert ptr in self.live, "unregistering a range never registered"
        del self.live[ptr]
        self.log.append(("unregister", ptr))

    def copy(self, host: torch.Tensor) -> torch.Tensor:
        p = host.data_ptr()
        inside = any(a <= p and p + host.nbytes <= a + n for a, n in self.live.items())
        self.pinned_copies += inside
        self.unpinned_copies += not inside
        dev = torch.full(host.shape, 0, dtype=host.dtype)
        self.pending.append((host, dev))
        return dev

    def event(self) -> FakeEvent:
        ev = FakeEvent(self, self.pending, self.lag)
        self.pending = []
        self.events.append(ev)
        return ev

    def handoff(self, event: FakeEvent, tensors: list) -> None:
        self.handoffs += 1

    def synchronize(self) -> None:
        if self.events:
            self.events[-1].synchronize()

    def registrations(self) -> int:
        return sum(1 for e in self.log if e[0] == "register")


def test_the_stand_in_has_the_runtime_surface():
    from stoker.loader import options

    assert set(SURFACE) == set(options._RUNTIME_SURFACE)
    assert all(hasattr(FakeCuda, a) for a in SURFACE)
    with pytest.raises(ValueError, match="device runtime with device, register"):
        RunOptions(device=object())


@pytest.mark.parametrize("lag", [None, 2])
@pytest.mark.parametrize("workers", [0, 2])
def test_batches_on_the_device_equal_the_host_batches(packed_local, tmp_path, lag, workers):
    ds = open_dataset(packed_local, cache_dir=str(tmp_path), cache_bytes=64 << 20)
    with Loader(ds, 8, num_workers=workers, seed=5) as lo:
        host = [(x.clone(), y.clone()) for x, y in lo]
    fake = FakeCuda(lag)
    with Loader(ds, 8, num_workers=workers, seed=5, run=RunOptions(device=fake)) as lo:
        dev = list(lo)  # nothing cloned: the "device" tensors are the transfer's own
        ring, tr = lo.pipeline.ring, lo.pipeline.transfer
        slots = len(ring.paths)
        assert tr.stats.batches == len(host) and fake.handoffs == len(host)
    # the copies read the slots only when their events completed: a slot handed back to the
    # workers earlier would have been overwritten by a later batch
    assert len(dev) == len(host)
    for (x, y), (gx, gy) in zip(host, dev, strict=True):
        assert torch.equal(gx, x) and torch.equal(gy, y)
    assert fake.unpinned_copies == 0 and fake.pinned_copies == 2 * len(host)  # from the slots themselves
    # each slot registered once at most (a slot may carry only batches never delivered: the next
    # epoch's head start, dropped at close); the ring did not grow per batch
    assert len({e[1] for e in fake.log if e[0] == "register"}) == fake.registrations() <= slots <= 8
    assert fake.live == {} and tr.stats.unregistered == tr.stats.registered == fake.registrations()  # at close


def test_a_slot_is_not_reused_before_its_copy_completed(packed_local, tmp_path, monkeypatch):
    """Directly: every slot the ring hands out again has no copy pending on it."""
    ds = open_dataset(packed_local, cache_dir=str(tmp_path), cache_bytes=64 << 20)
    fake = FakeCuda(lag=None)
    handed: list = []
    orig = SlotRing.try_acquire

    def watched(self):
        i = orig(self)
        if i is not None:
            handed.append(i)
            view = np.frombuffer(self.mapping(i), dtype=np.uint8)
            lo, hi = view.ctypes.data, view.ctypes.data + view.nbytes
            del view
            for ev in fake.events:
                for host, _ in ev.copies:
                    assert ev.done or not lo <= host.data_ptr() < hi, f"slot {i} handed out with a copy from it pending"
        return i

    monkeypatch.setattr(SlotRing, "try_acquire", watched)
    with Loader(ds, 8, num_workers=2, seed=1, run=RunOptions(device=fake)) as lo:
        for _ in range(2):
            assert sum(len(y) for _, y in lo) == len(ds)
    assert len(handed) > len(set(handed))  # slots were reused
    assert any(ev.done for ev in fake.events) and fake.live == {}


def test_dropped_loader_and_ctrl_c_unregister_every_slot(packed_local, tmp_path):
    ds = open_dataset(packed_local, cache_dir=str(tmp_path), cache_bytes=64 << 20)
    fake = FakeCuda(lag=1)
    lo = Loader(ds, 8, num_workers=2, run=RunOptions(device=fake))
    it = iter(lo)
    next(it), next(it)
    assert fake.live  # registered while running
    del it, lo
    gc.collect()
    assert fake.live == {} and fake.registrations() > 0
    fake = FakeCuda(lag=1)
    with pytest.raises(KeyboardInterrupt):
        with Loader(ds, 8, num_workers=2, run=RunOptions(device=fake)) as lo:
            for k, _ in enumerate(lo):
                if k == 2:
                    raise KeyboardInterrupt
    assert fake.live == {} and fake.registrations() > 0


def test_a_grown_slot_is_registered_again():
    ring = SlotRing(4, 8, 1, shared=True, slot_bytes=mmap.PAGESIZE)
    fake = FakeCuda(lag=None)
    tr = DeviceTransfer(ring, fake)
    writer = SlotWriter()
    sent = []
    try:
        for n in (1000, 1000, 9000, 100_000):  # the 3rd and 4th outgrow the slot: the worker grows its file
            i = ring.acquire()
            arr = np.arange(n, dtype=np.int64) * 7 + n
            specs, nbytes = writer.write(ring.paths[i], [arr])
            batch = rebuild(("np", 0), specs, ring.buffer(i, nbytes))  # mapped again when it grew
            sent.append((arr, tr.batch({"x": batch, "note": "kept"}, i)))
        ring.drain()
        registers = [e for e in fake.log if e[0] == "register"]
        assert len(registers) == 3 and [e[0] for e in fake.log] == ["register", "unregister"] * 2 + ["register"]
        assert registers[-1][2] >= 100_000 * 8  # the new mapping, whole
        for arr, out in sent:
            assert out["note"] == "kept" and np.array_equal(out["x"].numpy(), arr)
    finally:
        tr.close()
        writer.close()
        ring.close()
    assert fake.live == {} and tr.stats.unregistered == 3


@pytest.mark.parametrize("workers", [0, 2])
def test_raw_batches_on_the_device_equal_the_host_ones(packed_local, tmp_path, workers):
    ds = open_dataset(packed_local, cache_dir=str(tmp_path), cache_bytes=64 << 20)
    kw = dict(num_workers=workers, collate=raw_bytes, seed=2)
    with Loader(ds, 16, **kw) as lo:
        host = [RawBatch(*(t.clone() for t in b)) for b in lo]
    fake = FakeCuda(lag=1)
    with Loader(ds, 16, run=RunOptions(device=fake), **kw) as lo:
        dev = list(lo)
    assert len(dev) == len(host)
    for h, d in zip(host, dev, strict=True):
        assert isinstance(d, RawBatch)  # a namedtuple: moved field by field, not left on the host
        for a, b in zip(h, d, strict=True):
            assert torch.equal(a, b)
    if workers:
        assert fake.unpinned_copies == 0
    assert fake.live == {}


def _tokens(fields, rng):
    """A document of 5-90 random tokens (the sample's bytes are not used)."""
    return rng.integers(0, 1000, int(rng.integers(5, 90))).astype(np.int64)


def test_a_streaming_collates_rows_on_the_device_equal_the_host_ones(packed_local):
    """pack_tokens keeps views of a slot in its carry: that slot is held until the carry moves on."""
    from stoker.collate import pack_tokens

    ds = open_dataset(packed_local, cache_dir=None)
    kw = dict(decode=_tokens, collate=pack_tokens(64, eos_id=999), num_workers=2, seed=2)
    with Loader(ds, 7, **kw) as lo:
        host = [{k: v.clone() for k, v in r.items()} for r in lo]
    fake = FakeCuda(lag=1)
    with Loader(ds, 7, run=RunOptions(device=fake), **kw) as lo:
        dev = list(lo)
    assert len(dev) == len(host) > 1
    for h, d in zip(host, dev, strict=True):
        assert h.keys() == d.keys() and all(torch.equal(h[k], d[k]) for k in h)
    assert fake.live == {}


def test_the_cuda_runtime_calls_and_their_errors(monkeypatch):
    """CudaRuntime's calls into torch's CUDA runtime bindings, with those bindings faked."""
    import contextlib

    from stoker.loader.device import cuda_host

    calls: list = []

    class Cudart:
        def cudaHostRegister(self, ptr, size, flags):
            calls.append(("register", ptr, size, flags))
            return 2 if size > 1 << 20 else 0  # cudaErrorMemoryAllocation

        def cudaHostUnregister(self, ptr):
            calls.append(("unregister", ptr))
            return 0

        def cudaError(self, rc):
            return rc

        def cudaGetErrorString(self, err):
            return "out of memory"

    monkeypatch.setattr(torch.cuda, "cudart", Cudart)
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    rt = object.__new__(cuda_host.CudaRuntime)  # (its __init__ needs a GPU: its stream)
    rt.device = torch.device("cuda:0")
    rt.register(4096, 8192)
    rt.unregister(4096)
    assert calls == [("register", 4096, 8192, cuda_host.REGISTER_PORTABLE), ("unregister", 4096)]
    with pytest.raises(RuntimeError, match=r"cudaHostRegister of 2097152 bytes failed with cudaError 2 \(out of"):
        rt.register(4096, 2 << 20)


class RefusingCuda(FakeCuda):
    def register(self, ptr: int, nbytes: int) -> None:
        raise RuntimeError("cudaHostRegister of 1 bytes failed with cudaError 2 (out of memory)")


def test_a_refused_registration_is_logged_and_copied_unpinned(packed_local, caplog):
    ds = open_dataset(packed_local, cache_dir=None)
    with Loader(ds, 8, num_workers=0, shuffle=False) as lo:
        host = [(x.clone(), y.clone()) for x, y in lo]
    fake = RefusingCuda(lag=1)
    with caplog.at_level("WARNING", logger="stoker.loader.device.transfer"):
        with Loader(ds, 8, num_workers=0, shuffle=False, run=RunOptions(device=fake)) as lo:
            dev = list(lo)
            stats = lo.pipeline.transfer.stats
    assert stats.register_failures > 0 and stats.registered == stats.unregistered == 0
    assert fake.unpinned_copies == 2 * len(host) and "without pinning" in caplog.text
    assert caplog.text.count("could not register") == 1  # logged once
    for (x, y), (gx, gy) in zip(host, dev, strict=True):
        assert torch.equal(gx, x) and torch.equal(gy, y)
