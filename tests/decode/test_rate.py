"""The decode calibration: several short rounds, the recipes taking turns, summarised by the
median, so one moment of a busy machine moves the figure by one round and not the whole of it."""

from __future__ import annotations

import pytest

from stoker.decode import rate


def test_rounds_take_turns_after_an_untimed_warm_up(monkeypatch):
    calls = []
    script = iter([0.0, 0.0, 100.0, 50.0, 900.0, 40.0, 110.0, 60.0])  # warm-ups, then s p s p s p

    def fake(payloads, mode, min_seconds, recipe, *, size, seed):
        calls.append((recipe, len(payloads), min_seconds))
        return next(script)

    monkeypatch.setattr(rate, "measure_decode_rate", fake)
    got = rate.measure_decode_rounds([b"x"] * 20, rounds=3, round_seconds=0.25)
    assert [c[0] for c in calls] == ["stoker", "pillow"] + ["stoker", "pillow"] * 3
    assert calls[0][1:] == (8, 0.0) and calls[1][1:] == (8, 0.0)  # the warm-up: a few payloads, untimed
    assert all(c[1:] == (20, 0.25) for c in calls[2:])
    assert got == {"stoker": [100.0, 900.0, 110.0], "pillow": [50.0, 40.0, 60.0]}
    assert rate.median_rate(got["stoker"]) == 110.0  # the fast moment (900/s) is one round of three


def test_median_rate():
    assert rate.median_rate([100.0, 1000.0, 1010.0, 990.0, 1005.0]) == 1000.0
    assert rate.median_rate([3.0, 1.0]) == 2.0
    with pytest.raises(ValueError, match="no decode rate"):
        rate.median_rate([])
    with pytest.raises(ValueError, match="rounds must be >= 1"):
        rate.measure_decode_rounds([b"x"], rounds=0)


def test_rounds_on_real_photos(sample_tree):
    photos = [f.read_bytes() for f in sorted((sample_tree / "train").rglob("*.JPEG"))[:6]]
    got = rate.measure_decode_rounds(photos, rounds=2, round_seconds=0.01)
    assert set(got) == {"stoker", "pillow"}
    assert all(len(v) == 2 and all(r > 0 for r in v) for v in got.values())
