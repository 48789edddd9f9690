"""Statistics that tell the truth when an epoch delivers nothing: ``drop_last`` with fewer samples
than a batch, or more ranks than samples with ``even="drop"``. Such an epoch warns once (naming
why) and its stats do not claim ``exactly_once``; an epoch that delivers its plan still does."""

from __future__ import annotations

import warnings

import pytest

from _helpers import sample_id
from stoker import Loader, ReadOptions, open_dataset
from stoker.loader.epoch_stats import why_empty
from stoker.store.pack import pack

N = 6


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> str:
    src = tmp_path_factory.mktemp("small-src")
    for i in range(N):
        (src / f"s{i}.bin").write_bytes(f"{i}".encode().ljust(100, b"."))
    dst = tmp_path_factory.mktemp("small") / "packed"
    pack(str(src), str(dst), source="files", progress=False)
    return str(dst)


@pytest.mark.parametrize(
    "kw,cause",
    [
        (dict(batch_size=8, drop_last=True), "drop_last=True drops the dataset's only batch: 6 sample"),
        (dict(batch_size=2, rank=3, world_size=8, read=ReadOptions(even="drop")), 'even="drop" splits 6 sample'),
    ],
    ids=["drop-last", "more-ranks-than-samples"],
)
def test_an_epoch_that_delivers_nothing_says_why_and_is_not_exactly_once(small, kw, cause):
    ds = open_dataset(small, cache=False)
    with Loader(ds, num_workers=0, decode=sample_id, **kw) as loader:
        with pytest.warns(RuntimeWarning, match="delivers no sample of 6") as seen:
            assert list(loader) == []
        assert any(cause in str(w.message) for w in seen)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # once per loader: the next epochs are quiet
            assert list(loader) == []
        for st in loader.history:
            assert st.samples == 0 and not st.exactly_once and cause in st.empty_reason


def test_an_epoch_that_delivers_its_plan_is_still_exactly_once(small):
    ds = open_dataset(small, cache=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with Loader(ds, 4, num_workers=0, decode=sample_id, drop_last=True) as loader:
            assert sum(len(b) for b in loader) == 4
    assert loader.stats.exactly_once and loader.stats.empty_reason == ""


def test_why_empty():
    assert why_empty(0, 1, "pad", 8, True) == ""  # nothing to deliver: nothing missed
    assert why_empty(10, 4, "pad", 8, False) == ""
    assert "fewer than batch_size 8" in why_empty(10, 4, "pad", 8, True)  # 3 per rank
    assert "this rank's only batch" in why_empty(10, 4, "pad", 8, True)
    assert "every rank gets 0" in why_empty(3, 4, "drop", 1, False)
    assert why_empty(3, 4, "pad", 1, False) == ""
