"""Decode on the accelerator, in the training process (DLBooster's split of the work).

With ``Loader(..., image=ImageOptions(decode_device="cuda"))`` the loader's workers only read and verify each
sample's bytes (cache, staging or origin; checksums) and fill the labels; the training process
hands each batch's payloads to a :class:`stoker.decode.gpu.GpuJpegDecoder`, which decodes the
JPEGs on the GPU (nvJPEG) and falls back to the CPU path per sample, and applies the train or
eval transform on the device (same crop boxes and flips as the CPU path, slightly different
pixels, made after the workers are forked, tested only with a CPU stand-in for nvJPEG: this
folder's README.md).
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np

from ..options import WorkerConfig

__all__ = ["DeviceBatchDecoder"]


class DeviceBatchDecoder:
    """Training-process side of device decode: payloads of one batch -> tensors on the device.

    Args:
        spec: ``ImageOptions.decode_device``: a device name (a
            :class:`~stoker.decode.gpu.GpuJpegDecoder` is made for it) or a ready decoder object
            (with its ``decode(datas, keys, skip_errors)``, ``transform_batch(imgs, mode, rngs,
            size)`` and ``device``).
        dataset: the loader's dataset (sample keys for error messages).
        cfg: the loader's :class:`~stoker.loader.options.WorkerConfig` (``transform``, ``seed``,
            ``image_size``, ``on_error`` are used).
    """

    def __init__(self, spec, dataset, cfg: WorkerConfig):
        self.spec, self.dataset, self.cfg = spec, dataset, cfg
        self.decoder: Any = None  #: the decoder, once :meth:`start` made it

    def start(self) -> DeviceBatchDecoder:
        """Make the decoder, once (in the training process, after the workers are forked: the
        module docstring); returns self.

        Raises:
            RuntimeError: no CUDA or no GPU JPEG decoder.
        """
        if self.decoder is None:
            if isinstance(self.spec, str):
                from ...decode.gpu import GpuJpegDecoder

                self.decoder = GpuJpegDecoder(self.spec, exif_orientation=self.cfg.exif_orientation)
            else:
                self.decoder = self.spec
        return self

    def __call__(self, epoch: int, payloads: list, labels: np.ndarray):
        """Decode and transform one batch.

        Args:
            epoch: the epoch (for the per-sample RNG).
            payloads: ``[(sample id, bytes)]`` in batch order, as the workers read them.
            labels: ``(len(payloads),)`` int64, in the same order.

        Returns:
            ``(images, labels, skipped ids, skipped keys, padded)``: images ``(n, 3, S, S)`` uint8
            and labels ``(n,)`` int64 on the device, the samples dropped under
            ``on_error="skip"``, and the ``(sample id, key)`` of the substitutes decoded when every
            sample was dropped (:mod:`stoker.loader.workers.padding`; empty otherwise).

        Raises:
            DecodeError: a sample no decoder reads, with ``on_error="raise"`` (names its key).
            WorkerError: every sample was skipped and no substitute decoded (the dataset looks
                unreadable).
        """
        ids = [int(sid) for sid, _ in payloads]
        keys = [self.dataset.key(sid) for sid in ids]
        skip = self.cfg.on_error == "skip"
        imgs = self.decoder.decode([data for _, data in payloads], keys, skip_errors=skip)
        keep = [j for j, im in enumerate(imgs) if im is not None]
        skipped = [ids[j] for j in range(len(imgs)) if imgs[j] is None]
        skipped_keys = [keys[j] for j in range(len(imgs)) if imgs[j] is None]
        padded: list = []
        if keep:
            ids, imgs, labels = [ids[j] for j in keep], [imgs[j] for j in keep], labels[keep]
        elif payloads and self.cfg.substitutes:  # every sample skipped: substitutes, so every rank yields it
            padded, imgs = self._pad(epoch, ids, skipped_keys)
            ids = [sid for sid, _ in padded]
            labels = np.asarray(self.dataset.index.labels[ids])
        else:
            return None, None, skipped, skipped_keys, padded
        images, lab = self._transform(epoch, ids, imgs, labels)
        return images, lab, skipped, skipped_keys, padded

    def _transform(self, epoch: int, ids: list, imgs: list, labels: np.ndarray):
        """The transform of the decoded ``imgs`` (of sample ids ``ids``) and their ``labels``, on the device."""
        import torch

        from ...order import sample_seed

        mode, seed = self.cfg.transform, self.cfg.seed
        rngs = [np.random.default_rng(sample_seed(seed, epoch, sid)) for sid in ids] if mode == "train" else None
        images = self.decoder.transform_batch(imgs, mode, rngs, self.cfg.image_size)
        lab = torch.from_numpy(np.ascontiguousarray(labels, dtype=np.int64))
        return images, lab.to(self.decoder.device, non_blocking=True)

    def _pad(self, epoch: int, ids: list, skipped_keys: list) -> tuple[list, list]:
        """Substitutes for the batch of sample ids ``ids``, every one of them skipped
        (:mod:`stoker.loader.workers.padding`), read here and decoded on the device a round at a time:
        their ``(id, key)`` and decoded images.

        Raises:
            WorkerError: none of the samples tried decoded.
        """
        from ..workers.padding import probe_limit, probe_order, unreadable

        ds, limit = self.dataset, probe_limit(len(ids))
        order = probe_order(self.cfg.seed, epoch, ids, len(ds), self.cfg.sample_ids)
        padded: list[tuple[int, str]] = []
        imgs: list = []
        tried = 0
        while len(padded) < len(ids) and tried < limit:
            chunk = list(itertools.islice(order, min(len(ids) - len(padded), limit - tried)))
            if not chunk:
                break
            tried += len(chunk)
            keys = [ds.key(sid) for sid in chunk]
            got = self.decoder.decode([ds.read(sid) for sid in chunk], keys, skip_errors=True)
            for sid, key, img in zip(chunk, keys, got, strict=True):
                if img is not None:
                    padded.append((sid, key))
                    imgs.append(img)
        if not padded:
            raise unreadable(epoch, skipped_keys, tried, None)
        return padded, imgs
