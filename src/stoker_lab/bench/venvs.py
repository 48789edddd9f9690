"""Virtual environments for benchmark peers whose requirements conflict with stoker's.

DALI (``nvidia-dali-cuda130``), Mosaic Streaming and LitData (which want
``torch==2.14.1 torchvision==0.29.1``, not the CPU torch stoker is pinned to) each run in a
virtual environment of their own, made on first use under ``~/.cache/stoker-bench/venvs/<name>``
(``$STOKER_BENCH_VENVS`` overrides the root) and reused while its recorded requirement list is
unchanged. A peer that cannot be installed raises :class:`VenvError` with pip's stderr tail, so
the benchmark can report why it did not run.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys

from ..errors import VenvError  # noqa: F401 - re-exported

_MARKER = ".stoker-requirements.json"

# Requirement lists per peer (pins shared with the decode benchmark).
PEER_REQUIREMENTS: dict[str, list[str]] = {
    "dali": ["nvidia-dali-cuda130==2.4.0", "numpy"],
    # SPDL's image decode is FFmpeg's: spdl-io links the system's libavcodec/libavfilter (FFmpeg 4-9,
    # e.g. Debian's libavfilter8 + libavdevice59), which pip cannot install.
    "spdl": ["spdl==0.8.0", "numpy"],
    "streaming": ["mosaicml-streaming==0.13.0", "torch==2.14.1", "torchvision==0.29.1"],
    "litdata": ["litdata==0.2.76", "torch==2.14.1", "torchvision==0.29.1", "boto3"],
    # DLIO's own pins pull in DALI for CUDA 11 and full TensorFlow; its PyTorch reader needs torch,
    # hydra, MPI (mpi4py over the MPICH wheel, no system MPI) and, since its profiler factory imports
    # it at start-up, TensorFlow (the CPU build). dlio-benchmark itself goes in without its deps.
    "dlio": [
        "torch==2.13.0",
        "tensorflow-cpu",
        "mpi4py",
        "mpich",
        "pydftracer==1.0.2",
        "hydra-core>=1.3.2",
        "omegaconf>=2.2.0",
        "numpy",
        "pandas",
        "psutil",
        "Pillow",
        "h5py",
        "PyYAML",
    ],
}

# Packages installed after the requirements, without their own dependencies (pip --no-deps).
PEER_NO_DEPS: dict[str, list[str]] = {
    "dlio": ["dlio-benchmark==2.0.0"],
}


def venv_root() -> str:
    """Folder that holds the peers' environments (``$STOKER_BENCH_VENVS`` or ~/.cache/stoker-bench/venvs)."""
    return os.environ.get("STOKER_BENCH_VENVS") or os.path.join(
        os.path.expanduser("~"), ".cache", "stoker-bench", "venvs"
    )


def venv_python(name: str, path: str | None = None) -> str:
    """Path of the environment's python (it may not exist yet)."""
    return os.path.join(path or os.path.join(venv_root(), name), "bin", "python")


def _recorded(reqs: list[str], no_deps: list[str]) -> list[str]:
    """What the marker file holds: the requirement list, then ``--no-deps`` and those packages."""
    return reqs + (["--no-deps", *no_deps] if no_deps else [])


def ready_venv(
    name: str, requirements: list[str] | None = None, path: str | None = None, no_deps: list[str] | None = None
) -> str | None:
    """The python of an existing, complete environment for ``requirements`` (and ``no_deps``, by
    default :data:`PEER_NO_DEPS` of a named peer), else None (makes nothing)."""
    reqs = requirements if requirements is not None else PEER_REQUIREMENTS[name]
    nd = no_deps if no_deps is not None else (PEER_NO_DEPS.get(name, []) if requirements is None else [])
    root = path or os.path.join(venv_root(), name)
    try:
        with open(os.path.join(root, _MARKER)) as f:
            done = json.load(f)
    except (OSError, ValueError):
        return None
    py = venv_python(name, root)
    return py if done == _recorded(reqs, nd) and os.path.exists(py) else None


def _tail(text: str | bytes | None, lines: int = 8) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    kept = [ln for ln in (text or "").strip().splitlines() if "is ignored: it is neither" not in ln]
    return "\n".join(kept[-lines:])


def ensure_venv(
    name: str,
    requirements: list[str] | None = None,
    path: str | None = None,
    timeout_s: float = 1800.0,
    log=None,
    no_deps: list[str] | None = None,
) -> str:
    """Make (or reuse) the environment ``name`` with ``requirements``; returns its python.

    ``no_deps``: packages installed afterwards with ``pip --no-deps`` (default: :data:`PEER_NO_DEPS`
    of a named peer when ``requirements`` is not given).

    ``path`` overrides the location; ``timeout_s`` bounds each pip/venv step (seconds);
    ``log`` (a callable taking a string) hears about a fresh install. The environment is marked
    complete only after pip succeeds, so an interrupted install is redone, not reused.
    Raises :class:`VenvError` (with pip's stderr tail) if it cannot be made.
    """
    reqs = requirements if requirements is not None else PEER_REQUIREMENTS[name]
    nd = no_deps if no_deps is not None else (PEER_NO_DEPS.get(name, []) if requirements is None else [])
    root = path or os.path.join(venv_root(), name)
    py = ready_venv(name, reqs, root, nd)
    if py:
        return py
    if log:
        log(
            f"making virtual environment {root}: pip install {' '.join(reqs)}"
            + (f"; pip install --no-deps {' '.join(nd)}" if nd else "")
        )
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(os.path.dirname(root), exist_ok=True)
    py = venv_python(name, root)
    steps = [
        [sys.executable, "-m", "venv", root],
        [py, "-m", "pip", "install", "-q", "--disable-pip-version-check", *reqs],
    ]
    if nd:
        steps.append([py, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps", *nd])
    for cmd in steps:
        try:
            subprocess.run(cmd, check=True, capture_output=True, timeout=timeout_s, stdin=subprocess.DEVNULL)
        except subprocess.CalledProcessError as exc:
            raise VenvError(
                f"{' '.join(cmd[:5])} ... failed (exit {exc.returncode}):\n{_tail(exc.stderr) or _tail(exc.stdout)}"
            ) from None
        except subprocess.TimeoutExpired:
            raise VenvError(f"{' '.join(cmd[:5])} ... did not finish in {timeout_s:.0f} s") from None
        except OSError as exc:
            raise VenvError(f"{' '.join(cmd[:5])} ... could not run: {exc}") from None
    with open(os.path.join(root, _MARKER), "w") as f:
        json.dump(_recorded(reqs, nd), f)
    return py


def run_json_lines(cmd: list[str], env: dict, timeout_s: float, log_path: str) -> tuple[list[dict], str | None]:
    """Run ``cmd`` (a benchmark runner, often in a peer's environment) in a session of its own, its
    stderr in ``log_path``; returns (the JSON objects it printed one per line, None), or (those so
    far, why it failed: its exit status or the timeout, then the last lines of its stderr). A run
    past ``timeout_s`` seconds is killed with its whole process group."""
    rows: list[dict] = []
    with open(log_path, "w+") as err:
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=err,
            stdin=subprocess.DEVNULL,
            text=True,
            env=env,
            start_new_session=True,
        )
        try:
            out, _ = proc.communicate(timeout=timeout_s)
            why = None if proc.returncode == 0 else f"exit status {proc.returncode}"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            why = f"did not finish in {timeout_s:.0f} s"
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        for line in (out or "").splitlines():
            if line.startswith("{"):
                try:
                    rows.append(json.loads(line))
                except ValueError:
                    pass
        if why:
            err.seek(0)
            why = f"{why}: {stderr_tail(err.read())}"
    return rows, why


def stderr_tail(text: str, lines: int = 6) -> str:
    """The last ``lines`` lines of a runner's stderr that say something (pip's index warnings left out)."""
    kept = [ln for ln in text.strip().splitlines() if ln.strip() and "is ignored: it is neither" not in ln]
    return "\n".join(kept[-lines:])
