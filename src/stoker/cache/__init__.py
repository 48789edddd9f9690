"""The node cache: blocks of shards on local disk, shared by every process on the node."""
from .disk import DiskCache, CacheStats, POLICIES

__all__ = ["DiskCache", "CacheStats", "POLICIES"]
