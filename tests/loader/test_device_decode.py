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


@pytest.mark.parametrize("workers", [0, 2])
def test_ranks_yield_the_same_number_of_batches_with_device_decode(tmp_path, cases_dir, workers):
    """A rank whose batches are undecodable whole (loader/workers/padding.py): the training process reads
    and decodes their substitutes on the device, the same ones the CPU path picks."""
    from test_padding import BAD, BATCH, N, make_ranked_dataset

    path = make_ranked_dataset(tmp_path, cases_dir)
    ds = open_dataset(path, cache=False)
    out = {}
    for rank in (0, 1):
        for where in ("device", "cpu"):
            image = ImageOptions(image_size=32)
            if where == "device":
                image = ImageOptions(
                    image_size=32, decode_device=GpuJpegDecoder("cpu", _fake_decoder(set(), set(), []))
                )
            with Loader(
                ds,
                BATCH,
                shuffle=False,
                seed=5,
                rank=rank,
                world_size=2,
                num_workers=workers,
                image=image,
                run=RunOptions(on_error="skip"),
            ) as loader:
                sizes = [len(y) for _, y in loader]
                out[rank, where] = (sizes, len(loader), loader.stats)
    (s0, n0, st0), (s1, n1, st1) = out[0, "device"], out[1, "device"]
    assert len(s0) == len(s1) == n0 == n1 == N // 2 // BATCH and st0.batches == st1.batches == len(s0)
    assert s0 == [4, 4, 4, 3] and s1 == [4, 4, 4, 4]
    assert st0.skipped == len(BAD) and st0.padded == 2 * BATCH and st0.samples == N // 2 - len(BAD)
    assert st0.exactly_once and st1.exactly_once and st1.padded == 0  # over the samples that decode
    assert st0.padded_keys == out[0, "cpu"][2].padded_keys  # the same substitutes as the CPU path
    assert not {int(k.split("/")[1]) for k in st0.padded_keys} & BAD
