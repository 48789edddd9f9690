"""Byte sizes written for people: parse_size and format_size, and the API entry points that take them."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

import stoker
from stoker._units import MAX_BYTES, format_size, parse_size


@pytest.mark.parametrize(
    "text, n_bytes",
    [
        ("64MiB", 64 << 20),
        ("64 MiB", 64 << 20),
        ("64mib", 64 << 20),
        ("64M", 64 << 20),
        ("100gb", 100 * 10**9),
        ("100 GB", 100 * 10**9),
        ("1.5 GiB", 3 << 29),
        ("1.5GiB", 3 << 29),
        ("8G", 8 << 30),
        ("500MB", 500 * 10**6),
        ("2kB", 2000),
        ("2KiB", 2048),
        ("2k", 2048),
        ("1048576", 1 << 20),
        (" 7 ", 7),
        ("7B", 7),
        ("7 bytes", 7),
        ("1e3", 1000),
        ("0", 0),
        ("2TiB", 2 << 40),
        ("1PB", 10**15),
    ],
)
def test_parse_size_strings(text, n_bytes):
    assert parse_size(text) == n_bytes


def test_parse_size_numbers_pass_through():
    assert parse_size(4096) == 4096
    assert parse_size(2.0 * (1 << 20)) == 2 << 20


@pytest.mark.parametrize(
    "bad, match",
    [
        ("64 furlongs", "cannot read '64 furlongs'"),
        ("", "cannot read ''"),
        ("MiB", "cannot read"),
        ("1.5.0GiB", "cannot read"),
        ("-1MiB", "must not be negative"),
        (-5, "must not be negative"),
        ("1.5B", "not a whole number of bytes"),
        ("0.3k", "not a whole number"),
        (2.5, "not a whole number"),
        (float("nan"), "finite"),
        ("infb", "cannot read 'infb'"),
        ("inf", "cannot read"),
        ("nan GiB", "cannot read"),
        ("1e999", "over the largest size"),
        ("1e99999999b", "over the largest size"),
        ("9" * 5000, "over the largest"),
        (1 << 64, "over the largest size"),
        ("8192PiB", "over the largest size"),
    ],
)
def test_parse_size_rejects_with_a_message_naming_the_value(bad, match):
    with pytest.raises(ValueError, match=match):
        parse_size(bad, "cache_bytes")
    with pytest.raises(ValueError, match="cache_bytes"):
        parse_size(bad, "cache_bytes")


@pytest.mark.parametrize("bad", [None, True, [64], {"n": 1}])
def test_parse_size_rejects_other_types(bad):
    with pytest.raises(TypeError, match="prefetch_bytes"):
        parse_size(bad, "prefetch_bytes")


@given(
    st.integers(min_value=0, max_value=1 << 60),
    st.sampled_from(["", "B", "KiB", "MiB", "GiB", "TiB", "kB", "MB", "GB", "K", "M", "G"]),
)
def test_parse_size_is_exact_for_whole_numbers_with_any_unit(n, unit):
    scale = {
        "": 1,
        "B": 1,
        "KiB": 1 << 10,
        "MiB": 1 << 20,
        "GiB": 1 << 30,
        "TiB": 1 << 40,
        "kB": 10**3,
        "MB": 10**6,
        "GB": 10**9,
        "K": 1 << 10,
        "M": 1 << 20,
        "G": 1 << 30,
    }[unit]
    if n * scale > MAX_BYTES:  # beyond any 64-bit offset: refused, not wrapped or rounded
        with pytest.raises(ValueError, match="over the largest size"):
            parse_size(f"{n}{unit}")
        return
    assert parse_size(f"{n}{unit}") == n * scale
    assert parse_size(f"{n} {unit.lower()}") == n * scale


@pytest.mark.parametrize(
    "n_bytes, text",
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1.0 KiB"),
        (64 << 20, "64.0 MiB"),
        (3 << 29, "1.5 GiB"),
        (5 << 50, "5120.0 TiB"),
    ],
)
def test_format_size(n_bytes, text):
    assert format_size(n_bytes) == text


def test_cli_size_type_reports_the_bad_value():
    import argparse

    from stoker.cli.args import size_arg

    assert size_arg("1.5GiB") == 3 << 29
    with pytest.raises(argparse.ArgumentTypeError, match="'12 parsecs'"):
        size_arg("12 parsecs")


def test_open_dataset_takes_size_strings(tmp_path):
    """Sizes reach the cache as bytes; a bad one is refused (naming the argument) before any I/O."""
    src = tmp_path / "src" / "cls0"
    src.mkdir(parents=True)
    import numpy as np
    from PIL import Image

    for i in range(3):
        Image.fromarray(np.full((8, 8, 3), i * 40, np.uint8)).save(src / f"{i}.jpg")
    stoker.pack(str(tmp_path / "src"), str(tmp_path / "ds"), shard_bytes="1MiB")
    ds = stoker.open_dataset(
        str(tmp_path / "ds"), cache_dir=str(tmp_path / "cache"), cache_bytes="64MiB", block_bytes="64KiB"
    )
    assert ds.block_bytes == 64 << 10
    assert ds.cache.capacity_bytes == 64 << 20
    with pytest.raises(ValueError, match="cache_bytes.*'lots'"):
        stoker.open_dataset(str(tmp_path / "ds"), cache_dir=str(tmp_path / "cache"), cache_bytes="lots")
    with pytest.raises(ValueError, match="shard_bytes"):
        stoker.pack(str(tmp_path / "src"), str(tmp_path / "ds2"), shard_bytes="1 furlong")


def test_loader_takes_size_strings(tmp_path):
    """The Loader's byte budgets accept strings, and refuse a bad one naming the argument."""
    src = tmp_path / "src" / "cls0"
    src.mkdir(parents=True)
    import numpy as np
    from PIL import Image

    for i in range(2):
        Image.fromarray(np.full((8, 8, 3), i * 40, np.uint8)).save(src / f"{i}.jpg")
    stoker.pack(str(tmp_path / "src"), str(tmp_path / "ds"))
    ds = stoker.open_dataset(str(tmp_path / "ds"), cache=False)
    ld = stoker.Loader(
        ds,
        batch_size=2,
        num_workers=0,
        read=stoker.ReadOptions(prefetch_bytes="32MiB", staging_bytes="1.5 MiB"),
        image=stoker.ImageOptions(image_size=8, cache_form_bytes="1GiB"),
    )
    assert (ld.read.prefetch_bytes, ld.read.staging_bytes, ld.image.cache_form_bytes) == (32 << 20, 3 << 19, 1 << 30)
    with pytest.raises(ValueError, match="staging_bytes"):
        stoker.Loader(
            ds,
            batch_size=2,
            num_workers=0,
            read=stoker.ReadOptions(staging_bytes="some"),
            image=stoker.ImageOptions(image_size=8),
        )
