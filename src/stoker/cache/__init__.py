"""The node cache: blocks of shards on local disk, shared by every process on the node."""

from .disk import DiskCache, CacheStats, POLICIES
from .readonly import ReadOnlyCache
from .staging import StagingArea
from .tiered import TieredCache, default_memory_root

__all__ = ["DiskCache", "CacheStats", "POLICIES", "ReadOnlyCache", "StagingArea", "TieredCache", "default_memory_root"]
