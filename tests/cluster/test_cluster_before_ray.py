"""``stoker.cluster`` before ``ray.init()``: one clear error naming the fix, not Ray's own; its
public names are listed by ``dir()`` though they are imported on first use."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("ray")

SCRIPT = textwrap.dedent(
    """
    import stoker.cluster as sc
    url = "s3://bucket/data"
    for call in (lambda: sc.run(lambda ctx: 0, url, 1), lambda: sc.placement_hint(url, 2)):
        try:
            call()
        except RuntimeError as exc:
            print("RuntimeError:", exc)
    """
)


def test_run_and_placement_hint_before_ray_init_say_to_start_ray():
    # a fresh interpreter: the test session's own Ray (the cluster fixture) must not be running
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    lines = out.stdout.splitlines()
    assert out.returncode == 0, out.stderr
    assert len(lines) == 2
    for line in lines:
        assert line.startswith("RuntimeError: stoker.cluster needs a running Ray for s3://bucket/data")
        assert "ray.init()" in line


def test_dir_lists_the_public_names():
    import stoker.cluster

    names = dir(stoker.cluster)
    for name in ("run", "rank_loader", "rank_context", "placement_hint", "WorkerContext"):
        assert name in names
