"""`stoker bench peers` and the system packages a peer needs (SPDL: FFmpeg's shared libraries):
`scripts/system_deps.sh spdl` names the set this Debian release packages and installs nothing in a
dry run or when not root (it prints the exact command); the benchmark reports a peer whose
packages are missing with that command, never drops it; its table says which loaders ran.
The script runs against stand-ins for `ldconfig`, `apt-cache` and `id` on PATH, so no test
installs anything, whatever this machine has."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from stoker_lab.bench import sysdeps
from stoker_lab.bench.peers.bench import PeersConfig, run_peers
from stoker_lab.bench.peers.report import markdown

SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "system_deps.sh"
APT = "apt-get install -y -q --no-install-recommends "
DEBIAN_12 = APT + "libavutil57 libavcodec59 libavformat59 libavdevice59 libavfilter8"
DEBIAN_13 = APT + "libavutil59 libavcodec61 libavformat61 libavdevice61 libavfilter10"


def _fake_bin(tmp_path: Path, known: str, present: tuple[str, ...] = (), uid: int | None = None) -> dict:
    """An environment whose PATH starts with stand-ins: `apt-cache show` knows only the package
    ``known``, `ldconfig -p` lists the sonames ``present``, `id -u` says ``uid`` (if given)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    listing = "".join(f"\\t{so} (libc6,x86-64) => /lib/x86_64-linux-gnu/{so}\\n" for so in present)
    tools = {
        "apt-cache": f'for a in "$@"; do [ "$a" = "{known}" ] && exit 0; done; exit 100',
        "ldconfig": f'printf "{len(present)} libs found in cache\\n{listing}"',
    }
    if uid is not None:
        tools["id"] = f"echo {uid}"
    for name, body in tools.items():
        path = bin_dir / name
        path.write_text(f"#!/bin/sh\n{body}\n")
        path.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}


def _script(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=60)


@pytest.mark.parametrize("known,command", [("libavfilter8", DEBIAN_12), ("libavfilter10", DEBIAN_13)])
def test_a_dry_run_prints_the_ffmpeg_set_this_release_packages(tmp_path, known, command):
    r = _script(_fake_bin(tmp_path, known), "spdl", "--dry-run")
    assert (r.returncode, r.stdout.strip()) == (3, command)


def test_libraries_already_there_need_nothing(tmp_path):
    sonames = ("libavutil.so.57", "libavcodec.so.59", "libavformat.so.59", "libavdevice.so.59", "libavfilter.so.8")
    r = _script(_fake_bin(tmp_path, "libavfilter8", present=sonames), "spdl", "--dry-run")
    assert (r.returncode, r.stdout) == (0, "")
    r = _script(_fake_bin(tmp_path, "libavfilter8", present=sonames[:-1]), "spdl", "--dry-run")
    assert r.returncode == 3  # one library short: the whole set is named


def test_not_root_prints_the_exact_command_and_installs_nothing(tmp_path):
    r = _script(_fake_bin(tmp_path, "libavfilter8", uid=1000), "spdl")
    assert (r.returncode, r.stdout.strip()) == (3, DEBIAN_12)
    assert f"as root, run {DEBIAN_12}" in r.stderr


def test_the_tests_group_is_unchanged_and_a_bad_group_is_refused(tmp_path):
    r = _script(_fake_bin(tmp_path, "libavfilter8", uid=1000))
    assert r.returncode == 0 and ("will skip" in r.stderr or r.stderr == "")
    r = _script(os.environ.copy(), "ffmpeg")
    assert r.returncode == 2 and "unknown argument ffmpeg" in r.stderr


def _missing_script(tmp_path: Path) -> str:
    """A stand-in for the script: SPDL's packages missing, the command on stdout (exit 3)."""
    path = tmp_path / "system_deps.sh"
    path.write_text(f'[ "$1" = spdl ] || exit 9\necho "{DEBIAN_12}"\nexit 3\n')
    return str(path)


def test_a_peer_with_missing_packages_is_reported_with_the_command(tmp_path):
    script = _missing_script(tmp_path)
    with pytest.raises(RuntimeError) as e:
        sysdeps.ensure_system_packages("spdl", install=False, script=script)
    assert f"as root run: {DEBIAN_12}" in str(e.value) and "making environments is off" in str(e.value)
    sysdeps.ensure_system_packages("torch", install=False, script=script)  # no system packages: nothing run


def test_bench_peers_skips_spdl_with_the_command_and_says_which_loaders_ran(tmp_path, monkeypatch):
    monkeypatch.setattr(sysdeps, "SCRIPT", _missing_script(tmp_path))
    r = run_peers(
        PeersConfig(
            images=8,
            classes=2,
            epochs=1,
            batch_size=4,
            workers=1,
            consumer_rate=4000.0,
            loaders=("stoker", "spdl"),
            make_venvs=False,
            run_timeout_s=300,
            workdir=str(tmp_path / "work"),
        )
    )
    (s,) = r["skipped"]
    assert s["loader"] == "spdl" and DEBIAN_12 in s["reason"]
    text = markdown(r)
    assert "Ran 1 of 2 loaders: stoker; skipped: spdl (reasons below)" in text
    assert f"- spdl: {s['reason']}" in text
