"""WebDataset shards as a pack source: tar archives streamed sample by sample.

SRC is a ``.tar``/``.tgz``/``.tar.gz`` URL, a brace list (``train-{000..099}.tar``,
``{a,b}.tar``), a glob (``train-*.tar``), a directory holding such archives, or a
prefix of them (``s3://b/train-``). Archives are read in sorted order (brace
lists: in their order) through ranged GETs of :data:`READ_CHUNK` bytes with
retries; gzip is decompressed as it streams, so memory holds one sample at a time.

Grouping follows the WebDataset convention: a member ``dir/name.f1.f2`` has key
``dir/name`` (the path up to the first dot of the basename) and field ``f1.f2``;
consecutive members with the same key form one sample. Members whose basename
has no dot (or starts with one) are skipped and counted. The primary payload is
the first member whose field ends in an image extension (:data:`IMG_EXTENSIONS`),
else the first member; it is stored first, the other members follow in source
order, all byte-exact. The label is the integer in a ``cls`` member, else the
``label`` or ``cls`` field of a ``json`` member, else none (-1).
"""
from __future__ import annotations

import io
import json
import logging
import re
import tarfile
from typing import Iterator

from ..storage import Origin, url_to_fs
from .sources import IMG_EXTENSIONS, StreamSample, check_utf8, is_tar_name

log = logging.getLogger(__name__)

#: Bytes per ranged GET while streaming an archive.
READ_CHUNK = 8 << 20
_IMG_FIELDS = {e[1:] for e in IMG_EXTENSIONS}
_BRACE = re.compile(r"\{([^{}]*)\}")


def brace_expand(pattern: str) -> list[str]:
    """Expand ``{a,b}`` lists and ``{000..012}`` numeric ranges (zero padding kept), left to right."""
    m = _BRACE.search(pattern)
    if m is None:
        return [pattern]
    body, head, tail = m.group(1), pattern[:m.start()], pattern[m.end():]
    rng = re.fullmatch(r"(\d+)\.\.(\d+)", body)
    if rng:
        a, b = rng.groups()
        width = len(a) if a.startswith("0") else 0
        step = 1 if int(b) >= int(a) else -1
        items = [str(i).zfill(width) for i in range(int(a), int(b) + step, step)]
    else:
        items = body.split(",")
    return [head + it + rest for it in items for rest in brace_expand(tail)]


def expand_urls(url: str, storage_options: dict | None = None) -> list[str]:
    """The archive URLs that ``url`` names (see the module docstring). Raises FileNotFoundError."""
    out: list[str] = []
    for u in brace_expand(url):
        fs, path = url_to_fs(u, storage_options)
        if any(c in path for c in "*?["):
            out += [fs.unstrip_protocol(p) for p in sorted(fs.glob(path)) if is_tar_name(p)]
        elif fs.isdir(path):
            out += [fs.unstrip_protocol(p) for p in sorted(fs.find(path)) if is_tar_name(p)]
        elif fs.exists(path):
            out.append(u)
        else:
            out += [fs.unstrip_protocol(p) for p in sorted(fs.glob(path + "*")) if is_tar_name(p)]
    if not out:
        raise FileNotFoundError(f"source {url}: no .tar/.tgz/.tar.gz archives found")
    return out


class RangeReader(io.RawIOBase):
    """A read-only stream over one object, read with retried ranged GETs (``origin.read_range``)."""

    def __init__(self, origin: Origin, size: int):
        self.origin, self.size, self.pos = origin, int(size), 0

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        n = min(len(b), self.size - self.pos)
        if n <= 0:
            return 0
        data = self.origin.read_range("", self.pos, self.pos + n)
        b[:n] = data
        self.pos += n
        return n


def split_name(name: str) -> tuple[str, str] | None:
    """``(key, field)`` of a member name by the WebDataset rule, or None when it has no field."""
    slash = name.rfind("/")
    dot = name.find(".", slash + 1)
    if dot <= slash + 1:
        return None
    return name[:dot], name[dot + 1:]


def sample_label(fields: dict, where: str):
    """Raw label of a sample from its ``cls`` or ``json`` member (int, str or None)."""
    if "cls" in fields:
        text = fields["cls"].decode("utf-8", "replace").strip()
        try:
            return int(text)
        except ValueError:
            return text or None
    if "json" in fields:
        try:
            meta = json.loads(fields["json"])
        except ValueError:
            log.debug("%s: json member is not JSON; no label", where)
            return None
        if isinstance(meta, dict):
            for name in ("label", "cls"):
                if isinstance(meta.get(name), (int, str)) and not isinstance(meta.get(name), bool):
                    return meta[name]
    return None


def _finish(key: str, members: list, where: str) -> StreamSample:
    fields = dict(members)
    primary = next((i for i, (f, _) in enumerate(members) if f.rsplit(".", 1)[-1].lower() in _IMG_FIELDS), 0)
    ordered = [members[primary]] + members[:primary] + members[primary + 1:]
    return StreamSample(key=key, label=sample_label(fields, f"{where}: sample {key!r}"),
                        members=ordered, where=where)


def iter_archive(url: str, storage_options: dict | None = None,
                 skipped: list | None = None) -> Iterator[StreamSample]:
    """Stream the samples of one archive. Member names without a field go to ``skipped``.

    Raises ValueError naming the archive and member for a name that is not UTF-8
    or a field repeated within one sample; tarfile.TarError for a corrupt archive;
    :class:`stoker.storage.OriginError` when the origin fails after retries.
    """
    origin = Origin(url, storage_options or {})
    size = origin.size("")
    stream = io.BufferedReader(RangeReader(origin, size), buffer_size=READ_CHUNK)
    key, members = None, []
    try:
        with tarfile.open(fileobj=stream, mode="r|*", encoding="utf-8", errors="surrogateescape") as tar:
            for m in tar:
                if not m.isfile():
                    continue
                check_utf8(m.name, f"archive {url}: member")
                kf = split_name(m.name)
                if kf is None:
                    if skipped is not None:
                        skipped.append(f"{url}:{m.name}")
                    continue
                data = tar.extractfile(m).read()
                if kf[0] != key:
                    if members:
                        yield _finish(key, members, url)
                    key, members = kf[0], []
                elif any(f == kf[1] for f, _ in members):
                    raise ValueError(f"archive {url}: sample {key!r} has field {kf[1]!r} twice")
                members.append((kf[1], data))
    except tarfile.TarError as exc:
        raise tarfile.TarError(f"archive {url}: not a readable tar archive ({exc})") from exc
    if members:
        yield _finish(key, members, url)


def iter_samples(urls: list[str], storage_options: dict | None = None,
                 skipped: list | None = None) -> Iterator[StreamSample]:
    """Stream the samples of every archive in ``urls``, in order."""
    for url in urls:
        yield from iter_archive(url, storage_options, skipped)
