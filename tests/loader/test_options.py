"""The Loader's option groups: validation, repr, and the old flat keywords (deprecated for one
release: each still works, warns, and lands in its group's field)."""

from __future__ import annotations

import inspect
import warnings

import pytest

from stoker import ImageOptions, Loader, ReadOptions, RunOptions, open_dataset
from stoker.loader.options import DEPRECATED, GROUPS, loader_kwargs

# A value for each old keyword that differs from its default and is valid without a GPU.
OLD_VALUES = {
    "order": "uniform",
    "order_window": 4,
    "even": "drop",
    "cache_aware_window": 8,
    "prefetch_batches": 3,
    "prefetch_bytes": "8MiB",
    "staging_bytes": 1 << 20,
    "fetch_concurrency": 2,
    "prefetch_next_epoch": False,
    "image_size": 32,
    "exif_orientation": True,
    "cache_form": "jpeg",
    "cache_form_bytes": "1GiB",
    "cache_form_dir": "/tmp/derived",
    "decode_device": None,
    "device": "cpu",
    "on_error": "skip",
    "timeout_s": 7.5,
    "start_method": "spawn",
    "metrics_port": None,
    "epoch": 3,
}
PARSED = {"prefetch_bytes": 8 << 20, "cache_form_bytes": 1 << 30}


@pytest.fixture(scope="module")
def ds(packed_local):
    return open_dataset(packed_local, cache=False)


def test_every_old_keyword_has_a_test_value():
    assert set(OLD_VALUES) == set(DEPRECATED)


@pytest.mark.parametrize("old", sorted(DEPRECATED))
def test_old_keyword_warns_and_lands_in_its_option(ds, old):
    value = OLD_VALUES[old]
    with pytest.warns(DeprecationWarning, match=rf"^{old}= is deprecated; ") as rec:
        loader = Loader(ds, 8, num_workers=0, **{old: value})
    group, field = DEPRECATED[old]
    msg = str(rec[0].message)
    want = PARSED.get(old, value)
    if group is None:
        assert "set_epoch" in msg and loader.epoch == value
        return
    assert f"use {group}={GROUPS[group].__name__}({field}=...)" in msg
    opt = {"read": loader.read, "image": loader.image, "run": loader.run}[group]
    assert getattr(opt, field) == want


def test_the_warning_points_at_the_callers_line(ds):
    with pytest.warns(DeprecationWarning) as rec:
        Loader(ds, 8, num_workers=0, timeout_s=5)
    assert rec[0].filename == __file__


def test_a_loader_made_by_stoker_for_the_user_warns_at_the_users_line(ds):
    """``ctx.loader(timeout_s=5)`` makes the Loader inside stoker (stoker.cluster.jobs.job): the warning
    names the user's line, not stoker's, so the default filters show it."""
    made_by_stoker = {"__name__": "stoker.cluster.fake", "Loader": Loader}
    exec("def make(ds, **kw):\n    return Loader(ds, 8, num_workers=0, **kw)\n", made_by_stoker)
    with pytest.warns(DeprecationWarning) as rec:
        made_by_stoker["make"](ds, timeout_s=5)
    assert rec[0].filename == __file__


def test_old_keyword_with_its_group_is_refused(ds):
    with pytest.raises(TypeError, match=r"prefetch_bytes= and read= were both given"):
        Loader(ds, 8, num_workers=0, read=ReadOptions(order="uniform"), prefetch_bytes=1 << 20)


def test_unknown_keyword_is_a_type_error(ds):
    with pytest.raises(TypeError, match="unexpected keyword argument 'prefetch_byte'"):
        Loader(ds, 8, prefetch_byte=1)


def test_signature_is_short():
    params = [
        p
        for p in inspect.signature(Loader.__init__).parameters.values()
        if p.name != "self" and p.kind is not inspect.Parameter.VAR_KEYWORD
    ]
    assert len(params) <= 14


def test_new_api_does_not_warn(ds):
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        lo = Loader(
            ds,
            8,
            num_workers=0,
            read=ReadOptions(prefetch_bytes="8MiB", order="uniform"),
            image=ImageOptions(image_size=32),
            run=RunOptions(timeout_s=9),
        )
    assert lo.read.prefetch_bytes == 8 << 20 and lo.cfg.image_size == 32 and lo.run.timeout_s == 9
    assert lo.read.order == "uniform"


def test_options_validate_and_name_the_field():
    with pytest.raises(ValueError, match="ReadOptions.prefetch_bytes"):
        ReadOptions(prefetch_bytes="lots")
    with pytest.raises(ValueError, match="ReadOptions.order"):
        ReadOptions(order="bogus")
    with pytest.raises(ValueError, match="ReadOptions.even"):
        ReadOptions(even="odd")
    with pytest.raises(TypeError, match="ReadOptions.fetch_concurrency"):
        ReadOptions(fetch_concurrency=2.5)
    with pytest.raises(ValueError, match="ImageOptions.image_size"):
        ImageOptions(image_size=0)
    with pytest.raises(ValueError, match="ImageOptions.cache_form: unknown sample form"):
        ImageOptions(cache_form="png")
    with pytest.raises(ValueError, match="ImageOptions.decode_device must be"):
        ImageOptions(decode_device="tpu")
    with pytest.raises(ValueError, match="RunOptions.on_error"):
        RunOptions(on_error="ignore")
    with pytest.raises(ValueError, match="RunOptions.timeout_s"):
        RunOptions(timeout_s=0)
    with pytest.raises(TypeError, match="read must be a ReadOptions"):
        Loader(None, 8, read=RunOptions())
    with pytest.raises(TypeError, match="image must be an ImageOptions, got RunOptions"):
        Loader(None, 8, image=RunOptions())


@pytest.mark.parametrize(
    "make, field",
    [
        (lambda v: ReadOptions(prefetch_next_epoch=v), "ReadOptions.prefetch_next_epoch"),
        (lambda v: ImageOptions(exif_orientation=v), "ImageOptions.exif_orientation"),
    ],
)
def test_a_flag_takes_a_bool_not_any_truthy_value(make, field):
    """A string such as "no" is truthy: it is refused rather than read as True."""
    for bad in ("no", "false", 0, 1, None):
        with pytest.raises(TypeError, match=field):
            make(bad)
    assert make(False) != make(True)


def test_run_options_check_the_form_and_the_loader_checks_the_machine():
    with pytest.raises(ValueError, match="RunOptions.start_method must be one of"):
        RunOptions(start_method="thread")
    with pytest.raises(ValueError, match="RunOptions.device must be"):
        RunOptions(device="gpu")
    # a CUDA option can be built where there is no GPU (a login node); the Loader checks CUDA
    assert RunOptions(device="cuda:1").device == "cuda:1"
    assert RunOptions(start_method="spawn").start_method == "spawn"


def test_options_are_frozen_and_repr_shows_what_changed():
    r = ReadOptions(prefetch_bytes="1MiB", order="uniform")
    assert r.prefetch_bytes == 1 << 20
    assert repr(r) == "ReadOptions(order='uniform', prefetch_bytes=1048576)"
    assert repr(ReadOptions()) == "ReadOptions()"
    assert repr(RunOptions(timeout_s=5)) == "RunOptions(timeout_s=5)"
    with pytest.raises(AttributeError):
        r.order = "blockwise"


def test_loader_kwargs_groups_a_flat_config():
    kw = loader_kwargs({"batch_size": 16, "timeout_s": 15.0, "image_size": 32, "staging_bytes": 4 << 20})
    assert kw == {
        "batch_size": 16,
        "run": RunOptions(timeout_s=15.0),
        "image": ImageOptions(image_size=32),
        "read": ReadOptions(staging_bytes=4 << 20),
    }


def test_metrics_port_must_be_a_port_number():
    with pytest.raises(ValueError, match=r"RunOptions\.metrics_port must be a port number in 0\.\.65535, got 70000"):
        RunOptions(metrics_port=70000)
    with pytest.raises(ValueError, match=r"RunOptions\.metrics_port must be >= 0"):
        RunOptions(metrics_port=-1)
    assert RunOptions(metrics_port=65535).metrics_port == 65535
