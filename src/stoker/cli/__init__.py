"""The `stoker` command: one module per command group, registered in :data:`GROUPS` (which
module holds which command: this package's README.md).

Other packages add commands through the ``stoker.commands`` entry-point group (the lab's,
:mod:`stoker_lab.cli`): each entry point names a module (or object) with ``add_parsers(sub)``. A
command that needs packages beyond the product sets ``needs`` (a tuple of import names) in its
parser's defaults: when one is missing, the command prints one line naming it and the extra that
installs it, and exits 2.
"""

from __future__ import annotations

import argparse
import errno
import importlib.metadata
import importlib.util
import logging
import os
import sys
import tarfile

from ..cache.perms import MODE_ENV
from ..errors import StokerError
from . import cache, cluster, data, top
from .args import mode_arg
from .args import storage_errors as _storage_errors

log = logging.getLogger(__name__)

#: Command groups in ``--help`` order; each has ``add_parsers(sub)``.
GROUPS = (data, cluster, cache, top)

#: The entry-point group through which other installed packages add ``stoker`` commands.
COMMANDS_GROUP = "stoker.commands"


def plugin_groups() -> list:
    """The command groups that installed packages register under :data:`COMMANDS_GROUP`, loaded,
    in entry-point name order. One that fails to import is logged and left out, so a broken plugin
    never takes the product's own commands down with it."""
    out = []
    for ep in sorted(importlib.metadata.entry_points(group=COMMANDS_GROUP), key=lambda e: e.name):
        try:
            out.append(ep.load())
        except Exception as exc:  # noqa: BLE001 - any import failure of a plugin
            log.warning("stoker: commands of %r (%s) not loaded: %s: %s", ep.name, ep.value, type(exc).__name__, exc)
    return out


def build_parser() -> argparse.ArgumentParser:
    """The ``stoker`` argument parser, every command group registered."""
    p = argparse.ArgumentParser(prog="stoker", description="Keep accelerators fed with training data.")
    # the parent package is loaded before any of its modules: read its version, import nothing
    version = sys.modules[__name__.split(".")[0]].__version__
    p.add_argument("--version", action="version", version=f"stoker {version}")
    p.add_argument("-v", "--verbose", action="store_true")
    p.add_argument(
        "--cache-mode",
        type=mode_arg,
        metavar="MODE",
        help="file mode of the node caches this command creates or opens (default 0600, "
        "directories 0700; e.g. 0640 for a cache its directory's group may read); "
        "sets $STOKER_CACHE_MODE for the command and its processes",
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    for group in (*GROUPS, *plugin_groups()):
        group.add_parsers(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the command; expected failures (bad input, storage errors) print one line, exit 2;
    Ctrl-C prints one line, exit 130."""
    args = build_parser().parse_args(argv)
    if args.cache_mode:
        os.environ[MODE_ENV] = args.cache_mode
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    expected: tuple[type[BaseException], ...] = (
        FileNotFoundError,
        FileExistsError,
        ValueError,
        StokerError,
        tarfile.TarError,
        OSError,
        *_storage_errors(),
    )
    try:
        for name in getattr(args, "needs", ()):  # packages a plugin's command declares it needs
            if importlib.util.find_spec(name) is None:
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return int(args.fn(args) or 0)
    except KeyboardInterrupt:  # Ctrl-C: one line, the shell's code for SIGINT
        print(f"\nstoker {args.cmd}: interrupted", file=sys.stderr)
        return 130
    except ModuleNotFoundError as exc:  # an optional extra this command needs is not installed
        if args.verbose or not exc.name:
            raise
        extra = _EXTRA_OF.get(exc.name.split(".")[0])
        hint = (
            (f" (the '{extra}' extra: pip install -e '.[{extra}]' in the stoker checkout, or the wheel with [{extra}])")
            if extra
            else ""
        )
        print(
            f"stoker {args.cmd}: needs the Python package '{exc.name}', which is not installed{hint}", file=sys.stderr
        )
        return 2
    except BrokenPipeError:  # e.g. `stoker ls URL | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except expected as exc:
        if args.verbose:
            raise
        where = _where(args, exc)
        plain = isinstance(exc, (ValueError, OSError, StokerError))  # their messages say what happened
        print(
            f"stoker {args.cmd}{where}: {exc}" if plain else f"stoker {args.cmd}{where}: {type(exc).__name__}: {exc}",
            file=sys.stderr,
        )
        return 2


#: Optional packages -> the extra (pyproject.toml) that installs them.
_EXTRA_OF = {
    "simpy": "lab",
    "rich": "metrics",
    "prometheus_client": "metrics",
    "ray": "cluster",
    "waitress": "cluster",
    "moto": "lab",
    "boto3": "lab",
    "matplotlib": "lab",
    "skimage": "lab",
    "sklearn": "lab",
    "soundfile": "audio",
}


def _where(args, exc: BaseException) -> str:
    """`` (URL)`` to put after the command name in a one-line error, or "": nothing when the error
    already names a URL of its own (an origin error, or any of the command's URLs in its text), so
    that an error about ``pack``'s destination is never labelled with its source."""
    urls = [
        u
        for u in (getattr(args, "src", None), getattr(args, "dst", None), getattr(args, "url", None))
        if isinstance(u, str)
    ]
    if getattr(exc, "url", None) or not urls or any(u in str(exc) for u in urls):
        return ""
    dst = getattr(args, "dst", None)
    if isinstance(exc, OSError) and isinstance(dst, str):
        # a full, quota-bound or read-only filesystem is always the one written: the destination;
        # a file under the destination's directory names it too
        if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS):
            return f" ({dst})"
        named = [os.path.abspath(str(f)) for f in (exc.filename, exc.filename2) if f]
        root = os.path.abspath(dst)
        if (
            named
            and "://" not in dst
            and any(f == root or f.startswith(root + os.sep) or root.startswith(f + os.sep) for f in named)
        ):
            return f" ({dst})"
        if named:
            return ""  # the error names its file
    return f" ({urls[0]})"
