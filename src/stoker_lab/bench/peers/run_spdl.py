"""SPDL (Meta's Scalable and Performant Data Loading) as a benchmark peer.

It follows SPDL's own recipe for image training input, written in its documentation
(facebookresearch.github.io/spdl: "Migrating from PyTorch DataLoader" and "Best Practices":
decode with SPDL I/O in a thread stage, ``aggregate`` the frames into batches and make each
batch with one ``spdl.io.convert_frames``; "Filter Graphs": random augmentation as an FFmpeg
filter description drawn per image; "Analyzing the Performance": a download stage then
``disaggregate`` into samples). Its pipeline here, built with ``spdl.pipeline.PipelineBuilder``:

    shard names (shuffled each epoch) -> download (2 concurrent) -> iter_tarfile, samples
    shuffled within the shard -> disaggregate -> demux_image + decode_packets with
    "crop=W:H:X:Y,scale=224:224,[hflip,]format=rgb24" (``workers`` concurrent) ->
    aggregate(batch) -> convert_frames -> sink

on ``workers`` decode threads plus the download threads. Images come out as a uint8 array
(N, 3, 224, 224) (a transposed view of SPDL's NHWC batch, as its docs permute it).

Data: the WebDataset tar shards of the other peers, read from the emulated origin with
presigned GETs. SPDL has no cache and no resume: the runner keeps each downloaded shard on
local disk (``cache_dir``) as it passes, and later epochs read that copy, which is what a user
of SPDL would add. The first epoch's download is part of the pipeline, so it overlaps decoding.

SPDL decodes with FFmpeg: spdl-io loads the system's FFmpeg libraries (4 to 9: libavutil,
libavcodec, libavformat, libavdevice and libavfilter of one major; on Debian 12 ``libavutil57``,
``libavcodec59``, ``libavformat59``, ``libavdevice59``, ``libavfilter8``), which pip cannot
install: ``scripts/system_deps.sh spdl`` does, as root (:mod:`stoker_lab.bench.sysdeps`). Runs
under the Python of its own virtual environment (spdl 0.8.0 and numpy); see :mod:`stoker_lab.bench.peers._runner`.
"""

import os
import random
import urllib.request

import _runner

ABOUT = {
    "packages": ["spdl", "spdl-io", "spdl-core", "numpy"],
    "recipe": "spdl.pipeline.PipelineBuilder: download stage, iter_tarfile, disaggregate, SPDL I/O decode with an "
    "FFmpeg crop/scale/flip filter per image, aggregate, convert_frames (SPDL docs: Migrating from PyTorch "
    "DataLoader; Best Practices; Filter Graphs)",
    "cache": "none in SPDL; the runner keeps the downloaded shards on local disk, read by later epochs",
    "resume": "none (a pipeline has no state to save)",
}
DOWNLOADS = 2  # shards fetched at once (each ~20 MB: two keep the 100 MB/s origin busy)


def convert(src, out, cfg):
    """``src``: a folder of WebDataset ``.tar`` shards; SPDL reads them as they are (linked into ``out``)."""
    os.makedirs(out, exist_ok=True)
    for name in sorted(os.listdir(src)):
        if name.endswith(".tar"):
            os.link(os.path.join(src, name), os.path.join(out, name))


def _get(url):
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(url, timeout=120) as resp:
        return resp.read()


class _Spdl:
    def __init__(self, cfg):
        import spdl.io.utils

        try:  # loads FFmpeg now (set-up time), and says so if it is missing
            self.ffmpeg = {k: ".".join(map(str, v)) for k, v in spdl.io.utils.get_ffmpeg_versions().items()}
        except RuntimeError as exc:
            raise SystemExit(
                "SPDL cannot load the FFmpeg libraries it decodes with (FFmpeg 4-9's libavutil, libavcodec, "
                "libavformat, libavdevice, libavfilter; as root, bash scripts/system_deps.sh spdl installs them, "
                "on Debian 12: apt-get install -y --no-install-recommends libavutil57 libavcodec59 libavformat59 "
                f"libavdevice59 libavfilter8): {exc}"
            ) from None
        self.cfg = cfg
        self.local = cfg["cache_dir"]
        os.makedirs(self.local, exist_ok=True)
        self.shards = [(u, n) for u, n in cfg["fetch"] if n.endswith(".tar")]
        self.workers = int(cfg["workers"])
        self.rng = random.Random(cfg["seed"])

    def settings(self):
        return {
            "decode_threads": self.workers,
            "download_threads": DOWNLOADS,
            "num_threads": self.workers + DOWNLOADS,
            "shards": len(self.shards),
            "shuffle": "shard order each epoch + samples within each shard",
            "resize": "FFmpeg scale, bilinear",
            "ffmpeg": self.ffmpeg,
        }

    def download(self, shard):
        """(url, name) -> the shard's bytes: the local copy if there is one, else a GET kept on disk."""
        url, name = shard
        path = os.path.join(self.local, name)
        if os.path.exists(path):
            with open(path, "rb") as f:
                return f.read()
        data = _get(url)
        with open(path + ".part", "wb") as f:
            f.write(data)
        os.replace(path + ".part", path)
        return data

    def samples(self, data):
        """A shard's bytes -> its (jpeg bytes, label, seed) samples, in a random order."""
        import spdl.io

        jpg, cls = {}, {}
        for name, body in spdl.io.iter_tarfile(data):
            key, _, ext = name.rpartition(".")
            if ext == "jpg":
                jpg[key] = body
            elif ext == "cls":
                cls[key] = int(bytes(body))
        keys = sorted(jpg)
        self.rng.shuffle(keys)
        return [(jpg[k], cls[k], self.rng.getrandbits(32)) for k in keys]

    def decode(self, sample):
        """(jpeg, label, seed) -> (224x224 RGB frames after RandomResizedCrop + flip, label)."""
        import spdl.io

        data, label, seed = sample
        packets = spdl.io.demux_image(data)
        rng = random.Random(seed)
        x, y, w, h = _runner.crop_box(packets.width, packets.height, rng)
        flip = ",hflip" if rng.random() < 0.5 else ""
        desc = f"crop={w}:{h}:{x}:{y},scale=224:224:flags=bilinear{flip},format=rgb24"
        return spdl.io.decode_packets(packets, filter_desc=desc), label

    @staticmethod
    def collate(items):
        import numpy as np
        import spdl.io

        frames, labels = zip(*items, strict=True)
        batch = spdl.io.to_numpy(spdl.io.convert_frames(list(frames)))  # (N, 224, 224, 3)
        return batch.transpose(0, 3, 1, 2), np.asarray(labels, dtype=np.int64)

    def batches(self, e):
        from spdl.pipeline import PipelineBuilder

        order = list(self.shards)
        random.Random(self.cfg["seed"] * 1000 + e).shuffle(order)
        pipeline = (
            PipelineBuilder()
            .add_source(order)
            .pipe(self.download, concurrency=DOWNLOADS, name="download")
            .pipe(self.samples, name="untar")
            .disaggregate()
            .pipe(self.decode, concurrency=self.workers, name="decode")
            .aggregate(int(self.cfg["batch_size"]))
            .pipe(self.collate, name="collate")
            .add_sink(3)
            .build(num_threads=self.workers + DOWNLOADS, max_failures=0)
        )
        with pipeline.auto_stop():
            yield from pipeline


def build(cfg):
    return _Spdl(cfg)


def epoch(d, e):
    return d.batches(e)


if __name__ == "__main__":
    _runner.main(convert, build, epoch, ABOUT)
