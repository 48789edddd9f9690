"""``stoker sample-data DIR``: the embedded real photos as an ImageFolder tree."""

from __future__ import annotations

import json
import sys


def cmd_sample_data(a) -> int:
    """``stoker sample-data DIR``: the embedded photos as an ImageFolder tree; the summary as JSON."""
    from ..sample_data import make_sample_data

    print(json.dumps(make_sample_data(a.dir, images=a.images, classes=a.classes, seed=a.seed), indent=2))
    print(
        f"ImageFolder tree: {a.dir.rstrip('/')}/train  (pack it with: stoker pack {a.dir.rstrip('/')}/train DST)",
        file=sys.stderr,
    )
    return 0


def add_parsers(sub) -> None:
    """Register ``sample-data`` on the top-level subparsers ``sub``."""
    s = sub.add_parser("sample-data", help="write the embedded real-photo ImageFolder set")
    s.add_argument("dir")
    s.add_argument("--images", type=int, default=2000)
    s.add_argument("--classes", type=int, default=10)
    s.add_argument("--seed", type=int, default=0)
    s.set_defaults(fn=cmd_sample_data)
