"""`stoker bench peers` at a tiny size: the report's JSON schema, every loader either measured or
skipped with its reason. Peers that need their own virtual environment are pointed at an empty
venv directory, so they must show up in `skipped` whatever this machine has cached (the test never
installs one, and its time does not grow with the venvs a benchmark run left behind). SPDL and
Ray Data have a test of their own (tests/lab/bench/test_bench_peers_new.py)."""

import json

from stoker_lab.bench.peers.bench import PeersConfig, run_peers

LOADERS = ("stoker", "torch", "webdataset", "streaming", "litdata", "dali")
RUN_KEYS = {"loader", "epoch", "samples_per_s", "first_batch_s", "stall_fraction", "cpu_s_per_1000", "origin_bytes"}


def test_peers_report_schema(tmp_path, monkeypatch):
    monkeypatch.setenv("STOKER_BENCH_VENVS", str(tmp_path / "no-venvs"))
    out = tmp_path / "peers.json"
    cfg = PeersConfig(
        images=24,
        classes=3,
        epochs=2,
        batch_size=8,
        workers=1,
        consumer_rate=4000.0,
        loaders=LOADERS,
        make_venvs=False,
        run_timeout_s=600,
        workdir=str(tmp_path / "work"),
        json_path=str(out),
        plot_path=str(tmp_path / "peers.png"),
    )
    r = run_peers(cfg)
    assert json.loads(out.read_text())["runs"] == r["runs"]
    assert (tmp_path / "peers.png").stat().st_size > 0
    assert isinstance(r["machine"]["loadavg_start"], list) and len(r["machine"]["loadavg_start"]) == 3
    for row in r["runs"]:
        assert RUN_KEYS <= set(row) and row["loader"] in LOADERS
        assert row["samples"] == 24, row  # every loader delivers the whole set each epoch
        assert row["samples_per_s"] > 0 and 0.0 <= row["stall_fraction"] <= 1.0
        assert row["cpu_s_per_1000"] > 0 and row["origin_cpu_s_per_1000"] >= 0
    for f in r["formats"]:
        assert {"loader", "convert_seconds", "bytes"} <= set(f) and f["bytes"] > 0
    ran = {row["loader"] for row in r["runs"]}
    skipped = {s["loader"]: s["reason"] for s in r["skipped"]}
    assert {"stoker", "torch", "webdataset"} <= ran and not {"stoker", "torch", "webdataset"} & set(skipped)
    for loader in LOADERS:  # each loader measured for every epoch, or skipped with a reason
        epochs = sorted(row["epoch"] for row in r["runs"] if row["loader"] == loader)
        assert epochs == [0, 1] or skipped.get(loader, "").strip(), (loader, epochs, skipped)
    by = {(row["loader"], row["epoch"]): row for row in r["runs"]}
    for loader in ("stoker", "webdataset"):  # their caches: the first epoch reads the origin, the next does not
        assert by[(loader, 0)]["origin_bytes"] > 0 and by[(loader, 1)]["origin_bytes"] == 0
    assert by[("torch", 1)]["origin_bytes"] > 0  # no cache: every epoch reads every file again
    assert set(r["checks"]) == {
        "warm_vs_best_peer",
        "cold_vs_best_peer",
        "warm_cpu_lowest",
        "ray_data_stoker_vs_ray_data",
    }
    for loader in ran:  # each peer that ran says what it is: versions, cache, resume
        p = r["peers"][loader]
        assert p["versions"] and all(p["versions"].values()) and p["cache"] and p["resume"], (loader, p)


def test_missing_peer_environment_is_reported(tmp_path, monkeypatch):
    monkeypatch.setenv("STOKER_BENCH_VENVS", str(tmp_path / "no-venvs"))
    r = run_peers(
        PeersConfig(images=4, classes=2, epochs=1, loaders=("dali",), make_venvs=False, workdir=str(tmp_path / "work"))
    )
    assert r["runs"] == [] and r["formats"] == []
    (s,) = r["skipped"]
    assert s["loader"] == "dali" and "not present" in s["reason"] and str(tmp_path / "no-venvs") in s["reason"]
