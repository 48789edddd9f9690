"""Decode on the device in the training process (Loader(decode_device=...)), run on the CPU with
an injected stand-in for nvJPEG: the workers deliver bytes, the training process decodes them."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_transfer import _fake_decoder

from stoker.decode import DecodeError, decode_image, eval_transform
from stoker.decode.gpu import GpuJpegDecoder
from stoker.loader import ImageOptions, Loader, RunOptions
from stoker.order import sample_seed
from stoker.store.dataset import open_dataset


def _expected(dec, ds, ids, epoch, mode, seed):
    imgs = dec.decode([ds.read(int(i)) for i in ids], [ds.key(int(i)) for i in ids])
    rngs = [np.random.default_rng(sample_seed(seed, epoch, int(i))) for i in ids] if mode == "train" else None
    return dec.transform_batch(imgs, mode, rngs, 224)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_batches_are_the_device_decode_of_the_plan(packed_local, tmp_path, workers, mode):
    ds = open_dataset(packed_local, cache_dir=str(tmp_path), cache_bytes=64 << 20)
    calls = []
    dec = GpuJpegDecoder("cpu", _fake_decoder(set(), set(), calls))
    ref = GpuJpegDecoder("cpu", _fake_decoder(set(), set(), []))
    with Loader(ds, 16, num_workers=workers, transform=mode, seed=3, image=ImageOptions(decode_device=dec)) as loader:
        plan = loader.plan(0)
        batches = [(x.clone(), y.clone()) for x, y in loader]
        assert loader.stats.exactly_once and loader.stats.samples == len(ds)
    assert sum(calls) == len(ds) and dec.stats.gpu == len(ds)  # every sample went through the "GPU"
    for k, (x, y) in enumerate(batches):
        ids = plan[k * 16 : (k + 1) * 16]
        assert torch.equal(x, _expected(ref, ds, ids, 0, mode, 3))
        assert torch.equal(y, torch.from_numpy(ds.index.labels[ids]))
    if mode == "eval":  # and close to the CPU path (the stand-in uses a faster IDCT; torch resizes)
        x0 = batches[0][0][0].numpy().astype(int)
        cpu = eval_transform(decode_image(ds.read(int(plan[0])), "k")).astype(int)
        assert np.abs(x0 - cpu).mean() < 3.0


def test_workers_do_not_decode(packed_local, tmp_path, monkeypatch):
    """The workers only read: a decode in a worker would fail loudly here."""
    import stoker.decode.transforms as tmod

    def boom(*a, **k):
        raise AssertionError("decoded on the CPU in a worker")

    monkeypatch.setattr(tmod, "decode_transform", boom)
    monkeypatch.setattr("stoker.decode.decode_transform", boom)
    ds = open_dataset(packed_local, cache_dir=str(tmp_path), cache_bytes=64 << 20)
    dec = GpuJpegDecoder("cpu", _fake_decoder(set(), set(), []))
    with Loader(ds, 16, num_workers=2, image=ImageOptions(decode_device=dec)) as loader:
        assert sum(len(y) for _, y in loader) == len(ds)


def test_shared_cases_fall_back_per_sample(cases_packed, tmp_path):
    """Every case file: decoded on the "GPU", or screened to the CPU path (CMYK, libjpeg warnings,
    truncated); the truncated file is an error naming its key, or with skip, skipped and counted."""
    ds = open_dataset(cases_packed, cache_dir=str(tmp_path), cache_bytes=64 << 20)
    dec = GpuJpegDecoder("cpu", _fake_decoder(set(), set(), []))
    with Loader(ds, 4, num_workers=2, transform="eval", shuffle=False, image=ImageOptions(decode_device=dec)) as loader:
        with pytest.raises(DecodeError, match="pillow/truncated_jpeg"):
            for _ in loader:
                pass
    dec = GpuJpegDecoder("cpu", _fake_decoder(set(), set(), []))
    with Loader(
        ds,
        4,
        num_workers=2,
        transform="eval",
        shuffle=False,
        image=ImageOptions(decode_device=dec),
        run=RunOptions(on_error="skip"),
    ) as loader:
        got = sum(len(y) for _, y in loader)
        assert got == len(ds) - 1
        assert loader.stats.skipped == 1 and loader.stats.skipped_keys == ["pillow/truncated_jpeg"]
        st = loader.device_decode_stats
        assert st.screened >= 4 and st.gpu >= 6  # CMYK, 3 warning files, truncated; the ordinary ones


def test_decode_device_with_cache_form_is_refused(packed_local):
    ds = open_dataset(packed_local, cache_dir=None)
    with pytest.raises(ValueError, match="cache_form"):
        Loader(
            ds,
            4,
            image=ImageOptions(cache_form="rgb", decode_device=GpuJpegDecoder("cpu", _fake_decoder(set(), set(), []))),
        )


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without CUDA")
def test_decode_device_cuda_without_cuda_is_a_clear_error(packed_local):
    ds = open_dataset(packed_local, cache_dir=None)
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        Loader(ds, 4, image=ImageOptions(decode_device="cuda"))


def test_decode_device_validated_at_construction(packed_local):
    ds = open_dataset(packed_local, cache_dir=None)
    for bad in ("cpu", "gpu", object()):
        with pytest.raises(ValueError, match="decode_device"):
            Loader(ds, 4, image=ImageOptions(decode_device=bad))
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA is not available"):
            Loader(ds, 4, image=ImageOptions(decode_device=torch.device("cuda")))
