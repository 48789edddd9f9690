"""DLIO's rows of ``bytes_only`` (:mod:`stoker_lab.bench.bytes_only`): runs under the Python of DLIO's own
virtual environment, where stoker is not installed (standard library and DLIO only).

``python dlio_runner.py CFG_JSON`` (``{"batch_size": B, "overrides": [hydra overrides], "marks": [epochs],
"quiet_index_map": bool}``) runs DLIO's own entry point (``dlio_benchmark.main.main``, as ``python -m
dlio_benchmark.main OVERRIDES`` would). ``DLIOBenchmark._train`` is wrapped so that a boundary mark
(:func:`stoker_lab.bench.steady_state.mark`: wall clock, CPU of the whole process tree by
:func:`stoker_lab.bench.peers._runner.tree_cpu_s`, the same code that counts the other readers, and
samples so far) is printed before each epoch listed in ``marks`` (0-based) and after the last one:
the marks :func:`stoker_lab.bench.steady_state.figures` takes. Then it prints where the installed
DLIO builds its per-sample debug string (``kind: debug_line``), what that string costs once
(``kind: index_map_format``, :func:`index_map_format_s`) and DLIO's own summary (``kind: summary``).

With ``quiet_index_map``, DLIO's sample -> file map (what ``ConfigArguments.get_global_map_index``
returns) is handed on as a dict subclass whose ``str()`` / ``format()`` is a constant
(:class:`QuietMap`): DLIO's ``self.logger.debug(f"{self.global_index_map}")`` in
``FormatReader.read_index`` then formats a few characters instead of the whole map, on every
sample. Lookups are the dict's own; DLIO's code is not changed.
"""

import importlib.util
import inspect
import json
import os
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))


def _load(name: str, path: str):
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


class QuietMap(dict):
    """DLIO's index map with a constant ``str()``: the debug string of every sample costs nothing."""

    def __repr__(self):
        return f"<index map of {len(self)} samples>"

    __str__ = __repr__

    def __format__(self, spec):
        return repr(self)


def emit(row: dict) -> None:
    print(json.dumps(row), flush=True)


def index_map_format_s(reps: int = 20) -> None:
    """Emit (``kind: index_map_format``) the CPU seconds of one ``f"{train_global_index_map}"`` in DLIO's
    process, on DLIO's map: what ``FormatReader.read_index`` pays per sample for its debug string."""
    try:
        from dlio_benchmark.utils.config import ConfigArguments

        m = ConfigArguments.get_instance().train_global_index_map
        c0 = time.process_time()
        for _ in range(reps):
            f"{m}"  # noqa: B018 - the expression DLIO evaluates per sample
        emit({"kind": "index_map_format", "entries": len(m), "cpu_s": (time.process_time() - c0) / reps})
    except Exception as exc:  # a later DLIO may have renamed it: then no figure, said so
        emit({"kind": "index_map_format", "error": f"{type(exc).__name__}: {exc}"})


def debug_line() -> None:
    """Emit (``kind: debug_line``) the file, line number and text of the installed DLIO's line that
    formats the index map in ``FormatReader.read_index`` (none found: ``line`` is None)."""
    try:
        from dlio_benchmark.reader import reader_handler

        path = inspect.getsourcefile(reader_handler)
        if path is None:
            raise OSError("no source file for dlio_benchmark.reader.reader_handler")
        with open(path) as f:
            hits = [(k + 1, t.strip()) for k, t in enumerate(f) if "global_index_map}" in t]
        emit(
            {
                "kind": "debug_line",
                "file": path,
                "line": hits[0][0] if hits else None,
                "text": hits[0][1] if hits else None,
            }
        )
    except Exception as exc:
        emit({"kind": "debug_line", "error": f"{type(exc).__name__}: {exc}"})


def quiet_index_map() -> None:
    """Make ``ConfigArguments.get_global_map_index`` return its map as a :class:`QuietMap`."""
    from dlio_benchmark.utils.config import ConfigArguments

    build = ConfigArguments.get_global_map_index

    def quiet(self, *args, **kwargs):
        got = build(self, *args, **kwargs)
        if isinstance(got, tuple):  # (map, count) in some releases; the map alone in 2.0.0 as installed
            return (QuietMap(got[0]), *got[1:])
        return QuietMap(got)

    ConfigArguments.get_global_map_index = quiet


def main() -> None:
    with open(sys.argv[1]) as f:
        cfg = json.load(f)
    runner = _load("_stoker_peer_runner", os.path.join(_HERE, "peers", "_runner.py"))
    steady = _load("_stoker_steady_state", os.path.join(_HERE, "steady_state.py"))
    runner.subreaper()
    from dlio_benchmark import main as dlio

    if cfg.get("quiet_index_map"):
        quiet_index_map()
    train = dlio.DLIOBenchmark._train
    batch, at_marks, last = int(cfg["batch_size"]), set(cfg["marks"][:-1]), int(cfg["marks"][-1])
    done = {"samples": 0, "bytes": 0}

    def timed_train(self, epoch):
        k = int(epoch) - 1  # DLIO counts epochs from 1
        if k in at_marks:
            emit(steady.mark(k, done["samples"], done["bytes"], runner.tree_cpu_s))
        steps = train(self, epoch)
        n = int(steps) * batch * int(self.comm_size)
        done["samples"] += n
        done["bytes"] += n * int(self.args.record_length)
        if k + 1 == last:
            emit(steady.mark(last, done["samples"], done["bytes"], runner.tree_cpu_s))
        return steps

    dlio.DLIOBenchmark._train = timed_train
    out = next((o.split("=", 1)[1] for o in cfg["overrides"] if o.startswith("++workload.output.folder=")), None)
    sys.argv = ["dlio_benchmark", *cfg["overrides"]]
    dlio.main()
    debug_line()
    index_map_format_s()
    try:
        if out is None:
            raise OSError("no ++workload.output.folder= among the overrides")
        with open(os.path.join(out, "summary.json")) as f:
            emit({"kind": "summary", "summary": json.load(f).get("metric")})
    except (OSError, ValueError, TypeError):
        pass


if __name__ == "__main__":
    main()
