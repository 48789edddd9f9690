"""Every rank's value, on every rank: the exchange :func:`stoker.cluster.train.rankdata.rank_context`
uses to learn each rank's node and rank 0's placement of the dataset.

With an initialised ``torch.distributed`` process group of the job's size (a Ray Train
``TorchTrainer`` worker, torchrun) it is ``torch.distributed.all_gather_object``. Without one
(any Ray task, a Ray Train worker of another framework) it goes through a small named Ray actor,
``stoker-gather-<job>`` in the namespace ``stoker``: each rank posts its value for the round, then
asks until every rank's is there. The actor is owned by the rank that made it (it dies with that
process, and when that rank drops its handle: a handle found by name does not keep it), so after
the last round every rank waits until all have read it, then ends it; a rank that gives up
waiting ends it too, so a finished or failed exchange leaves nothing behind. Values cross as
Ray or torch pickles: only plain data (node ids, lists, dicts).
"""

from __future__ import annotations

import contextlib
import sys
import time
from typing import Any

from ...errors import RankSetupError

#: Pause between two asks of the board while ranks are missing, seconds.
POLL_S = 0.05
#: Shortest wait for one answer of the board (a Ray actor that may still be starting), seconds.
CALL_S = 30.0


class _Board:
    """The Ray actor of one job's exchange: ``{round: {rank: value}}`` and who read which round."""

    def __init__(self, world_size: int):
        self.world_size = int(world_size)
        self.rounds: dict[int, dict[int, Any]] = {}
        self.readers: dict[int, set[int]] = {}

    def post(self, rnd: int, rank: int, value: Any, world_size: int) -> None:
        if int(world_size) != self.world_size:
            raise ValueError(
                f"rank {rank} gathers over {world_size} ranks, the board was made for {self.world_size}: "
                "two jobs of one name at once? give each its own ClusterOptions(job=...)"
            )
        self.rounds.setdefault(int(rnd), {})[int(rank)] = value

    def take(self, rnd: int, rank: int) -> tuple[list | None, bool]:
        """``(values by rank, whether every rank has now read this round)``; None while one is missing."""
        got = self.rounds.get(int(rnd), {})
        if len(got) < self.world_size:
            return None, False
        readers = self.readers.setdefault(int(rnd), set())
        readers.add(int(rank))
        return [got[r] for r in range(self.world_size)], len(readers) == self.world_size

    def all_read(self, rnd: int) -> bool:
        """Whether every rank has read round ``rnd``."""
        return len(self.readers.get(int(rnd), ())) == self.world_size

    def missing(self, rnd: int) -> list[int]:
        """The ranks that have not posted round ``rnd``."""
        got = self.rounds.get(int(rnd), {})
        return [r for r in range(self.world_size) if r not in got]


def process_group_size() -> int | None:
    """The world size of the initialised ``torch.distributed`` group, or None (no group, or torch
    not imported: a group cannot exist without it)."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return int(dist.get_world_size())
    return None


class Exchange:
    """All-gathers of one job's ranks (module doc). ``rank``/``world_size``: this rank's place;
    ``job``: the name every rank of the job gives (unique among the jobs running at once; only
    the Ray-actor path uses it); ``timeout_s``: longest wait for the other ranks, seconds."""

    def __init__(self, rank: int, world_size: int, job: str, timeout_s: float = 120.0):
        self.rank, self.world_size, self.job = int(rank), int(world_size), str(job)
        self.timeout_s = float(timeout_s)
        self.via = "torch" if process_group_size() == self.world_size else "ray"
        self._round = 0
        self._board: Any = None

    def all_gather(self, value: Any, last: bool = False) -> list:
        """Every rank's ``value``, in rank order (the same list on every rank). ``last``: no later
        round follows (the Ray actor is ended once every rank has read it). Every rank must call it
        the same number of times. Raises :class:`stoker.errors.RankSetupError` when the other ranks
        do not all post within ``timeout_s`` after this one did (naming the job and the ranks
        missing), or the Ray actor does not answer one call within ``max(timeout_s, CALL_S)``."""
        self._round += 1
        if self.world_size == 1:
            return [value]
        if self.via == "torch":
            import torch.distributed as dist

            out: list = [None] * self.world_size
            dist.all_gather_object(out, value)
            return out
        return self._ray_gather(value, last)

    def _ray_gather(self, value: Any, last: bool) -> list:
        import ray

        from ..service.cache_service import NAMESPACE

        if self._board is None:
            board_cls = ray.remote(num_cpus=0)(_Board)
            self._board = board_cls.options(
                name=f"stoker-gather-{self.job}", namespace=NAMESPACE, get_if_exists=True
            ).remote(self.world_size)
        call_s = max(self.timeout_s, CALL_S)  # one call to the board (its start included)
        try:
            ray.get(self._board.post.remote(self._round, self.rank, value, self.world_size), timeout=call_s)
        except ray.exceptions.GetTimeoutError as exc:
            raise RankSetupError(
                f"job {self.job!r}: the gather actor stoker-gather-{self.job} did not answer rank {self.rank} "
                f"within {call_s} s"
            ) from exc
        deadline = time.monotonic() + self.timeout_s
        while True:
            values, done = ray.get(self._board.take.remote(self._round, self.rank), timeout=call_s)
            if values is not None:
                if last:
                    self._finish(done, call_s)
                return values
            if time.monotonic() >= deadline:
                missing = ray.get(self._board.missing.remote(self._round), timeout=call_s)
                ray.kill(self._board)  # the job cannot go on without them: its exchange ends here
                raise RankSetupError(
                    f"job {self.job!r}: ranks {missing} of {self.world_size} did not report within "
                    f"{self.timeout_s} s (round {self._round}); did every rank start, with the same "
                    "ClusterOptions(job=...) and world size?"
                )
            time.sleep(POLL_S)

    def _finish(self, done: bool, call_s: float) -> None:
        """After the last round: wait until every rank has read it, then end the board. The rank
        that made the board owns it, and Ray ends it when that rank drops its handle (a handle
        found by name does not keep it), so no rank may leave before every rank has read; a board
        already gone means the others are done."""
        import ray

        deadline = time.monotonic() + self.timeout_s
        with contextlib.suppress(ray.exceptions.RayActorError):  # ended by another rank: every rank had read
            while not done:
                if time.monotonic() >= deadline:
                    return  # a rank that never reads: its owner's exit ends the board
                time.sleep(POLL_S)
                done = ray.get(self._board.all_read.remote(self._round), timeout=call_s)
            ray.kill(self._board)
