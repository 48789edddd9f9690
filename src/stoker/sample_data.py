"""The old import path of :mod:`stoker.bench.sample_data` (the embedded real-photo dataset that
the demo and the benchmarks make), kept so that scripts written against it, such as the cluster
reproducers in the shared cases, keep working. New code imports :mod:`stoker.bench.sample_data`.
"""
from __future__ import annotations

from .bench.sample_data import make_sample_data

__all__ = ["make_sample_data"]
