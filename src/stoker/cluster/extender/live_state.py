"""The live extender's state source: ``stoker cluster-state`` run in a child process per refresh.

Why a child process.  A process that has joined a Ray cluster as a driver is ended by Ray itself
when the cluster's control store (GCS) stays unreachable: Ray's core worker gives up after
``gcs_rpc_server_reconnect_timeout_s`` (60 s by default) and exits the process ("Failed to
connect to GCS within 60 seconds ... GCS may have been killed"). An extender that joined Ray
in its own process therefore died about a minute after the cluster went away, taking the HTTP
server with it. Here the extender process never joins Ray: every refresh starts ``python -m
stoker.cli cluster-state`` with a time limit, reads its JSON, and the child ends (or is ended
at the limit). A cluster that is gone, or an address where no cluster ever was, only makes
refreshes fail; the server keeps answering from the last state, whose age grows until
``max_age_s`` (:mod:`stoker.cluster.freshness`).
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys

from ..freshness import refreshing
from .scoring import check_state

log = logging.getLogger(__name__)

#: Seconds one refresh may take (starting Python, importing Ray, joining, asking every service).
REFRESH_TIMEOUT_S = 60.0
#: Seconds between refreshes.
REFRESH_EVERY_S = 10.0


def cluster_state_command(
    urls: list[str],
    ray_address: str | None = None,
    storage_options: dict | None = None,
    block_bytes: int | None = None,
    python: str = sys.executable,
    timeout_s: float = REFRESH_TIMEOUT_S,
) -> list[str]:
    """The ``stoker cluster-state`` command line a refresh runs (JSON on its stdout). The child
    gives up by itself after ``timeout_s`` + 5 seconds (``--timeout``), so that a child whose
    extender is gone (killed, or a test that ended) does not wait on a missing cluster for ever."""
    cmd = [python, "-m", "stoker.cli", "cluster-state", *urls, "--timeout", f"{timeout_s + 5:g}"]
    if ray_address:
        cmd += ["--ray-address", ray_address]
    if storage_options:
        cmd += ["--storage-options", json.dumps(storage_options)]
    if block_bytes:
        cmd += ["--block-size", str(int(block_bytes))]
    return cmd


def run_state_command(cmd: list[str], timeout_s: float = REFRESH_TIMEOUT_S) -> dict:
    """Run ``cmd`` and return the cache state it prints (checked with :func:`check_state`).

    A child still running after ``timeout_s`` seconds is asked to stop (SIGTERM), and ended
    5 s later if it has not.

    Raises:
        TimeoutError: no answer within ``timeout_s``.
        RuntimeError: the command failed (its exit code and last stderr line in the message).
        ValueError: its output is not a cache state.
    """
    what = " ".join(cmd)[:160]
    proc = subprocess.Popen(
        cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
        raise TimeoutError(f"{what} gave no answer within {timeout_s:g} s") from None
    if proc.returncode != 0:
        lines = [ln for ln in err.decode(errors="replace").splitlines() if ln.strip()]
        raise RuntimeError(f"{what} exited with {proc.returncode}: {lines[-1] if lines else 'no message'}")
    try:
        state = json.loads(out)
    except ValueError as exc:
        raise ValueError(f"{what} printed no JSON: {exc}") from None
    return check_state(state, f"output of {what}")


def live_state(
    urls: list[str],
    ray_address: str | None = None,
    storage_options: dict | None = None,
    block_bytes: int | None = None,
    every_s: float = REFRESH_EVERY_S,
    timeout_s: float = REFRESH_TIMEOUT_S,
    command: list[str] | None = None,
):
    """A state source for :func:`stoker.cluster.extender.scoring.serve` asking the cache services of the
    Ray cluster at ``ray_address`` (default ``auto``) about ``urls``, every ``every_s`` seconds,
    each time in a child process given ``timeout_s`` seconds (see the module docstring).

    Returns the :func:`stoker.cluster.freshness.refreshing` callable: it answers at once with the
    last state (``{"nodes": {}, "time": 0}``, stale, before the first); ``stop()`` ends the
    refresh thread. ``command``: run this instead (tests).
    """
    cmd = command or cluster_state_command(urls, ray_address, storage_options, block_bytes, timeout_s=timeout_s)
    return refreshing(lambda: run_state_command(cmd, timeout_s), every_s)
