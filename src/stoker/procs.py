"""Process liveness, for finding what dead processes left behind (temporary fills, batch slots)."""
from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """True if process ``pid`` exists and is not a zombie (a killed process whose parent has not
    reaped it yet still answers ``kill(pid, 0)``). A pid we may not signal counts as alive."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except (OSError, IndexError):
        return True
