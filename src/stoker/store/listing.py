"""`stoker ls` and `stoker stat`: the sample directory on the command line."""
from __future__ import annotations

import json
import sys

from .._units import format_size
from .directory import SampleDirectory


# -- `stoker ls` / `stoker stat` ------------------------------------------------
_human = format_size


def _sample_line(d: SampleDirectory, name: str, i: int) -> str:
    r = d.sample(i)
    return f"{name}\t{r.length} B\tlabel {r.label}\t{r.shard}@{r.offset}\tid {r.id}"


def ls(directory: SampleDirectory, prefix: str = "", limit: int | None = 1000) -> list[str]:
    """Lines for ``stoker ls``: the children of directory ``prefix``.

    A directory line is ``name/<TAB>count samples<TAB>ids start-stop`` (ids only when
    keys are sorted); a sample line is ``name<TAB>length B<TAB>label L<TAB>shard@offset<TAB>id I``.
    If ``prefix`` is itself a key, its sample line (full key) comes first. At most
    ``limit`` children (None = all), then a ``... more`` line. Raises KeyError naming
    ``prefix`` when it is neither a key nor a directory.
    """
    lines = []
    exact = None
    if prefix and not prefix.endswith("/"):
        try:
            exact = directory.id_of(prefix)
        except KeyError:
            exact = None
        if exact is not None:
            lines.append(_sample_line(directory, prefix, exact))
    try:
        kids = directory.children(prefix, None if limit is None else limit + 1)
    except KeyError:
        if exact is not None:
            return lines
        raise KeyError(f"{prefix!r}: no such key or directory") from None
    more = limit is not None and len(kids) > limit
    for name, leaf, start, stop in kids[:limit]:
        if leaf:
            lines.append(_sample_line(directory, name, int(directory.ids(start, stop)[0])))
        else:
            span = f"\tids {start}-{stop}" if directory.keys_sorted else ""
            lines.append(f"{name}\t{stop - start} samples{span}")
    if more:
        lines.append(f"... more entries (showing the first {limit}; raise --limit)")
    return lines


def stat(directory: SampleDirectory, url: str | None = None) -> list[str]:
    """Lines for ``stoker stat``: ``name: value`` for the fields of :meth:`SampleDirectory.summary`,
    then the class mapping, one ``  <label>\t<class name>`` line per class in label order."""
    s = directory.summary()
    lines = [f"url: {url}"] if url is not None else []
    lines += [f"samples: {s['samples']}",
              f"payload_bytes: {s['payload_bytes']} ({_human(s['payload_bytes'])})",
              f"shards: {s['shards']}",
              f"shard_bytes: {s['shard_bytes']} ({_human(s['shard_bytes'])})",
              f"classes: {s['classes']}",
              f"version: {s['version']}",
              f"keys_sorted: {s['keys_sorted']}",
              f"directory_bytes: {s['directory_bytes']} ({_human(s['directory_bytes'])})"]
    classes = directory.index.classes
    if classes:
        lines.append("class mapping (label, class name):")
        lines += [f"  {label}\t{name}" for label, name in enumerate(classes)]
    return lines


def _open_directory(a) -> SampleDirectory:
    from .dataset import open_dataset
    ds = open_dataset(a.url, cache=False, check=False, storage_options=json.loads(a.storage_options or "{}"))
    return SampleDirectory(ds.index)


def _cmd_ls(a) -> int:
    d = _open_directory(a)
    try:
        lines = ls(d, a.prefix or "", None if a.limit <= 0 else a.limit)
    except KeyError as exc:
        print(f"stoker ls: {exc.args[0]}", file=sys.stderr)
        return 2
    for line in lines:
        print(line)
    return 0


def _cmd_stat(a) -> int:
    d = _open_directory(a)
    if a.json:
        print(json.dumps({"url": a.url, **d.summary(), "class_names": list(d.index.classes)}, indent=2))
    else:
        for line in stat(d, a.url):
            print(line)
    return 0


def add_parsers(sub) -> None:
    """Register ``stoker ls URL [PREFIX]`` and ``stoker stat URL`` on an argparse subparsers object."""
    p = sub.add_parser("ls", help="list the sample directory of a packed dataset under a key prefix")
    p.add_argument("url")
    p.add_argument("prefix", nargs="?", default="", help="directory or key (e.g. n01440764/)")
    p.add_argument("--limit", type=int, default=1000, help="most entries shown (0 = all; default 1000)")
    p.add_argument("--storage-options", help="fsspec storage options as JSON")
    p.set_defaults(fn=_cmd_ls)

    p = sub.add_parser("stat", help="summary of a packed dataset: samples, bytes, shards, classes, version, "
                                    "and the class mapping (label -> class name)")
    p.add_argument("url")
    p.add_argument("--storage-options", help="fsspec storage options as JSON")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(fn=_cmd_stat)
