"""Class lists for `stoker pack --classes`: fixed labels, identical across splits.

A class list is the class names in label order (label = position). It comes from:

* a packed dataset (its URL, or the URL of its ``index.parquet``): the class list
  recorded in its index metadata, so ``pack val/ DST --classes <train dataset>``
  gives val the labels of train;
* a ``.json`` file: a list of names, or an object with ``class_names`` (what
  ``stoker stat --json`` prints);
* any other file: a text file with one class name per line (blank lines ignored).

Names are checked: non-empty, unique, no ``/``, and none that the sources ignore
(hidden or OS-metadata names, :func:`.sources.is_ignored_name`).
"""

from __future__ import annotations

import io
import json

import pyarrow.parquet as pq

from ..errors import SourceError, SourceNotFoundError
from ..storage import Origin
from .index import INDEX_NAME
from .sources import is_ignored_name


def check_class_list(names, where: str) -> list[str]:
    """Return ``names`` as a list of str after the checks above; ValueError naming ``where``."""
    if isinstance(names, (str, bytes)) or not hasattr(names, "__iter__"):
        raise SourceError(f"class list {where}: expected a list of class names, got {type(names).__name__}")
    out = list(names)
    if not out:
        raise SourceError(f"class list {where}: no class names")
    seen: dict[str, int] = {}
    for i, name in enumerate(out):
        if not isinstance(name, str) or not name or "/" in name:
            raise SourceError(
                f"class list {where}: entry {i} ({name!r}) is not a class name (a non-empty string without '/')"
            )
        if is_ignored_name(name):
            raise SourceError(f"class list {where}: {name!r} is a hidden or OS-metadata name, which is never a class")
        if name in seen:
            raise SourceError(f"class list {where}: {name!r} appears twice (entries {seen[name]} and {i})")
        seen[name] = i
    return out


def _index_classes(data: bytes, where: str) -> list:
    try:
        meta = json.loads(pq.ParquetFile(io.BytesIO(data)).schema_arrow.metadata[b"stoker"])
        return meta["classes"]
    except Exception as exc:  # noqa: BLE001 - any unreadable index
        raise SourceError(f"class list {where}: not a stoker index ({type(exc).__name__}: {exc})") from exc


def load_class_list(spec, storage_options: dict | None = None) -> list[str]:
    """The class list named by ``spec``: a list of names, or a URL (see the module doc).

    ``storage_options``: fsspec options for the URL. Raises FileNotFoundError when the
    URL holds neither a dataset nor a file, ValueError for a list that fails the checks
    (naming the URL), :class:`stoker.storage.OriginError` on storage failures.
    """
    if not isinstance(spec, str):
        return check_class_list(spec, "(given)")
    origin = Origin(spec, storage_options or {})
    if origin.exists(INDEX_NAME):
        where = origin.full_url(INDEX_NAME)
        names = _index_classes(origin.read(INDEX_NAME), where)
        if not names:
            raise SourceError(f"class list {where}: that dataset has no classes (unlabelled)")
        return check_class_list(names, where)
    if not origin.exists(""):
        raise SourceNotFoundError(f"class list {spec}: no such file or packed dataset")
    data = origin.read("")
    low = spec.lower()
    if low.endswith((".parquet", ".pq")):
        return check_class_list(_index_classes(data, spec), spec)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise SourceError(f"class list {spec}: not UTF-8 text") from None
    if low.endswith(".json"):
        try:
            obj = json.loads(text)
        except ValueError as exc:
            raise SourceError(f"class list {spec}: invalid JSON ({exc})") from None
        if isinstance(obj, dict):
            if "class_names" not in obj:
                raise SourceError(f"class list {spec}: a JSON object needs a 'class_names' list")
            obj = obj["class_names"]
        return check_class_list(obj, spec)
    return check_class_list([line.rstrip("\r") for line in text.split("\n") if line.strip()], spec)
