"""The packed sample store (DLFS): tar shards plus a Parquet index, the sample directory."""

from .index import DatasetIndex, INDEX_NAME, read_index
from .pack import pack

__all__ = ["DatasetIndex", "INDEX_NAME", "read_index", "pack"]
