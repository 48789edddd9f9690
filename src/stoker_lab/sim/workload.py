"""The dataset a simulated job reads: sample sizes, shards and stoker's own cache blocks.

:func:`synthetic` lays samples out the way ``stoker pack`` writes them (tar members: a 512-byte
header, the payload padded to 512 bytes, shards closed at ``shard_bytes``) and cuts the blocks
with :func:`stoker.store.blockmap.plan_blocks`, the function the cache uses, so block counts and
block bytes (what a cache fill fetches) are stoker's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from stoker.store.blockmap import plan_blocks

#: tar member header (POSIX ustar), bytes.
TAR_HEADER_BYTES = 512


@dataclass
class Workload:
    """One dataset. ``sample_bytes`` int64 (N,) payload bytes; ``sample_block`` int64 (N,) block
    of each sample; ``block_bytes`` int64 (B,) bytes one fill of the block fetches (shard range,
    tar headers included); ``name`` labels it in reports; ``keys``: the names its blocks are
    placed by (:func:`stoker.cluster.placement.block_keys`: content version and block name), None
    for a made-up dataset (then ``name/b``)."""

    sample_bytes: np.ndarray
    sample_block: np.ndarray
    block_bytes: np.ndarray
    name: str = "dataset"
    keys: list[str] | None = None

    def block_keys(self) -> list[str]:
        """The placement key of every block (B strings)."""
        return list(self.keys) if self.keys is not None else [f"{self.name}/{b}" for b in range(self.num_blocks)]

    @property
    def num_samples(self) -> int:
        """Samples N."""
        return len(self.sample_bytes)

    @property
    def num_blocks(self) -> int:
        """Cache blocks B."""
        return len(self.block_bytes)

    @property
    def total_bytes(self) -> int:
        """Payload bytes of all samples."""
        return int(self.sample_bytes.sum())


@dataclass
class _Index:  # the fields of stoker.store.index.DatasetIndex that plan_blocks reads
    shard: np.ndarray
    offset: np.ndarray
    span_end: np.ndarray

    def __len__(self) -> int:
        return len(self.shard)


def synthetic(
    samples: int,
    total_bytes: int,
    shard_bytes: int,
    block_bytes: int,
    sigma: float = 0.5,
    seed: int = 0,
    name: str = "dataset",
) -> Workload:
    """A workload of ``samples`` samples with ``total_bytes`` payload bytes in all (sizes
    log-normal with shape ``sigma``, scaled to the exact total; sigma 0 = all equal), packed in
    order into tar shards of about ``shard_bytes`` and cut into blocks of about ``block_bytes``
    by :func:`stoker.store.blockmap.plan_blocks`. Raises ValueError for samples < 1 or sizes < 1.
    """
    if samples < 1 or total_bytes < samples or shard_bytes < 1 or block_bytes < 1:
        raise ValueError(
            f"bad workload: {samples} samples, {total_bytes} bytes, shard {shard_bytes}, block {block_bytes}"
        )
    rng = np.random.default_rng(seed)
    raw = rng.lognormal(0.0, sigma, samples) if sigma > 0 else np.ones(samples)
    sizes = np.maximum(1, np.floor(raw / raw.sum() * total_bytes)).astype(np.int64)
    short = int(total_bytes - sizes.sum())  # flooring left these bytes out: one more to the first
    sizes[: max(0, short)] += 1
    member = TAR_HEADER_BYTES + (sizes + 511) // 512 * 512  # header + padded payload
    end = np.cumsum(member)
    shard = (np.concatenate([[0], end[:-1]]) // shard_bytes).astype(np.int32)
    first_of_shard = np.searchsorted(shard, shard, side="left")
    base = np.concatenate([[0], end[:-1]])[first_of_shard]
    offset = np.concatenate([[0], end[:-1]]) - base + TAR_HEADER_BYTES
    blocks = plan_blocks(_Index(shard, offset, offset + sizes), block_bytes)  # type: ignore[arg-type]
    return Workload(
        sizes, blocks["sample_block"].astype(np.int64), (blocks["end"] - blocks["start"]).astype(np.int64), name
    )


def from_dataset(ds, name: str = "dataset") -> Workload:
    """The workload of a real :class:`stoker.store.dataset.Dataset` (opened with the block size the
    cache used): its samples' bytes, its blocks as the cache cut them and their placement keys
    (:func:`stoker.cluster.placement.block_keys`), so the model places the blocks exactly as the
    cluster placed them."""
    from stoker.cluster.placement import block_keys

    b = np.arange(len(ds.blocks))
    return Workload(
        np.asarray(ds.index.length, dtype=np.int64),
        np.asarray(ds.blocks.sample_block, dtype=np.int64),
        np.asarray(ds.blocks.nbytes(b), dtype=np.int64),
        name,
        block_keys(ds),
    )
