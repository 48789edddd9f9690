"""WebDataset as a benchmark peer: tar shards written by ``webdataset.ShardWriter``, read over
HTTP with curl (WebDataset's own ``http://`` opener; presigned GET URLs for the S3 origin),
shard shuffle + a 1,000-sample shuffle buffer, WebDataset's shard cache (``cache_dir``) turned
on, Pillow decode, ``WebLoader`` workers. Its transform is the same Pillow RandomResizedCrop(224)
+ flip as the torch recipe (:func:`stoker_lab.reference.pillow_train_transform`), since
torchvision does not import beside the CPU torch stoker is pinned to.

Runs under stoker's own Python (see :mod:`stoker_lab.bench.peers._runner` for the protocol).
"""

import os

import _runner

ABOUT = {
    "packages": ["webdataset", "torch", "pillow"],
    "recipe": "WebDataset(urls, shardshuffle, cache_dir).shuffle(1000).decode('pil') + WebLoader (WebDataset README)",
    "cache": "cache_dir: whole shards on local disk, per job",
    "resume": "none mid-epoch",
}


def convert(src, out, cfg):
    import webdataset as wds

    os.makedirs(out, exist_ok=True)
    with wds.ShardWriter(
        os.path.join(out, "shard-%06d.tar"), maxsize=int(cfg["wds_shard_bytes"]), maxcount=10**9, verbose=0
    ) as sink:
        for path, label, key in _runner.image_folder(src):
            with open(path, "rb") as f:
                sink.write({"__key__": key.replace("/", "_"), "jpg": f.read(), "cls": label})


def _augment(sample):
    """(RGB PIL image, label) -> (uint8 tensor (3, 224, 224), label). A tensor, so that the
    batch travels from the worker through shared memory, as torchvision's ToTensor output does."""
    import numpy as np
    import torch
    from stoker_lab.reference import pillow_train_transform

    img, label = sample  # decode("pil") gives RGB
    return torch.from_numpy(pillow_train_transform(img, np.random.default_rng(), 224)), label


def build(cfg):
    import webdataset as wds

    os.makedirs(cfg["cache_dir"], exist_ok=True)
    urls = cfg["urls"]
    ds = (
        wds.WebDataset(urls, shardshuffle=len(urls), cache_dir=cfg["cache_dir"], seed=cfg["seed"], empty_check=False)
        .shuffle(1000)
        .decode("pil")
        .to_tuple("jpg", "cls")
        .map(_augment)
        .batched(cfg["batch_size"], partial=True)
    )
    return wds.WebLoader(ds, batch_size=None, num_workers=cfg["workers"])


def epoch(loader, e):
    return loader


if __name__ == "__main__":
    _runner.main(convert, build, epoch, ABOUT)
