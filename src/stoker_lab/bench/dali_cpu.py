"""NVIDIA DALI's CPU pipeline doing stoker's train transform, for `stoker bench decode`.

Run by the Python of a separate virtual environment that has ``nvidia-dali-cuda130`` (it does
not import stoker). Usage: ``python dali_cpu.py JPEG_DIR SECONDS``; prints JSON
``{"samples_per_s": wall rate, "samples_per_cpu_s": rate per CPU-second}``: one CPU thread
(``num_threads=1``) decoding from memory, RandomResizedCrop(224, area 0.08-1, ratio 3/4-4/3) +
horizontal flip, CHW output, as stoker and the Pillow recipe do. :func:`train_augment` is that
transform as DALI operators; ``peers/run_dali.py`` uses it too.
"""

import glob
import json
import sys
import time

import numpy as np
from nvidia.dali import fn, pipeline_def, types

BATCH = 32


def train_augment(jpegs, device="cpu"):
    """DALI operators: decode to RGB, RandomResizedCrop(224, area 0.08-1, ratio 3/4-4/3),
    horizontal flip with probability 0.5, HWC -> CHW. Output: uint8 (3, 224, 224) per sample.
    ``device="cpu"``: every operator on the CPU; ``"gpu"``: DALI's GPU recipe, the decode
    ``device="mixed"`` (nvJPEG: Huffman on the CPU, the rest on the GPU) and the rest on the GPU."""
    img = fn.decoders.image(jpegs, device="cpu" if device == "cpu" else "mixed", output_type=types.RGB)
    img = fn.random_resized_crop(img, size=224, random_area=[0.08, 1.0], random_aspect_ratio=[0.75, 4 / 3])
    img = fn.flip(img, horizontal=fn.random.coin_flip())
    return fn.transpose(img, perm=[2, 0, 1])


def main() -> None:
    root, seconds = sys.argv[1], float(sys.argv[2])
    files = sorted(glob.glob(f"{root}/**/*.JPEG", recursive=True))[:320]
    payloads = [np.frombuffer(open(f, "rb").read(), dtype=np.uint8) for f in files]
    batches = max(1, len(payloads) // BATCH)

    def source(i):
        k = int(i) % batches
        return payloads[k * BATCH : (k + 1) * BATCH]

    @pipeline_def(
        batch_size=BATCH,
        num_threads=1,
        device_id=None,
        seed=0,
        prefetch_queue_depth=1,
        exec_async=False,
        exec_pipelined=False,
    )
    def pipe():
        return train_augment(fn.external_source(source=source, batch=True, dtype=types.UINT8))

    p = pipe()
    p.build()
    for _ in range(3):
        p.run()
    n, t, c = 0, time.perf_counter(), time.process_time()
    while time.perf_counter() - t < seconds:
        p.run()
        n += BATCH
    wall, cpu = time.perf_counter() - t, time.process_time() - c
    print(json.dumps({"samples_per_s": n / wall, "samples_per_cpu_s": n / cpu}))


if __name__ == "__main__":
    main()
