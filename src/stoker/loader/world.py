"""This process's rank and world size, from the arguments or else from the environment.

A Loader left without ``rank=``/``world_size=`` takes them from an initialised
``torch.distributed`` process group, else from the ``RANK``/``WORLD_SIZE`` variables torchrun,
Lightning and accelerate set, else rank 0 of 1. A loader of one rank inside a group of several
warns once per process: every rank would read the whole dataset.
"""

from __future__ import annotations

import os
import sys
import warnings

__all__ = ["from_environment", "resolve"]

_warned = False  #: the world-size warning was given in this process


def from_environment() -> tuple[int, int] | None:
    """``(rank, world_size)`` of the initialised ``torch.distributed`` group (only looked at when
    torch.distributed is imported already: a group cannot exist otherwise), else of ``RANK`` and
    ``WORLD_SIZE`` when both are set, else None. ValueError naming the variable when one is not
    an integer."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return int(dist.get_rank()), int(dist.get_world_size())
    values = {}
    for name in ("RANK", "WORLD_SIZE"):
        text = os.environ.get(name)
        if text is None:
            return None
        try:
            values[name] = int(text)
        except ValueError:
            raise ValueError(f"${name}={text!r} is not an integer (the Loader takes its rank from it)") from None
    return values["RANK"], values["WORLD_SIZE"]


def resolve(rank: int | None, world_size: int | None, stacklevel: int = 2) -> tuple[int, int]:
    """``(rank, world_size)``: each argument given wins; one left None comes from
    :func:`from_environment` (the rank only when the world size is the environment's), else 0 and
    1. Warns (UserWarning, once per process) when the result is one rank in an environment of
    several. Raises ValueError as :func:`from_environment`, and for a world size above 1 given
    without a rank in a job of another size (every rank would take rank 0)."""
    global _warned
    env = from_environment()
    if world_size is None:
        world_size = env[1] if env is not None else 1
    if rank is None:
        if env is not None and env[1] == world_size:
            rank = env[0]
        elif env is None or world_size == 1:
            rank = 0
        else:  # every rank of the job would take rank 0
            raise ValueError(f"world_size={world_size} without rank= in a job of {env[1]} ranks: pass rank= too")
    if env is not None and env[1] > 1 and world_size == 1 and not _warned:
        _warned = True
        warnings.warn(
            f"Loader with world_size=1 in a job of {env[1]} ranks (torch.distributed / $WORLD_SIZE): every "
            "rank reads the whole dataset; leave out rank=/world_size= to take the job's",
            UserWarning,
            stacklevel=stacklevel,
        )
    return int(rank), int(world_size)
