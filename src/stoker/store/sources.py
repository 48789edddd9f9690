"""Sources that `stoker pack` reads, at any fsspec URL, and the rule that picks one.

* ``imagefolder``: ``root/<class>/**/<name>.<ext>`` (torchvision's ImageFolder).
* ``webdataset``: tar shards (``.tar``, ``.tgz``, ``.tar.gz``), see :mod:`.wds`.
* ``filelist``: a CSV or Parquet file with columns ``path`` and ``label``, see :mod:`.filelist`.
* ``files`` and ``parquet`` (only when asked for): any file tree grouped by basename, or a Parquet
  table of sample bytes (Hugging Face exports), see :mod:`.anysource`.

:func:`detect_source` chooses by what SRC is (first rule that matches):

1. SRC names tar archives: it ends in ``.tar``/``.tgz``/``.tar.gz`` (a file, a
   ``{a,b}``/``{000..009}`` brace list or a glob) -> ``webdataset``;
2. SRC ends in ``.csv``, ``.parquet`` or ``.pq`` -> ``filelist``;
3. SRC is a directory whose top level holds tar archives and no sub-directory
   -> ``webdataset``; a path that does not exist but is the prefix of tar
   archives (``s3://b/train-`` for ``train-000.tar``...) -> ``webdataset``;
4. anything else -> ``imagefolder``.

Keys are stored as UTF-8 strings. A source file or tar member whose name is not
valid UTF-8 is refused with a ValueError naming it (keys are never altered).
"""

from __future__ import annotations

import logging
import posixpath
from collections import deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import islice

from ..errors import SourceError, SourceNotFoundError

log = logging.getLogger(__name__)

#: File extensions ImageFolder accepts (torchvision's list), matched case-insensitively.
IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
#: Archive suffixes read as WebDataset shards.
TAR_SUFFIXES = (".tar", ".tgz", ".tar.gz")
LIST_SUFFIXES = (".csv", ".parquet", ".pq")
SOURCES = ("imagefolder", "webdataset", "filelist", "files", "parquet")
#: Operating-system and tool metadata names (compared case-insensitively) that are never
#: classes or samples, besides every name that starts with "." (``.ipynb_checkpoints``,
#: ``.DS_Store``, AppleDouble ``._*`` files, ``.Trash-1000``).
IGNORED_NAMES = frozenset(
    {"__macosx", "thumbs.db", "ehthumbs.db", "desktop.ini", "$recycle.bin", "system volume information"}
)


def is_ignored_name(name: str) -> bool:
    """True for a hidden (leading ".") or OS-metadata (:data:`IGNORED_NAMES`) file or folder name."""
    return name.startswith(".") or name.lower() in IGNORED_NAMES


@dataclass(frozen=True)
class SourceFile:
    """One sample's source file. ``rel`` is relative to the source root, '/'-separated.

    ``ext`` is the file's extension with its dot (``.JPEG``); the sample's primary
    field name is ``ext`` without the dot (:attr:`field`).
    """

    rel: str
    size: int
    key: str
    label: int
    class_name: str
    ext: str
    stamp: str = ""  # modification stamp from the listing (mtime, ETag): detects rewrites on resume

    @property
    def field(self) -> str:
        return self.ext[1:] if self.ext.startswith(".") else self.ext


@dataclass
class Listing:
    """An ImageFolder listing: samples, class names in label order, skipped (non-image)
    files and ignored (hidden or OS-metadata) folders (``name/``) and files."""

    files: list[SourceFile]
    classes: list[str]
    skipped: list[str]
    ignored: list[str] = field(default_factory=list)


def check_utf8(name: str, where: str) -> str:
    """Return ``name`` if it encodes as UTF-8, else raise :class:`stoker.SourceError` (a
    ValueError) naming ``where``.

    Names that were not valid UTF-8 on disk or in a tar header arrive as str with
    surrogate escapes (Python's ``surrogateescape``); they are refused, not rewritten.
    """
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        raw = name.encode("utf-8", "surrogateescape")
        raise SourceError(
            f"{where}: name {raw!r} is not valid UTF-8; stoker keys are UTF-8 strings (rename the file or member)"
        ) from None
    return name


def is_tar_name(path: str) -> bool:
    return path.lower().endswith(TAR_SUFFIXES)


def detect_source(origin, source: str | None = None) -> str:
    """The source kind of ``origin`` (a storage.Origin): the rule in this module's docstring.

    ``source`` overrides it (one of :data:`SOURCES`). Raises
    ValueError for an unknown ``source``.
    """
    if source is not None:
        if source not in SOURCES:
            raise SourceError(f"unknown source {source!r}: expected one of {SOURCES}")
        return source
    url = origin.url.rstrip("/")
    low = url.lower()
    if is_tar_name(low):
        return "webdataset"
    if low.endswith(LIST_SUFFIXES):
        return "filelist"
    fs, root = origin.fs, origin.root.rstrip("/")
    try:
        if fs.isdir(root):
            top = [
                e for e in fs.ls(root, detail=True) if not is_ignored_name(posixpath.basename(e["name"].rstrip("/")))
            ]
            tars = [e for e in top if e.get("type") == "file" and is_tar_name(e["name"])]
            dirs = [e for e in top if e.get("type") == "directory"]
            return "webdataset" if tars and not dirs else "imagefolder"
        if not fs.exists(root) and any(is_tar_name(p) for p in fs.glob(root + "*")):
            return "webdataset"
    except OSError as exc:
        log.debug("source detection of %s: %s", url, exc)
    return "imagefolder"


def resolve_labels(
    raw: list, classes: list[str] | None = None, keys: Sequence[str] | None = None
) -> tuple[list[int], list[str], list[str]]:
    """Turn raw labels (int, str or None per sample) into ``(labels, class_names, classes)``.

    None -> label -1, class name "". With a class list ``classes`` (label = position):
    a str label that is a name in it gets that position, an int label (or a string of
    one) must lie in ``0..len(classes)-1``; anything else is a ValueError naming the
    sample's key (``keys``, parallel to ``raw``). Without one: if every other label is
    an integer (or a string of one), labels are those integers and ``classes`` is
    ``["0", ..., str(max)]``; otherwise labels are class names, numbered in sorted order.
    """

    def as_int(v):
        if isinstance(v, bool):
            return None
        if isinstance(v, int):
            return v
        try:
            return int(str(v).strip())
        except ValueError:
            return None

    if classes is not None:
        num = {c: i for i, c in enumerate(classes)}
        labels = []
        for j, v in enumerate(raw):
            lab = -1 if v is None else num.get(v) if isinstance(v, str) and v in num else as_int(v)
            if lab is None or not -1 <= lab < len(classes):
                who = f"sample {keys[j]!r}" if keys is not None else f"sample {j}"
                raise SourceError(
                    f"{who}: label {v!r} is not in the class list ({len(classes)} classes: "
                    f"{', '.join(classes[:5])}{', ...' if len(classes) > 5 else ''})"
                )
            labels.append(lab)
        return labels, ["" if x < 0 else classes[x] for x in labels], list(classes)
    present = [v for v in raw if v is not None]
    ints = [as_int(v) for v in present]
    if all(x is not None for x in ints):
        top = max(ints, default=-1)
        classes = [str(i) for i in range(top + 1)]
        labels = [-1 if v is None else as_int(v) for v in raw]
        return labels, ["" if x < 0 else str(x) for x in labels], classes
    classes = sorted({str(v) for v in present})
    num = {c: i for i, c in enumerate(classes)}
    labels = [-1 if v is None else num[str(v)] for v in raw]
    return labels, ["" if v is None else str(v) for v in raw], classes


def list_image_folder(origin, classes: list[str] | None = None) -> Listing:
    """List an ImageFolder tree ``root/<class>/**/<name>.<ext>`` through ``origin`` (a storage.Origin).

    Hidden and OS-metadata entries (:func:`is_ignored_name`: ``.ipynb_checkpoints/``,
    ``__MACOSX/``, ``._x.jpg``, ``.DS_Store``, ``Thumbs.db``, ...) at any depth are
    never classes or samples; the dropped folders and files are named in one warning
    and listed in ``Listing.ignored``.

    Classes: with ``classes`` (a class list, label = position) those; a class directory
    not in it is a ValueError naming it. Without: every other immediate sub-directory,
    sorted (torchvision's ImageFolder rule). A class directory with no image keeps its
    label slot (torchvision raises there unless ``allow_empty``; here it is named in a
    warning), so on a filesystem the labels of splits agree; object stores hold no
    empty directories, which is why ``--classes`` exists. Samples are sorted by path;
    the key is ``<class>/<path-without-extension>``. Files that are not images by
    extension, or that lie directly under the root, are skipped and listed in
    ``Listing.skipped``, with entries that are neither files nor directories (a socket, a
    fifo; named in a warning). Raises :class:`stoker.SourceNotFoundError` (a
    FileNotFoundError) when the root is missing or an entry is a symbolic link whose target
    does not exist, and :class:`stoker.SourceError` (a ValueError) when it holds no class
    directory with an image, when two files map to the same key (e.g. ``a.jpg`` and
    ``a.png``), or when a file's path is not valid UTF-8.
    """
    entries, skipped, dirs, ignored = _walk_image_folder(origin)
    classes = _class_list(origin, dirs, entries, classes)
    label_of = {c: i for i, c in enumerate(classes)}
    files = []
    seen: dict[str, str] = {}  # key -> the file it came from
    for cls, rel, stem, ext, size, stamp in entries:
        if stem in seen:
            raise SourceError(f"source {origin.url}: duplicate key {stem!r} from {seen[stem]!r} and {rel!r}")
        seen[stem] = rel
        files.append(
            SourceFile(rel=rel, size=size, key=stem, label=label_of[cls], class_name=cls, ext=ext, stamp=stamp)
        )
    if skipped:
        log.warning("%s: skipped %d non-image or unclassified files (e.g. %s)", origin.url, len(skipped), skipped[0])
    return Listing(files=files, classes=classes, skipped=skipped, ignored=ignored)


def _walk_image_folder(origin) -> tuple[list[tuple], list[str], set[str], list[str]]:
    """One listing of the tree: ``(entries, skipped, dirs, ignored)``: the images as ``(class, rel,
    key, ext, size, stamp)`` in path order, the paths skipped, the top-level directories, the
    top-most ignored folders (``name/``) and files (named in one warning). Raises as
    :func:`list_image_folder` for a missing root, a broken symlink and a non-UTF-8 path."""
    fs, root = origin.fs, origin.root.rstrip("/")
    if not fs.exists(root):
        raise SourceNotFoundError(f"source {origin.url} does not exist")
    found = fs.find(root, withdirs=True, detail=True)
    entries, skipped, dirs = [], [], set()
    ignored: dict[str, int] = {}  # top-most ignored folder or file -> files under it
    for path, info in sorted(found.items()):
        rel = posixpath.relpath(path, root) if not path.startswith(root + "/") else path[len(root) + 1 :]
        if rel in ("", "."):
            continue
        parts = rel.split("/")
        kind = info.get("type", "file")
        is_file = kind == "file"
        bad = next((i for i, part in enumerate(parts) if is_ignored_name(part)), None)
        if bad is not None:
            top = "/".join(parts[: bad + 1]) + ("" if is_file and bad == len(parts) - 1 else "/")
            ignored[top] = ignored.get(top, 0) + int(is_file)
            continue
        if kind not in ("file", "directory"):
            if info.get("islink"):
                if not fs.exists(path):  # a broken symlink: stop, rather than drop a sample silently
                    raise SourceNotFoundError(
                        f"source {origin.url}: {rel} is a symbolic link to "
                        f"{info.get('destination', '?')!r}, which does not exist"
                    )
                continue  # a symlink the listing did not follow (a loop back to a parent directory)
            log.warning("%s: %s is not a regular file or directory (%s); skipped", origin.url, rel, kind)
            skipped.append(rel)
            continue
        if not is_file:
            if len(parts) == 1:
                dirs.add(check_utf8(parts[0], f"source {origin.url}"))
            continue
        stem, ext = posixpath.splitext(rel)
        if len(parts) < 2 or ext.lower() not in IMG_EXTENSIONS:
            skipped.append(rel)
            continue
        check_utf8(rel, f"source {origin.url}")
        stamp = str(info.get("ETag") or info.get("etag") or info.get("mtime") or info.get("LastModified") or "")
        entries.append((parts[0], rel, stem, ext, int(info.get("size") or 0), stamp))
    if ignored:
        names = sorted(ignored)
        log.warning(
            "%s: ignored %d hidden or OS-metadata entr%s (never classes or samples): %s%s",
            origin.url,
            len(names),
            "y" if len(names) == 1 else "ies",
            ", ".join(names[:10]),
            f", and {len(names) - 10} more" if len(names) > 10 else "",
        )
    return entries, skipped, dirs, sorted(ignored)


def _class_list(origin, dirs: set[str], entries: list[tuple], classes: list[str] | None) -> list[str]:
    """The class names in label order: ``classes`` when given (a class directory not in it is a
    SourceError), else the top-level directories, sorted; classes without an image are named
    in a log line (a warning without a class list). SourceError when no class holds an image."""
    with_images = {e[0] for e in entries}
    if not with_images:
        raise SourceError(
            f"source {origin.url}: no ImageFolder class directory with images "
            f"(expected <root>/<class>/<file>{{{','.join(IMG_EXTENSIONS)}}})"
        )
    found_classes = sorted(dirs | with_images)
    given = classes is not None
    if classes is not None:
        extra = [c for c in found_classes if c not in set(classes)]
        if extra:
            raise SourceError(
                f"source {origin.url}: class director{'y' if len(extra) == 1 else 'ies'} "
                f"{', '.join(map(repr, extra[:10]))} not in the class list "
                f"({len(classes)} classes: {', '.join(classes[:5])}{', ...' if len(classes) > 5 else ''})"
            )
        classes = list(classes)
    else:
        classes = found_classes
    if len(with_images) == 1 and len(classes) == 1 and all(e[1].count("/") >= 2 for e in entries):
        log.warning(
            "%s: one class directory %r holding sub-directories; did you mean to pack %s/%s "
            "(its sub-directories as the classes)?",
            origin.url,
            classes[0],
            origin.url,
            classes[0],
        )
    empty = [c for c in classes if c not in with_images]
    if empty:
        # with a class list, classes absent from one split are expected: no warning
        log.log(
            logging.INFO if given else logging.WARNING,
            "%s: %d class%s with no images keep%s the label slot: %s%s",
            origin.url,
            len(empty),
            "" if len(empty) == 1 else "es",
            "s" if len(empty) == 1 else "",
            ", ".join(f"{c!r} (label {classes.index(c)})" for c in empty[:10]),
            "" if given else "; pack every split with the same --classes so that labels agree",
        )
    return classes


@dataclass
class StreamSample:
    """One sample read from a streamed source (WebDataset shards, file lists).

    ``members``: ``[(field, payload bytes)]``, primary payload first, the rest in
    source order; ``label``: int, class-name str or None (see :func:`resolve_labels`);
    ``where``: the archive or file it came from (for error messages).
    """

    key: str
    label: object
    members: list
    where: str = ""


def ordered_map(fn, items, workers: int):
    """Yield ``fn(item)`` for each of ``items`` in their order, computed by ``workers`` threads
    with at most ``4 * workers`` calls ahead of the consumer (bounded memory for a source's reads).
    An exception of ``fn`` is raised when its item's turn comes."""
    workers = max(1, workers)
    it = iter(items)
    with ThreadPoolExecutor(workers) as pool:
        window = deque(pool.submit(fn, x) for x in islice(it, 4 * workers))
        for x in it:
            yield window.popleft().result()
            window.append(pool.submit(fn, x))
        while window:
            yield window.popleft().result()
