"""The `stoker` command: one module per command group, registered in :data:`GROUPS`.

* :mod:`.data`: ``sample-data``, ``pack``, ``ls``, ``stat``, ``verify``
* :mod:`.demo`: ``demo``, ``origin-server``
* :mod:`.bench`: ``bench decode|cache|peers|cluster``
* :mod:`.cluster`: ``warm``, ``cluster-state``, ``extender``
* :mod:`.cache`: ``cache status|clear``

The library modules never import argparse: each command module declares its arguments and calls
plain functions with keyword arguments.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

from . import bench, cache, cluster, data, demo
from ._common import storage_errors as _storage_errors

#: Command groups in ``--help`` order; each has ``add_parsers(sub)``.
GROUPS = (data, demo, bench, cluster, cache)


def build_parser() -> argparse.ArgumentParser:
    """The ``stoker`` argument parser, every command group registered."""
    p = argparse.ArgumentParser(prog="stoker", description="Keep accelerators fed with training data.")
    p.add_argument("-v", "--verbose", action="store_true")
    sub = p.add_subparsers(dest="cmd", required=True)
    for group in GROUPS:
        group.add_parsers(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the command; expected failures (bad input, storage errors) print one line, exit 2."""
    import tarfile

    from ..errors import StokerError
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    expected: tuple[type[BaseException], ...] = (
        FileNotFoundError, FileExistsError, ValueError, StokerError, tarfile.TarError, OSError, *_storage_errors())
    try:
        return int(args.fn(args) or 0)
    except BrokenPipeError:  # e.g. `stoker ls URL | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except expected as exc:
        if args.verbose:
            raise
        where = getattr(args, "src", None) or getattr(args, "url", None)
        where = f" ({where})" if isinstance(where, str) and where not in str(exc) else ""
        plain = isinstance(exc, (ValueError, OSError, StokerError))  # their messages say what happened
        print(f"stoker {args.cmd}{where}: {exc}" if plain else f"stoker {args.cmd}{where}: {type(exc).__name__}: {exc}",
              file=sys.stderr)
        return 2
