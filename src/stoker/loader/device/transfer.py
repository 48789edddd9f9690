"""Moving batches to the accelerator: pinned staging, non-blocking copies on a side stream.

``Loader(..., run=RunOptions(device="cuda"))`` passes each batch (tensors over a shared-memory slot) through
:class:`DeviceTransfer`:

1. the batch is copied (one CPU memcpy) into the next of ``depth`` *pinned* (page-locked)
   staging buffers; the shared-memory slot is free again as soon as the caller drops the CPU
   tensor, and a staging buffer is reused only after the copy that last read it has finished
   (its CUDA event);
2. a host-to-device copy with ``non_blocking=True`` is issued on a side CUDA stream, and an
   event is recorded after it;
3. the consumer's current stream waits on that event (``wait_event``: a GPU-side wait, the
   CPU does not block), and the device tensors are marked as used by the consumer's stream
   (``record_stream``) so the caching allocator does not hand their memory out early.

The copy therefore runs while the GPU is still executing the work the training loop queued for
the previous batch (CUDA calls are asynchronous), and only the consumer's later kernels wait for
it: the pattern of NVIDIA's apex ``data_prefetcher`` and torch's ``pin_memory`` +
``non_blocking``. ``device="cpu"`` runs the same staging logic with a CPU target (pinned
buffers only where torch can pin, i.e. with CUDA), so the stage is testable without a GPU; the
Loader itself keeps its zero-copy path for ``None``/``"cpu"``.

This module imports torch; elsewhere only :mod:`stoker._torch` and :mod:`stoker.decode.gpu` do
(the CUDA branch is checked on a GPU machine by ``scripts/gpu_check.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..._torch import check_device, pinning_available  # noqa: F401 - re-exported

__all__ = ["DeviceTransfer", "check_device", "TransferStats"]


@dataclass
class TransferStats:
    """Counters: ``batches`` moved, ``bytes`` copied host-to-device, ``staging_waits``: times a
    staging buffer was still being read by an earlier copy when it was needed."""

    batches: int = 0
    bytes: int = 0
    staging_waits: int = 0


class _Staging:
    """One pinned (where possible) host buffer pair and the event of the copy that last read it."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, pin: bool):
        self.images = torch.empty(images.shape, dtype=images.dtype, pin_memory=pin)
        self.labels = torch.empty(labels.shape, dtype=labels.dtype, pin_memory=pin)
        self.event: torch.cuda.Event | None = None  # None until the first copy from this buffer


class DeviceTransfer:
    """Copy ``(images, labels)`` batches to ``device`` through pinned staging buffers.

    Args:
        device: ``"cuda"``, ``"cuda:N"`` or ``"cpu"`` (see :func:`check_device`).
        depth: number of staging buffers (copies that may be in flight at once; >= 1).

    Calling the object with ``images`` uint8 ``(N, 3, S, S)`` and ``labels`` int64 ``(N,)`` CPU
    tensors returns new tensors on ``device`` with equal contents; N may change between calls
    (the buffers grow to the largest batch). The returned tensors are never overwritten later.

    Raises:
        ValueError / RuntimeError: see :func:`check_device`.
    """

    def __init__(self, device="cuda", depth: int = 2):
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self.device = check_device(device)
        self.cuda = self.device.type == "cuda"
        self.pin = pinning_available()
        self.stream = torch.cuda.Stream(device=self.device) if self.cuda else None
        self.depth = int(depth)
        self._ring: list[_Staging | None] = [None] * self.depth
        self._next = 0
        self.stats = TransferStats()

    def _staging_for(self, images: torch.Tensor, labels: torch.Tensor) -> _Staging:
        i = self._next
        self._next = (i + 1) % self.depth
        st = self._ring[i]
        if st is not None and st.event is not None:
            if not st.event.query():
                self.stats.staging_waits += 1
            st.event.synchronize()  # the copy that last read this buffer is done
        if st is None or st.images.shape[0] < images.shape[0] or st.images.shape[1:] != images.shape[1:]:
            st = self._ring[i] = _Staging(images, labels, self.pin)
        return st

    def __call__(self, images: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = images.shape[0]
        st = self._staging_for(images, labels)
        host_i, host_l = st.images[:n], st.labels[:n]
        host_i.copy_(images)  # shared-memory slot -> pinned buffer (the slot may be reused after this)
        host_l.copy_(labels)
        self.stats.batches += 1
        self.stats.bytes += host_i.nbytes + host_l.nbytes
        if not self.cuda:
            return host_i.clone(), host_l.clone()
        consumer = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.stream):
            dev_i = torch.empty(host_i.shape, dtype=host_i.dtype, device=self.device)
            dev_l = torch.empty(host_l.shape, dtype=host_l.dtype, device=self.device)
            dev_i.copy_(host_i, non_blocking=True)
            dev_l.copy_(host_l, non_blocking=True)
            st.event = torch.cuda.Event()
            st.event.record(self.stream)
        consumer.wait_event(st.event)
        dev_i.record_stream(consumer)
        dev_l.record_stream(consumer)
        return dev_i, dev_l
