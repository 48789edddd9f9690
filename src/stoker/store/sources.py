"""Sources that `stoker pack` reads: an ImageFolder tree at any fsspec URL."""
from __future__ import annotations

import logging
import posixpath
from dataclasses import dataclass

log = logging.getLogger(__name__)

#: File extensions ImageFolder accepts (torchvision's list), matched case-insensitively.
IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


@dataclass(frozen=True)
class SourceFile:
    """One sample's source file. ``rel`` is relative to the source root, '/'-separated."""

    rel: str
    size: int
    key: str
    label: int
    class_name: str
    ext: str
    stamp: str = ""  # modification stamp from the listing (mtime, ETag): detects rewrites on resume


@dataclass
class Listing:
    files: list[SourceFile]
    classes: list[str]
    skipped: list[str]


def list_image_folder(origin) -> Listing:
    """List an ImageFolder tree ``root/<class>/**/<name>.<ext>`` through ``origin`` (a storage.Origin).

    Classes are the sorted immediate sub-directories (label = position), samples are
    sorted by path; the key is ``<class>/<path-without-extension>``. Files that are
    not images by extension, or that lie directly under the root, are skipped and
    listed in ``Listing.skipped``. Raises FileNotFoundError when the root is missing
    and ValueError when it holds no class directory with an image, or when two
    files map to the same key (e.g. ``a.jpg`` and ``a.png``).
    """
    fs, root = origin.fs, origin.root.rstrip("/")
    if not fs.exists(root):
        raise FileNotFoundError(f"source {origin.url} does not exist")
    found = fs.find(root, detail=True)
    entries = []
    skipped = []
    for path, info in sorted(found.items()):
        if info.get("type", "file") != "file":
            continue
        rel = posixpath.relpath(path, root) if not path.startswith(root + "/") else path[len(root) + 1:]
        parts = rel.split("/")
        stem, ext = posixpath.splitext(rel)
        if len(parts) < 2 or ext.lower() not in IMG_EXTENSIONS:
            skipped.append(rel)
            continue
        stamp = str(info.get("ETag") or info.get("etag") or info.get("mtime") or info.get("LastModified") or "")
        entries.append((parts[0], rel, stem, ext, int(info.get("size") or 0), stamp))
    classes = sorted({e[0] for e in entries})
    if not classes:
        raise ValueError(f"source {origin.url}: no ImageFolder class directory with images "
                         f"(expected <root>/<class>/<file>{{{','.join(IMG_EXTENSIONS)}}})")
    label_of = {c: i for i, c in enumerate(classes)}
    files, seen = [], {}
    for cls, rel, stem, ext, size, stamp in entries:
        if stem in seen:
            raise ValueError(f"source {origin.url}: duplicate key {stem!r} from {seen[stem]!r} and {rel!r}")
        seen[stem] = rel
        files.append(SourceFile(rel=rel, size=size, key=stem, label=label_of[cls], class_name=cls, ext=ext,
                                stamp=stamp))
    if skipped:
        log.warning("%s: skipped %d non-image or unclassified files (e.g. %s)", origin.url,
                    len(skipped), skipped[0])
    return Listing(files=files, classes=classes, skipped=skipped)
