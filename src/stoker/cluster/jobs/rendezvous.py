"""A ``torch.distributed`` process group over a cluster job's ranks, set up from Ray.

torchrun gives each process ``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE`` and
``LOCAL_RANK``; a rank of :func:`stoker.cluster.run` gets the same from :class:`ProcessGroup`:

- the address is rank 0's node address as Ray knows it (``ray.util.get_node_ip_address``);
- the port is one rank 0 binds on that address itself (port 0: the kernel picks a free one) and
  keeps bound: the listening socket is handed to torch's ``TCPStore`` (``master_listen_fd``, a
  duplicate that the store owns), so no other process can take the port between the pick and
  its use, and no port is fixed;
- rank 0 publishes ``(address, port)`` through a small named Ray actor (:class:`Mailbox`, no CPU,
  owned by rank 0's process, so it goes when that process goes); the other ranks look it up by
  the job's name and wait for it for at most ``timeout_s`` seconds;
- ``LOCAL_RANK`` is the rank's index among the job's ranks on the same Ray node and
  ``LOCAL_WORLD_SIZE`` their number (with Ray, a rank's GPUs are the ones Ray gives its task,
  visible from index 0: ``LOCAL_RANK`` is not a device index there).

:meth:`ProcessGroup.close` destroys the group, ends the mailbox, closes the socket and gives the
environment variables back their earlier values (a Ray worker process runs later tasks too).
Torch is imported here on first use only.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import time
from typing import Any

import ray
from ray.util import get_node_ip_address

from ...errors import ProcessGroupError
from ..settings import BACKENDS

#: Backends :func:`stoker.cluster.run` and :meth:`stoker.cluster.WorkerContext.init_process_group` take.

#: The environment variables a rank's process group sets (the names torchrun uses).
ENV_NAMES = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")

#: Seconds between two look-ups of rank 0's mailbox.
POLL_S = 0.1


def check_backend(backend: str, request: dict | None = None) -> None:
    """Refuse a backend before any rank starts: ValueError when ``backend`` is not one of
    :data:`BACKENDS`; :class:`stoker.errors.ProcessGroupError` for ``"nccl"`` when the rank's
    resources (``request``, Ray's names; None: not known here) hold no GPU."""
    if backend not in BACKENDS:
        raise ValueError(f"process_group must be one of {BACKENDS} or None, got {backend!r}")
    if backend == "nccl" and request is not None and not request.get("GPU", 0) > 0:
        raise ProcessGroupError(
            f"process_group='nccl' needs a GPU per rank, but resources_per_worker={dict(request)} "
            f"asks for none; use 'gloo' for ranks on CPUs"
        )


def local_ranks(rank_nodes: list[str], rank: int) -> tuple[int, int]:
    """``(local rank, local world size)`` of ``rank``: its index among the ranks whose node
    (``rank_nodes``: node id per rank) is its own, and how many those are."""
    node = rank_nodes[rank]
    return sum(1 for n in rank_nodes[:rank] if n == node), sum(1 for n in rank_nodes if n == node)


class Mailbox:
    """Holds rank 0's ``(address, port)`` for the other ranks (a Ray actor: see
    :func:`_mailbox_actor`)."""

    def __init__(self, address: str, port: int):
        self.address, self.port = address, int(port)

    def value(self) -> tuple[str, int]:
        """``(address, port)`` of rank 0's store."""
        return self.address, self.port


def _mailbox_actor():
    return ray.remote(num_cpus=0, max_restarts=0)(Mailbox)


class ProcessGroup:
    """The default ``torch.distributed`` process group of one rank of a job.

    ``rank``/``world_size``; ``rank_nodes``: Ray node id per rank (for ``LOCAL_RANK``); ``name``:
    unique to the job (the mailbox's name); ``backend``: ``"gloo"`` or ``"nccl"``;
    ``timeout_s``: seconds the other ranks wait for rank 0's address and, passed to
    ``init_process_group``, the limit of the store's connection and of each collective.
    :meth:`open` sets it up (a context manager too: ``with`` opens it if needed and closes it);
    ``env`` holds the variables it set. Raises :class:`stoker.errors.ProcessGroupError` for
    ``nccl`` without CUDA and when rank 0's address does not come within ``timeout_s``.
    """

    def __init__(
        self, rank: int, world_size: int, rank_nodes: list[str], name: str, backend: str, timeout_s: float = 1800.0
    ):
        check_backend(backend)
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.rank, self.world_size, self.backend = int(rank), int(world_size), backend
        self.name, self.timeout_s = name, float(timeout_s)
        self.local_rank, self.local_world_size = local_ranks(rank_nodes, rank)
        self.env: dict[str, str] = {}
        self._saved: dict[str, str | None] = {}
        self._sock: socket.socket | None = None
        self._mailbox = None
        self._opened = False

    def open(self) -> ProcessGroup:
        """Publish or find rank 0's address, set the environment and call
        ``torch.distributed.init_process_group`` (blocks until every rank joined, as torch does);
        returns self. On failure, whatever was set up is undone before the error propagates."""
        if self._opened:
            return self
        import torch.distributed as dist

        if self.backend == "nccl":
            import torch

            if not torch.cuda.is_available():
                raise ProcessGroupError(f"rank {self.rank}: the 'nccl' backend needs a GPU, and CUDA sees none here")
        if dist.is_initialized():
            raise ProcessGroupError(
                f"rank {self.rank}: a default torch.distributed process group is already open in this process; "
                f"not opening the {self.backend!r} group"
            )
        self._opened = True
        try:
            address, port = self._publish() if self.rank == 0 else self._find()
            self._set_env(address, port)
            timeout = datetime.timedelta(seconds=self.timeout_s)
            # the store takes a duplicate of the listening socket (and closes it when it ends)
            fd = None if self._sock is None else os.dup(self._sock.fileno())
            store = dist.TCPStore(
                address,
                port,
                self.world_size,
                is_master=self.rank == 0,
                timeout=timeout,
                wait_for_workers=False,
                master_listen_fd=fd,
            )
            if self._sock is not None:  # the store listens on its duplicate now
                self._sock.close()
                self._sock = None
            dist.init_process_group(
                self.backend, store=store, rank=self.rank, world_size=self.world_size, timeout=timeout
            )
        except BaseException:
            self.close()
            raise
        return self

    def _publish(self) -> tuple[str, int]:
        address = get_node_ip_address()
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.bind((address, 0))
            sock.listen(max(128, self.world_size))
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        port = sock.getsockname()[1]
        self._mailbox = _mailbox_actor().options(name=self.name).remote(address, port)
        return address, port

    def _find(self) -> tuple[str, int]:
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                box = ray.get_actor(self.name)
                got: Any = ray.get(box.value.remote(), timeout=max(0.1, deadline - time.monotonic()))
                return str(got[0]), int(got[1])
            except (ValueError, ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError):
                pass  # not created yet, or (rank 0 gone) no longer there: the deadline decides
            if time.monotonic() >= deadline:
                raise ProcessGroupError(
                    f"rank {self.rank}: rank 0 did not publish its address for the {self.backend!r} "
                    f"process group within {self.timeout_s} s (timeout_s)"
                )
            time.sleep(POLL_S)

    def _set_env(self, address: str, port: int) -> None:
        self.env = {
            "MASTER_ADDR": address,
            "MASTER_PORT": str(port),
            "RANK": str(self.rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(self.local_rank),
            "LOCAL_WORLD_SIZE": str(self.local_world_size),
        }
        self._saved = {k: os.environ.get(k) for k in ENV_NAMES}
        os.environ.update(self.env)

    def close(self) -> None:
        """Destroy the group (if this object opened it), end rank 0's mailbox, close the socket
        and restore the environment variables; safe to call more than once."""
        if not self._opened:
            return
        self._opened = False
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        finally:
            if self._mailbox is not None:
                with contextlib.suppress(Exception):  # Ray shut down: the actor went with it
                    ray.kill(self._mailbox)
                self._mailbox = None
            if self._sock is not None:
                self._sock.close()
                self._sock = None
            for k, v in self._saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            self._saved = {}

    def __enter__(self) -> ProcessGroup:
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()
