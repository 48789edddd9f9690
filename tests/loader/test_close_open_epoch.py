"""Closing a loader whose epoch iterator the caller still holds ends that epoch then, with its
stats final, and nothing is left to fail at interpreter exit."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_an_epoch_iterator_held_past_close_ends_at_close_not_at_exit(packed_local):
    script = textwrap.dedent(f"""
        import stoker
        from stoker.store.dataset import open_dataset
        ds = open_dataset({packed_local!r}, cache=False)
        with stoker.Loader(ds, batch_size=4, num_workers=2, seed=0, image=stoker.ImageOptions(image_size=32)) as loader:
            it = iter(loader)
            next(it)
        print("samples", loader.stats.samples)
        try:
            next(it)
        except StopIteration:
            print("ended")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "samples 4" in out.stdout and "ended" in out.stdout  # stats of the epoch cut short at close
    assert "Exception ignored" not in out.stderr and "Traceback" not in out.stderr, out.stderr
