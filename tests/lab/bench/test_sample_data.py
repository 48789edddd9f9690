"""The offline sample ImageNet-style tree made from bundled photographs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image

from stoker_lab.sample_data import MANIFEST, make_sample_data


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.glob("train/*/*"))}


def test_layout_and_counts(sample_tree):
    classes = sorted(p.name for p in (sample_tree / "train").iterdir())
    assert len(classes) == 4 and all(c.startswith("n") and len(c) == 9 for c in classes)
    files = sorted(sample_tree.glob("train/*/*.JPEG"))
    assert len(files) == 120
    assert len({f.stem for f in files}) == 120
    for f in files:
        assert f.stem.startswith(f.parent.name + "_")
    per_class = [len(list((sample_tree / "train" / c).iterdir())) for c in classes]
    assert per_class == [30] * 4
    manifest = json.loads((sample_tree / MANIFEST).read_text())
    assert manifest["bytes"] == sum(f.stat().st_size for f in files)


def test_sizes_aspect_and_quality(sample_tree):
    sizes = []
    for f in sorted(sample_tree.glob("train/*/*.JPEG")):
        with Image.open(f) as im:
            assert im.format == "JPEG" and im.mode == "RGB"
            w, h = im.size
            assert 300 <= min(w, h) <= 500
            assert 3 / 4 <= w / h <= 4 / 3
            # IJG scaling of the standard luminance table (max entry 121): 36 at quality 85,
            # 12 at quality 95 (39 at 84, 10 at 96).
            assert 12 <= max(im.quantization[0]) <= 36
        sizes.append(f.stat().st_size)
    mean = sum(sizes) / len(sizes)
    assert 30_000 < mean < 150_000, mean


def test_deterministic_and_idempotent(tmp_path, sample_tree):
    again = make_sample_data(str(tmp_path / "a"), images=120, classes=4, seed=0, workers=1)
    assert again["generated"] and again["images"] == 120 and again["bytes"] > 0
    assert _files(tmp_path / "a") == _files(sample_tree)  # other worker count, same bytes

    marker = tmp_path / "a" / "train" / "marker"
    marker.write_text("kept")
    reused = make_sample_data(str(tmp_path / "a"), images=120, classes=4, seed=0)
    assert not reused["generated"] and reused["bytes"] == again["bytes"] and marker.exists()

    changed = make_sample_data(str(tmp_path / "a"), images=40, classes=2, seed=1, workers=2)
    assert changed["generated"] and not marker.exists()
    assert len(list((tmp_path / "a").glob("train/*/*.JPEG"))) == 40
    assert len(list((tmp_path / "a" / "train").iterdir())) == 2


def test_different_seed_differs(tmp_path, sample_tree):
    other = make_sample_data(str(tmp_path / "b"), images=120, classes=4, seed=1, workers=2)
    assert other["generated"]
    a, b = _files(sample_tree), _files(tmp_path / "b")
    assert a.keys() == b.keys()
    assert sum(a[k] != b[k] for k in a) == len(a)


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError):
        make_sample_data(str(tmp_path), images=3, classes=4)
    with pytest.raises(ValueError):
        make_sample_data(str(tmp_path), images=3, classes=0)


def test_a_larger_short_side_makes_bigger_photos_and_is_part_of_the_parameters(tmp_path, sample_tree):
    small = make_sample_data(str(tmp_path / "s"), images=20, classes=4, seed=0, workers=1)
    big = make_sample_data(str(tmp_path / "b"), images=20, classes=4, seed=0, workers=1, short_side=(400, 600))
    assert big["bytes"] > 1.2 * small["bytes"]
    for f in sorted((tmp_path / "b").glob("train/*/*.JPEG")):
        with Image.open(f) as im:
            assert im.format == "JPEG" and 400 <= min(im.size) <= 600
    manifest = json.loads((tmp_path / "b" / MANIFEST).read_text())
    assert manifest["short_side"] == [400, 600]
    assert "short_side" not in json.loads((tmp_path / "s" / MANIFEST).read_text())  # old trees still match
    again = make_sample_data(str(tmp_path / "b"), images=20, classes=4, seed=0, workers=1, short_side=(400, 600))
    assert not again["generated"]
    other = make_sample_data(str(tmp_path / "b"), images=20, classes=4, seed=0, workers=1)
    assert other["generated"] and other["bytes"] == small["bytes"]  # another side: made again


@pytest.mark.parametrize("side", [(10, 20), (500, 400), (0, 0)])
def test_a_bad_short_side_is_refused(tmp_path, side):
    with pytest.raises(ValueError, match="short_side"):
        make_sample_data(str(tmp_path), images=4, classes=4, short_side=side)
    assert not (tmp_path / "train").exists()
