"""Accelerator path on the CPU: the missing-CUDA error, GPU-decode fallback logic (the pinned-slot
transfer: test_pinned_slots.py)."""

from __future__ import annotations

import numpy as np
import pytest
import simplejpeg
import torch

from stoker.decode import DecodeError, decode_image
from stoker.decode.gpu import GpuJpegDecoder, gpu_eligible
from stoker.loader import Loader, RunOptions
from stoker.loader.device.transfer import check_device
from stoker.store.dataset import open_dataset
from stoker_lab.reference import pillow_decode, pillow_train_transform


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without CUDA")
def test_cuda_without_cuda_is_a_clear_error(packed_local):
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        check_device("cuda")
    ds = open_dataset(packed_local, cache_dir=None)
    with pytest.raises(RuntimeError, match="device='cuda' but CUDA is not available"):
        Loader(ds, 4, run=RunOptions(device="cuda"))
    with pytest.raises(ValueError, match="RunOptions.device must be"):
        RunOptions(device="tpu")


def test_loader_device_cpu_is_todays_path(packed_local):
    ds = open_dataset(packed_local, cache_dir=None)
    with Loader(ds, 8, num_workers=0, run=RunOptions(device="cpu")) as lo:
        x, y = next(iter(lo))
        assert lo.pipeline.transfer is None and x.dtype == torch.uint8 and x.shape == (8, 3, 224, 224)


@pytest.fixture(scope="module")
def jpegs(packed_local):
    ds = open_dataset(packed_local, cache_dir=None)
    return [ds.read(i) for i in range(6)]


def _fake_decoder(bad: set, wrong: set, calls: list):
    """A stand-in for nvJPEG on the CPU: libjpeg-turbo's fast IDCT (so results differ a little from
    the CPU path), raising on images whose first bytes are in ``bad``, a wrong size for ``wrong``."""

    def decode_fn(datas):
        calls.append(len(datas))
        out = []
        for d in datas:
            tag = bytes(d[-64:])
            if tag in bad:
                raise RuntimeError("nvjpeg: status 6")
            arr = simplejpeg.decode_jpeg(bytes(d), fastdct=True)
            if tag in wrong:
                arr = arr[:-1]
            out.append(torch.from_numpy(arr.copy()).permute(2, 0, 1))
        return out

    return decode_fn


def test_fallback_per_sample(jpegs):
    calls = []
    truncated = jpegs[5][: len(jpegs[5]) // 2]
    datas = jpegs[:5] + [truncated]
    dec = GpuJpegDecoder("cpu", _fake_decoder({bytes(jpegs[1][-64:])}, {bytes(jpegs[2][-64:])}, calls))
    with pytest.raises(DecodeError, match="'k5'"):  # the truncated one: screened out, CPU refuses, key named
        dec.decode(datas, [f"k{i}" for i in range(6)])
    dec = GpuJpegDecoder("cpu", _fake_decoder({bytes(jpegs[1][-64:])}, {bytes(jpegs[2][-64:])}, calls))
    calls.clear()
    out = dec.decode(jpegs[:5], [f"k{i}" for i in range(5)])
    assert calls == [5, 1, 1, 1, 1, 1]  # the batch raised, then one by one
    assert dec.stats.batch_errors == 1 and dec.stats.gpu == 3 and dec.stats.gpu_failed == 2
    for i in (1, 2):  # failed / wrong-sized on the "GPU": exactly the CPU path
        assert np.array_equal(out[i].permute(1, 2, 0).numpy(), decode_image(jpegs[i], "k"))
    for i in (0, 3, 4):
        assert np.abs(out[i].permute(1, 2, 0).numpy().astype(int) - decode_image(jpegs[i], "k")).max() <= 16


def test_screening(jpegs):
    assert gpu_eligible(jpegs[0]) == decode_image(jpegs[0], "k").shape[:2]
    assert gpu_eligible(jpegs[0][:-2]) is None  # no EOI
    assert gpu_eligible(b"\x89PNG\r\n\x1a\n" + b"\0" * 100) is None
    assert gpu_eligible(jpegs[0], max_pixels=10) is None


def test_train_batch_matches_reference(jpegs):
    dec = GpuJpegDecoder("cpu", _fake_decoder(set(), set(), []))
    got = dec.train_batch(jpegs[:4], ["k"] * 4, [np.random.default_rng(s) for s in range(4)])
    assert got.shape == (4, 3, 224, 224) and got.dtype == torch.uint8
    for s in range(4):
        ref = pillow_train_transform(pillow_decode(jpegs[s]), np.random.default_rng(s))
        assert np.abs(got[s].numpy().astype(int) - ref).mean() < 2.0
