"""Cluster policy without a cluster: weighted rendezvous placement, co-located rank plans, the
Kubernetes scheduler extender (real ExtenderArgs JSON over HTTP)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import numpy as np
import pytest

from stoker.cluster.extender import scoring as extender
from stoker.cluster.placement import owners
from stoker.cluster.schedule import choose_nodes, colocated_plans
from stoker.order import permutation, rank_plan

KEYS = [f"v1/{i:06d}-0-{i}" for i in range(30000)]


def locality(plans: list, sample_node: np.ndarray, rank_node: list) -> float:
    """Fraction of all planned samples that are cached on their rank's node."""
    total = sum(len(p) for p in plans)
    if not total:
        return 0.0
    hit = sum(int(np.sum(np.asarray(sample_node)[p] == rank_node[r])) for r, p in enumerate(plans))
    return hit / total


def test_placement_is_deterministic_whatever_the_node_order():
    a = owners(KEYS[:2000], ["n0", "n1", "n2"], [1, 1, 1])
    b = owners(KEYS[:2000], ["n2", "n0", "n1"], [1, 1, 1])
    names = ["n0", "n1", "n2"]
    assert [names[i] for i in a] == [["n2", "n0", "n1"][i] for i in b]
    assert np.array_equal(a, owners(KEYS[:2000], names, [1, 1, 1]))


def test_placement_follows_the_budgets():
    w = [1, 2, 5]
    share = np.bincount(owners(KEYS, ["a", "b", "c"], w), minlength=3) / len(KEYS)
    assert np.allclose(share, np.array(w) / sum(w), atol=0.015)  # binomial sd ~0.003
    assert np.bincount(owners(KEYS[:1000], ["a", "b"], [0, 3]), minlength=2)[0] == 0


def test_bounded_loads_keep_small_placements_on_the_weights():
    from stoker.cluster.placement import bounded_owners

    keys = KEYS[:120]
    sizes = np.random.default_rng(0).integers(40_000, 120_000, len(keys))
    for w in ([1, 1, 1], [1, 2, 3]):
        o = bounded_owners(keys, ["a", "b", "c"], w, sizes, balance=1.05)
        share = np.bincount(o, weights=sizes, minlength=3) / sizes.sum()
        assert np.all(share <= 1.05 * np.array(w) / sum(w) + sizes.max() / sizes.sum())
        names = np.array(["a", "b", "c"])[o]
        again = np.array(["c", "a", "b"])[bounded_owners(keys, ["c", "a", "b"], w[2:] + w[:2], sizes)]
        assert np.array_equal(names, again)  # deterministic whatever the node order
    plain = np.bincount(owners(keys, ["a", "b", "c"], [1, 1, 1]), weights=sizes, minlength=3) / sizes.sum()
    assert plain.max() > 0.36  # plain HRW on 120 keys is visibly off (why bounded loads are the default)


def test_removing_a_node_moves_only_its_keys():
    before = owners(KEYS[:5000], ["a", "b", "c"], [1, 1, 1])
    after = owners(KEYS[:5000], ["a", "c"], [1, 1])
    names_b = np.array(["a", "b", "c"])[before]
    names_a = np.array(["a", "c"])[after]
    kept = names_b != "b"
    assert np.array_equal(names_b[kept], names_a[kept])


def test_colocated_plans_are_exactly_once_equal_and_local():
    n, w = 1200, 4
    groups = np.arange(n) // 10
    node = owners([f"v/{g}" for g in range(groups.max() + 1)], ["x", "y", "z"], [1, 1, 1])[groups]
    rank_node = [0, 1, 2, 2]  # two ranks on node 2
    for epoch in range(3):
        perm = permutation(n, 0, epoch, "blockwise", groups=groups)
        plans = colocated_plans(perm, node, rank_node)
        assert {len(p) for p in plans} == {n // w}
        assert np.array_equal(np.sort(np.concatenate(plans)), np.arange(n))
        plain = [rank_plan(perm, r, w) for r in range(w)]
        assert locality(plans, node, rank_node) > 0.85 > 0.5 > locality(plain, node, rank_node)
        pos = np.empty(n, dtype=np.int64)
        pos[perm] = np.arange(n)
        assert all(np.all(np.diff(pos[p]) > 0) for p in plans)  # each rank keeps the epoch's order


def test_colocated_plans_pad_like_rank_plan():
    perm = permutation(103, 0, 0, "uniform")
    node = np.arange(103) % 3
    plans = colocated_plans(perm, node, [0, 1, 2], even="pad")
    ref = np.concatenate([rank_plan(perm, r, 3, "pad") for r in range(3)])
    assert {len(p) for p in plans} == {35}
    assert np.array_equal(np.sort(np.concatenate(plans)), np.sort(ref))


def test_choose_nodes_prefers_cached_bytes_then_budget():
    assert choose_nodes(["a", "b", "c"], [0, 900, 100], [1, 1, 1], 1) == ["b"]
    assert sorted(choose_nodes(["a", "b", "c"], [600, 300, 0], [1, 1, 1], 3)) == ["a", "a", "b"]
    assert choose_nodes(["a", "b", "c"], [0, 0, 0], [1, 5, 1], 1) == ["b"]
    assert sorted(choose_nodes(["a", "b", "c"], [9, 0, 0], [1, 1, 1], 3, slots=[1, 1, 1])) == ["a", "b", "c"]
    with pytest.raises(ValueError):
        choose_nodes(["a"], [1], [1], 2, slots=[1])


STATE = {
    "nodes": {
        "node-a": {"cache_bytes": 100, "datasets": {"s3://b/ds": 10}},
        "node-b": {"cache_bytes": 100, "datasets": {"s3://b/ds": 70}},
        "node-c": {"cache_bytes": 300, "datasets": {}},
    }
}


def _node(name):
    return {"metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}}, "status": {}}


def _pod(annotations):
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "trainer-0", "namespace": "ml", "annotations": annotations},
        "spec": {"containers": [{"name": "t", "image": "trainer:1"}]},
    }


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("ext") / "state.json"
    path.write_text(json.dumps(STATE))
    srv = extender.serve(extender.file_state(str(path)), port=0)
    yield f"http://127.0.0.1:{srv.server_address[1]}/stoker", srv
    srv.shutdown()
    srv.server_close()


def _post(url, payload):
    req = urllib.request.Request(url, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read())


def test_extender_listens_on_loopback_only(server):
    assert server[1].server_address[0] == "127.0.0.1"


def test_extender_prioritize_ranks_the_node_holding_the_dataset_first(server):
    url = server[0]
    args = {
        "Pod": _pod({"stoker.io/dataset": "s3://b/ds"}),
        "Nodes": {"kind": "NodeList", "items": [_node(n) for n in ("node-a", "node-b", "node-c")]},
        "NodeNames": None,
    }
    got = _post(url + "/prioritize", args)
    assert got == [{"Host": "node-a", "Score": 1}, {"Host": "node-b", "Score": 10}, {"Host": "node-c", "Score": 0}]
    # nodeCacheCapable: names only; a dataset cached nowhere goes by cache budget
    got = _post(
        url + "/prioritize",
        {"Pod": _pod({"stoker.io/dataset": "s3://b/new"}), "Nodes": None, "NodeNames": ["node-a", "node-c"]},
    )
    assert max(got, key=lambda h: h["Score"])["Host"] == "node-c"
    got = _post(url + "/prioritize", {"Pod": _pod({}), "Nodes": None, "NodeNames": ["node-a", "node-b"]})
    assert {h["Score"] for h in got} == {0}


def test_extender_filter(server):
    url = server[0]
    items = [_node(n) for n in ("node-a", "node-x")]
    got = _post(
        url + "/filter", {"Pod": _pod({"stoker.io/dataset": "s3://b/ds"}), "Nodes": {"items": items}, "NodeNames": None}
    )
    assert [n["metadata"]["name"] for n in got["Nodes"]["items"]] == ["node-a", "node-x"]
    assert got["FailedNodes"] == {} and got["Error"] == ""
    got = _post(
        url + "/filter",
        {
            "Pod": _pod({"stoker.io/dataset": "s3://b/ds", "stoker.io/require-cache": "true"}),
            "Nodes": None,
            "NodeNames": ["node-a", "node-x"],
        },
    )
    assert got["NodeNames"] == ["node-a"] and list(got["FailedNodes"]) == ["node-x"]


def test_extender_rejects_bad_requests_with_an_error(server):
    url = server[0]
    req = urllib.request.Request(url + "/filter", data=b"not json", headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=10)
    assert e.value.code == 400 and "Error" in json.loads(e.value.read())
    with pytest.raises(urllib.error.HTTPError) as e:
        _post(url + "/bind", {"Pod": _pod({})})
    assert e.value.code == 404


def test_stoker_imports_without_ray():
    import subprocess
    import sys

    code = (
        "import sys; import stoker, stoker.cli; stoker.cli.build_parser(); "
        "import stoker.cluster.extender.scoring, stoker.cluster.schedule; assert 'ray' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
