"""DLIO's half of ``bytes_only`` (:mod:`stoker_lab.bench.bytes_only`): runs under the Python of DLIO's own
virtual environment, where stoker is not installed (standard library and DLIO only).

``python dlio_runner.py CFG_JSON`` (``{"batch_size": B, "overrides": [hydra overrides]}``) runs DLIO's
own entry point (``dlio_benchmark.main.main``, as ``python -m dlio_benchmark.main OVERRIDES`` would),
timing each of its training epochs from outside: ``DLIOBenchmark._train`` is wrapped so that the CPU
of the whole process tree (:func:`stoker_lab.bench.peers._runner.tree_cpu_s`, the same code that
counts stoker's) and the wall time are taken before and after each epoch. It prints one JSON line per
epoch (``kind: epoch``: samples, bytes, seconds, cpu_s), then the cost of the debug string DLIO
builds per sample (``kind: index_map_format``, :func:`index_map_format_s`) and DLIO's own summary
(``kind: summary``: its ``summary.json`` metric block) for a cross-check. DLIO's code is not changed.
"""

import importlib.util
import json
import os
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))


def _load_runner():
    spec = importlib.util.spec_from_file_location("_stoker_peer_runner", os.path.join(_HERE, "peers", "_runner.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def index_map_format_s(reps: int = 20) -> None:
    """Emit (``kind: index_map_format``) the CPU seconds of one ``f"{train_global_index_map}"``: DLIO 2.0.0's
    ``FormatReader.read_index`` builds that string for a ``logging.debug`` call on every sample, debug on or
    off, so its per-sample CPU grows with the number of files. Measured here, in DLIO's process, on DLIO's map."""
    try:
        from dlio_benchmark.utils.config import ConfigArguments

        m = ConfigArguments.get_instance().train_global_index_map
        c0 = time.process_time()
        for _ in range(reps):
            f"{m}"  # noqa: B018 - the expression DLIO evaluates per sample
        runner_emit({"kind": "index_map_format", "entries": len(m), "cpu_s": (time.process_time() - c0) / reps})
    except Exception as exc:  # a later DLIO may have renamed it: then no figure, said so
        runner_emit({"kind": "index_map_format", "error": f"{type(exc).__name__}: {exc}"})


def runner_emit(row: dict) -> None:
    print(json.dumps(row), flush=True)


def main() -> None:
    with open(sys.argv[1]) as f:
        cfg = json.load(f)
    runner = _load_runner()
    runner.subreaper()
    from dlio_benchmark import main as dlio

    train = dlio.DLIOBenchmark._train
    batch = int(cfg["batch_size"])

    def timed_train(self, epoch):
        c0, t0 = runner.tree_cpu_s(), time.perf_counter()
        steps = train(self, epoch)
        t, c = time.perf_counter() - t0, runner.tree_cpu_s() - c0
        n = int(steps) * batch * int(self.comm_size)
        runner.emit(
            {
                "kind": "epoch",
                "epoch": int(epoch) - 1,
                "samples": n,
                "bytes": n * int(self.args.record_length),
                "seconds": t,
                "cpu_s": c,
                "steps": int(steps),
            }
        )
        return steps

    dlio.DLIOBenchmark._train = timed_train
    out = next((o.split("=", 1)[1] for o in cfg["overrides"] if o.startswith("++workload.output.folder=")), None)
    sys.argv = ["dlio_benchmark", *cfg["overrides"]]
    dlio.main()
    index_map_format_s()
    try:
        if out is None:
            raise OSError("no ++workload.output.folder= among the overrides")
        with open(os.path.join(out, "summary.json")) as f:
            runner.emit({"kind": "summary", "summary": json.load(f).get("metric")})
    except (OSError, ValueError, TypeError):
        pass


if __name__ == "__main__":
    main()
