"""LitData as a benchmark peer: chunks written by ``litdata.optimize`` (JPEG images opened from
their files, so the original bytes are stored) and read by ``litdata.StreamingDataset("s3://...",
cache_dir=..., storage_options={endpoint_url, keys})`` with shuffle on and its chunk cache kept
between epochs, ``StreamingDataLoader`` workers; images come back as uint8 tensors (LitData's
JPEG deserializer) and get torchvision RandomResizedCrop(224) + RandomHorizontalFlip.

Runs under the Python of its own virtual environment (litdata 0.2.76, torch 2.14.1,
torchvision 0.29.1); see :mod:`stoker_lab.bench.peers._runner` for the protocol.
"""

import os

import _runner

ABOUT = {
    "packages": ["litdata", "torch", "torchvision", "boto3"],
    "recipe": "litdata.optimize; StreamingDataset(s3 URL, cache_dir, shuffle) + StreamingDataLoader (LitData README)",
    "cache": "cache_dir chunk cache on disk",
    "resume": "StreamingDataLoader.state_dict() mid-epoch",
}


def _sample(item):
    from PIL import Image

    path, label = item
    return {"image": Image.open(path), "label": label}


def convert(src, out, cfg):
    import litdata

    items = [(p, label) for p, label, _ in _runner.image_folder(src)]
    litdata.optimize(
        fn=_sample, inputs=items, output_dir=out, chunk_bytes="64MB", num_workers=int(cfg["workers"]), mode="overwrite"
    )


def build(cfg):
    os.environ.setdefault("DISABLE_S5CMD", "1")  # s5cmd is not installed; LitData then uses boto3
    import litdata
    from litdata.streaming import downloader

    # LitData prefetches chunks with obstore, whose HTTP client refuses plain-http endpoints unless
    # its client option allow_http is set; LitData passes fixed client options and offers no knob.
    # The emulated origin speaks http (a real S3 endpoint is https), so the option is added here.
    downloader._OBSTORE_CLIENT_OPTIONS["allow_http"] = "true"
    from torchvision.transforms import v2

    tf = v2.Compose([v2.RandomResizedCrop(224, antialias=True), v2.RandomHorizontalFlip()])
    so = cfg["storage_options"]
    opts = {
        "endpoint_url": so["endpoint_url"],
        "aws_access_key_id": so["key"],
        "aws_secret_access_key": so["secret"],
        "region_name": so["client_kwargs"]["region_name"],
    }

    def transform(s):
        return tf(s["image"]), s["label"]

    ds = litdata.StreamingDataset(
        cfg["url"],
        cache_dir=cfg["cache_dir"],
        shuffle=True,
        seed=cfg["seed"],
        storage_options=opts,
        transform=transform,
    )
    return litdata.StreamingDataLoader(ds, batch_size=cfg["batch_size"], num_workers=cfg["workers"])


def epoch(loader, e):
    return loader


if __name__ == "__main__":
    _runner.main(convert, build, epoch, ABOUT)
