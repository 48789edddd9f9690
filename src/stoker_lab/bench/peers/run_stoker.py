"""stoker as a benchmark peer: ``stoker pack`` to tar shards + Parquet index; Loader over the
node cache (disk tier, a budget that holds the dataset) with its prefetcher and decode workers.
With ``device="cuda"`` (the accelerator comparison) the JPEGs are decoded and transformed on the
GPU in the training process (``ImageOptions(decode_device="cuda")``), the workers only read.

Runs under stoker's own Python (see :mod:`stoker_lab.bench.peers._runner` for the protocol).
"""

import _runner

ABOUT = {
    "packages": ["stoker", "simplejpeg", "opencv-python-headless", "numpy", "torch"],
    "recipe": "stoker pack; open_dataset(s3 URL, cache_dir, cache_bytes) + Loader(transform='train') (README)",
    "cache": "node cache on disk (shared by the node's jobs, kept between jobs)",
    "resume": "Loader.state_dict() mid-epoch",
}


def convert(src, out, cfg):
    from stoker.store.pack import pack

    pack(src, out, shard_bytes=int(cfg.get("shard_bytes", 64 << 20)), overwrite=True, progress=False)


def build(cfg):
    from stoker.loader import Loader
    from stoker.store.dataset import open_dataset

    ds = open_dataset(
        cfg["url"],
        cache_dir=cfg["cache_dir"],
        cache_bytes=int(cfg["cache_bytes"]),
        storage_options=cfg["storage_options"],
    )
    return Loader(
        ds, cfg["batch_size"], num_workers=cfg["workers"], seed=cfg["seed"], transform="train", **options(cfg)
    )


def options(cfg):
    """Loader keyword arguments for ``cfg['device']``: none on the CPU; on "cuda", decode on it."""
    if cfg.get("device", "cpu") == "cpu":
        return {}
    from stoker.loader import ImageOptions

    return {"image": ImageOptions(decode_device=cfg["device"])}


def epoch(loader, e):
    return loader  # each iter() is the next epoch


if __name__ == "__main__":
    _runner.main(convert, build, epoch, ABOUT)
