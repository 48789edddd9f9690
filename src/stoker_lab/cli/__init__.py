"""The lab's ``stoker`` commands, registered on the ``stoker`` command through the
``stoker.commands`` entry-point group (``pyproject.toml``; read by :func:`stoker.cli.build_parser`).

* :mod:`.demo`: ``demo``, ``origin-server``
* :mod:`.samples`: ``sample-data``
* :mod:`.bench`: ``bench decode|cache|peers|cluster|...``
* :mod:`.simulate`: ``simulate --validate``, ``simulate tdcs``

Importing this package imports only argparse-level code; each command imports its library
modules (and their optional dependencies) when it runs.
"""

from __future__ import annotations

from . import bench, demo, samples, simulate

#: Command groups in ``--help`` order; each has ``add_parsers(sub)``.
GROUPS = (samples, demo, bench, simulate)


def add_parsers(sub) -> None:
    """Register every lab command on the ``stoker`` command's top-level subparsers ``sub``
    (an ``argparse._SubParsersAction``)."""
    for group in GROUPS:
        group.add_parsers(sub)
