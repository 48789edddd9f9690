"""The scheduler extender answers every request with JSON: odd request shapes, bad state files,
oversized or broken bodies, and a Hypothesis fuzz over its JSON (no Ray, no Kubernetes)."""

from __future__ import annotations

import http.client
import json
import socket

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stoker.cluster.extender import scoring as extender

DS = "s3://b/ds"
STATE = {
    "nodes": {
        "n1": {"cache_bytes": 100, "datasets": {DS: 80}},
        "n2": {"cache_bytes": 100, "datasets": {DS: 20}},
        "ghost": {"cache_bytes": 100, "datasets": {DS: 999}},
    }
}
POD = {"metadata": {"name": "p", "annotations": {extender.DATASET_ANNOTATION: DS, extender.REQUIRE_ANNOTATION: "true"}}}
CAP = 64 << 10  # a small body cap, so that the 413 test sends little


class _Box:
    """A state source the tests can swap (the handler checks whatever a source returns)."""

    def __init__(self, state):
        self.state = state

    def __call__(self):
        if isinstance(self.state, Exception):
            raise self.state
        return self.state


@pytest.fixture(scope="module")
def box():
    return _Box(STATE)


@pytest.fixture(scope="module")
def port(box):
    srv = extender.serve(box, port=0, max_body_bytes=CAP)
    yield srv.server_address[1]
    srv.shutdown()
    srv.server_close()


def _request(port, method, path, body: bytes | None = None, headers=None):
    """(status, decoded JSON body) of one request; a dropped connection raises."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request(method, path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        assert resp.getheader("Content-Type") == "application/json"
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def _post(port, verb, args):
    return _request(port, "POST", f"/stoker/{verb}", json.dumps(args).encode())


def _raw(port, data: bytes) -> bytes:
    """Send raw bytes, half-close, return everything the server answers."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out


def _names_in(args) -> set:
    names = set()
    if isinstance(args, dict):
        if isinstance(args.get("NodeNames"), list):
            names |= {n for n in args["NodeNames"] if isinstance(n, str)}
        items = (args.get("Nodes") or {}).get("items") if isinstance(args.get("Nodes"), dict) else None
        for it in items or []:
            if isinstance(it, dict) and isinstance(it.get("metadata"), dict):
                names.add(it["metadata"].get("name"))
    return names


def test_a_state_file_of_the_wrong_shape_is_a_json_error_naming_it_and_the_server_goes_on(tmp_path):
    path = tmp_path / "state.json"
    path.write_text(json.dumps(STATE))
    srv = extender.serve(extender.file_state(str(path)), port=0)
    port = srv.server_address[1]
    args = {"Pod": POD, "NodeNames": ["n1", "n2"]}
    try:
        for bad, entry in (
            ('{"nodes": {"n1": [1, 2]}}', "nodes['n1']"),
            ('{"nodes": {"n1": {"datasets": {"s3://b/ds": "80"}}}}', "datasets['s3://b/ds']"),
            ('{"nodes": {"n1": {"cache_bytes": -1}}}', "cache_bytes"),
            ('{"nodes": {"n1": ', "not JSON"),
            ("[]", "'nodes' object"),
        ):
            path.write_text(bad)
            for verb in ("filter", "prioritize"):
                code, body = _post(port, verb, args)
                assert code == 500, (bad, body)
                assert str(path) in body["Error"] and entry in body["Error"]
        path.write_text(json.dumps(STATE))
        assert _post(port, "prioritize", args) == (200, [{"Host": "n1", "Score": 10}, {"Host": "n2", "Score": 2}])
    finally:
        srv.shutdown()
        srv.server_close()


def test_state_sources_that_fail_or_return_odd_shapes_give_500(port, box):
    args = {"Pod": POD, "NodeNames": ["n1"]}
    try:
        for bad in ({"nodes": {"n1": {"datasets": [DS]}}}, {"nodes": None}, None, OSError("state gone")):
            box.state = bad
            code, body = _post(port, "filter", args)
            assert code == 500 and body["Error"].startswith("cache state unavailable")
    finally:
        box.state = STATE
    assert _post(port, "filter", args)[0] == 200


@pytest.mark.parametrize(
    "args, field",
    [
        ({"Pod": POD, "NodeNames": "n1"}, "NodeNames must be an array"),
        ({"Pod": POD, "NodeNames": ["n1", 7]}, "NodeNames[1]"),
        ({"Pod": POD, "NodeNames": [["n1"]]}, "NodeNames[0]"),
        ({"Pod": POD, "Nodes": {"items": [{"metadata": {"name": "n1"}}, 3]}}, "Nodes.items[1]"),
        ({"Pod": POD, "Nodes": {"items": [{}]}}, "Nodes.items[0].metadata.name"),
        ({"Pod": POD, "Nodes": {"items": {"n1": {}}}}, "Nodes.items must be an array"),
        ({"Pod": POD, "Nodes": []}, "Nodes must be an object"),
        ({"Pod": [], "NodeNames": ["n1"]}, "Pod must be an object"),
        ({"Pod": {"metadata": "p"}, "NodeNames": ["n1"]}, "Pod.metadata must be an object"),
        (
            {"Pod": {"metadata": {"annotations": {extender.DATASET_ANNOTATION: {"url": DS}}}}, "NodeNames": ["n1"]},
            "stoker.io/dataset",
        ),
        (
            {"Pod": {"metadata": {"annotations": {extender.REQUIRE_ANNOTATION: True}}}, "NodeNames": ["n1"]},
            "stoker.io/require-cache",
        ),
    ],
)
def test_requests_of_the_wrong_shape_get_400_naming_the_field(port, args, field):
    for verb in ("filter", "prioritize"):
        code, body = _post(port, verb, args)
        assert code == 400 and field in body["Error"], body


def test_both_request_shapes_answer_only_with_nodes_of_the_request(port):
    got = _post(port, "filter", {"Pod": POD, "Nodes": None, "NodeNames": ["n2", "n3"]})[1]
    assert got["NodeNames"] == ["n2"] and list(got["FailedNodes"]) == ["n3"]
    got = _post(port, "filter", {"Pod": POD, "Nodes": {"items": [{"metadata": {"name": "n1"}}]}})[1]
    assert got["Nodes"] == {"items": [{"metadata": {"name": "n1"}}]} and got["NodeNames"] is None
    assert _post(port, "prioritize", {"Pod": None, "Nodes": None, "NodeNames": []}) == (200, [])
    for nameless in ({}, {"Pod": POD}, {"Pod": None, "Nodes": None, "NodeNames": None}, {"Nodes": {"items": None}}):
        code, body = _post(port, "filter", nameless)
        assert code == 400 and "names no nodes" in body["Error"]
    ann_null = {"Pod": {"metadata": {"annotations": {extender.REQUIRE_ANNOTATION: None}}}, "NodeNames": ["n3"]}
    assert _post(port, "filter", ann_null)[1]["NodeNames"] == ["n3"]


def test_bodies_over_the_cap_get_413_and_broken_bodies_a_json_error(port):
    code, body = _request(port, "POST", "/stoker/filter", b" " * (CAP + 1))
    assert code == 413 and str(CAP) in body["Error"]
    assert _request(port, "POST", "/stoker/filter", b" " * CAP + b"{}")[0] == 413
    assert _request(port, "POST", "/stoker/filter", json.dumps({"NodeNames": ["n1"]}).encode())[0] == 200
    assert _request(port, "GET", "/stoker/filter", b"")[0] == 405  # the verbs take POST only
    assert _request(port, "GET", "/healthz", b"")[0] == 200
    # a length that is negative or not a number, a chunked body, a body shorter than its length
    for head, code in (
        (b"Content-Length: -5\r\n", 400),
        (b"Content-Length: lots\r\n", 400),
        (b"Transfer-Encoding: chunked\r\n", 400),
        (b"Content-Length: 100\r\n", 400),
    ):
        out = _raw(port, b"POST /stoker/filter HTTP/1.1\r\nHost: x\r\n" + head + b"\r\n{}")
        status, _, payload = out.partition(b"\r\n\r\n")
        assert status.split()[1] == str(code).encode(), out
        assert "Error" in json.loads(payload)
    # the HTTP server's own refusals are JSON too
    code, body = _request(port, "PUT", "/stoker/filter", b"{}")
    assert code == 405 and "Error" in body
    out = _raw(port, b"NONSENSE\r\n\r\n")
    assert out.split()[1] == b"400" and "Error" in json.loads(out.partition(b"\r\n\r\n")[2])
    assert _request(port, "POST", "/stoker/bind", b"{}")[0] == 404
    assert _request(port, "POST", "/stoker/filter", b"\xff\xfe{")[0] == 400


def _status_and_error(out: bytes) -> tuple[int, str]:
    head, _, payload = out.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(payload)["Error"]


def test_a_negative_length_with_a_large_body_is_refused_without_reading_it(port):
    """Content-Length: -1 does not skip the body limit: 400 at once, the 5 MB body is not read."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"POST /stoker/filter HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n")
        try:
            s.sendall(b"x" * (5 << 20))  # the server may close its side before taking it all
        except OSError:
            pass
        s.settimeout(10)
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
        except ConnectionResetError:
            pass
    code, error = _status_and_error(out)
    assert code == 400 and "Content-Length" in error
    assert _post(port, "filter", {"Pod": POD, "NodeNames": ["n1"]})[0] == 200  # still serving


def test_chunked_bodies_are_read_within_the_cap(port):
    ok = json.dumps({"Pod": POD, "NodeNames": ["n1"]}).encode()
    out = _raw(
        port,
        b"POST /stoker/filter HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        + b"%x\r\n" % len(ok)
        + ok
        + b"\r\n0\r\n\r\n",
    )
    assert json.loads(out.partition(b"\r\n\r\n")[2])["NodeNames"] == ["n1"]
    big = b" " * (CAP + 1)
    out = _raw(
        port,
        b"POST /stoker/filter HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        + b"%x\r\n" % len(big)
        + big
        + b"\r\n0\r\n\r\n",
    )
    assert _status_and_error(out)[0] == 413


def test_idle_and_slow_loris_connections_are_closed_and_others_still_served():
    srv = extender.serve(_Box(STATE), port=0, idle_timeout_s=1, cleanup_interval_s=1)
    port = srv.server_address[1]
    socks = []
    try:
        for k in range(80):  # more than the connection limit: idle, or a request that stalls half-way
            s = socket.create_connection(("127.0.0.1", port), timeout=10)
            if k % 2:
                s.sendall(b"POST /stoker/filter HTTP/1.1\r\nHost: x\r\nContent-Le")
            socks.append(s)
        for s in socks:  # each is closed by the server (an end or a reset), none waits for ever
            s.settimeout(30)
            try:
                assert s.recv(1024) == b""
            except ConnectionResetError:
                pass
        assert _post(port, "prioritize", {"Pod": POD, "NodeNames": ["n1"]})[0] == 200
    finally:
        for s in socks:
            s.close()
        srv.shutdown()


def test_many_concurrent_requests_are_all_answered(port):
    from concurrent.futures import ThreadPoolExecutor

    args = [{"Pod": POD, "NodeNames": ["n1", "n2"]}, {"Nodes": [1, 2]}, {"NodeNames": [1]}, "[1]"]
    with ThreadPoolExecutor(32) as ex:
        got = list(ex.map(lambda k: _post(port, ("filter", "prioritize")[k % 2], args[k % 4]), range(200)))
    for k, (code, body) in enumerate(got):
        assert code == (200 if k % 4 == 0 else 400), (k, body)
        assert code == 200 or body["Error"]


def test_answers_carry_the_state_age(port, box):
    import time

    box.state = {**STATE, "time": time.time() - 5}
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request("POST", "/stoker/prioritize", body=json.dumps({"Pod": POD, "NodeNames": ["n1"]}))
        resp = conn.getresponse()
        resp.read()
        assert 4 <= float(resp.getheader("X-Stoker-State-Age")) < 60
        conn.close()
    finally:
        box.state = STATE


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)
_name = st.sampled_from(["n1", "n2", "ghost", "n3", ""]) | _json
_node = st.fixed_dictionaries({}, optional={"metadata": st.fixed_dictionaries({}, optional={"name": _name}) | _json})
_ann = st.dictionaries(
    st.sampled_from([extender.DATASET_ANNOTATION, extender.REQUIRE_ANNOTATION, "x"]),
    st.sampled_from([DS, "true", "false", "s3://other"]) | _json,
    max_size=3,
)
_pod = (
    st.fixed_dictionaries({}, optional={"metadata": st.fixed_dictionaries({}, optional={"annotations": _ann}) | _json})
    | _json
)
_args = (
    st.fixed_dictionaries(
        {},
        optional={
            "Pod": _pod,
            "Nodes": st.fixed_dictionaries({}, optional={"items": st.lists(_node | _json, max_size=4) | _json}) | _json,
            "NodeNames": st.lists(_name, max_size=4) | _json,
        },
    )
    | _json
)


@settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(args=_args, verb=st.sampled_from(["filter", "prioritize"]))
def test_fuzz_every_json_request_gets_a_json_answer_naming_only_requested_nodes(port, args, verb):
    code, body = _post(port, verb, args)  # raises on a dropped connection or a body that is not JSON
    assert code in (200, 400), body
    if code == 400:
        assert isinstance(body, dict) and body["Error"]
        return
    sent = _names_in(args)
    if verb == "prioritize":
        assert {h["Host"] for h in body} <= sent and all(0 <= h["Score"] <= 10 for h in body)
    else:
        got = set(body["NodeNames"] or []) | {i["metadata"]["name"] for i in (body["Nodes"] or {}).get("items", [])}
        assert got <= sent and set(body["FailedNodes"]) <= sent


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    state=st.fixed_dictionaries(
        {
            "nodes": st.dictionaries(
                st.sampled_from(["n1", "n2"]),
                _json
                | st.fixed_dictionaries(
                    {},
                    optional={
                        "cache_bytes": st.integers(-5, 500) | _json,
                        "datasets": st.dictionaries(st.sampled_from([DS, "x"]), st.integers(-5, 500) | _json) | _json,
                    },
                ),
                max_size=2,
            )
        }
    )
    | _json
)
def test_fuzz_any_state_gives_an_answer_or_a_500_json_error(port, box, state):
    box.state = state
    try:
        for verb in ("filter", "prioritize"):
            code, body = _post(port, verb, {"Pod": POD, "NodeNames": ["n1", "n2"]})
            assert code in (200, 500), body
            assert code == 200 or body["Error"].startswith("cache state unavailable")
    finally:
        box.state = STATE
