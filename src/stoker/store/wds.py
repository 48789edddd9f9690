"""WebDataset shards as a pack source: tar archives streamed sample by sample.

SRC is a ``.tar``/``.tgz``/``.tar.gz`` URL, a WebDataset shard spec (``train-{000..099}.tar``,
``{a,b}.tar``, ``a.tar::b.tar``: :func:`brace_expand`), a glob (``train-*.tar``), a directory
holding such archives, or a prefix of them (``s3://b/train-``). Archives are read in sorted order (brace
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

import braceexpand

from ..errors import SourceArchiveError, SourceError, SourceNotFoundError
from ..storage import Origin, url_to_fs
from .sources import IMG_EXTENSIONS, StreamSample, check_utf8, is_tar_name

log = logging.getLogger(__name__)

#: Bytes per ranged GET while streaming an archive.
READ_CHUNK = 8 << 20
_IMG_FIELDS = {e[1:] for e in IMG_EXTENSIONS}
# "::" between specs, but not inside an IPv6 host such as http://[::1]:8000/
_LIST_SEP = re.compile(r"::(?![^\[]*\])")


def brace_expand(pattern: str) -> list[str]:
    """The shard URLs of a WebDataset shard spec, expanded as WebDataset expands them.

    ``a::b`` lists specs, each expanded in turn (a ``::`` inside ``[...]``, an IPv6 host, is
    kept). Each spec is expanded by ``braceexpand``, the library WebDataset uses: ``{a,b}``
    lists (nested too: ``{a,{b,c}}`` gives ``a b c``), ``{000..099}`` numeric ranges (zero
    padding kept), steps ``{0..6..2}``, letter ranges ``{a..c}``, left to right; ``\\{`` is a
    literal brace. (WebDataset also replaces ``${name}`` with the environment variable
    ``WDS_name``; stoker does not read the environment here.)

    Raises:
        stoker.SourceError (a ValueError): a brace that is not closed or an empty spec, naming
            ``pattern``.
    """
    out: list[str] = []
    for spec in _LIST_SEP.split(pattern):
        if not spec:
            raise SourceError(f"shard spec {pattern!r}: empty entry between '::'")
        try:
            out += braceexpand.braceexpand(spec)
        except braceexpand.UnbalancedBracesError as exc:  # type: ignore[attr-defined]  # not in braceexpand's .pyi
            raise SourceError(f"shard spec {pattern!r}: {exc}") from None
    return out


def expand_urls(url: str, storage_options: dict | None = None) -> list[str]:
    """The archive URLs that ``url`` names (see the module docstring).

    A shard spec (braces or a ``::`` list) names its shards one by one, as WebDataset reads
    them: every entry must exist (or, for a glob or a directory entry, hold an archive), and the
    missing ones are named in the error instead of being left out. Only a single plain URL may
    be a prefix of archives.

    Raises:
        stoker.SourceNotFoundError (a FileNotFoundError): no archive at all, or (a shard spec)
            entries that name none, listed.
        stoker.SourceError (a ValueError): a malformed spec (:func:`brace_expand`).
    """
    entries = brace_expand(url)
    spec = entries != [url]
    out: list[str] = []
    missing: list[str] = []
    for u in entries:
        fs, path = url_to_fs(u, storage_options)
        if any(c in path for c in "*?["):
            found = [fs.unstrip_protocol(p) for p in sorted(fs.glob(path)) if is_tar_name(p)]
        elif fs.isdir(path):
            found = [fs.unstrip_protocol(p) for p in sorted(fs.find(path)) if is_tar_name(p)]
        elif fs.exists(path):
            found = [u]
        elif spec:
            found = []
        else:
            found = [fs.unstrip_protocol(p) for p in sorted(fs.glob(path + "*")) if is_tar_name(p)]
        if spec and not found:
            missing.append(u)
        out += found
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise SourceNotFoundError(f"source {url}: {len(missing)} of its {len(entries)} shards not found: {shown}")
    if not out:
        raise SourceNotFoundError(f"source {url}: no .tar/.tgz/.tar.gz archives found")
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
    return name[:dot], name[dot + 1 :]


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


def finish_sample(key: str, members: list, where: str) -> StreamSample:
    """The sample ``key`` of ``members`` = ``[(field, bytes)]`` in source order: its primary payload
    (the first image field, else the first member) moved first, its label from :func:`sample_label`."""
    fields = dict(members)
    primary = next((i for i, (f, _) in enumerate(members) if f.rsplit(".", 1)[-1].lower() in _IMG_FIELDS), 0)
    ordered = [members[primary]] + members[:primary] + members[primary + 1 :]
    return StreamSample(key=key, label=sample_label(fields, f"{where}: sample {key!r}"), members=ordered, where=where)


def iter_archive(url: str, storage_options: dict | None = None, skipped: list | None = None) -> Iterator[StreamSample]:
    """Stream the samples of one archive. Member names without a field go to ``skipped``.

    Raises :class:`stoker.SourceError` (a ValueError) naming the archive and member for a
    name that is not UTF-8 or a field repeated within one sample;
    :class:`stoker.SourceArchiveError` (a tarfile.TarError) for a corrupt archive;
    :class:`stoker.storage.OriginError` when the origin fails after retries.
    """
    origin = Origin(url, storage_options or {})
    size = origin.size("")
    stream = io.BufferedReader(RangeReader(origin, size), buffer_size=READ_CHUNK)
    key = ""  # the sample being collected; members is empty until its first member
    members: list[tuple[str, bytes]] = []
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
                f = tar.extractfile(m)
                assert f is not None  # m is a regular file
                data = f.read()
                if kf[0] != key:
                    if members:
                        yield finish_sample(key, members, url)
                    key, members = kf[0], []
                elif any(f == kf[1] for f, _ in members):
                    raise SourceError(f"archive {url}: sample {key!r} has field {kf[1]!r} twice")
                members.append((kf[1], data))
    except tarfile.TarError as exc:
        raise SourceArchiveError(f"archive {url}: not a readable tar archive ({exc})") from exc
    if members:
        yield finish_sample(key, members, url)


def iter_samples(
    urls: list[str], storage_options: dict | None = None, skipped: list | None = None
) -> Iterator[StreamSample]:
    """Stream the samples of every archive in ``urls``, in order."""
    for url in urls:
        yield from iter_archive(url, storage_options, skipped)
