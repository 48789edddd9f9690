"""Ray Data over stoker's node cache (the ``ray_data+stoker`` row): the recipe of
:mod:`run_ray_data` with only the source changed.

    stoker pack (the same packed dataset as the stoker row)
    stoker.ray_data.read("s3://.../ray_data_stoker/", storage_options, cache_dir, cache_bytes)
                                                    # read tasks read through the node cache's service
    per epoch: .map_batches(decode + RandomResizedCrop(224) + flip, batch_size=batch)
               .iter_torch_batches(batch_size=batch, local_shuffle_buffer_size=1000)

on the same local Ray instance (``ray.init(num_cpus=workers)``). No ``materialize()``: the first
epoch fills the node cache (disk, a budget that holds the dataset, as the stoker row's) through
the node's cache service, and every later epoch reads the blocks from it, nothing from the
origin, with nothing of the dataset kept in Ray's object store. ``randomize_block_order`` is left
out: on a dataset that is not materialized it is an all-to-all step that holds every block in
the object store before the first batch; the order of the read tasks, as they finish, and the
local shuffle buffer are the shuffle. The labels come from the index (the ``label`` column), the
image bytes from the ``bytes`` column. Decode and transform are Pillow's, as the ray_data row's.

Runs under stoker's own Python (see :mod:`stoker_lab.bench.peers._runner` for the protocol).
"""

import os
import shutil
import tempfile

import _runner

ABOUT = {
    "packages": ["stoker", "ray", "pyarrow", "pandas", "torch", "pillow"],
    "recipe": "stoker pack; stoker.ray_data.read (read tasks through the node cache's service, a quarter CPU per "
    "read task), then per epoch the ray_data row's map_batches(Pillow decode, RandomResizedCrop, flip) + "
    "iter_torch_batches with a local shuffle buffer; no materialize(), no randomize_block_order (docs/cluster.md, "
    "Ray Data)",
    "cache": "stoker's node cache on disk through its cache service (kept between jobs); nothing in Ray's object store",
    "resume": "none mid-epoch",
}
SHUFFLE_BUFFER = 1000  # rows, as the ray_data row's


def convert(src, out, cfg):
    from stoker.store.pack import pack

    pack(src, out, shard_bytes=int(cfg.get("shard_bytes", 64 << 20)), overwrite=True, progress=False)


def augment(batch):
    """Ray map_batches UDF: ``{"bytes", "label", ...}`` numpy columns -> ``{"image": uint8 (N, 3,
    224, 224), "label": int64 (N,)}`` (Pillow decode, RandomResizedCrop(224) + flip)."""
    import numpy as np

    from stoker_lab.reference import pillow_decode_transform

    rng = np.random.default_rng()
    images = [pillow_decode_transform(data, "train", rng, 224) for data in batch["bytes"]]
    return {"image": np.stack(images), "label": np.asarray(batch["label"], dtype=np.int64)}


class _RayDataStoker:
    def __init__(self, cfg):
        import ray

        import stoker.ray_data

        self.cfg = cfg
        self.tmp = tempfile.mkdtemp(prefix="ray-")  # Ray's session files, removed by close()
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
        self.ds = stoker.ray_data.read(
            cfg["url"],
            storage_options=cfg["storage_options"],
            cache_dir=cfg["cache_dir"],
            cache_bytes=int(cfg["cache_bytes"]),
        )

    def settings(self):
        return {
            "ray_cpus": int(self.cfg["workers"]),
            "read_task_cpus": 0.25,
            "map_batch_size": int(self.cfg["batch_size"]),
            "local_shuffle_buffer_size": SHUFFLE_BUFFER,
            "object_store": "Ray's default (30% of memory), not used for a cache",
            "cache_bytes": int(self.cfg["cache_bytes"]),
        }

    def batches(self, e):
        seed = int(self.cfg["seed"]) * 1000 + e
        bs = int(self.cfg["batch_size"])
        ds = self.ds.map_batches(augment, batch_size=bs, batch_format="numpy")
        for b in ds.iter_torch_batches(
            batch_size=bs, local_shuffle_buffer_size=SHUFFLE_BUFFER, local_shuffle_seed=seed
        ):
            yield b["image"], b["label"]

    def close(self):
        import ray

        from stoker.cluster.service.cache_service import stop_services

        self.ds = None
        stop_services()
        ray.shutdown()
        shutil.rmtree(self.tmp, ignore_errors=True)


def build(cfg):
    return _RayDataStoker(cfg)


def epoch(r, e):
    return r.batches(e)


if __name__ == "__main__":
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    _runner.main(convert, build, epoch, ABOUT)
