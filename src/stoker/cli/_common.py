"""Helpers shared by the command modules: argument types and the errors the CLI reports in one line."""
from __future__ import annotations

import argparse
import json

from .._units import parse_size


def size_arg(text: str) -> int:
    """argparse type for byte sizes (``1048576``, ``64MiB``, ``1.5GiB``, ``500MB``, ``8G``) -> bytes.

    Parsed by :func:`stoker._units.parse_size`; text that is not a size is an argparse error naming it.
    """
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


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
