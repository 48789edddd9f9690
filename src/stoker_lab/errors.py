"""Errors raised by the lab alone (benchmarks); both are :class:`stoker.errors.StokerError`
subclasses, so one ``except StokerError`` still catches every error of a ``stoker`` command."""

from __future__ import annotations

from stoker.errors import StokerError

__all__ = ["NetnsUnavailable", "VenvError"]


class NetnsUnavailable(StokerError, RuntimeError):
    """This machine or process cannot make network namespaces (the message says why, on one line)."""


class VenvError(StokerError, RuntimeError):
    """A peer's virtual environment could not be made; the message ends with pip's stderr tail."""
