"""``stoker simulate``: the cluster model (:mod:`stoker.sim`): ``--validate`` against measured
runs, ``tdcs`` for the TDCS paper's experiment and its scaling curves."""
from __future__ import annotations

import glob
import json
import os
import sys
import time


def _write_json(path: str | None, report: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=1, default=float)
        print(f"wrote {path}")


def _need(path: str, what: str) -> str:
    if not os.path.exists(path):
        raise FileNotFoundError(f"{what}: {path} does not exist (run the benchmark or pass the option)")
    return path


def default_netns(paths: list[str]) -> tuple[list[str], list[str]]:
    """The ``--netns`` reports ``--validate`` uses by default, and those it leaves out, with why.

    A report's ``runs`` are the placements' epochs, all run before any injected fault (``stoker
    bench cluster --netns`` runs its fault runs after the placements and reports them apart, in
    ``faults``), so a report with faults is used like any other. One without a cold ``direct``
    epoch (a faults-only run of one placement) is left out: the links' delivered fraction is
    fitted on that epoch (:func:`stoker.sim.calibrate.cold_direct_row`). Raises OSError or
    ValueError for an unreadable report."""
    from ..sim.calibrate import cold_direct_row
    used, skipped = [], []
    for p in paths:
        with open(p) as f:
            report = json.load(f)
        try:
            cold_direct_row(report, p)
        except ValueError as e:
            skipped.append(f"{p} ({e})")
            continue
        used.append(p)
    return used, skipped


def cmd_validate(a) -> int:
    """``stoker simulate --validate``: predicted against measured, per epoch and placement."""
    from ..sim.validate import table, validate
    netns = a.netns
    if not netns:
        netns, skipped = default_netns(sorted(glob.glob(os.path.join("benchmarks", "bench_cluster_netns*.json"))))
        for why in skipped:
            print(f"left out: {why}")
    for p in netns:
        _need(p, "--netns report")
    if a.demo:
        _need(a.demo, "--demo report")
    report = validate(netns, a.demo or None, a.decode if a.decode and os.path.exists(a.decode) else None,
                      a.calibration, measured=not a.made_up_layout)
    print("parameters:")
    for k, v in report["parameters"].items():
        print(f"  {k} = {v['value']:.6g}   ({v['source']})")
    print(table(report))
    print(json.dumps(report["summary"]))
    _write_json(a.json, report)
    return 0


def cmd_tdcs(a) -> int:
    """``stoker simulate tdcs``: the four setups at the configured scale (and ``--scaling``)."""
    from ..sim.scaling import plot, scaling
    from ..sim.tdcs import TdcsConfig, experiment
    sources = {}
    cfg = TdcsConfig(nodes=a.nodes, gpus_per_node=a.gpus_per_node, gpu_rate=a.gpu_rate, samples=a.samples,
                     store_gbit=a.store_gbit, store_latency_ms=a.store_latency_ms, nic_gbit=a.nic_gbit,
                     cache_fraction=a.cache_fraction, epochs=a.epochs, jobs=a.jobs, peer_latency_ms=a.peer_latency_ms,
                     decode_cores=a.decode_cores)
    if a.decode_rate:
        cfg.decode_rate = a.decode_rate
        sources["decode_rate"] = "--decode-rate"
    elif a.decode and os.path.exists(a.decode):
        with open(a.decode) as f:
            cfg.decode_rate = float(json.load(f)["per_core"]["stoker"])
        sources["decode_rate"] = f"{a.decode}: per_core.stoker (stoker bench decode, this machine's core)"
    from dataclasses import asdict

    from ..sim.tdcs import assumptions
    base = assumptions(TdcsConfig())
    for k, v in asdict(cfg).items():  # an option given on the command line says so, with the default's source
        if k not in sources and v != base[k]["value"]:
            sources[k] = f"given on the command line (the default, {base[k]['value']:g}: {base[k]['source']})"
    report = experiment(cfg, sources=sources)
    print("assumptions:")
    for k, v in report["assumptions"].items():
        print(f"  {k} = {v['value']}   ({v['source']})")
    print("| setup | epoch | GPUs | epoch s | GPU utilisation | origin GB | host-to-host GB | local GB | busiest |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in report["rows"]:
        b = r["bytes"]
        print(f"| {r['setup']} | {r['epoch']} | {r['gpus']} | {r['epoch_s']:.1f} | {r['gpu_utilization']:.2f} | "
              f"{b['origin'] / 1e9:.1f} | {b['host_to_host'] / 1e9:.1f} | {b['local'] / 1e9:.1f} | "
              f"{r['bottleneck']['name']} |")
    print(json.dumps(report["summary"]))
    if a.scaling:
        t0 = time.process_time()

        def show(pt: dict) -> None:
            print(f"scaling: {pt['setup']}, {pt['nodes']} nodes, {pt['jobs']} jobs, cache {pt['cache_fraction']:g}: "
                  f"cold {pt['cold_epoch_s']:.1f} s ({pt['cold_bottleneck']['name']}), warm {pt['warm_epoch_s']:.2f} s "
                  f"({pt['warm_bottleneck']['name']}); {time.process_time() - t0:.0f} s of CPU so far", flush=True)

        report["scaling"] = scaling(cfg, sources, quick=a.quick_scaling, on_point=show)
        report["scaling"]["cpu_s"] = time.process_time() - t0
    if a.plot and "scaling" in report:
        plot(report, a.plot)
        print(f"wrote {a.plot}")
    _write_json(a.json, report)
    return 0


def cmd_simulate(a) -> int:
    """Dispatch ``stoker simulate`` to ``--validate`` or ``tdcs``."""
    if a.what == "tdcs":
        return cmd_tdcs(a)
    if a.validate:
        return cmd_validate(a)
    print("stoker simulate: give --validate or tdcs (see --help)", file=sys.stderr)
    return 2


def add_parsers(sub) -> None:
    """Register ``simulate`` on the top-level subparsers ``sub``."""
    from ..sim.tdcs_config import TdcsConfig  # no SimPy: every command builds this parser
    d = TdcsConfig()
    s = sub.add_parser("simulate", help="the cluster model: --validate against measured runs, or tdcs "
                                        "(the TDCS experiment at 128 GPUs and scaling curves)")
    s.add_argument("what", nargs="?", choices=["tdcs"], help="tdcs: the paper's experiment on the model")
    s.add_argument("--validate", action="store_true", help="predict the measured runs and compare")
    s.add_argument("--json", help="write the report here")
    s.add_argument("--netns", action="append", help="a stoker bench cluster --netns report (repeatable; "
                                                    "default benchmarks/bench_cluster_netns*.json with a cold "
                                                    "direct epoch)")
    s.add_argument("--calibration", help="the --netns report the local read time is taken from, and the peer "
                                         "request time for reports without their own peer probe (default: "
                                         "the first)")
    s.add_argument("--made-up-layout", action="store_true",
                   help="--validate: model the namespace runs on a made-up dataset layout and node names, plain "
                        "rate-limited links, ranks drawn by the model and started together (not the runs' own "
                        "dataset, node keys, rank hosts, rank starts and token buckets)")
    s.add_argument("--demo", default=os.path.join("docs", "demo.json"), help="a stoker demo --json report ('' = skip)")
    s.add_argument("--decode", default=os.path.join("benchmarks", "bench_decode.json"),
                   help="a stoker bench decode --json report (decode rate per core, pipeline efficiency)")
    t = s.add_argument_group("tdcs")
    t.add_argument("--nodes", type=int, default=d.nodes)
    t.add_argument("--gpus-per-node", type=int, default=d.gpus_per_node)
    t.add_argument("--gpu-rate", type=float, default=d.gpu_rate, help="samples/s per GPU (default: ResNet-50, "
                                                                       "V100, NVIDIA's published figure)")
    t.add_argument("--samples", type=int, default=d.samples, help="dataset samples (default ImageNet-1k train)")
    t.add_argument("--store-gbit", type=float, default=d.store_gbit, help="remote store bandwidth, Gbit/s")
    t.add_argument("--store-latency-ms", type=float, default=d.store_latency_ms, help="per request")
    t.add_argument("--nic-gbit", type=float, default=d.nic_gbit, help="per node and direction")
    t.add_argument("--cache-fraction", type=float, default=d.cache_fraction,
                   help="cache per node as a fraction of dataset / nodes")
    t.add_argument("--decode-cores", type=int, default=d.decode_cores, help="per node")
    t.add_argument("--decode-rate", type=float, help="samples/s per core (default: from --decode's report)")
    t.add_argument("--peer-latency-ms", type=float, default=d.peer_latency_ms, help="per peer request")
    t.add_argument("--epochs", type=int, default=d.epochs)
    t.add_argument("--jobs", type=int, default=d.jobs, help="jobs sharing the dataset (GPUs split between them)")
    t.add_argument("--scaling", action="store_true", help="also the curves over nodes, cache and jobs")
    t.add_argument("--quick-scaling", action="store_true", help="fewer points on the curves")
    t.add_argument("--plot", help="write the scaling curves as a PNG here")
    s.set_defaults(fn=cmd_simulate)
