"""Helpers shared by the command modules: argument types and the errors the CLI reports in one line."""
from __future__ import annotations

import json


def size_arg(text: str) -> int:
    """Parse a byte size for an argument: ``1048576``, ``64MiB``, ``1GiB``, ``500MB``, ``8G`` -> bytes.

    Binary units (KiB, MiB, GiB, TiB and the one-letter K, M, G, T) are powers of 1024;
    decimal units (kB, MB, GB, TB) powers of 1000. Raises ValueError on text that is not a size.
    """
    t = text.strip().lower().replace(" ", "")
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40, "kb": 10**3, "mb": 10**6,
             "gb": 10**9, "tb": 10**12, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40, "b": 1}
    for u in sorted(units, key=len, reverse=True):
        if t.endswith(u):
            return int(float(t[: -len(u)]) * units[u])
    return int(t)


def json_options(text: str | None) -> dict:
    """Storage options (fsspec) given as JSON text on the command line (``None`` -> ``{}``).

    Raises ValueError (json.JSONDecodeError) on text that is not JSON.
    """
    return json.loads(text) if text else {}


def storage_errors() -> tuple[type[BaseException], ...]:
    """Exception types of the S3 client stack (credentials, endpoint, HTTP errors), if installed."""
    try:
        from botocore.exceptions import BotoCoreError, ClientError
    except ImportError:
        return ()
    return (BotoCoreError, ClientError)
