"""numpy <-> Arrow over the same bytes (``stoker.store.arrownp``), and what it is for: opening a
dataset and reading it imports no pandas (about 30 MB of RSS in every process that opens one)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stoker.store.arrownp import from_bools, from_numpy, from_strings, to_numpy

DTYPES = ["int8", "int16", "int32", "int64", "uint8", "uint32", "uint64", "float32", "float64"]


@pytest.mark.parametrize("dtype", DTYPES)
def test_numbers_round_trip_over_the_same_bytes_and_slices_keep_their_offset(dtype):
    a = (np.arange(37) * 3).astype(dtype)
    arr = from_numpy(a)
    assert arr.type == pa.from_numpy_dtype(a.dtype)
    assert arr.to_pylist() == a.tolist()  # what Arrow itself reads there
    back = to_numpy(arr)
    assert back.dtype == a.dtype and np.array_equal(back, a)
    assert np.array_equal(to_numpy(arr.slice(5, 11)), a[5:16])
    assert np.array_equal(to_numpy(pa.chunked_array([arr.slice(0, 3), arr.slice(3)])), a)
    assert np.array_equal(to_numpy(from_numpy(a[::2])), a[::2])  # strided: copied contiguous first


@settings(max_examples=60, deadline=None)
@given(st.lists(st.one_of(st.none(), st.booleans()), max_size=70), st.integers(0, 9), st.booleans())
def test_booleans_and_nulls_read_as_arrow_reads_them(values, start, fill):
    arr = pa.array(values, type=pa.bool_()).slice(min(start, len(values)))
    want = [fill if v is None else v for v in arr.to_pylist()]
    assert to_numpy(arr, null=fill).tolist() == want
    if arr.null_count:
        with pytest.raises(ValueError, match="null"):
            to_numpy(arr)
    else:
        assert to_numpy(arr).tolist() == want
    mask = np.array([bool(v) for v in values], bool)
    assert to_numpy(from_bools(mask)).tolist() == mask.tolist()


def test_integer_nulls_take_the_given_value_and_other_types_are_refused():
    arr = pc.list_value_length(pa.array([[1, 2], None, [], [3]]))
    assert to_numpy(arr, null=0).tolist() == [2, 0, 0, 1]
    with pytest.raises(ValueError, match="1 null"):
        to_numpy(arr)
    with pytest.raises(ValueError, match="string"):
        to_numpy(pa.array(["a"]))
    with pytest.raises(ValueError, match="1-d integer or float"):
        from_numpy(np.array(["a"]))


def test_opening_and_reading_a_dataset_imports_no_pandas(packed_local, tmp_path):
    """In the training process and in spawned workers (each would carry about 30 MB more), also
    for a dataset whose samples have several fields."""
    pytest.importorskip("pandas")  # nothing to show where it is not installed
    script = textwrap.dedent(
        """
        import sys
        import numpy as np
        from stoker import Loader, RunOptions, open_dataset

        def probe(fields, rng):
            return np.array([int("pandas" in sys.modules)])

        if __name__ == "__main__":
            ds = open_dataset(sys.argv[1], cache_dir=sys.argv[2], cache_bytes=64 << 20)
            seen = []
            for workers in (0, 2):
                with Loader(ds, 8, num_workers=workers, decode=probe, run=RunOptions(start_method="spawn")) as ld:
                    seen += [int(np.asarray(b).sum()) for b in ld]
            assert len(ds.subset([ds.key(3), ds.key(5)])) == 2  # lookups by key
            several = open_dataset(sys.argv[3], cache=False)  # samples of several fields (members)
            assert several.read_fields(3) == {"bin": b"xxx", "json": b'{"a": 3}', "cls": b"1"}
            print(int("pandas" in sys.modules), sum(seen), len(seen))
        """
    )
    from stoker import Writer

    with Writer(str(tmp_path / "several")) as w:
        for i in range(10):
            w.write({"__key__": f"k{i}", "bin": b"x" * i, "json": {"a": i}, "cls": i % 2})
    path = tmp_path / "probe.py"
    path.write_text(script)
    done = subprocess.run(
        [sys.executable, str(path), packed_local, str(tmp_path / "cache"), str(tmp_path / "several")],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr
    here, in_workers, batches = map(int, done.stdout.split())
    assert batches > 2
    assert (here, in_workers) == (0, 0), done.stdout


def test_strings_are_arrow_strings_and_a_non_string_is_named():
    values = ["n01440764_10026", "", "ünï", "a" * 300]
    arr = from_strings(values)
    assert arr.type == pa.string() and arr.to_pylist() == values
    assert from_strings([]).to_pylist() == []
    with pytest.raises(TypeError, match="int 7"):
        from_strings(["a", 7])
