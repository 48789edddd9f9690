"""`stoker demo --kind tokens` on a tiny corpus: both loaders do the same work (same token count),
stoker serves every document once through shared memory; the report has the rates. (The speed
ratio itself is not asserted: wall-clock figures on shared machines move.)"""

import json

from _helpers import require


def test_tokens_demo_reports_both_loaders_on_the_same_work(tmp_path):
    require("tokens demo", "tokenizers")
    from stoker_lab.bench.tokens_demo import TokensDemoConfig, run_tokens_demo

    cfg = TokensDemoConfig(
        latency_ms=2,
        bandwidth_MBps=1000,
        workers=1,
        batch_size=8,
        seq_len=128,
        vocab_size=400,
        epochs=2,
        max_files=24,
        max_file_bytes=3000,
        workdir=str(tmp_path),
        json_path=str(tmp_path / "r.json"),
    )
    report = run_tokens_demo(cfg)
    assert [(r["loader"], r["epoch"]) for r in report["runs"]] == [
        ("baseline", 0),
        ("baseline", 1),
        ("stoker", 0),
        ("stoker", 1),
    ]
    assert report["dataset"]["documents"] == 24
    for name in ("same_work", "exactly_once", "shared_memory"):
        assert report["checks"][name]["ok"], (name, report["checks"][name])
    assert all(r["tokens_per_s"] > 0 and r["tokens"] > 24 for r in report["runs"])
    assert "ratio" in report["checks"]["warm_tokens_per_s_3x_baseline"]
    assert json.loads((tmp_path / "r.json").read_text())["kind"] == "tokens"
