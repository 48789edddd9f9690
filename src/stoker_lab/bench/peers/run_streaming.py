"""Mosaic Streaming as a benchmark peer: MDS shards written by ``streaming.MDSWriter`` (a
``jpeg`` column: the original file bytes, since the images are opened from their files) and
read by ``StreamingDataset(remote="s3://...", local=<cache dir>)`` with its documented S3
settings (``S3_ENDPOINT_URL`` for an S3-compatible store), shuffle on, the local shard cache
kept between epochs, ``StreamingDataLoader`` workers; torchvision RandomResizedCrop(224) +
RandomHorizontalFlip on the decoded PIL image, uint8 output.

Runs under the Python of its own virtual environment (mosaicml-streaming 0.13.0, torch 2.14.1,
torchvision 0.29.1); see :mod:`stoker_lab.bench.peers._runner` for the protocol.
"""

import os

import _runner

ABOUT = {
    "packages": ["mosaicml-streaming", "torch", "torchvision", "pillow"],
    "recipe": "MDSWriter; StreamingDataset(remote, local, shuffle) + StreamingDataLoader (Streaming docs)",
    "cache": "local= shard cache on disk",
    "resume": "StreamingDataLoader.state_dict() mid-epoch",
}


def convert(src, out, cfg):
    from PIL import Image
    from streaming import MDSWriter

    with MDSWriter(out=out, columns={"image": "jpeg", "label": "int"}) as w:
        for path, label, _ in _runner.image_folder(src):
            w.write({"image": Image.open(path), "label": label})


def build(cfg):
    os.environ["S3_ENDPOINT_URL"] = cfg["storage_options"]["endpoint_url"]
    from streaming import StreamingDataLoader, StreamingDataset
    from streaming.base.storage import CloudDownloader
    from streaming.base.util import clean_stale_shared_memory
    from torchvision.transforms import v2

    clean_stale_shared_memory()
    tf = v2.Compose([v2.RandomResizedCrop(224, antialias=True), v2.RandomHorizontalFlip(), v2.PILToTensor()])

    class Images(StreamingDataset):
        def __getitem__(self, i):
            s = super().__getitem__(i)
            return tf(s["image"].convert("RGB")), s["label"]

    ds = Images(
        remote=cfg["url"], local=cfg["cache_dir"], shuffle=True, shuffle_seed=cfg["seed"], batch_size=cfg["batch_size"]
    )
    # A known bug taken out. The dataset downloaded its index.json here, with the S3 client each
    # Stream keeps, and the DataLoader then forks its workers: they share that client's pooled
    # keep-alive connection, so two workers' ranged GETs interleave on one socket. One worker
    # waits out botocore's 60 s read timeout for a reply the other took (cold epochs of 68-85 s
    # instead of 14 s, a first batch at 61 s, 8 MiB fetched twice), or takes bytes of another
    # shard's part as its own (PIL.UnidentifiedImageError). The same failure as any boto3 client
    # used across fork. Each stream gets a downloader with no client yet: each worker makes its own.
    for mosaic_stream in ds.streams:
        mosaic_stream._downloader = CloudDownloader.get(mosaic_stream.remote)
    return StreamingDataLoader(ds, batch_size=cfg["batch_size"], num_workers=cfg["workers"])


def epoch(loader, e):
    return loader


if __name__ == "__main__":
    _runner.main(convert, build, epoch, ABOUT)
