"""Subsets and splits of a packed dataset (``ds.subset``, ``ds.split``): every form of selection,
its errors, a split that is disjoint, covering and the same in every process, and a subset that
shares the whole dataset's index, cache and version while counting its own samples."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from _helpers import pack_id_dataset
from stoker import open_dataset

N = 40


@pytest.fixture(scope="module")
def url(tmp_path_factory) -> str:
    """``N`` samples ``s0000``.. whose bytes start with their id, in blocks of about five."""
    return pack_id_dataset(tmp_path_factory.mktemp("subsets"), N, size=3000, shard_bytes=32 << 10)


@pytest.fixture
def ds(url, tmp_path):
    return open_dataset(url, cache_dir=str(tmp_path / "cache"), cache_bytes=16 << 20, block_bytes=16 << 10)


def _ids(sub) -> list[int]:
    """The ids the samples' own bytes name, read through the subset (``sub.read(i)``)."""
    return [int(sub.read(i).split(b".")[0]) for i in range(len(sub))]


def test_every_form_of_selection_gives_the_named_samples_in_the_original_order(ds):
    want = [3, 7, 21, 30]
    forms = {
        "ids": [21, 3, 30, 7],
        "range": range(3, 31, 1),
        "numpy ids": np.array([30, 7, 3, 21], dtype=np.int32),
        "keys": ["s0021", "s0003", "s0030", "s0007"],
        "numpy keys": np.array(["s0007", "s0030", "s0021", "s0003"]),
        "mask": np.isin(np.arange(N), want),
        "pyarrow predicate": lambda t: pc.is_in(t["key"], value_set=pa.array(["s0003", "s0007", "s0021", "s0030"])),
        "numpy predicate": lambda t: np.isin(t["sample_id"].to_numpy(), want),
    }
    for name, sel in forms.items():
        sub = ds.subset(sel)
        expect = list(range(3, 31)) if name == "range" else want
        assert sub.selection.tolist() == expect, name
        assert len(sub) == len(expect)
        assert _ids(sub) == expect, name  # read(i) counts the subset's own samples
        assert [sub.key(i) for i in range(len(sub))] == [f"s{j:04d}" for j in expect]
        # the same packed dataset: index, blocks, cache and version shared, nothing copied
        assert sub.index is ds.index and sub.blocks is ds.blocks and sub.cache is ds.cache
        assert sub.version == ds.version


def test_subset_reads_index_and_fields_by_its_own_position(ds):
    sub = ds.subset([5, 9, 12])
    payload, label = sub[1]
    assert payload == ds.read(9) and label == int(ds.labels[9])
    assert sub[-1][0] == ds.read(12)
    fields = sub.read_fields(2, meta=True)
    assert fields["__key__"] == "s0012" and fields["__id__"] == 12  # __id__: the packed id
    assert sub.labels.tolist() == ds.labels[[5, 9, 12]].tolist()
    with pytest.raises(IndexError, match=r"sample 3 out of range for 3 samples of a subset of 40"):
        sub.read(3)
    # a subset of a subset: ids count the subset's samples, keys must be in it
    assert sub.subset([0, 2]).selection.tolist() == [5, 12]
    assert sub.subset(["s0009"]).selection.tolist() == [9]
    assert sub.whole.selection is None and len(sub.whole) == N


def test_bad_selections_are_refused_naming_what_is_wrong(ds):
    with pytest.raises(KeyError, match=r"no sample with key 'nope' in .*packed"):
        ds.subset(["s0001", "nope"])
    with pytest.raises(KeyError, match=r"key 's0002' is a sample of .* but not of this subset"):
        ds.subset([1, 3]).subset(["s0002"])
    with pytest.raises(IndexError, match=r"sample id 40 out of range for the 40 samples"):
        ds.subset([1, 40])
    with pytest.raises(IndexError, match=r"sample id -1 out of range"):
        ds.subset([-1])
    with pytest.raises(ValueError, match=r"sample id 4 is named twice"):
        ds.subset([4, 2, 4])
    with pytest.raises(ValueError, match=r"key 's0004' is named twice"):
        ds.subset(["s0004", "s0004"])
    with pytest.raises(TypeError, match="not one key string"):
        ds.subset("s0001")
    with pytest.raises(TypeError, match="not a mix of int, str"):
        ds.subset([1, "s0002"])
    with pytest.raises(TypeError, match="must return a bool array"):
        ds.subset(lambda t: 3)
    with pytest.raises(ValueError, match=r"gives \(3,\) flags, not one per sample \(40\)"):
        ds.subset(np.array([True, False, True]))
    with pytest.raises(TypeError, match="numpy array of sample ids, keys or a bool mask"):
        ds.subset(np.array([1.0, 2.0]))


def test_split_is_disjoint_covering_sized_and_deterministic(ds):
    train, val = ds.split([0.8, 0.2], seed=7)
    assert (len(train), len(val)) == (32, 8)
    a, b = set(train.selection.tolist()), set(val.selection.tolist())
    assert not a & b and a | b == set(range(N))
    assert train.selection.tolist() == sorted(a)  # the original order
    again = ds.split([0.8, 0.2], seed=7)
    assert [p.selection.tolist() for p in again] == [train.selection.tolist(), val.selection.tolist()]
    assert ds.split([0.8, 0.2], seed=8)[1].selection.tolist() != val.selection.tolist()
    parts = ds.split([1 / 3, 1 / 3, 1 / 3], seed=1)  # 40 = 14 + 13 + 13: within one sample of its share
    assert sorted(len(p) for p in parts) == [13, 13, 14]
    assert sorted(np.concatenate([p.selection for p in parts]).tolist()) == list(range(N))
    # a split of a subset deals the subset's samples
    halves = val.split([0.5, 0.5], seed=0)
    assert sorted(np.concatenate([h.selection for h in halves]).tolist()) == val.selection.tolist()


def test_split_is_the_same_in_another_process(ds, url):
    code = (
        "import sys; from stoker import open_dataset; "
        f"ds = open_dataset({url!r}, cache=False); "
        "print(ds.split([0.7, 0.3], seed=42)[1].selection.tolist())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == str(ds.split([0.7, 0.3], seed=42)[1].selection.tolist())


def test_split_refuses_fractions_that_do_not_sum_to_one(ds):
    with pytest.raises(ValueError, match=r"fractions must sum to 1, got \[0.5, 0.6\]"):
        ds.split([0.5, 0.6])
    with pytest.raises(ValueError, match=r"each fraction must be in \(0, 1\], got 1.2 in \[1.2, -0.2\]"):
        ds.split([1.2, -0.2])
    with pytest.raises(TypeError, match="non-empty list of numbers"):
        ds.split(0.9)
    with pytest.raises(TypeError, match="seed must be an int"):
        ds.split([0.5, 0.5], seed=0.5)


def test_repr_says_it_is_a_subset_and_of_how_many(ds):
    sub = ds.subset(range(10))
    assert "samples=10, subset_of=40" in repr(sub)
    assert "subset_of" not in repr(ds)
