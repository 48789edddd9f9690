"""Cluster mode on Ray (TDCS): a cache service per node, blocks placed by weighted rendezvous
hashing, reads local → peer → origin, co-located training workers, a Kubernetes scheduler
extender. Importing this package needs Ray (``pip install stoker[cluster]``); ``import stoker``
does not."""
from .job import ClusterLoader, WorkerContext, read_epochs, run
from .service import find_services, start_services
from .warm import cluster_state, warm

__all__ = ["run", "warm", "cluster_state", "start_services", "find_services", "WorkerContext",
           "ClusterLoader", "read_epochs"]
