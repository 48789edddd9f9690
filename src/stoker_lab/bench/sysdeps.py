"""System packages a benchmark peer needs that pip cannot install (SPDL: FFmpeg's shared
libraries), installed the way the tests' are: by ``scripts/system_deps.sh`` of the stoker checkout,
run with the peer's group (:data:`PEER_GROUPS`). The script knows the packages (by the Debian
release's FFmpeg) and how to tell they are there; this module runs it and turns its exit status
into a reason a report can carry: the exact ``apt-get`` command to run as root.

Script exit statuses: 0 ready (present, or installed now); 3 missing and not installed (not root,
no apt-get, or ``--dry-run``), the command on stdout; anything else a failed install.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable

#: The stoker checkout's script (absent in an installed wheel: then nothing is checked here).
_ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), *[".."] * 3))
SCRIPT = os.path.join(_ROOT, "scripts", "system_deps.sh")
#: Peers that need system packages, and the ``scripts/system_deps.sh`` group that has them.
PEER_GROUPS = {"spdl": "spdl"}
#: Exit status of the script for "missing, not installed".
MISSING = 3


def ensure_system_packages(
    peer: str,
    install: bool,
    script: str | None = None,
    timeout_s: float = 900.0,
    log: Callable[[str], None] | None = None,
) -> None:
    """Make sure ``peer``'s system packages are there: with ``install``, run ``script`` for its group
    (default :data:`SCRIPT`; it installs them as root with apt-get), else only check
    (``--dry-run``). Nothing to do for a
    peer outside :data:`PEER_GROUPS` or without the script. ``timeout_s`` bounds the script
    (seconds); ``log`` hears that a check or an install runs. Raises RuntimeError with the reason
    and the exact command when they are missing and were not installed, or the install failed."""
    group = PEER_GROUPS.get(peer)
    script = script or SCRIPT
    if group is None or not os.path.exists(script):
        return
    if log:
        log(f"{peer}: system packages: bash {script} {group}" + ("" if install else " --dry-run"))
    r = _run(script, group, install, timeout_s)
    if r.returncode == 0:
        return
    command = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else ""
    if r.returncode != MISSING:
        tail = "\n".join(r.stderr.strip().splitlines()[-3:])
        command = command or _run(script, group, False, timeout_s).stdout.strip()
        raise RuntimeError(
            f"installing its system packages failed (exit {r.returncode}): {tail}; as root run: {command}"
        )
    how = "not root, or no apt-get here" if install else "making environments is off: nothing is installed"
    raise RuntimeError(
        f"needs system packages that are not installed ({group}: {command.split('--no-install-recommends ')[-1]}); "
        f"as root run: {command} (or: bash {script} {group}; {how})"
    )


def _run(script: str, group: str, install: bool, timeout_s: float) -> subprocess.CompletedProcess:
    cmd = ["bash", script, group] + ([] if install else ["--dry-run"])
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{' '.join(cmd)} did not finish in {timeout_s:.0f} s") from None
