"""The first batch of an epoch decoded by every worker at once.

At an epoch's start the consumer waits for batch 0 alone, yet batch 0 is one task: one worker
decodes its ``batch_size`` samples while the others decode batches the consumer does not want
yet. Split into parts, one per worker, batch 0 is ready in about ``1 / workers`` of the time
(measured on the demo: the cold first batch was delivered 0.2 s after its last block landed,
one worker decoding 64 samples on cores shared with the prefetcher and the origin).

Each part is an ordinary task with an ``offset``: its worker writes rows ``[offset, offset +
len(ids))`` of the batch's slot. The replies of the parts are joined here into the reply of
the whole batch (:func:`join_replies`): counts added, skipped samples in order, and rows that
skipped samples left empty closed up, so the slot holds the batch as one worker would have
written it. Only image batches decoded by the workers are split (a user's collate sees whole
batches; device decode sends byte payloads).

A part's worker never decodes substitutes for skipped samples: a batch whose parts all came back
empty is sent again whole to one worker (:mod:`stoker.loader.workers.padding`).
"""

from __future__ import annotations

import numpy as np

#: Fewest samples in a part: smaller parts cost more in messages than they save in decode.
MIN_PART = 8


def split_ids(ids: np.ndarray, workers: int, min_part: int = MIN_PART) -> list[tuple[int, np.ndarray]]:
    """``[(offset, ids of the part)]``: ``ids`` (K,) cut into at most ``workers`` contiguous parts
    of at least ``min_part`` samples each (one part, offset 0, when K is too small)."""
    parts = max(1, min(int(workers), len(ids) // max(1, min_part)))
    bounds = np.linspace(0, len(ids), parts + 1).round().astype(int)
    return [(int(a), ids[a:b]) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def join_replies(msgs: list[tuple], images: np.ndarray | None, labels: np.ndarray | None) -> tuple:
    """One reply for a batch from the replies of its parts (each ends with its part's offset).

    ``msgs``: every part's reply, ``("ok", wid, run, seq, slot, n, skipped, skipped_keys, counters,
    payloads, generic, padded, offset)`` (a part is never padded: ``padded`` is empty) or
    ``("error", wid, run, seq, slot, key, err, tb, counters, cause, offset)``; ``images`` /
    ``labels``: the slot's arrays, ``(B, 3, S, S)`` uint8 and ``(B,)``, where rows left by skipped
    samples are closed up. ``msgs`` come in the order they arrived. Returns the first error by
    offset if a part failed, else an ``"ok"`` reply of the whole batch (offset 0) that carries the
    worker and counters of the part that arrived last (the loader records every part's counters as
    it comes).
    """
    last = msgs[-1]
    msgs = sorted(msgs, key=lambda m: m[-1])
    errors = [m for m in msgs if m[0] == "error"]
    if errors:
        return errors[0]
    n, skipped, skipped_keys = 0, [], []
    for m in msgs:
        offset, got = m[-1], m[5]
        if got and offset != n and images is not None and labels is not None:
            images[n : n + got] = images[offset : offset + got]
            labels[n : n + got] = labels[offset : offset + got]
        n += got
        skipped += m[6]
        skipped_keys += m[7]
    return ("ok", last[1], last[2], last[3], last[4], n, skipped, skipped_keys, last[8], None, None, [], 0)
