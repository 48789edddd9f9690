"""Helpers shared by the command modules: argument types and the errors the CLI reports in one line."""

from __future__ import annotations

import argparse
import json
import sys

from .._units import parse_size
from ..cache.perms import parse_mode


def size_arg(text: str) -> int:
    """argparse type for byte sizes (``1048576``, ``64MiB``, ``1.5GiB``, ``500MB``, ``8G``) -> bytes.

    Parsed by :func:`stoker._units.parse_size`; text that is not a size is an argparse error naming it.
    """
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def mode_arg(text: str) -> str:
    """argparse type for ``--cache-mode`` (an octal file mode such as ``0600`` or ``0640``),
    checked by :func:`stoker.cache.perms.parse_mode`; returned as 4-digit octal text."""
    try:
        return f"{parse_mode(text):04o}"
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


class Renamed(argparse.Action):
    """A flag with an old spelling after its current one (``--cache-bytes``, ``--cache-size``):
    stores the value, and prints one deprecation line on stderr when the old spelling is used."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        if option_string and option_string != self.option_strings[0]:
            print(f"stoker: {option_string} is deprecated; use {self.option_strings[0]}", file=sys.stderr)


class OptionsFlag(Renamed):
    """A storage-options flag with deprecated spellings (``--src-options`` for
    ``--src-storage-options``), as :class:`Renamed`, that also records the spelling used in
    ``<dest>_flag`` (for error messages)."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, f"{self.dest.split('_')[0]}_flag", option_string or self.option_strings[0])
        super().__call__(parser, namespace, values, option_string)


def storage_errors() -> tuple[type[BaseException], ...]:
    """Exception types of the S3 client stack (credentials, endpoint, HTTP errors), if installed."""
    try:
        from botocore.exceptions import BotoCoreError, ClientError
    except ImportError:
        return ()
    return (BotoCoreError, ClientError)


def show_progress(args) -> bool:
    """Whether a command draws a progress bar: not with ``--no-progress``, and only when stderr
    (where tqdm draws) is a terminal, so pipes, logs and CI output stay free of bars."""
    if getattr(args, "no_progress", False):
        return False
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False
