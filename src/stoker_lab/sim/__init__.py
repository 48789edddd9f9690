"""A model of stoker on a cluster: discrete-event simulation (SimPy) that calls stoker's own
decisions, calibrated and validated on measured runs (``stoker simulate``).

- :mod:`.network`: flows sharing links by max-min fairness; :mod:`.buckets`: token-bucket links;
- :mod:`.measured`: a measured run's own dataset, node names, rank hosts and rank starts;
- :mod:`.workload`: datasets laid out as ``stoker pack`` lays them, blocks from the cache's planner;
- :mod:`.decide`: placement, owners, read plans, order and budget from stoker's own functions;
- :mod:`.model`: ranks reading their plans through caches, peers and the origin;
- :mod:`.calibrate`, :mod:`.validate`: parameters from measurements; predicted against measured;
- :mod:`.tdcs`, :mod:`.scaling`: the TDCS paper's experiment and curves past it;
- :mod:`.byte_cpu`: the CPU-s/GB of each byte path and the cores per node moving bytes;
- :mod:`.plan`, :mod:`.plan_report`: ``stoker plan``, the setups on a user's figures and the
  smallest cache per node.

Why SimPy and not SimGrid: see docs/simulation.md.
"""

from __future__ import annotations

__all__ = ["EpochResult", "FlowNetwork", "Job", "Params", "Workload", "max_min_rates", "simulate", "synthetic"]

_WHERE = {
    "EpochResult": "model",
    "Job": "model",
    "Params": "model",
    "simulate": "model",
    "FlowNetwork": "network",
    "max_min_rates": "network",
    "Workload": "workload",
    "synthetic": "workload",
}


def __getattr__(name: str):
    """The package's names, imported on first use: SimPy (the ``sim`` extra) is needed only by the
    model itself, not by ``stoker simulate --help`` or :mod:`.tdcs_config`."""
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
