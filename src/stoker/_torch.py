"""PyTorch adapters and torch-device helpers, imported by the loader and by decode/gpu.py.

torch is imported inside each function, so importing this module costs nothing until a
function runs. :mod:`stoker.loader.device.transfer` and :mod:`stoker.decode.gpu` import torch themselves.
"""

from __future__ import annotations

import importlib
import sys
import threading
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch


def as_tensors(images: np.ndarray, labels: np.ndarray):
    """Wrap a batch as torch tensors without copying the images.

    ``images`` uint8 (N, 3, S, S) -> torch.uint8 tensor sharing its memory;
    ``labels`` int64 (N,) -> torch.int64 tensor.
    """
    import torch

    return torch.from_numpy(images), torch.from_numpy(labels)


def load() -> None:
    """Import torch now (about a second, once per process), not inside the first batch.

    The first import runs on a thread of its own: torch.fx keeps the frame of each module that
    calls ``torch.fx.wrap`` while torch imports, and Python 3.11 links a kept frame to every frame
    that called it, so an import made under a Loader's ``iter()`` would keep that Loader (and its
    processes) alive for ever. A thread's stack holds nothing of the caller's.

    Raises:
        ImportError: torch cannot be imported (raised here, from the thread's error).
    """
    if "torch" in sys.modules:
        return
    failed: list[BaseException] = []

    def run() -> None:
        try:
            importlib.import_module("torch")
        except BaseException as exc:  # noqa: BLE001 - raised again in the caller
            failed.append(exc)

    thread = threading.Thread(target=run, name="stoker-import-torch", daemon=True)
    thread.start()
    thread.join()
    if failed:
        raise failed[0]


def check_device(device) -> torch.device:
    """Validate a Loader ``device``: returns the ``torch.device``.

    Raises:
        ValueError: not ``cpu`` or ``cuda[:N]``.
        RuntimeError: ``cuda`` asked for but ``torch.cuda.is_available()`` is False (a CPU-only
            torch build or no visible GPU), or the index is out of range.
    """
    load()  # (on a thread: see load)
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {device!r}") from exc
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {device!r}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(
                f"device={device!r} but CUDA is not available to this torch "
                f"({torch.__version__}, CUDA build: {torch.version.cuda}); "
                "use device=None or 'cpu', or install a CUDA build of torch"
            )
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise RuntimeError(f"device={device!r} but only {torch.cuda.device_count()} CUDA device(s) are visible")
    return dev
