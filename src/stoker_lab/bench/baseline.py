"""The standard recipe stoker is measured against: torch DataLoader over a map-style
ImageFolder dataset that reads each file from the origin through fsspec and decodes
it with Pillow (what `torchvision.datasets.ImageFolder` users get, with the same
transform semantics; torchvision itself does not import beside the CPU torch build
here, so the Pillow transforms of :mod:`stoker_lab.reference` stand in for it).
"""

from __future__ import annotations

import os
import posixpath

import numpy as np

from stoker.store.sources import IMG_EXTENSIONS
from stoker.storage import url_to_fs


class FsspecImageFolder:
    """Map-style dataset: ``ds[i] -> (image uint8 tensor (3,S,S), label int)``.

    Lists ``url/<class>/<file>`` once; each item is one whole-object GET plus a
    Pillow decode and transform. The filesystem is created lazily in each process.
    """

    def __init__(
        self, url: str, storage_options: dict | None = None, transform: str = "train", size: int = 224, seed: int = 0
    ):
        self.url, self.storage_options = url, dict(storage_options or {})
        self.transform, self.size, self.seed = transform, size, seed
        self.epoch = 0
        fs, root = url_to_fs(url, self.storage_options)
        files = sorted(p for p in fs.find(root) if posixpath.splitext(p)[1].lower() in IMG_EXTENSIONS)
        rels = [p[len(root.rstrip("/")) + 1 :] for p in files]
        self.classes = sorted({r.split("/")[0] for r in rels})
        cidx = {c: i for i, c in enumerate(self.classes)}
        self.samples = [(p, cidx[r.split("/")[0]]) for p, r in zip(files, rels)]
        self._fs, self._pid = None, None

    def __len__(self) -> int:
        return len(self.samples)

    def _filesystem(self):
        if self._fs is None or self._pid != os.getpid():
            self._fs, _ = url_to_fs(self.url, self.storage_options)
            self._pid = os.getpid()
        return self._fs

    def __getitem__(self, i: int):
        import io

        import torch
        from PIL import Image

        from stoker_lab.reference import pillow_eval_transform, pillow_train_transform

        path, label = self.samples[i]
        data = self._filesystem().cat_file(path)
        img = Image.open(io.BytesIO(data)).convert("RGB")
        if self.transform == "train":
            rng = np.random.default_rng([self.seed, self.epoch, i])
            arr = pillow_train_transform(img, rng, self.size)
        else:
            arr = pillow_eval_transform(img, self.size)
        return torch.from_numpy(arr), label


def make_baseline_loader(ds: FsspecImageFolder, batch_size: int, num_workers: int, seed: int = 0):
    """``torch.utils.data.DataLoader`` as the common recipe configures it (shuffle, workers, prefetch 2)."""
    import torch
    from torch.utils.data import DataLoader

    g = torch.Generator()
    g.manual_seed(seed)
    return DataLoader(
        ds,
        batch_size=batch_size,
        shuffle=True,
        num_workers=num_workers,
        generator=g,
        persistent_workers=num_workers > 0,
        prefetch_factor=2 if num_workers else None,
    )
