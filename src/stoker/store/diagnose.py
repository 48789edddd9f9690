"""Why a URL holds no packed dataset: the one message :func:`stoker.open_dataset` gives with its
``OriginNotFoundError``, with only the advice that can help (the bucket, the URL, an unfinished
pack, something else stored there)."""

from __future__ import annotations

import logging

from ..storage import Origin
from .index import INDEX_NAME, SHARD_DIR

log = logging.getLogger(__name__)

__all__ = ["why_no_index"]


def why_no_index(origin: Origin) -> str:
    """Why the dataset root of ``origin`` has no index, with only the advice that can help: the
    bucket does not exist (S3), nothing is stored under the URL, the pack that wrote its shards did
    not finish, or it holds something that is not a packed dataset. Best effort: a probe that fails
    leaves the plain statement."""
    url = origin.url
    try:
        fs = origin.fs
        root = origin.root
        protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
        if protocol in ("s3", "s3a"):
            bucket = root.split("/", 1)[0]
            if not fs.exists(bucket):
                return (
                    f"{url} is not a packed stoker dataset: its bucket {bucket!r} does not exist (check "
                    "the bucket name, and the endpoint and credentials in the storage options or the "
                    "AWS environment)"
                )
        if not fs.exists(root):
            return f"{url} is not a packed stoker dataset: nothing is stored there (check the URL)"
        if fs.exists(origin.path("_parts")):
            return (
                f"{url} is not a packed stoker dataset yet: it holds the parts of parallel stoker.Writers "
                "that were not merged (call stoker.Writer.merge(url, parts) once every part has closed)"
            )
        if fs.exists(origin.path(SHARD_DIR)):
            return (
                f"{url} is not a packed stoker dataset yet: it has shards but no {INDEX_NAME}, so the "
                "pack (or stoker.Writer) that wrote it did not finish (run the same `stoker pack` again: it "
                "resumes; a Writer writes it again)"
            )
    except Exception as exc:  # noqa: BLE001 - only a better message is lost
        log.debug("probing %s failed: %s", url, exc)
        return f"{url} is not a packed stoker dataset (no {INDEX_NAME})"
    return f"{url} is not a packed stoker dataset (no {INDEX_NAME}; pack one there with `stoker pack`)"
