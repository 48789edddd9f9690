"""Ray Data as a benchmark peer: the training-ingest recipe of Ray's own documentation.

docs.ray.io, Ray Data "Working with Images" (read the image files), "Working with PyTorch"
(transform with ``map_batches``, iterate with ``iter_torch_batches``), "Performance Tips"
(I/O-bound reads: fewer CPUs per read task through ``ray_remote_args``), and Ray Train "Data
Loading and Preprocessing" (shuffle: ``randomize_block_order`` + a local shuffle buffer;
"Caching the preprocessed dataset": ``materialize()`` what fits in the object store, with the
per-epoch random transforms after it). The pipeline here:

    read_binary_files("s3://.../ray_data/", pyarrow S3FileSystem, include_paths=True,
                      ray_remote_args={"num_cpus": 0.25})      # the raw ImageFolder tree
    .materialize()                                              # in the first epoch, kept after it
    per epoch: .randomize_block_order(seed) .map_batches(decode + RandomResizedCrop(224) + flip,
               batch_size=batch) .iter_torch_batches(batch_size=batch, local_shuffle_buffer_size=1000)

on a local Ray instance started by the runner (``ray.init(num_cpus=workers)``: one map task per
core, as the other loaders have one worker per core). Decode and transform are Pillow's, the same
reference transform as the torch and WebDataset rows (:func:`stoker_lab.reference.pillow_train_transform`;
``read_images`` also decodes with Pillow). The materialized raw bytes are Ray's cache: they live
in its object store (memory), are gone when the job ends, and are filled before the first
batch (no cache fills while streaming). Ray Data has no mid-epoch resume. With one training
process ``iter_torch_batches`` reads the dataset directly; ``streaming_split(n)`` is what feeds
n training workers.

The runner's CPU counts every Ray process it starts (GCS, raylet, workers: they are its
descendants; it is a child subreaper). Runs under stoker's own Python: stoker's Ray (2.60) is the
version the package index has, and pandas and pyarrow, Ray Data's requirements, are there too.
See :mod:`stoker_lab.bench.peers._runner` for the protocol.
"""

import os
import shutil
import tempfile

import _runner

ABOUT = {
    "packages": ["ray", "pyarrow", "pandas", "torch", "pillow"],
    "recipe": "ray.data.read_binary_files (num_cpus=0.25 per read task) + materialize(), then per epoch "
    "randomize_block_order + map_batches(Pillow decode, RandomResizedCrop, flip) + iter_torch_batches with a local "
    "shuffle buffer (Ray docs: Working with Images; Working with PyTorch; Performance Tips; Ray Train Data Loading "
    "and Preprocessing)",
    "cache": "materialize(): the raw bytes in Ray's object store (memory, this job only), filled before the "
    "first batch",
    "resume": "none mid-epoch",
}
SHUFFLE_BUFFER = 1000  # rows, as WebDataset's shuffle buffer here


def convert(src, out, cfg):
    shutil.copytree(src, out, dirs_exist_ok=True)  # the format is the ImageFolder tree itself


def augment(batch):
    """Ray map_batches UDF: ``{"bytes", "path"}`` numpy columns -> ``{"image": uint8 (N, 3, 224,
    224), "label": int64 (N,)}`` (Pillow decode, RandomResizedCrop(224) + flip; the label is the
    index of the class folder in the sorted list ``augment.classes``)."""
    import numpy as np

    from stoker_lab.reference import pillow_decode_transform

    rng = np.random.default_rng()
    images = [pillow_decode_transform(data, "train", rng, 224) for data in batch["bytes"]]
    labels = [CLASSES[p.rsplit("/", 2)[-2]] for p in batch["path"]]
    return {"image": np.stack(images), "label": np.asarray(labels, dtype=np.int64)}


CLASSES: dict = {}  # class folder -> label; set by build(), carried to Ray's workers with augment


class _RayData:
    def __init__(self, cfg):
        import pyarrow.fs
        import ray

        self.cfg = cfg
        self.tmp = tempfile.mkdtemp(prefix="ray-")  # Ray's session files, removed by close()
        so = cfg["storage_options"]
        endpoint = so["endpoint_url"]
        self.fs = pyarrow.fs.S3FileSystem(
            access_key=so["key"],
            secret_key=so["secret"],
            endpoint_override=endpoint.split("://", 1)[1],
            scheme=endpoint.split("://", 1)[0],
            region=so["client_kwargs"]["region_name"],
        )
        self.path = cfg["url"].split("://", 1)[1].rstrip("/")
        infos = self.fs.get_file_info(pyarrow.fs.FileSelector(self.path))
        classes = sorted(i.base_name for i in infos if i.type == pyarrow.fs.FileType.Directory)
        CLASSES.clear()
        CLASSES.update({c: i for i, c in enumerate(classes)})
        ray.init(
            num_cpus=int(cfg["workers"]),
            include_dashboard=False,
            _temp_dir=self.tmp,
            logging_level="ERROR",
            log_to_driver=False,
        )
        ctx = ray.data.DataContext.get_current()
        ctx.enable_progress_bars = False
        ctx.print_on_execution_start = False
        self.cached = None

    def settings(self):
        return {
            "ray_cpus": int(self.cfg["workers"]),
            "read_task_cpus": 0.25,
            "map_batch_size": int(self.cfg["batch_size"]),
            "local_shuffle_buffer_size": SHUFFLE_BUFFER,
            "object_store": "Ray's default (30% of memory)",
            "filesystem": "pyarrow S3FileSystem",
        }

    def batches(self, e):
        import ray

        if self.cached is None:  # the first epoch reads the origin and keeps the bytes
            ds = ray.data.read_binary_files(
                self.path, filesystem=self.fs, include_paths=True, ray_remote_args={"num_cpus": 0.25}
            )
            self.cached = ds.materialize()
        seed = int(self.cfg["seed"]) * 1000 + e
        bs = int(self.cfg["batch_size"])
        ds = self.cached.randomize_block_order(seed=seed).map_batches(augment, batch_size=bs, batch_format="numpy")
        for b in ds.iter_torch_batches(
            batch_size=bs, local_shuffle_buffer_size=SHUFFLE_BUFFER, local_shuffle_seed=seed
        ):
            yield b["image"], b["label"]

    def close(self):
        import ray

        self.cached = None
        ray.shutdown()
        shutil.rmtree(self.tmp, ignore_errors=True)


def build(cfg):
    return _RayData(cfg)


def epoch(r, e):
    return r.batches(e)


if __name__ == "__main__":
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    _runner.main(convert, build, epoch, ABOUT)
