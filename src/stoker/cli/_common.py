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


def json_options(text: str | None, option: str = "--storage-options") -> dict:
    """Storage options (fsspec) given as a JSON object on the command line (``None`` -> ``{}``).

    Raises ValueError naming ``option`` when the text is not a JSON object.
    """
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{option} is not valid JSON ({exc}): {text!r}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{option} must be a JSON object such as '{{\"anon\": true}}', got {text!r}")
    return value


def storage_errors() -> tuple[type[BaseException], ...]:
    """Exception types of the S3 client stack (credentials, endpoint, HTTP errors), if installed."""
    try:
        from botocore.exceptions import BotoCoreError, ClientError
    except ImportError:
        return ()
    return (BotoCoreError, ClientError)
