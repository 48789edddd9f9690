"""What `stoker ls` and `stoker stat` print (the commands themselves are in :mod:`stoker.cli.data`)."""

from __future__ import annotations

import numpy as np

from .._units import format_size
from .keytable import KeyTable

# -- `stoker ls` / `stoker stat` ------------------------------------------------
_human = format_size


def _sample_line(d: KeyTable, name: str, i: int) -> str:
    r = d.sample(i)
    return f"{name}\t{r.length} B\tlabel {r.label}\t{r.shard}@{r.offset}\tid {r.id}"


def ls(directory: KeyTable, prefix: str = "", limit: int | None = 1000) -> list[str]:
    """Lines for ``stoker ls``: the children of directory ``prefix``, each named by its full key
    or key prefix (what ``stoker ls`` and :meth:`stoker.Dataset.index_of` take back).

    A directory line is ``prefix/<TAB>N sample(s)<TAB>ids first-last`` (ids, inclusive, only
    when keys are sorted); a sample line is ``key<TAB>length B<TAB>label L<TAB>shard@offset<TAB>id I``.
    If ``prefix`` is itself a key, its sample line comes first. At the root, classes of the
    class list that hold no sample (an empty class folder keeps its label) follow as
    ``name/<TAB>0 samples<TAB>label L (empty class)``. At most ``limit`` children (None = all),
    then a ``... more`` line. Raises KeyError naming ``prefix`` when it is neither a key nor a
    directory.
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
    base = prefix if not prefix or prefix.endswith("/") else prefix + "/"
    more = limit is not None and len(kids) > limit
    for name, leaf, start, stop in kids[:limit]:
        if leaf:
            lines.append(_sample_line(directory, base + name, int(directory.ids(start, stop)[0])))
        else:
            span = f"\tids {start}-{stop - 1}" if directory.keys_sorted else ""
            lines.append(f"{base}{name}\t{_count(stop - start)}{span}")
    if more:
        lines.append(f"... more entries (showing the first {limit}; raise --limit)")
    elif not prefix:
        lines += _empty_classes(directory, {name for name, leaf, _, _ in kids if not leaf})
    return lines


def _count(n: int) -> str:
    return f"{n} sample" if n == 1 else f"{n} samples"


def _empty_classes(directory: KeyTable, listed: set[str]) -> list[str]:
    """Root lines for the classes of the class list that no sample has (label counts 0)."""
    classes = directory.index.classes
    if not classes:
        return []
    counts = np.bincount(np.asarray(directory.index.labels, dtype=np.int64).clip(min=0), minlength=len(classes))
    return [
        f"{name}/\t0 samples\tlabel {label} (empty class)"
        for label, name in enumerate(classes)
        if counts[label] == 0 and f"{name}/" not in listed
    ]


def stat(directory: KeyTable, url: str | None = None) -> list[str]:
    """Lines for ``stoker stat``: ``name: value`` for the fields of :meth:`KeyTable.summary`,
    then the class mapping, one ``  <label>\t<class name>`` line per class in label order."""
    s = directory.summary()
    lines = [f"url: {url}"] if url is not None else []
    lines += [
        f"samples: {s['samples']}",
        f"payload_bytes: {s['payload_bytes']} ({_human(s['payload_bytes'])})",
        f"shards: {s['shards']}",
        f"shard_bytes: {s['shard_bytes']} ({_human(s['shard_bytes'])})",
        f"classes: {s['classes']}",
        f"version: {s['version']}",
        f"keys_sorted: {s['keys_sorted']}",
        f"directory_bytes: {s['directory_bytes']} ({_human(s['directory_bytes'])})",
    ]
    classes = directory.index.classes
    if classes:
        lines.append("class mapping (label, class name):")
        lines += [f"  {label}\t{name}" for label, name in enumerate(classes)]
    return lines
