"""The lab's argparse type for an origin bandwidth (``--bandwidth-MBps``, the demo's caps)."""

from __future__ import annotations

import argparse

from stoker._units import parse_size


def rate_arg(text: str) -> float:
    """argparse type for a bandwidth -> megabytes (1e6 bytes) per second: a bare number is MB/s
    (``100``), or a size per second (``100MB/s``, ``1.5GB/s``, ``800MiB/s``; the size parsed by
    :func:`stoker._units.parse_size`). Bits (``Mbps``, ``Mb/s``) are refused, naming the text,
    since the unit differs by 8x."""
    t = text.strip()
    try:
        value = float(t)
    except ValueError:
        low = t.lower()
        if low.endswith(("bps", "bit/s", "bits/s")) or (t.endswith("b/s") and not low.endswith("ib/s")):
            raise argparse.ArgumentTypeError(
                f"bandwidth {text!r}: give bytes per second such as '100MB/s' (or a number of MB/s), not bits"
            ) from None
        if not low.endswith("/s"):
            raise argparse.ArgumentTypeError(
                f"bandwidth {text!r}: give MB/s as a number or a size per second such as '100MB/s'"
            ) from None
        try:
            value = parse_size(t[:-2]) / 1e6
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"bandwidth {text!r}: {exc}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"bandwidth {text!r} is negative")
    return value
