"""Moving batches to the accelerator straight from pinned shared-memory slots.

``Loader(..., run=RunOptions(device="cuda"))`` passes each finished batch through
:class:`DeviceTransfer`, which copies it from its shared-memory slot (:mod:`stoker.loader.shm`)
with no host copy at all:

1. **pinned once**: the first time a slot is copied from, this process's mapping of it is
   page-locked (``cudaHostRegister`` through torch's CUDA runtime bindings,
   :class:`~stoker.loader.device.cuda_host.CudaRuntime`); it stays registered for the life of
   the mapping. A slot a worker grew (a user collate's or a raw batch's slot, mapped again by
   :meth:`~stoker.loader.shm.SlotRing.buffer`) is unregistered and its new mapping registered.
   No ``pin_memory()`` copy per batch;
2. **copied asynchronously**: each tensor of the batch is copied to the device with
   ``non_blocking=True`` on a side CUDA stream (DMA straight out of the slot), and a CUDA event
   is recorded after the copies;
3. **handed over on the event**: the consumer's current stream waits on that event (on the GPU:
   the CPU does not block) and the device tensors are marked as used by it (``record_stream``).
   The slot goes back to the workers only once the event says the copy has completed
   (:meth:`~stoker.loader.shm.SlotRing.release_after`): the ring polls it when it needs a slot,
   and waits for the oldest copy rather than make another slot when none is free.

The copy runs while the GPU still executes the work the training loop queued for the previous
batch (SPDL's pinned shared-memory pool; NVIDIA apex's ``data_prefetcher``). Every registration
is undone before its mapping can go: this object holds each registered mapping, and
:meth:`DeviceTransfer.close` (the Loader's ``close()``, the end of a ``with`` block, a Ctrl-C
that leaves it), or its finalizer (a dropped Loader, the interpreter's exit), waits for the side
stream and unregisters every slot before letting go of the mappings.

Without a GPU the same code runs with a stand-in for :class:`CudaRuntime` (an object with
:data:`~stoker.loader.device.cuda_host.SURFACE`, given as ``RunOptions(device=...)``): the tests
run it that way; ``scripts/gpu_check.py`` is the check on a GPU.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..._torch import check_device  # noqa: F401 - re-exported

log = logging.getLogger(__name__)

__all__ = ["DeviceTransfer", "TransferStats", "check_device"]


@dataclass
class TransferStats:
    """Counters of a :class:`DeviceTransfer`.

    Attributes:
        batches: batches copied to the device.
        bytes: bytes copied host-to-device.
        registered: slot mappings registered as pinned memory (a grown slot counts again).
        unregistered: registrations undone.
        register_failures: mappings the CUDA runtime refused to register (copied unpinned: a
            synchronous copy, logged once).
    """

    batches: int = 0
    bytes: int = 0
    registered: int = 0
    unregistered: int = 0
    register_failures: int = 0


def _address(mm: mmap.mmap) -> int:
    """The address of the first byte of ``mm`` (the buffer export is dropped at once)."""
    view = ctypes.c_char.from_buffer(mm)
    try:
        return ctypes.addressof(view)
    finally:
        del view


def _runtime(device: Any):
    """The runtime of ``device``: a :class:`~stoker.loader.device.cuda_host.CudaRuntime` for a
    CUDA device name, else ``device`` itself (a stand-in with the same surface)."""
    if isinstance(device, str) or type(device).__name__ == "device":
        from .cuda_host import CudaRuntime

        return CudaRuntime(str(device))
    return device


class DeviceTransfer:
    """Copy batches from the slots of ``ring`` to the device (see the module docstring).

    Args:
        ring: the run's :class:`~stoker.loader.shm.SlotRing`.
        device: ``"cuda"`` / ``"cuda:N"``, or a stand-in runtime with
            :data:`~stoker.loader.device.cuda_host.SURFACE`.

    Raises:
        ValueError / RuntimeError: see :func:`check_device`.
    """

    def __init__(self, ring, device: Any = "cuda"):
        self.ring = ring
        self.runtime = _runtime(device)
        self.device = self.runtime.device
        self.stats = TransferStats()
        #: slot -> (mapping, address, bytes registered); address None: registration refused
        self._pins: dict[int, tuple[mmap.mmap, int | None, int]] = {}
        self._finalizer = weakref.finalize(self, _unpin_all, self._pins, self.runtime, self.stats)

    def pin(self, slot: int) -> None:
        """Register slot ``slot``'s current mapping, once; a slot mapped again (grown) has its old
        registration undone first (no copy reads the old mapping: the slot was with a worker)."""
        mm = self.ring.mapping(slot)
        old = self._pins.get(slot)
        if old is not None and old[0] is mm:
            return
        if old is not None:
            del self._pins[slot]
            _unpin(old, self.runtime, self.stats)
        nbytes = -(-len(mm) // mmap.PAGESIZE) * mmap.PAGESIZE  # whole pages: a mapping is made of them
        ptr: int | None = _address(mm)
        try:
            self.runtime.register(ptr, nbytes)
            self.stats.registered += 1
        except RuntimeError as exc:  # (torch.cuda.CudaError is one)
            if not self.stats.register_failures:
                log.warning(
                    "could not register batch slot %d (%d bytes) as pinned memory: %s; its batches are "
                    "copied to %s without pinning (slower)",
                    slot,
                    nbytes,
                    exc,
                    self.device,
                )
            self.stats.register_failures += 1
            ptr = None
        self._pins[slot] = (mm, ptr, nbytes)

    def images(self, slot: int, n: int) -> tuple[Any, Any]:
        """The first ``n`` images (uint8 ``(n, 3, S, S)``) and labels (int64 ``(n,)``) of slot
        ``slot`` as tensors on the device; the slot goes back to the workers once their copy
        has completed."""
        import torch

        self.pin(slot)
        images, labels = self.ring.views(slot)
        host = [torch.from_numpy(images[:n]), torch.from_numpy(labels[:n])]
        dev = self._send(host, slot)
        return dev[0], dev[1]

    def batch(self, batch: Any, slot: int | None) -> Any:
        """``batch`` (a user collate's or a raw batch, its arrays views over slot ``slot``, or
        ``slot`` None: host memory of this process) with every numpy array and CPU tensor copied
        to the device, same structure (dicts, lists, tuples, namedtuples such as
        :class:`stoker.collate.RawBatch`); other leaves as they are. The slot goes back to the
        workers once the copies have completed."""
        if slot is not None:
            self.pin(slot)
        host: list = []
        tree = _gather(batch, host)
        dev = self._send(host, slot)
        return _fill(tree, dev)

    def _send(self, host: list, slot: int | None) -> list:
        """Copy ``host`` tensors on the side stream, hand them to the consumer on one event, and
        give ``slot`` back to the ring once that event has completed."""
        rt = self.runtime
        self.ring.reap()  # the slots of copies completed since the last batch go back now
        dev = [rt.copy(t) for t in host]
        event = rt.event()
        rt.handoff(event, dev)
        self.ring.release_after(slot, event, host)
        self.stats.batches += 1
        self.stats.bytes += sum(t.nbytes for t in host)
        return dev

    def close(self) -> None:
        """Wait for every copy in flight, give their slots back, and unregister every slot
        (before any mapping can be unmapped). Idempotent."""
        try:
            self.ring.drain()
        except RuntimeError as exc:  # a CUDA error: the slots are unregistered all the same
            log.warning("waiting for the copies to %s at close: %s", self.device, exc)
        finally:
            self._finalizer()


def _unpin(pin: tuple, runtime, stats: TransferStats) -> None:
    """Undo one registration (nothing for a refused one); an error is logged, not raised (the
    process is letting go of the memory either way)."""
    _, ptr, nbytes = pin
    if ptr is None:
        return
    try:
        runtime.unregister(ptr)
        stats.unregistered += 1
    except RuntimeError as exc:
        log.warning("could not unregister a pinned batch slot (%d bytes): %s", nbytes, exc)


def _unpin_all(pins: dict, runtime, stats: TransferStats) -> None:
    """Wait for the side stream, then undo every registration (a transfer's close or finalizer)."""
    if not pins:
        return
    try:
        runtime.synchronize()
    except RuntimeError as exc:
        log.warning("waiting for the copies to the device at close: %s", exc)
    while pins:
        _unpin(pins.popitem()[1], runtime, stats)


def _gather(x: Any, host: list) -> Any:
    """The tree of ``x`` with each array/CPU tensor replaced by its index in ``host`` (appended
    there as a CPU tensor)."""
    import torch

    if isinstance(x, np.ndarray) and not x.dtype.hasobject:
        host.append(torch.from_numpy(x))
        return _Leaf(len(host) - 1)
    if isinstance(x, torch.Tensor) and x.device.type == "cpu":
        host.append(x)
        return _Leaf(len(host) - 1)
    if isinstance(x, dict):
        return {k: _gather(v, host) for k, v in x.items()}
    if isinstance(x, tuple) and hasattr(type(x), "_fields"):  # a namedtuple
        named: Any = type(x)
        return named._make(_gather(v, host) for v in x)
    if type(x) in (tuple, list):
        return type(x)(_gather(v, host) for v in x)
    return x


def _fill(tree: Any, dev: list) -> Any:
    """:func:`_gather`'s tree with each index replaced by its device tensor."""
    if isinstance(tree, _Leaf):
        return dev[tree.i]
    if isinstance(tree, dict):
        return {k: _fill(v, dev) for k, v in tree.items()}
    if isinstance(tree, tuple) and hasattr(type(tree), "_fields"):
        named: Any = type(tree)
        return named._make(_fill(v, dev) for v in tree)
    if type(tree) in (tuple, list):
        return type(tree)(_fill(v, dev) for v in tree)
    return tree


class _Leaf:
    """A placeholder for the ``i``-th host tensor in a gathered tree."""

    __slots__ = ("i",)

    def __init__(self, i: int):
        self.i = i
