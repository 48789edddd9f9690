"""Where the peer stage's CPU goes (:mod:`stoker_lab.bench.peer_stage`): the CPU time of a set of
processes between two moments (every thread's ``schedstat``), and a profile of them (py-spy of the
Python processes, ``perf`` of all) reduced to each one's top frames."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time

#: Seconds of passes a profile covers.
PROFILE_S = 2
#: The roles that run Python (profiled with py-spy as well as perf).
PYTHON_ROLES = ("rank", "service", "worker")


def threads_cpu_ns(pid: int) -> dict[int, int]:
    """``{thread id: nanoseconds on a CPU}`` of every thread of ``pid`` now (the first field of
    ``/proc/<pid>/task/<tid>/schedstat``: user and system time, and softirq work done in the
    thread's context on a kernel without IRQ time accounting); {} for a process that is gone."""
    out: dict = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for t in tids:
        try:
            with open(f"/proc/{pid}/task/{t}/schedstat") as f:
                out[int(t)] = int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            continue
    return out


def cpu_marks(pids: dict) -> dict:
    """``{role: threads_cpu_ns(pid)}`` of ``pids`` (``{role: pid}``)."""
    return {k: threads_cpu_ns(p) for k, p in pids.items()}


def cpu_between(before: dict, after: dict) -> dict:
    """``{role: CPU seconds}`` between two :func:`cpu_marks`: each thread's time since the first
    mark (a thread started in between counts whole; one that ended in between is lost)."""
    return {k: sum(ns - before.get(k, {}).get(t, 0) for t, ns in v.items()) / 1e9 for k, v in after.items()}


def _tool(name: str) -> str | None:
    import sys

    here = os.path.join(os.path.dirname(sys.executable), name)
    return here if os.path.exists(here) else shutil.which(name)


def profile(pids: dict, one_pass, seconds: float = PROFILE_S, top: int = 6) -> dict:
    """Profile ``pids`` (``{role: pid}``) while ``one_pass()`` runs again and again for ``seconds``:
    py-spy (``record --native``, 100 Hz; it pauses the process for each sample) of the Python
    processes (:data:`PYTHON_ROLES`) and ``perf record`` (499 Hz) of every process, at the same
    time. Returns ``{role: {"py-spy": [[share, frame], ...] | why not, "perf": [...] | why not}}``:
    the ``top`` frames by their own samples (py-spy: the innermost frame of each stack; perf:
    ``dso symbol``, ``--no-children``), each with its share of that process's samples in percent."""
    pyspy, perf = _tool("py-spy"), _tool("perf")
    out: dict = {k: {} for k in pids}
    with tempfile.TemporaryDirectory(prefix="stoker-peer-prof-") as d:
        procs = []
        for role, pid in pids.items():
            tag = role.replace(" ", "_")
            if role in PYTHON_ROLES:
                if pyspy is None:
                    out[role]["py-spy"] = "py-spy not installed"
                else:
                    f = os.path.join(d, f"{tag}.py-spy")
                    cmd = [pyspy, "record", "--pid", str(pid), "--duration", str(int(seconds)), "--rate", "100"]
                    cmd += ["--format", "raw", "--output", f, "--gil"]
                    procs.append((role, "py-spy", f, _bg(cmd, d, f"{tag}-py-spy")))
            if perf is None:
                out[role]["perf"] = "perf not installed"
            else:
                f = os.path.join(d, f"{tag}.perf")
                cmd = [perf, "record", "-F", "499", "-p", str(pid), "-o", f, "--", "sleep", str(int(seconds))]
                procs.append((role, "perf", f, _bg(cmd, d, f"{tag}-perf")))
        time.sleep(0.5)  # the profilers attach
        t_end = time.monotonic() + seconds
        while time.monotonic() < t_end:
            one_pass()
        for role, kind, f, p in procs:
            try:
                p.wait(timeout=seconds + 60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            if p.returncode != 0 or not os.path.exists(f):
                out[role][kind] = f"{kind} failed (exit code {p.returncode}): {_tail(d, f'{role}-{kind}')}"
                continue
            try:
                out[role][kind] = _pyspy_top(f, top) if kind == "py-spy" else _perf_top(str(perf), f, top)
            except Exception as exc:  # noqa: BLE001 - a profile is an explanation, not a result
                out[role][kind] = f"{kind} output unreadable: {type(exc).__name__}: {exc}"
    return out


def _bg(cmd: list[str], d: str, name: str) -> subprocess.Popen:
    with open(os.path.join(d, f"{name}.log"), "wb") as log:
        return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log)


def _tail(d: str, name: str) -> str:
    try:
        with open(os.path.join(d, f"{name.replace(' ', '_')}.log"), errors="replace") as f:
            return " ".join(f.read()[-400:].split())
    except OSError:
        return ""


def _pyspy_top(path: str, top: int) -> list:
    """The ``top`` innermost frames of a py-spy raw file (``frame;frame;... count`` per line)."""
    counts: dict[str, int] = {}
    total = 0
    with open(path) as f:
        for line in f:
            stack, _, n = line.rstrip("\n").rpartition(" ")
            if not stack or not n.isdigit():
                continue
            leaf = stack.rsplit(";", 1)[-1]
            counts[leaf] = counts.get(leaf, 0) + int(n)
            total += int(n)
    ranked = sorted(counts.items(), key=lambda kv: -kv[1])[:top]
    return [[round(100.0 * n / total, 1), frame] for frame, n in ranked] if total else []


def _perf_top(perf: str, path: str, top: int) -> list:
    """The ``top`` symbols of a ``perf record`` file by their own samples (``--no-children``)."""
    proc = subprocess.run(
        [perf, "report", "-i", path, "--stdio", "--no-children", "--sort", "dso,sym", "-q"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    rows = []
    for line in proc.stdout.splitlines():
        parts = line.split(None, 1)
        if len(parts) == 2 and parts[0].endswith("%"):
            try:
                share = float(parts[0][:-1])
            except ValueError:
                continue
            rows.append([share, " ".join(parts[1].split())])
        if len(rows) >= top:
            break
    if not rows and "no samples" not in proc.stderr:
        raise RuntimeError(proc.stderr.strip()[-300:] or "no samples")
    return rows  # [] when the process never ran while it was sampled (an idle raylet)
