"""The less common settings of :func:`stoker.pack` in one frozen group, checked where it is
written (:class:`PackOptions`), and pack's old flat keywords that moved into it (:func:`resolve`)."""

from __future__ import annotations

import dataclasses
import numbers
import warnings
from collections.abc import Mapping
from dataclasses import dataclass

from .._units import parse_size
from .lease import DEFAULT_LEASE_S
from .shards import DEFAULT_SMALL_SAMPLE_BYTES

__all__ = ["DEPRECATED", "PackOptions", "resolve"]


@dataclass(frozen=True)
class PackOptions:
    """How :func:`stoker.pack` reads its source and holds its destination, beyond its common keywords.

    Attributes:
        src_storage_options: fsspec storage options for ``src`` only (a dict; S3: ``endpoint_url``,
            ``key``, ``secret``, ``profile``, ...), in place of pack's ``storage_options`` there.
            Default None: pack's ``storage_options``.
        dst_storage_options: the same for ``dst``; a ``classes`` URL is read with them too.
        read_workers: source reads at once (threads; int >= 1, default 16); more for a far object store.
        shuffle_seed: ImageFolder, file-list and file-tree samples are placed in the shards in a
            random order from this seed (int; None = source order, default 0), so that any run of
            a shard mixes classes; WebDataset and Parquet samples keep their source order (archives
            are streams; WebDataset shards are normally shuffled when made). Sample ids are in
            sorted key order either way.
        column: with ``source="parquet"``, and only there (ValueError from pack otherwise): the
            column that holds each row's sample bytes (:mod:`stoker.store.anysource`).
        key_column: with ``source="parquet"``: the column of the sample keys (default None:
            ``<file stem>/<row>``).
        lease_s: length in seconds of the lease pack holds on ``dst`` while it writes
            (:mod:`stoker.store.lease`; > 0, default 60), renewed every third of it.
        small_sample_bytes: samples whose fields total fewer bytes than this are grouped, many
            to one tar member, at a few bytes of overhead each instead of about 1 KiB
            (:mod:`stoker.store.shards`); an int or a size string (default 4096). 0: every sample
            is its own tar members (the WebDataset layout); a size above every sample's groups all.

    Raises TypeError or ValueError naming the field for a value of the wrong type or range.
    """

    src_storage_options: dict | None = None
    dst_storage_options: dict | None = None
    read_workers: int = 16
    shuffle_seed: int | None = 0
    column: str | None = None
    key_column: str | None = None
    lease_s: float = DEFAULT_LEASE_S
    small_sample_bytes: int | str = DEFAULT_SMALL_SAMPLE_BYTES

    def __post_init__(self):
        for name in ("src_storage_options", "dst_storage_options"):
            if not isinstance(value := getattr(self, name), (Mapping, type(None))):
                raise TypeError(f"PackOptions.{name} must be a dict, got {type(value).__name__} {value!r}")
            object.__setattr__(self, name, None if value is None else dict(value))  # the caller's may change
        if not _is_int(self.read_workers):
            raise TypeError(f"PackOptions.read_workers must be an integer, got {self.read_workers!r}")
        if self.read_workers < 1:
            raise ValueError(f"PackOptions.read_workers must be >= 1, got {self.read_workers}")
        if self.shuffle_seed is not None and not _is_int(self.shuffle_seed):
            raise TypeError(f"PackOptions.shuffle_seed must be an integer or None, got {self.shuffle_seed!r}")
        for name in ("column", "key_column"):
            if not isinstance(getattr(self, name), (str, type(None))):
                raise TypeError(f"PackOptions.{name} must be a column name, got {getattr(self, name)!r}")
        if isinstance(self.lease_s, bool) or not isinstance(self.lease_s, numbers.Real) or not self.lease_s > 0:
            raise ValueError(f"PackOptions.lease_s must be a number of seconds > 0, got {self.lease_s!r}")
        object.__setattr__(
            self, "small_sample_bytes", parse_size(self.small_sample_bytes, "PackOptions.small_sample_bytes")
        )


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


#: pack's old flat keyword -> the :class:`PackOptions` field it moved to (``src_options`` and
#: ``dst_options`` are the older names of the per-side storage options); fields added since the
#: group was made (``small_sample_bytes``) were never flat keywords.
DEPRECATED: dict[str, str] = {
    **{f.name: f.name for f in dataclasses.fields(PackOptions) if f.name not in ("small_sample_bytes",)},
    "src_options": "src_storage_options",
    "dst_options": "dst_storage_options",
}


def resolve(options: PackOptions | None, flat: dict, storage_options: dict | None) -> PackOptions:
    """The :class:`PackOptions` of one pack call, each side's storage options set (its own, else
    ``storage_options``, else ``{}``), pack's old keywords ``flat`` (old name -> value) moved in
    with one DeprecationWarning each, given after every check. TypeError: ``options`` not a
    PackOptions, an unknown keyword, an old one with ``options``; ValueError: two old names of one
    field (``dst_options``, ``dst_storage_options``), a value the group rejects."""
    if not isinstance(options, (PackOptions, type(None))):
        raise TypeError(f"options must be a PackOptions, got {type(options).__name__} {options!r}")
    fields: dict[str, str] = {}  # field -> the old keyword that set it
    for old in flat:
        if old not in DEPRECATED:
            raise TypeError(f"pack() got an unexpected keyword argument {old!r}")
        field = DEPRECATED[old]
        if options is not None:
            raise TypeError(f"{old}= and options= were both given: {old} belongs in options=PackOptions({field}=...)")
        if field in fields:
            raise ValueError(f"pack: {fields[field]}= and {old}= both set PackOptions.{field}; give one")
        fields[field] = old
    options = options or PackOptions(**{field: flat[old] for field, old in fields.items()})
    for old in flat:
        warnings.warn(
            f"{old}= is deprecated; use options=PackOptions({DEPRECATED[old]}=...)", DeprecationWarning, stacklevel=3
        )
    src, dst, both = options.src_storage_options, options.dst_storage_options, storage_options or {}
    return dataclasses.replace(  # PackOptions copies each dict
        options, src_storage_options=both if src is None else src, dst_storage_options=both if dst is None else dst
    )
