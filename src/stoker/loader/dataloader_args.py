"""``torch.utils.data.DataLoader``'s arguments, and what a :class:`stoker.Loader` does instead.

A Loader takes some of them under the same name (:data:`SAME`); each of the others
(:data:`INSTEAD`) is refused with one line naming the stoker equivalent, or why there is none,
rather than Python's bare ``unexpected keyword argument``. The user guide's table
(docs/guide.md, "Coming from torch's DataLoader") says the same, and a test keeps the three in
step with the DataLoader of the installed torch.
"""

from __future__ import annotations

__all__ = ["INSTEAD", "SAME", "dataloader_keyword"]

#: DataLoader arguments the Loader takes under the same name, with the same meaning.
SAME = ("batch_size", "shuffle", "num_workers", "drop_last")

#: DataLoader argument -> what the Loader takes instead (or why it has none), in words.
INSTEAD: dict[str, str] = {
    "dataset": "the Loader's first argument is a packed stoker Dataset (stoker.open_dataset(url))",
    "sampler": (
        "the Loader draws its own order, a pure function of (seed, epoch): shuffle=, seed=, "
        "read=ReadOptions(order=...); rank=/world_size= split it as DistributedSampler does"
    ),
    "batch_sampler": "the Loader makes its own batches: batch_size= and drop_last=",
    "collate_fn": "use collate=: collate(samples) -> batch, run in the worker processes",
    "pin_memory": (
        "use run=RunOptions(device='cuda'): batches are copied to the GPU through pinned memory on a side stream"
    ),
    "pin_memory_device": "use run=RunOptions(device='cuda:N')",
    "timeout": "use run=RunOptions(timeout_s=...): the longest wait for one batch, seconds",
    "worker_init_fn": (
        "the workers are stoker's and need no set-up call: randomness comes from the rng that "
        "decode(fields, rng) gets, seeded by (seed, epoch, sample id); do one-time set-up lazily "
        "inside decode="
    ),
    "multiprocessing_context": "use run=RunOptions(start_method='fork'|'forkserver'|'spawn')",
    "generator": "use seed=: the order and every sample's rng follow from it",
    "prefetch_factor": "use read=ReadOptions(prefetch_batches=...): batches in flight over all workers",
    "persistent_workers": "the workers always persist: they live from the first iter() until close()",
    "in_order": "batches always come in order (deterministic for a seed, and resumable)",
}


def dataloader_keyword(name: str) -> str | None:
    """The one-line error message for the DataLoader-only keyword ``name`` given to a Loader
    (``"Loader() has no pin_memory= (a torch DataLoader argument): use ..."``), or None when
    ``name`` is not one of :data:`INSTEAD`."""
    if name not in INSTEAD:
        return None
    return f"Loader() has no {name}= (a torch DataLoader argument): {INSTEAD[name]}"
