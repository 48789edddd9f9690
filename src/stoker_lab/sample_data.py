"""Real, offline sample data: an ImageNet-style JPEG tree cut from bundled photographs.

The colour photographs that ship inside scikit-image (``skimage/data``) and scikit-learn
(``sklearn/datasets/images``) are cropped, flipped, rescaled and re-encoded into
``root/train/<class>/<key>.JPEG``. Nothing is downloaded. Every image is a pure function of
``(seed, index)``, so the tree is byte-identical for the same seed whatever the worker count.
"""

from __future__ import annotations

import importlib.util
import io
import json
import math
import os
import shutil
import time
from concurrent.futures import ProcessPoolExecutor

import numpy as np

_FORMAT = 2
MANIFEST = ".stoker-sample-data.json"
SKIMAGE_PHOTOS = (
    "astronaut.png",
    "chelsea.png",
    "coffee.png",
    "hubble_deep_field.jpg",
    "ihc.png",
    "motorcycle_left.png",
    "motorcycle_right.png",
    "retina.jpg",
    "rocket.jpg",
)
SKLEARN_PHOTOS = ("china.jpg", "flower.jpg")
SHORT_SIDE = (300, 500)  # pixels, inclusive
ASPECT = (3 / 4, 4 / 3)  # width / height, inclusive
QUALITY = (85, 95)  # JPEG quality, inclusive

_sources: list | None = None  # decoded photographs, per process


def _package_dir(package: str, hint: str) -> str:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"make_sample_data needs the '{package}' package for its bundled photographs; install "
            f"stoker's lab extra (pip install -e '.[lab]') or: pip install {hint}",
            name=package,
        )
    return list(spec.submodule_search_locations)[0]


def source_photo_paths() -> list[str]:
    """Paths of the bundled colour photographs used as sources.

    Raises ModuleNotFoundError if scikit-image or scikit-learn is not installed, FileNotFoundError if
    an expected photograph is missing from the installed package.
    """
    skimage_data = os.path.join(_package_dir("skimage", "scikit-image"), "data")
    sklearn_images = os.path.join(_package_dir("sklearn", "scikit-learn"), "datasets", "images")
    paths = [os.path.join(skimage_data, n) for n in SKIMAGE_PHOTOS]
    paths += [os.path.join(sklearn_images, n) for n in SKLEARN_PHOTOS]
    for p in paths:
        if not os.path.isfile(p):
            raise FileNotFoundError(f"bundled photograph not found: {p}")
    return paths


def _load_sources(paths: list[str]) -> None:
    global _sources
    from PIL import Image

    loaded = []
    for p in paths:
        with Image.open(p) as im:
            loaded.append(im.convert("RGB"))
    _sources = loaded


def class_names(classes: int) -> list[str]:
    """Deterministic ImageNet-synset-like class directory names, e.g. ``n00000000``."""
    return [f"n{c:08d}" for c in range(classes)]


def _make_image(seed: int, index: int, short_side: tuple[int, int] = SHORT_SIDE) -> bytes:
    """JPEG bytes of image ``index``: a function of (seed, index, short_side) only."""
    from PIL import Image, ImageFilter

    rng = np.random.default_rng([seed, index])
    src = _sources[int(rng.integers(len(_sources)))]
    sw, sh = src.size
    aspect = math.exp(rng.uniform(math.log(ASPECT[0]), math.log(ASPECT[1])))
    short = int(rng.integers(short_side[0], short_side[1] + 1))
    if aspect >= 1:
        h = short
        w = min(max(round(short * aspect), short), math.floor(short * ASPECT[1]))
    else:
        w = short
        h = min(max(round(short / aspect), short), math.floor(short / ASPECT[0]))
    # Largest crop of the output's aspect inside the source, then a random fraction of it.
    cw = min(sw, sh * w / h)
    ch = cw * h / w
    frac = math.sqrt(rng.uniform(0.25, 1.0))
    cw, ch = cw * frac, ch * frac
    x0 = rng.uniform(0, sw - cw)
    y0 = rng.uniform(0, sh - ch)
    img = src.resize((w, h), Image.Resampling.BICUBIC, box=(x0, y0, x0 + cw, y0 + ch))
    if w > cw:  # upscaled: restore some of the crispness interpolation took away
        img = img.filter(ImageFilter.SHARPEN)
    if rng.random() < 0.5:
        img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    quality = int(rng.integers(QUALITY[0], QUALITY[1] + 1))
    subsampling = 0 if rng.random() < 0.5 else 2  # chroma 4:4:4 or 4:2:0, as cameras vary
    out = io.BytesIO()
    img.save(out, format="JPEG", quality=quality, subsampling=subsampling)
    return out.getvalue()


def _write_chunk(args: tuple) -> int:
    train, names, seed, indices, short_side = args
    total = 0
    for i in indices:
        cls = names[i % len(names)]
        data = _make_image(seed, i, short_side)
        with open(os.path.join(train, cls, f"{cls}_{i:06d}.JPEG"), "wb") as f:
            f.write(data)
        total += len(data)
    return total


def _existing(root: str, params: dict) -> dict | None:
    """The manifest if the tree at root was made with ``params`` and is complete."""
    try:
        with open(os.path.join(root, MANIFEST)) as f:
            manifest = json.load(f)
    except (OSError, ValueError):
        return None
    if any(manifest.get(k) != params.get(k) for k in {*params, "short_side"}):
        return None  # (a tree of another short side is not one of the default's)
    train = os.path.join(root, "train")
    found = sum(len([n for n in names if n.endswith(".JPEG")]) for _, _, names in os.walk(train))
    return manifest if found == params["images"] else None


def make_sample_data(
    root: str,
    images: int = 2000,
    classes: int = 10,
    seed: int = 0,
    workers: int | None = None,
    short_side: tuple[int, int] = SHORT_SIDE,
) -> dict:
    """Write ``root/train/<class>/<class>_<index:06d>.JPEG``, an ImageNet-style tree.

    Each image is a random crop (random horizontal flip) of one of the bundled photographs,
    rescaled to a shorter side of ``short_side`` px (default 300-500, inclusive) and an aspect ratio (width / height) in
    3:4..4:3 (sharpened if upscaled), saved as JPEG at quality 85-95 with 4:4:4 or 4:2:0
    chroma subsampling. Image ``i`` belongs to class ``i % classes``.
    Same parameters produce byte-identical files. If ``root`` already holds a complete tree
    made with the same parameters (``root/.stoker-sample-data.json``) nothing is written;
    otherwise ``root/train`` is removed and regenerated. ``workers`` processes (default
    ``os.cpu_count()``; 1 = in this process).

    Returns ``{"root", "images", "classes", "bytes" (total JPEG bytes), "seconds" (wall time of
    this call), "generated" (False when the existing tree was reused)}``.
    ``short_side`` (min, max): e.g. (400, 600) gives photos of about 90 KB, near ImageNet's mean
    JPEG (about 110 KB); a non-default range is part of the parameters the manifest records.
    Raises ValueError for ``classes < 1``, ``images < classes`` or a ``short_side`` range that is
    not 16 <= min <= max, RuntimeError if
    scikit-image or scikit-learn is missing, OSError on write failures.
    """
    if classes < 1 or images < classes:
        raise ValueError(f"need classes >= 1 and images >= classes, got {images=} {classes=}")
    lo, hi = (int(x) for x in short_side)
    if not 16 <= lo <= hi:
        raise ValueError(f"short_side must be (min, max) pixels with 16 <= min <= max, got {short_side!r}")
    t0 = time.perf_counter()
    root = os.path.abspath(root)
    params: dict = {"format": _FORMAT, "images": images, "classes": classes, "seed": seed}
    if (lo, hi) != SHORT_SIDE:  # the default stays out, so trees made before still match
        params["short_side"] = [lo, hi]
    summary = {"root": root, "images": images, "classes": classes}
    manifest = _existing(root, params)
    if manifest is not None:
        return {**summary, "bytes": manifest["bytes"], "seconds": time.perf_counter() - t0, "generated": False}

    paths = source_photo_paths()
    train = os.path.join(root, "train")
    os.makedirs(root, exist_ok=True)
    if os.path.exists(os.path.join(root, MANIFEST)):
        os.remove(os.path.join(root, MANIFEST))
    shutil.rmtree(train, ignore_errors=True)
    names = class_names(classes)
    for cls in names:
        os.makedirs(os.path.join(train, cls))

    workers = max(1, min(workers or os.cpu_count() or 1, math.ceil(images / 64)))
    step = max(16, math.ceil(images / (workers * 8)))
    chunks = [(train, names, seed, range(s, min(s + step, images)), (lo, hi)) for s in range(0, images, step)]
    if workers == 1:
        _load_sources(paths)
        total = sum(map(_write_chunk, chunks))
    else:
        with ProcessPoolExecutor(workers, initializer=_load_sources, initargs=(paths,)) as ex:
            total = sum(ex.map(_write_chunk, chunks))

    from stoker._atomic import umask_mode, write_atomic

    write_atomic(
        os.path.join(root, MANIFEST),
        json.dumps({**params, "bytes": total, "generator": "stoker_lab.sample_data"}).encode(),
        mode=umask_mode(),
    )
    return {**summary, "bytes": total, "seconds": time.perf_counter() - t0, "generated": True}
