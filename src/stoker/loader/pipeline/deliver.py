"""Turning a finished batch into what ``next()`` yields: tensors over its shared-memory slot (no
copy), or copied to the device straight from the pinned slot (:mod:`stoker.loader.device.transfer`), or decoded there
(:mod:`stoker.loader.device.device_decode`), or the user's collated batch (:mod:`stoker.loader.workers.batches`),
with the epoch's accounting of its samples (:func:`stoker.loader.epoch_stats.account`).
"""

from __future__ import annotations

from ..epoch_stats import account

__all__ = ["Delivery"]


class Delivery:
    """Delivers the batches of one started pipeline (see the module docstring).

    Args:
        ring: the :class:`~stoker.loader.shm.SlotRing` the batches are in.
        cfg: the :class:`~stoker.loader.options.WorkerConfig` (``generic``, ``collate``).
        state: the Loader's :class:`~stoker.loader.state.LoaderState` (a streaming collate's carry).
        transfer: the :class:`~stoker.loader.device.transfer.DeviceTransfer`, or None (CPU tensors).
        device_decoder: the :class:`~stoker.loader.device.device_decode.DeviceBatchDecoder`, or None.
    """

    def __init__(self, ring, cfg, state, transfer=None, device_decoder=None):
        self.ring, self.cfg, self.state = ring, cfg, state
        self.transfer, self.device_decoder = transfer, device_decoder

    def __call__(
        self,
        epoch,
        slot,
        bids,
        n,
        skipped,
        skipped_keys,
        payloads,
        generic=None,
        padded=(),
        *,
        stats,
        delivered,
        last=False,
    ):
        """Account for one finished batch and turn slot ``slot`` into what ``next()`` yields:
        tensors over the slot (or on ``device``), or the device decode of the workers'
        ``payloads`` (the slot is then released at once), or the user's collated batch
        (``generic``, the worker's reply of :func:`stoker.loader.workers.batches.pack_reply`; ``last``: the
        epoch's last batch, where a streaming collate flushes its carry). ``padded``: the
        ``(sample id, key)`` of the substitutes decoded for a batch whose every sample was
        skipped (:mod:`stoker.loader.workers.padding`). None (nothing to yield) when a streaming
        collate carried every token to the next batch, or every sample of the batch was skipped on
        a loader of one rank (no substitutes: ``WorkerConfig.substitutes``), or, for a batch of no
        sample, nothing was decoded."""
        if self.cfg.generic:
            return self._generic(slot, bids, skipped, skipped_keys, generic, padded, stats, delivered, last)
        if payloads is not None:
            labels = self.ring.views(slot)[1][:n].copy()
            self.ring.release(slot)
            images, labels, more, more_keys, padded = self.device_decoder(epoch, payloads, labels)
            account(stats, bids, list(skipped) + more, list(skipped_keys) + more_keys, delivered, padded)
            return None if images is None else (images, labels)
        account(stats, bids, skipped, skipped_keys, delivered, padded)
        if n == 0:
            self.ring.release(slot)
            return None
        if self.transfer is not None:
            return self.transfer.images(slot, n)  # straight from the pinned slot, released on the copy's event
        imgs, labels = self.ring.batch(slot, n)
        from ..._torch import as_tensors

        return as_tensors(imgs, labels)  # over the slot (no copy)

    def _generic(self, slot, bids, skipped, skipped_keys, reply, padded, stats, delivered, last):
        from ..workers.batches import receive

        account(stats, bids, skipped, skipped_keys, delivered, padded)
        cut = getattr(self.cfg.collate, "cut", None)  # a streaming collate (stoker.collate.PackTokens)
        # to the device straight from the slot, which the transfer gives back on the copy's event; a
        # streaming collate's carry may keep views of it: then it is held until they are dropped
        held = self.transfer is not None and cut is None and reply is not None and reply[0] == "shm"
        batch = receive(self.ring, slot, reply, stats, hold=not held)
        if cut is not None and (batch is not None or (last and self.state.carry is not None)):
            if batch is None:
                batch = {"tokens": self.state.carry[:0]}
            self.state.carry_before = self.state.carry  # (a consumer holding this batch has not handed it on)
            batch, self.state.carry = cut(self.state.carry, batch, last)
        if batch is None:
            return None
        return batch if self.transfer is None else self.transfer.batch(batch, slot if held else None)
