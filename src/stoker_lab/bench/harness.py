"""One measuring harness for every loader: throughput, data stall, emulated accelerator.

The emulated accelerator consumes each batch at a fixed rate (sleeps
``len(batch) / rate`` seconds: it uses no CPU); the data stall is the fraction of
wall time spent blocked in ``next()`` (benchmarks/README.md, the measuring terms).
"""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass
class Measurement:
    """samples delivered, wall seconds, seconds blocked in next(), seconds from the start until
    the first batch came out of ``next()`` (``first_batch_s``; the whole run if none did), derived
    rates."""

    samples: int
    seconds: float
    wait_s: float
    first_batch_s: float = 0.0

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds if self.seconds else 0.0

    @property
    def stall_fraction(self) -> float:
        return self.wait_s / self.seconds if self.seconds else 0.0


def measure(batches, consumer_rate: float = 0.0, max_samples: int | None = None) -> Measurement:
    """Drain ``batches`` (an iterable of (images, labels)); consume each batch at
    ``consumer_rate`` samples/s (0 = a consumer that takes no time); stop after
    ``max_samples`` (None = until exhausted). Returns a :class:`Measurement`. The clock starts
    before ``iter(batches)``: starting an epoch counts in its time and in its first batch's."""
    samples, wait_s, first_s = 0, 0.0, None
    t0 = time.perf_counter()
    it = iter(batches)
    try:
        while max_samples is None or samples < max_samples:
            t = time.perf_counter()
            try:
                images, _ = next(it)
            except StopIteration:
                break
            now = time.perf_counter()
            wait_s += now - t
            if first_s is None:
                first_s = now - t0
            n = len(images)
            samples += n
            del images
            if consumer_rate > 0:
                time.sleep(n / consumer_rate)
    finally:
        close = getattr(it, "close", None)
        if close is not None and max_samples is not None:
            close()
    seconds = time.perf_counter() - t0
    return Measurement(
        samples=samples, seconds=seconds, wait_s=wait_s, first_batch_s=seconds if first_s is None else first_s
    )
