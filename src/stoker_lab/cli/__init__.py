"""The lab's ``stoker`` commands, registered on the ``stoker`` command through the
``stoker.commands`` entry-point group (``pyproject.toml``; read by :func:`stoker.cli.build_parser`).

* :mod:`.demo`: ``demo``, ``origin-server``
* :mod:`.samples`: ``sample-data``
* :mod:`.bench`: ``bench decode|cache|peers|cluster|...``
* :mod:`.simulate`: ``simulate --validate``, ``simulate tdcs``
* :mod:`.plan`: ``plan`` (the capacity planner on the model)

Importing this package imports only argparse-level code; each command imports its library
modules (and their optional dependencies) when it runs.
"""

from __future__ import annotations

from . import bench, demo, plan, samples, simulate

#: Command groups in ``--help`` order; each has ``add_parsers(sub)``.
GROUPS = (samples, demo, bench, simulate, plan)

#: Packages (import names) each lab command needs beyond the product, all from the ``lab``
#: extra: without one, ``stoker <command>`` prints one line naming it and the extra, exit 2
#: (:func:`stoker.cli.main` reads a parser's ``needs`` default). ``simulate`` checks its own.
NEEDS = {
    "sample-data": ("skimage", "sklearn"),
    "demo": ("skimage", "sklearn", "moto", "boto3", "matplotlib"),
    "origin-server": ("moto", "waitress", "boto3"),
    "bench": ("skimage", "sklearn", "moto", "boto3"),
    "plan": ("simpy",),
}


class _LabCommands:
    """The ``stoker`` subparsers as the lab's modules see them: each command's help says it comes
    with the lab extra, and its parser records the packages it needs (:data:`NEEDS`)."""

    def __init__(self, sub):
        self.sub = sub

    def add_parser(self, name: str, **kwargs):
        if kwargs.get("help"):
            kwargs["help"] = f"{kwargs['help']} [lab extra]"
        parser = self.sub.add_parser(name, **kwargs)
        parser.set_defaults(needs=NEEDS.get(name, ()))
        return parser


def add_parsers(sub) -> None:
    """Register every lab command on the ``stoker`` command's top-level subparsers ``sub``
    (an ``argparse._SubParsersAction``)."""
    lab = _LabCommands(sub)
    for group in GROUPS:
        group.add_parsers(lab)
