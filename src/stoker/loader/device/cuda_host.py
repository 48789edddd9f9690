"""The CUDA calls of the pinned-slot path (:mod:`stoker.loader.device.transfer`), in one small object.

:class:`CudaRuntime` is everything :class:`~stoker.loader.device.transfer.DeviceTransfer` asks of a
GPU: page-lock a host range and undo it (``cudaHostRegister`` / ``cudaHostUnregister`` through
torch's CUDA runtime bindings, ``torch.cuda.cudart()``), copy a host tensor on a side stream with
``non_blocking=True``, record an event after the copies, make the consumer's stream wait on that
event, and wait for the side stream. A stand-in with the same surface (``device``, ``register``,
``unregister``, ``copy``, ``event``, ``handoff``, ``synchronize``) runs the same path without a GPU:
the tests inject one as ``RunOptions(device=...)``.

This module imports torch; it is imported only where ``device`` is a CUDA device.
"""

from __future__ import annotations

import torch

from ..._torch import check_device

__all__ = ["CudaRuntime", "SURFACE", "REGISTER_PORTABLE"]

#: What a device object must have to stand in for :class:`CudaRuntime` (``RunOptions(device=...)``).
SURFACE = ("device", "register", "unregister", "copy", "event", "handoff", "synchronize")

#: ``cudaHostRegisterPortable``: the range counts as pinned in every CUDA context of the process,
#: not only the current device's (CUDA runtime API, ``cudaHostRegister`` flags).
REGISTER_PORTABLE = 1


class CudaRuntime:
    """Host-memory registration, a side stream, events: the CUDA runtime surface of the pinned slots.

    Args:
        device: ``"cuda"`` or ``"cuda:N"``.

    Raises:
        ValueError / RuntimeError: see :func:`stoker._torch.check_device` (no CUDA, bad index).
    """

    def __init__(self, device: str = "cuda"):
        self.device = check_device(device)
        if self.device.type != "cuda":
            raise ValueError(f"CudaRuntime needs a CUDA device, got {device!r}")
        self.stream = torch.cuda.Stream(device=self.device)

    def register(self, ptr: int, nbytes: int) -> None:
        """Page-lock ``nbytes`` bytes of host memory at address ``ptr`` (a mapping of a slot), so
        copies from it run as DMA without a staging copy (``cudaHostRegister``, portable).

        Raises:
            RuntimeError: the runtime refused (names the CUDA error code and its text).
        """
        with torch.cuda.device(self.device):
            rc = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, REGISTER_PORTABLE)
        _check(int(rc), "cudaHostRegister", nbytes)

    def unregister(self, ptr: int) -> None:
        """Undo :meth:`register` for the range at ``ptr`` (``cudaHostUnregister``); before the
        mapping is unmapped.

        Raises:
            RuntimeError: the runtime refused.
        """
        with torch.cuda.device(self.device):
            rc = torch.cuda.cudart().cudaHostUnregister(ptr)
        _check(int(rc), "cudaHostUnregister", None)

    def copy(self, host: torch.Tensor) -> torch.Tensor:
        """A new tensor on the device with ``host``'s contents, copied with ``non_blocking=True``
        on the side stream (asynchronous when ``host`` is in registered memory): read its result
        only after :meth:`handoff` of an event recorded after it."""
        with torch.cuda.stream(self.stream):
            return host.to(self.device, non_blocking=True)

    def event(self) -> torch.cuda.Event:
        """An event recorded on the side stream now, after the copies issued so far: ``query()``
        is True (and ``synchronize()`` returns) once they have completed."""
        ev = torch.cuda.Event()
        ev.record(self.stream)
        return ev

    def handoff(self, event: torch.cuda.Event, tensors: list) -> None:
        """Make the consumer's current stream wait on ``event`` (on the GPU: the CPU does not
        block) and mark ``tensors`` (the copies' results, allocated on the side stream) as used
        by it, so the caching allocator does not hand their memory out early."""
        consumer = torch.cuda.current_stream(self.device)
        consumer.wait_event(event)
        for t in tensors:
            t.record_stream(consumer)

    def synchronize(self) -> None:
        """Wait until every copy issued on the side stream has completed."""
        self.stream.synchronize()


def _check(rc: int, call: str, nbytes: int | None) -> None:
    """Raise RuntimeError for a CUDA runtime return code ``rc`` other than 0 (``cudaSuccess``),
    naming ``call``, the bytes concerned and the runtime's text for the code (the codes are
    compared as ints, as torch's own ``torch.cuda._pin_memory_utils`` does).

    Raises:
        RuntimeError: ``rc`` is not 0.
    """
    if rc == 0:
        return
    try:
        cudart = torch.cuda.cudart()
        text = cudart.cudaGetErrorString(cudart.cudaError(rc))
    except Exception:  # noqa: BLE001 - the code alone still says what failed
        text = "unknown error"
    size = f" of {nbytes} bytes" if nbytes is not None else ""
    raise RuntimeError(
        f"{call}{size} failed with cudaError {rc} ({text}); it may be an asynchronous error of an "
        "earlier CUDA call (CUDA_LAUNCH_BLOCKING=1 shows where)"
    )
