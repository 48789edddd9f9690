"""Prometheus metrics (:mod:`stoker.metrics`): the loader's counters at scrape time, a real
Prometheus server's ``rate()`` against the loader's own stats, the extender's requests, and the
cache service's Ray metrics."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request

import pytest

import stoker
from stoker import CacheOptions

prom = pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402


def _scrape(url: str) -> dict:
    """{(name, frozenset(labels other than dataset/job/node/rank)): value} of a metrics page."""
    out = {}
    for fam in text_string_to_metric_families(urllib.request.urlopen(url, timeout=10).read().decode()):
        for s in fam.samples:
            extra = frozenset((k, v) for k, v in s.labels.items() if k not in ("dataset", "job", "node", "rank"))
            out[(s.name, extra)] = s.value
    return out


@pytest.fixture
def dataset(packed_local, tmp_path):
    return stoker.open_dataset(packed_local, cache_dir=str(tmp_path / "cache"), cache_bytes=1 << 30)


def test_loader_metrics_match_its_stats(dataset):
    with stoker.Loader(
        dataset, 8, num_workers=2, image=stoker.ImageOptions(image_size=32), run=stoker.RunOptions(metrics_port=0)
    ) as ld:  # 2 workers + prefetcher
        url = ld.metrics_url
        mid = None
        for i, _ in enumerate(ld):
            if i == 3:  # the epoch in progress counts already
                mid = _scrape(url)
        st = ld.stats
        m = _scrape(url)
    assert mid[("stoker_samples_total", frozenset())] == 4 * 8
    assert m[("stoker_samples_total", frozenset())] == st.samples == len(dataset)
    assert m[("stoker_batches_total", frozenset())] == st.batches
    assert m[("stoker_origin_bytes_total", frozenset())] == st.origin_bytes > 0
    assert m[("stoker_origin_requests_total", frozenset())] == st.origin_requests
    hits = {t: m[("stoker_cache_hits_total", frozenset({("tier", t)}))] for t in ("memory", "disk", "staged")}
    assert hits["memory"] + hits["disk"] == st.cache_hits
    assert m[("stoker_cache_misses_total", frozenset())] == st.cache_misses
    assert m[("stoker_data_stall_seconds_total", frozenset())] == pytest.approx(st.wait_s)
    assert m[("stoker_epochs_total", frozenset())] == 1
    assert ("stoker_samples_total", frozenset()) not in _scrape(url)  # closed: no longer reported


def _tier_hits(m: dict) -> dict:
    return {t: m[("stoker_cache_hits_total", frozenset({("tier", t)}))] for t in ("memory", "disk", "staged")}


def test_tier_hits_first_batch_and_the_prefetchers_traffic_live(packed_local, tmp_path):
    """A memory tier and a disk tier of a third of the dataset each, one staging block: over three
    epochs the scraped hits of every tier, the misses and the origin bytes equal the sums of the
    loader's EpochStats, and the first-batch gauge its last epoch's. Mid-epoch (the last batch in
    hand, the prefetcher done with the plan) the origin bytes already count the prefetcher's reads."""
    probe = stoker.open_dataset(packed_local, cache=False, block_bytes=128 << 10)
    third = int((probe.blocks.end - probe.blocks.start).sum()) // 3
    ds = stoker.open_dataset(
        packed_local,
        cache_dir=str(tmp_path / "disk"),
        cache_bytes=third,
        block_bytes=128 << 10,
        cache=CacheOptions(memory_bytes=third, memory_dir=str(tmp_path / "shm")),
    )
    with stoker.Loader(
        ds,
        16,
        num_workers=2,
        read=stoker.ReadOptions(staging_bytes=128 << 10),
        image=stoker.ImageOptions(image_size=32),
        run=stoker.RunOptions(metrics_port=0),
    ) as ld:
        for i, _ in enumerate(ld):
            if i == len(ld) - 1:
                p = ld.pipeline
                deadline = time.monotonic() + 60
                while not p.prefetcher.plan_done(p.dispatch.run_id) and time.monotonic() < deadline:
                    time.sleep(0.05)
                mid = _scrape(ld.metrics_url)
        for _ in range(2):
            for _ in ld:
                pass
        m, hist = _scrape(ld.metrics_url), ld.history
    assert mid[("stoker_origin_bytes_total", frozenset())] == hist[0].origin_bytes > 0
    assert mid[("stoker_origin_requests_total", frozenset())] == hist[0].origin_requests
    hits = _tier_hits(m)
    assert hits["memory"] == sum(e.memory_hits for e in hist) > 0
    assert hits["disk"] == sum(e.cache_hits - e.memory_hits for e in hist) > 0
    assert hits["staged"] == sum(e.staged_hits for e in hist) > 0
    assert m[("stoker_cache_misses_total", frozenset())] == sum(e.cache_misses for e in hist)
    assert m[("stoker_origin_bytes_total", frozenset())] == sum(e.origin_bytes for e in hist)
    assert m[("stoker_first_batch_seconds", frozenset())] == hist[-1].first_batch_s > 0


def test_skipped_samples_and_replaced_processes(cases_packed, tmp_path):
    """A corrupt JPEG skipped (``on_error="skip"``), a SIGKILLed decode worker and then the
    prefetcher replaced: the scraped counters equal the loader's stats."""
    ds = stoker.open_dataset(cases_packed, cache_dir=str(tmp_path), cache_bytes=64 << 20)
    with stoker.Loader(
        ds,
        2,
        num_workers=2,
        transform="eval",
        shuffle=False,
        run=stoker.RunOptions(on_error="skip", timeout_s=60, metrics_port=0),
    ) as ld:
        it = iter(ld)
        next(it)
        os.kill(ld.processes.workers[1].pid, signal.SIGKILL)
        next(it)
        pf = ld.processes.prefetcher
        os.kill(pf.pid, signal.SIGKILL)
        pf.join(30)  # dead before the next check (its exit code is read, not waited for): the
        # epoch's last batches can all arrive before a kill still in flight takes effect
        for _ in it:
            pass
        st, m = ld.stats, _scrape(ld.metrics_url)
    assert m[("stoker_skipped_samples_total", frozenset())] == st.skipped == 1
    assert m[("stoker_samples_total", frozenset())] == st.samples == len(ds) - 1
    assert m[("stoker_process_restarts_total", frozenset({("process", "worker")}))] == st.worker_restarts == 1
    assert m[("stoker_process_restarts_total", frozenset({("process", "prefetcher")}))] == st.prefetcher_restarts == 1


def test_origin_retries(s3_packed, origin_faults, tmp_path):
    """The fault proxy in front of the emulated S3 origin answers the next 3 object GETs with
    503 SlowDown: each is retried, by whichever process sent it (prefetcher or worker), and the
    scraped retries equal the loader's stats and the faults the proxy answered."""
    from stoker_lab.bench.faultproxy import Fault, object_gets

    url, _ = s3_packed
    proxy, opts = origin_faults
    ds = stoker.open_dataset(url, storage_options=opts, cache_dir=str(tmp_path), cache_bytes=64 << 20)
    proxy.set_fault(Fault("status", 503, count=3, match=object_gets))
    with stoker.Loader(
        ds, 8, num_workers=2, image=stoker.ImageOptions(image_size=32), run=stoker.RunOptions(metrics_port=0)
    ) as ld:
        assert sum(len(y) for _, y in ld) == len(ds)
        st, m = ld.stats, _scrape(ld.metrics_url)
    served = proxy.stats()["faults_injected"]
    assert served == 3
    assert m[("stoker_origin_retries_total", frozenset())] == st.origin_retries == served


def test_loader_labels_and_names(dataset, monkeypatch):
    monkeypatch.setenv("STOKER_JOB", "resnet")
    with stoker.Loader(
        dataset, 8, num_workers=0, image=stoker.ImageOptions(image_size=32), run=stoker.RunOptions(metrics_port=0)
    ) as ld:
        text = urllib.request.urlopen(ld.metrics_url, timeout=10).read().decode()
    line = next(x for x in text.splitlines() if x.startswith("stoker_samples_total{"))
    assert f'dataset="{dataset.url}"' in line and 'job="resnet"' in line and 'rank="0"' in line
    assert "version" not in line  # one series per dataset URL: the version is on its own series
    info = next(x for x in text.splitlines() if x.startswith("stoker_dataset_info{"))
    assert f'dataset="{dataset.url}"' in info and f'version="{dataset.version}"' in info and info.endswith(" 1.0")
    names = {fam.name for fam in text_string_to_metric_families(text)}
    assert all(n.startswith("stoker_") for n in names)


def test_port_from_environment(dataset, monkeypatch):
    monkeypatch.setenv("STOKER_METRICS_PORT", "not-a-port")
    with pytest.raises(ValueError, match="STOKER_METRICS_PORT"):
        stoker.Loader(dataset, 8, num_workers=0)
    with socket.socket() as busy:  # a taken port from the environment: logged, training goes on
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        monkeypatch.setenv("STOKER_METRICS_PORT", str(busy.getsockname()[1]))
        ld = stoker.Loader(dataset, 8, num_workers=0, image=stoker.ImageOptions(image_size=32))
        assert ld.metrics_port not in (None, busy.getsockname()[1]) and ld.metrics_url is not None
        ld.close()


def _listening(port: int) -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", port))
    s.listen()
    return s


def _free_run(n: int) -> int:
    """A port p with p..p+n-1 free now (another program may take one meanwhile: rare)."""
    for _ in range(50):
        base = _free_port()
        if base + n > 65535:
            continue
        try:
            socks = [_listening(p) for p in range(base, base + n)]
        except OSError:
            continue
        for x in socks:
            x.close()
        return base
    raise AssertionError("no run of free ports")


def test_a_busy_metrics_port_takes_the_next_free_one(dataset, monkeypatch, caplog):
    """The second training process of a node given the same metrics_port= (held by another
    process here) serves on the next free port, says so in a warning and in loader.metrics_port,
    and trains: a busy port never stops a trainer."""
    monkeypatch.delenv("STOKER_METRICS_PORT", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    base = _free_run(4)
    with _listening(base), _listening(base + 1):
        with stoker.Loader(
            dataset,
            8,
            num_workers=0,
            image=stoker.ImageOptions(image_size=32),
            run=stoker.RunOptions(metrics_port=base),
        ) as ld:
            assert ld.metrics_port == base + 2 and ld.metrics_url.endswith(f":{base + 2}/metrics")
            assert len(next(iter(ld))[1]) == 8
            assert _scrape(ld.metrics_url)[("stoker_samples_total", frozenset())] == 8
        assert f"on port {base + 2} (loader.metrics_port), not metrics_port={base}" in caplog.text
        assert f"port {base}, {base + 1} held by another program" in caplog.text
        # torchrun's LOCAL_RANK: a taken port is followed by this rank's own (port + LOCAL_RANK)
        monkeypatch.setenv("LOCAL_RANK", "3")
        with stoker.Loader(dataset, 8, num_workers=0, run=stoker.RunOptions(metrics_port=base)) as ld:
            assert ld.metrics_port == base + 3


def test_every_port_taken_leaves_the_loader_without_metrics(dataset, monkeypatch, caplog):
    from stoker.metrics import loader_ports

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert loader_ports(9300, 2, tries=3) == [9300, 9302, 9301, 9303]
    assert loader_ports(65534, None) == [65534, 65535] and loader_ports(0, 5) == [0]
    base = _free_run(3)
    monkeypatch.setattr("stoker.metrics.PORT_TRIES", 2)
    with _listening(base), _listening(base + 1), _listening(base + 2):
        with stoker.Loader(dataset, 8, num_workers=0, run=stoker.RunOptions(metrics_port=base)) as ld:
            assert ld.metrics_port is None and ld.metrics_url is None
            assert len(next(iter(ld))[1]) == 8
    assert f"no Prometheus metrics for this loader: metrics_port={base}: ports {base}..{base + 2} are all taken" in (
        caplog.text
    )


def test_loader_works_without_prometheus_client(packed_local, tmp_path):
    code = f"""
import sys
sys.modules["prometheus_client"] = None  # not installed
import stoker
ds = stoker.open_dataset({packed_local!r}, cache=False)
ld = stoker.Loader(ds, 16, num_workers=0, image=stoker.ImageOptions(image_size=32))
assert len(next(iter(ld))[1]) == 16
try:
    stoker.Loader(ds, 16, num_workers=0, run=stoker.RunOptions(metrics_port=0))
except ImportError as exc:
    assert "stoker[metrics]" in str(exc), exc
    print("ok")
"""
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "STOKER_CACHE_DIR": str(tmp_path)},
    )
    assert out.stdout.strip() == "ok", out.stderr[-2000:]


def test_extender_metrics():
    from stoker.cluster.extender.scoring import serve
    from stoker.metrics import serve_extender_metrics

    port = serve_extender_metrics(0)
    state = {"nodes": {"a": {"cache_bytes": 10, "datasets": {"s3://d": 5}}, "b": {"cache_bytes": 10}}}
    srv = serve(lambda: state, port=0, max_age_s=None)
    base = f"http://127.0.0.1:{srv.server_address[1]}"
    before = _scrape(f"http://127.0.0.1:{port}/metrics")
    try:
        body = json.dumps(
            {"Pod": {"metadata": {"annotations": {"stoker.io/dataset": "s3://d"}}}, "NodeNames": ["a", "b"]}
        ).encode()
        for verb in ("filter", "prioritize", "prioritize"):
            urllib.request.urlopen(urllib.request.Request(f"{base}/{verb}", data=body), timeout=10).read()
        with pytest.raises(urllib.error.HTTPError):
            urllib.request.urlopen(urllib.request.Request(f"{base}/bind", data=body), timeout=10)
    finally:
        srv.shutdown()
    m = _scrape(f"http://127.0.0.1:{port}/metrics")

    def grew(key):
        return m.get(key, 0) - before.get(key, 0)

    assert grew(("stoker_extender_requests_total", frozenset({("verb", "filter"), ("code", "200")}))) == 1
    assert grew(("stoker_extender_requests_total", frozenset({("verb", "prioritize"), ("code", "200")}))) == 2
    assert grew(("stoker_extender_requests_total", frozenset({("verb", "other"), ("code", "404")}))) == 1
    assert grew(("stoker_extender_errors_total", frozenset({("verb", "other")}))) == 1
    assert grew(("stoker_extender_request_duration_seconds_count", frozenset({("verb", "prioritize")}))) == 2


class _FakeRayMetric:
    def __init__(self, name, description="", tag_keys=()):
        self.name, self.tag_keys, self.values = name, tag_keys, {}

    def inc(self, value=1.0, tags=None):
        assert set(tags) == set(self.tag_keys)
        key = tuple(sorted(tags.items()))
        self.values[key] = self.values.get(key, 0) + value

    def set(self, value, tags=None):
        self.values[tuple(sorted(tags.items()))] = value


class _FakeRay:
    Counter = Gauge = _FakeRayMetric


def test_service_metrics_record():
    from stoker.metrics import ServiceMetrics

    m = ServiceMetrics("node-1", backend=_FakeRay)
    m.served_bytes(100, "cache")
    m.served_bytes(50, "origin")
    m.served_bytes(0, "cache")
    m.flush()
    m.filled({"filled": 3, "cached": 2, "failed": 1})
    m.held_bytes("s3://b/train", "v1", 4096)
    assert m.served.values == {
        (("node", "node-1"), ("source", "cache")): 100,
        (("node", "node-1"), ("source", "origin")): 50,
    }
    assert m.fills.values[(("node", "node-1"), ("outcome", "filled"))] == 3
    assert m.failures.values == {(("node", "node-1"),): 1}
    assert m.held.values == {(("dataset", "s3://b/train"), ("node", "node-1"), ("version", "v1")): 4096}

    class Broken:
        def Counter(*a, **k):  # noqa: N802, N805
            raise RuntimeError("no metrics agent")

    dead = ServiceMetrics("n", backend=Broken)
    dead.served_bytes(1)  # no metrics, no error
    dead.filled({"failed": 1})


def test_service_metrics_add_up_served_bytes_and_hand_them_on_by_themselves():
    """Served bytes reach the backend in one ``inc`` per source, within ``flush_s`` of the first
    request, with no later request or flush() needed (a burst then silence is counted whole)."""
    import time

    from stoker.metrics import ServiceMetrics

    calls = []

    class Counting(_FakeRayMetric):
        def inc(self, value=1.0, tags=None):
            calls.append((self.name, value))
            super().inc(value, tags)

    class Backend:
        Counter = Gauge = Counting

    m = ServiceMetrics("node-1", backend=Backend, flush_s=0.05)
    for _ in range(1000):
        m.served_bytes(1 << 20, "cache")
    m.served_bytes(7, "handoff")
    deadline = time.monotonic() + 30
    while len(calls) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sorted(calls) == [("stoker_peer_served_bytes", 7), ("stoker_peer_served_bytes", 1000 << 20)]
    assert m.served.values[(("node", "node-1"), ("source", "cache"))] == 1000 << 20
    m.served_bytes(5, "cache")
    m.flush()  # at once, and its timer cancelled
    assert m.served.values[(("node", "node-1"), ("source", "cache"))] == (1000 << 20) + 5
    assert len(calls) == 3
    now = ServiceMetrics("node-1", backend=Backend, flush_s=0)  # flush_s=0: each request at once
    now.served_bytes(3, "origin")
    assert now.served.values == {(("node", "node-1"), ("source", "origin")): 3} and len(calls) == 4


# -- a real Prometheus server ----------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _query(base: str, promql: str, at: float) -> list:
    q = urllib.parse.urlencode({"query": promql, "time": f"{at:.3f}"})
    out = json.loads(urllib.request.urlopen(f"{base}/api/v1/query?{q}", timeout=10).read())
    assert out["status"] == "success", out
    return out["data"]["result"]


def test_prometheus_rate_matches_loader_stats(dataset, tmp_path):
    """A real Prometheus scrapes a running loader every 500 ms; ``rate(stoker_samples_total[5s])``
    agrees within 5% with the loader's own count of samples over the same 5 s. The consumer takes
    50 ms a batch (an emulated accelerator), so the rate is steady."""
    exe = shutil.which("prometheus")
    if exe is None:
        if os.environ.get("CI"):
            pytest.fail("prometheus is not installed (scripts/system_deps.sh installs it for make test)")
        pytest.skip("prometheus is not installed (Debian package 'prometheus'; `make test` installs it)")
    ld = stoker.Loader(
        dataset, 4, num_workers=1, image=stoker.ImageOptions(image_size=32), run=stoker.RunOptions(metrics_port=0)
    )
    prom_port = _free_port()
    port = urllib.parse.urlparse(ld.metrics_url).port
    (tmp_path / "prometheus.yml").write_text(
        "global: {scrape_interval: 500ms, scrape_timeout: 450ms}\n"
        "scrape_configs:\n"
        f"  - job_name: stoker\n    static_configs: [{{targets: ['127.0.0.1:{port}']}}]\n"
    )
    proc = subprocess.Popen(
        [
            exe,
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{prom_port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=open(tmp_path / "prometheus.log", "wb"),
    )
    base = f"http://127.0.0.1:{prom_port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{base}/-/ready", timeout=2).read()
                break
            except OSError:
                assert proc.poll() is None, (tmp_path / "prometheus.log").read_text()[-2000:]
                assert time.monotonic() < deadline, "prometheus did not get ready in 60 s"
                time.sleep(0.2)
        next(iter(ld))  # the processes are up: what follows runs at the consumer's pace
        while not _query(base, "count_over_time(stoker_samples_total[2s]) >= 2", time.time()):
            assert time.monotonic() < deadline, "prometheus did not scrape the loader"
            time.sleep(0.2)  # scraped twice: the series covers what follows
        window_s = 5.0
        marks = [(time.time(), ld.live.snapshot()["samples"])]  # (wall time, the loader's own count)
        t_end = time.time() + window_s + 1.5
        while marks[-1][0] < t_end:
            for _ in ld:
                time.sleep(0.05)
                marks.append((time.time(), ld.live.snapshot()["samples"]))
                if marks[-1][0] >= t_end:
                    break
        at = marks[-1][0] - 0.5
        time.sleep(1.0)  # the scrapes up to `at` are in
        result = _query(base, f"rate(stoker_samples_total[{window_s:g}s])", at)
        assert result, _query(base, "stoker_samples_total", at)
        prom_rate = float(result[0]["value"][1])
        scrapes = _query(base, f"stoker_samples_total[{window_s:g}s]", at)[0]["values"]

        def own(t):  # the loader's own count at time t
            return max(n for w, n in marks if w <= t)

        own_rate = (own(at) - own(at - window_s)) / window_s
        assert len(scrapes) >= 5, f"prometheus scraped only {len(scrapes)} times in {window_s} s: {scrapes}"
        assert prom_rate == pytest.approx(own_rate, rel=0.05), (prom_rate, own_rate, scrapes)
    finally:
        ld.close()
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def test_the_ranks_of_a_node_get_consecutive_ports_from_the_environment(monkeypatch):
    """Under torchrun every rank of a node sees one ``$STOKER_METRICS_PORT``: each serves on it
    plus its ``$LOCAL_RANK``, so the second rank is not left without metrics."""
    from stoker.metrics import metrics_port_from_env

    monkeypatch.setenv("STOKER_METRICS_PORT", "9300")
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert metrics_port_from_env() == 9300
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert metrics_port_from_env() == 9303
    monkeypatch.setenv("STOKER_METRICS_PORT", "0")  # any free port, whatever the rank
    assert metrics_port_from_env() == 0
    monkeypatch.setenv("STOKER_METRICS_PORT", "65535")
    with pytest.raises(ValueError, match="LOCAL_RANK = 65538"):
        metrics_port_from_env()
    monkeypatch.setenv("STOKER_METRICS_PORT", "9300")
    monkeypatch.setenv("LOCAL_RANK", "two")
    with pytest.raises(ValueError, match=r"\$LOCAL_RANK must be a non-negative integer, got 'two'"):
        metrics_port_from_env()
