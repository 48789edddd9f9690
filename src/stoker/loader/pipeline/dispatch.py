"""Sending batches to the decode workers: one slot per batch, the first batch of an epoch split
over every worker (:mod:`.split`), and the first batches of the next epoch sent while this one
drains (``prefetch_next_epoch``), so the pipeline never runs dry at the epoch boundary.

Every epoch served (and every early next epoch) has a run id; the replies carry it, so replies to
an abandoned epoch are recognised and their slots freed.
"""

from __future__ import annotations

from ..prefetch.process import block_schedule
from .split import join_replies, split_ids

__all__ = ["Dispatcher"]


class Dispatcher:
    """Hands batches to a :class:`~stoker.loader.workers.pool.WorkerPool` (see the module docstring).

    Args:
        config: the :class:`~stoker.loader.options.RunConfig` (``num_workers``, ``prefetch_batches``;
            the batch size is its ``cfg.batch_size``).
        plan: ``plan(epoch) -> (sample ids, mean displacement)`` (the Loader's order).
        ring: the :class:`~stoker.loader.shm.SlotRing` of the batches.
        workers: the :class:`~stoker.loader.workers.pool.WorkerPool`.
        prefetcher: the :class:`~stoker.loader.prefetch.prefetcher.Prefetcher`, or None.
    """

    def __init__(self, config, plan, ring, workers, prefetcher):
        self.config, self.dataset, self.cfg, self.plan = config, config.dataset, config.cfg, plan
        self.ring, self.workers, self.prefetcher = ring, workers, prefetcher
        self.pre: dict | None = None  #: the next epoch's first batches, dispatched early (or None)
        self._parts: dict[tuple, tuple] = {}  # (run, seq) of a split batch -> (parts, replies so far)
        self._run_id = 0
        #: worker id -> the counters of its last reply (dead workers' kept), summed by ``Run.totals``
        self.worker_counters: dict[int, dict] = {}

    @property
    def run_id(self) -> int:
        """The last run id given (0: none yet)."""
        return self._run_id

    def new_run(self) -> int:
        """A new run id (one per epoch served)."""
        self._run_id += 1
        return self._run_id

    def reset(self) -> None:
        """Forget the early next epoch and the split batches (the pipeline stops)."""
        self.pre = None
        self._parts = {}

    def dispatch(
        self, run: int, epoch: int, seq: int, bids, inflight: dict, may_raise: bool = False, split: bool = False
    ) -> bool:
        """Send batch ``seq`` to the workers; False (nothing sent) when no slot is free and
        shared memory has no room for another. ``may_raise``: batch ``seq`` is the one the
        consumer waits for; then SharedMemoryError when no slot is with the workers either (every
        slot is held by batches the caller keeps): none would come back, waiting would only time out.
        ``split``: the first batch of an epoch, decoded by every worker at once (:mod:`.split`)."""
        slot = self.ring.try_acquire()
        if slot is None:
            if may_raise and not self.ring.busy:
                raise self.ring.shortage()
            return False
        self.ring.busy.add(slot)
        parts = [(0, bids)]
        if split and self.config.num_workers > 1 and not self.cfg.generic and self.cfg.decode_on == "cpu":
            parts = split_ids(bids, self.config.num_workers)
        if len(parts) > 1:
            self._parts[(run, seq)] = (len(parts), [], epoch, bids)
        for offset, ids in parts:  # (whole: a part's worker never pads it, loader/workers/padding.py)
            self.workers.send((run, seq, epoch, slot, self.ring.paths[slot], ids, offset, len(parts) == 1))
        inflight[seq] = (slot, bids)
        return True

    def keep_counters(self, msg: tuple, run: int) -> None:
        """Record the worker counters a reply carries (every reply, each part of a split batch
        too), where its run counts them: the pre-dispatched next epoch's own, else this run's (a
        reply to an abandoned epoch counts here as well)."""
        pre = self.pre
        if msg[2] != run and pre is not None and msg[2] == pre["run"]:
            pre["counters"][msg[1]] = msg[8]
        else:
            self.worker_counters[msg[1]] = msg[8]

    def whole(self, msg: tuple):
        """The reply of a whole batch: ``msg`` itself, or for a part of a split batch None until
        its last part came, then the joined reply (:func:`.split.join_replies`). A split batch
        whose every sample was skipped is sent again whole to one worker, which decodes
        substitutes in its place (:mod:`.padding`: chosen on the whole batch, never on a part):
        None then too, and its reply comes as a whole batch's."""
        key = (msg[2], msg[3])
        if key not in self._parts:
            return msg
        left, msgs, epoch, bids = self._parts[key]
        msgs.append(msg)
        if left > len(msgs):
            return None
        del self._parts[key]
        slot = msg[4]
        images, labels = self.ring.views(slot)
        joined = join_replies(msgs, images, labels)
        if joined[0] == "ok" and joined[5] == 0 and joined[6] and self.cfg.substitutes:
            self.workers.send((msg[2], msg[3], epoch, slot, self.ring.paths[slot], bids, 0, True))
            return None
        return joined

    def predispatch(self, epoch: int) -> None:
        """Start the first batches of the next epoch while this one drains (its plan is a pure
        function of the epoch), so the pipeline does not run dry at the epoch boundary. Kept
        in :attr:`pre` and adopted by the next ``iter()`` if it starts that epoch at batch 0;
        otherwise dropped (its replies are recognised by their run id)."""
        ids, displacement = self.plan(epoch)
        bs = self.cfg.batch_size
        batches = [ids[i : i + bs] for i in range(0, len(ids), bs)]
        pre = {
            "run": self.new_run(),
            "epoch": epoch,
            "ids": ids,
            "batches": batches,
            "inflight": {},
            "pending": {},
            "next": 0,
            "displacement": displacement,
            "counters": {},
        }
        while pre["next"] < min(len(batches), self.config.prefetch_batches):
            if not self.dispatch(
                pre["run"], epoch, pre["next"], batches[pre["next"]], pre["inflight"], split=pre["next"] == 0
            ):
                break
            pre["next"] += 1
        self.pre = pre
        pf = self.prefetcher
        if pf is not None:  # the prefetcher moves on to the next epoch's plan now
            pf.prev_done = pf.done
            pf.position = pre["next"] * bs
            pf.done = 0
            # draining: blocks this epoch still needs are charged to it, not to the next one
            pf.send((pre["run"], *block_schedule(self.dataset, ids), True))

    def prefetch_plan_done(self, run: int) -> bool:
        """Whether the prefetcher has fetched (or given up) every block of plan ``run``: only then
        do the next epoch's first batches start, so that their reads never fetch a block this
        epoch still needs and charge it to the next one (True without a working prefetcher)."""
        return self.prefetcher is None or self.prefetcher.plan_done(run)

    def take_pre(self, epoch: int, start: int):
        """The pre-dispatched next epoch, if it is the one starting now; else drop it."""
        pre, self.pre = self.pre, None
        if pre is not None and pre["epoch"] == epoch and start == 0:
            return pre
        return None
