"""The extender does not trust old cache state, and a slow or hung state source never holds a
request (no Ray: the sources are plain callables and files)."""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.request

from stoker.cluster.extender import scoring as extender
from stoker.cluster.freshness import refreshing

DS = "s3://b/ds"
NODES = {"n1": {"cache_bytes": 100, "datasets": {DS: 80}}, "n2": {"cache_bytes": 100, "datasets": {DS: 0}}}
ANN = {extender.DATASET_ANNOTATION: DS}
REQ = {extender.DATASET_ANNOTATION: DS, extender.REQUIRE_ANNOTATION: "true"}


def _args(ann, names=("n1", "n2", "n3")):
    return {"Pod": {"metadata": {"name": "p", "annotations": ann}}, "Nodes": None, "NodeNames": list(names)}


def _post(port, verb, body):
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/stoker/{verb}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        return resp.status, json.loads(resp.read())


def test_a_state_file_older_than_max_age_gives_no_preference_and_fails_require_cache(tmp_path):
    path = tmp_path / "state.json"
    srv = extender.serve(extender.file_state(str(path)), port=0, max_age_s=60)
    port = srv.server_address[1]
    try:
        path.write_text(json.dumps({"time": time.time(), "nodes": NODES}))  # fresh: n1 preferred
        assert _post(port, "prioritize", _args(ANN))[1][0] == {"Host": "n1", "Score": 10}
        assert _post(port, "filter", _args(REQ))[1]["NodeNames"] == ["n1", "n2"]
        path.write_text(json.dumps({"time": time.time() - 3600, "nodes": NODES}))  # an hour old
        code, got = _post(port, "prioritize", _args(ANN))
        assert code == 200 and {h["Score"] for h in got} == {0}
        code, got = _post(port, "filter", _args(REQ))
        assert code == 200 and got["NodeNames"] == [] and "old" in got["Error"]
        assert set(got["FailedNodes"]) == {"n1", "n2", "n3"}
        path.write_text(json.dumps({"nodes": NODES}))  # no time of its own: as old as the file
        old = time.time() - 3600
        os.utime(path, (old, old))
        assert {h["Score"] for h in _post(port, "prioritize", _args(ANN))[1]} == {0}
    finally:
        srv.shutdown()
        srv.server_close()


def test_a_state_time_in_the_future_or_not_a_number_is_refused(tmp_path):
    """A state stamped in the future would never grow old, and a time that is not a number must
    not silently fall back to the file's age: both are refused, naming the file."""
    import pytest

    path = tmp_path / "state.json"
    get = extender.file_state(str(path))
    for bad in (time.time() + 10**6, "yesterday", float("nan"), True):
        path.write_text(json.dumps({"time": bad, "nodes": NODES}))
        with pytest.raises(ValueError, match=f"{path}: 'time'"):
            get()
    path.write_text(json.dumps({"time": time.time() + 60, "nodes": NODES}))  # clock skew: accepted
    assert get()["nodes"] == NODES


def test_a_hung_state_source_never_holds_a_request():
    """The refresh runs in its own thread: while it hangs, requests are answered at once with the
    last state (here none: no preference, and require-cache pods get an error)."""
    release = threading.Event()
    calls = []

    def fetch():
        calls.append(1)
        release.wait()  # Ray is gone: the call never returns (until the test ends)
        return {"nodes": NODES}

    state = refreshing(fetch, ttl_s=0.05)
    srv = extender.serve(state, port=0)
    port = srv.server_address[1]
    try:
        for _ in range(3):
            code, got = _post(port, "prioritize", _args(ANN))
            assert code == 200 and {h["Score"] for h in got} == {0}
        assert "no stoker cache state yet" in _post(port, "filter", _args(REQ))[1]["Error"]
        assert calls == [1]  # one fetch in flight, not one per request
    finally:
        release.set()
        state.stop()
        srv.shutdown()
        srv.server_close()


def test_refreshing_answers_with_the_last_good_state_stamped_with_its_time():
    results = iter([{"nodes": NODES}, RuntimeError("ray gone")])
    got = threading.Event()

    def fetch():
        r = next(results, None)
        if r is None:
            got.set()
            threading.Event().wait(5)
            return {"nodes": {}}
        if isinstance(r, Exception):
            raise r
        return r

    t0 = time.time()
    state = refreshing(fetch, ttl_s=0.01)
    try:
        assert got.wait(30)
        s = state()
        assert s["nodes"] == NODES and s["time"] >= t0  # the failure kept the last good state
    finally:
        state.stop()
