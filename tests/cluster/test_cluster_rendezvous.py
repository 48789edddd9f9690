"""The pieces of :mod:`stoker.cluster.jobs.rendezvous` that need no Ray cluster: local ranks, the
backend checks, nccl refused without CUDA (the group itself: test_cluster_process_group.py)."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("ray")


def test_local_ranks_count_the_jobs_ranks_on_each_node():
    from stoker.cluster.jobs.rendezvous import local_ranks

    nodes = ["a", "b", "a", "a", "c", "b"]
    assert [local_ranks(nodes, r) for r in range(len(nodes))] == [(0, 3), (0, 2), (1, 3), (2, 3), (0, 1), (1, 2)]


def test_check_backend_refuses_unknown_backends_and_nccl_without_a_gpu():
    from stoker.cluster.jobs.rendezvous import check_backend
    from stoker.errors import ProcessGroupError, StokerError

    check_backend("gloo", {"CPU": 1.0})
    check_backend("nccl", {"CPU": 1.0, "GPU": 1.0})
    check_backend("nccl")  # resources not known: the rank checks CUDA itself
    with pytest.raises(ValueError, match=r"process_group must be one of \('gloo', 'nccl'\) or None, got 'mpi'"):
        check_backend("mpi")
    with pytest.raises(ProcessGroupError, match="'nccl' needs a GPU per rank.*use 'gloo'") as info:
        check_backend("nccl", {"CPU": 2.0})
    assert isinstance(info.value, StokerError) and isinstance(info.value, RuntimeError)


def test_nccl_group_without_cuda_is_refused_naming_the_backend_and_leaves_nothing_set():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    from stoker.cluster.jobs.rendezvous import ENV_NAMES, ProcessGroup
    from stoker.errors import ProcessGroupError

    group = ProcessGroup(0, 2, ["a", "a"], "stoker-pg-test", "nccl", timeout_s=5)
    with pytest.raises(ProcessGroupError, match="rank 0: the 'nccl' backend needs a GPU"):
        group.open()
    assert not torch.distributed.is_initialized()
    assert all(k not in os.environ for k in ENV_NAMES)
    group.close()  # nothing opened: nothing to do
