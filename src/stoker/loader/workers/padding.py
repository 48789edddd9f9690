"""Substitutes for a batch whose every sample was skipped (``RunOptions(on_error="skip")``).

Under DDP every rank must yield the same number of batches in an epoch: a rank with one batch
fewer leaves the others waiting in a collective, and the job hangs. The plan gives every rank the
same number of batches (``ReadOptions.even``, :func:`stoker.order.rank_plan`). Skipping a bad
sample only makes its batch shorter, which DDP accepts; but a batch whose every sample is skipped
would leave nothing to yield. Such a batch is filled with substitutes instead (only with several
ranks, ``WorkerConfig.substitutes``: a loader of one rank has no rank to keep level, and yields
no batch for it rather than decode other samples a second time):

- other samples of the dataset, tried in an order fixed by the loader's seed, the epoch and the
  batch's sample ids (:func:`probe_order`: a long stride through the sample ids, coprime with
  the dataset's size, from a pseudo-random start; the batch's own ids are left out), so a resumed or
  re-run epoch, any worker count and either side of a split batch pick the same ones;
- each decoded as any sample is (the same transform, its augmentation seeded by (seed, epoch, its
  id)), until the batch has as many samples as planned or :func:`probe_limit` samples were tried
  (a tried sample that does not decode either is passed over, and is not counted as skipped: it is
  not a sample of this batch);
- a batch that gets no substitute at all raises :class:`~stoker.errors.WorkerError` naming the
  batch (:func:`unreadable`): so many samples failed that the dataset looks unreadable.

Substitutes are counted in ``EpochStats.padded`` / ``padded_keys`` (:mod:`.epoch_stats`), never in
``samples`` nor among the ids ``exactly_once`` compares with the plan. A user's ``decode`` sees
:data:`PAD_FIELD` set to True in a substitute's fields. The choice is made on the whole batch:
the first batch of an epoch, decoded in parts by every worker (:mod:`.split`), is sent again whole
to one worker when every part came back empty (:mod:`.dispatch`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np

from ...errors import WorkerError

__all__ = ["PAD_FIELD", "probe_limit", "probe_order", "unreadable"]

#: The field a user's ``decode`` finds set to True in the fields of a substitute (absent otherwise).
PAD_FIELD = "__padding__"

#: Tag mixed into the probe order's seed, so it never equals a sample's augmentation seed.
_PROBE_TAG = 0x9AD5


def probe_limit(planned: int) -> int:
    """Most samples tried as substitutes for one batch of ``planned`` samples: ``max(64, 4 x
    planned)`` (a dataset with half its samples bad still fills the batch; one where 64 tries in a
    row fail is taken for unreadable)."""
    return max(64, 4 * int(planned))


def probe_order(seed: int, epoch: int, ids, num_samples: int, pool=None) -> Iterator[int]:
    """The sample ids tried as substitutes for the batch of sample ids ``ids`` (ints), in order:
    every id of ``[0, num_samples)`` at most once, none of ``ids``. A pure function of ``seed``
    (the loader's), ``epoch`` and ``ids`` (in plan order): a pseudo-random stride between about a
    quarter and three quarters of ``num_samples``, coprime with it, from a pseudo-random start, so
    consecutive tries land far apart (a run of bad samples, such as a damaged shard, is not walked
    through one by one). ``pool``: the ids a loader over a subset reads (an int array,
    ``WorkerConfig.sample_ids``): its entries are tried instead, in the same way, and
    ``num_samples`` is not used; None: every id."""
    n = int(num_samples) if pool is None else len(pool)
    own = {int(i) for i in ids}
    if n <= 0:
        return
    rng = np.random.default_rng(np.random.SeedSequence([int(seed), int(epoch), _PROBE_TAG, *(int(i) for i in ids)]))
    start = int(rng.integers(n))
    lo = max(1, n // 4)  # between a quarter and three quarters of the dataset: never a walk through neighbours
    stride = int(rng.integers(lo, max(lo + 1, n - n // 4)))
    while math.gcd(stride, n) != 1:  # n - 1 is always coprime with n: this ends
        stride += 1
    for k in range(n):
        sid = (start + k * stride) % n
        if pool is not None:
            sid = int(pool[sid])
        if sid not in own:
            yield sid


def unreadable(epoch: int, keys: list, tried: int, last_error: str | None) -> WorkerError:
    """The error for a batch whose samples (keys ``keys``) were all skipped and none of the
    ``tried`` samples tried in their place decoded (``last_error``: why the last one did not).
    ``key`` (the batch's first sample) is set on it, for the worker's reply."""
    shown = ", ".join(repr(k) for k in keys[:4]) + (f" and {len(keys) - 4} more" if len(keys) > 4 else "")
    msg = (
        f"every sample of a batch of epoch {epoch} was skipped ({shown}), and none of the {tried} samples "
        f"tried in its place decoded either: the dataset looks unreadable (on_error='skip' keeps every "
        f"rank yielding the same number of batches by decoding substitutes for such a batch)"
    )
    if last_error:
        msg += f"; the last failure: {last_error}"
    err = WorkerError(msg)
    err.key = keys[0] if keys else None  # type: ignore[attr-defined]
    return err
