"""`stoker bench decode` at a tiny size: the report has every field and a skipped peer is recorded."""

from stoker_lab.bench.decode_bench import run


def test_decode_bench_report(tmp_path):
    r = run(images=48, seconds=0.2, workers=(1,), batch_size=16, epochs=2, dali=False, workdir=str(tmp_path))
    assert r["per_core"]["stoker"] > 0 and r["per_core"]["pillow"] > 0 and r["per_core"]["dali"] is None
    assert r["skipped"] == [{"loader": "dali", "reason": "--no-dali"}]
    (row,) = r["loader"]
    assert row["workers"] == 1 and row["samples_per_s"] > 0
    assert abs(row["efficiency"] - row["samples_per_s"] / r["per_core"]["stoker"]) < 1e-9
    assert 0 <= row["trainer_cpu_per_batch_s"] < 1.0
    cf = r["cache_forms"]
    assert {"raw", "jpeg320", "jpeg256", "rgb256", "rgb"} <= set(cf["forms"])
    for name, row in cf["forms"].items():
        assert row["bytes_per_sample"] > 0 and row["decode_per_core"] > 0
        if name != "raw":
            assert row["pixel_mad"] >= 0 and row["fill_s_per_sample"] > 0
    assert cf["auto"]["choice"] in cf["forms"]
    # every sample of the last epoch is served from its entry: a derived image, or (a JPEG form
    # whose cap the image already fits) an entry saying "use the raw sample"
    assert cf["loader"]["derived_hits"] + cf["loader"]["derived_same"] == 48
    assert cf["loader"]["samples_per_s"] > 0
