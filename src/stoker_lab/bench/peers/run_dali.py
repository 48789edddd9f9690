"""NVIDIA DALI (CPU pipeline) as a benchmark peer: ``fn.readers.webdataset`` over WebDataset tar
shards with index files made by DALI's own ``wds2idx`` tool, random shuffle on, decode +
RandomResizedCrop(224) + flip as DALI operators (:func:`stoker_lab.bench.dali_cpu.train_augment`),
``num_threads`` = the workers of the other loaders.

DALI has no cache for remote data. ``source="local"`` (the default): the first epoch fetches
the shards and indexes from the origin into a local folder (parallel GETs, counted as that
epoch's origin bytes and time) and every epoch reads that copy, the usual way DALI is fed from
an object store. ``source="s3"``: DALI's readers read ``s3://`` directly (AWS SDK; endpoint from
``AWS_ENDPOINT_URL``), which re-reads the origin every epoch.

With ``device="cuda"`` (the accelerator comparison) the pipeline runs on GPU 0: decode with
``fn.decoders.image(device="mixed")`` and the crop, flip and transpose on the GPU, batches left
on the GPU (DALI's own GPU recipe for image classification).

Runs under the Python of its own virtual environment (nvidia-dali-cuda130 2.4.0); see
:mod:`stoker_lab.bench.peers._runner` for the protocol.
"""

import os
import subprocess
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import _runner

ABOUT = {
    "packages": ["nvidia-dali-cuda130", "numpy"],
    "recipe": "fn.readers.webdataset(random_shuffle) + fn.decoders.image + fn.random_resized_crop + fn.flip "
    "(DALI docs, webdataset reader and image classification examples)",
    "cache": "none of its own: the first epoch copies the shards to local disk (source=local)",
    "resume": "not used here (DALI readers can checkpoint, enable_checkpointing)",
}

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def convert(src, out, cfg):
    """``src``: a folder of WebDataset ``.tar`` shards; writes ``<name>.idx`` beside each in ``out``."""
    os.makedirs(out, exist_ok=True)
    tool = os.path.join(os.path.dirname(sys.executable), "wds2idx")
    for name in sorted(os.listdir(src)):
        if name.endswith(".tar"):
            subprocess.run(
                [tool, os.path.join(src, name), os.path.join(out, name[:-4] + ".idx")],
                check=True,
                stdout=subprocess.DEVNULL,
            )


def _fetch(url, dest):
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    tmp = dest + ".part"
    with opener.open(url, timeout=120) as resp, open(tmp, "wb") as f:
        while True:
            chunk = resp.read(1 << 20)
            if not chunk:
                break
            f.write(chunk)
    os.replace(tmp, dest)


class _Dali:
    def __init__(self, cfg):
        self.cfg, self.pipe, self.size = cfg, None, 0

    def _paths(self):
        cfg = self.cfg
        if cfg.get("dali_source", "local") == "s3":
            os.environ["AWS_ENDPOINT_URL"] = cfg["storage_options"]["endpoint_url"]
            os.environ.setdefault("AWS_ACCESS_KEY_ID", cfg["storage_options"]["key"])
            os.environ.setdefault("AWS_SECRET_ACCESS_KEY", cfg["storage_options"]["secret"])
            return cfg["s3_tars"], cfg["s3_indexes"]
        local = cfg["cache_dir"]
        os.makedirs(local, exist_ok=True)
        jobs = [
            (u, os.path.join(local, name)) for u, name in cfg["fetch"] if not os.path.exists(os.path.join(local, name))
        ]
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda j: _fetch(*j), jobs))
        names = [name for _, name in cfg["fetch"]]
        tars = sorted(os.path.join(local, n) for n in names if n.endswith(".tar"))
        return tars, [t[:-4] + ".idx" for t in tars]

    def _build(self):
        from dali_cpu import train_augment
        from nvidia.dali import fn, pipeline_def, types

        tars, idx = self._paths()
        cfg = self.cfg
        gpu = cfg.get("device", "cpu") != "cpu"

        @pipeline_def(
            batch_size=cfg["batch_size"], num_threads=cfg["workers"], device_id=0 if gpu else None, seed=cfg["seed"]
        )
        def pipe():
            jpg, cls = fn.readers.webdataset(
                paths=tars,
                index_paths=idx,
                ext=["jpg", "cls"],
                random_shuffle=True,
                pad_last_batch=True,
                name="Reader",
                dtypes=[types.UINT8, types.UINT8],
            )
            return train_augment(jpg, "gpu" if gpu else "cpu"), cls

        self.pipe = pipe()
        self.pipe.build()
        self.size = self.pipe.epoch_size("Reader")

    def batches(self):
        if self.pipe is None:  # in the first epoch: fetching and building count as its wait
            self._build()
        bs = self.cfg["batch_size"]
        n_batches = -(-self.size // bs)
        for b in range(n_batches):
            images, labels = self.pipe.run()
            keep = min(bs, self.size - b * bs)
            if self.cfg.get("device", "cpu") != "cpu":  # on the GPU: one dense tensor, the padding not counted
                yield _OnDevice(images.as_tensor(), keep), labels
            else:
                yield images.as_array()[:keep], labels


class _OnDevice:
    """A batch left on the GPU (a DALI TensorGPU) of which ``len`` samples are real (the rest pad)."""

    def __init__(self, tensor, samples):
        self.tensor, self.samples = tensor, samples

    def __len__(self):
        return self.samples


def build(cfg):
    return _Dali(cfg)


def epoch(d, e):
    return d.batches()


if __name__ == "__main__":
    _runner.main(convert, build, epoch, ABOUT)
