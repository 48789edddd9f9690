"""``stoker simulate``: the cluster model (:mod:`stoker_lab.sim`): ``--validate`` against measured
runs, ``tdcs`` for the TDCS paper's experiment and its scaling curves.

Bad input is refused before any model runs, in one line naming the option or report and what is
wrong (a ValueError, which :func:`stoker.cli.main` prints as ``stoker simulate: ...``, exit 2)."""

from __future__ import annotations

import glob
import json
import math
import os
import sys
import time

#: Default reports, relative to the source checkout (:func:`stoker_lab.sim.reports.default_path`).
NETNS_DEFAULT = os.path.join("benchmarks", "bench_cluster_netns*.json")
DEMO_DEFAULT = os.path.join("docs", "demo.json")
DECODE_DEFAULT = os.path.join("benchmarks", "bench_decode.json")

#: ``tdcs`` numeric options: (dest, lowest value, lowest excluded); integers or floats by their
#: argparse ``type``. Each defaults to None on the command line (so that one given is known),
#: then to :class:`stoker_lab.sim.tdcs.TdcsConfig`'s.
TDCS_NUMBERS = (
    ("nodes", 1, False),
    ("gpus_per_node", 1, False),
    ("gpu_rate", 0, True),
    ("samples", 1, False),
    ("store_gbit", 0, True),
    ("store_latency_ms", 0, False),
    ("nic_gbit", 0, True),
    ("cache_fraction", 0, False),
    ("decode_cores", 0, False),
    ("decode_rate", 0, True),
    ("peer_latency_ms", 0, False),
    ("epochs", 1, False),
    ("jobs", 1, False),
)
#: Options of ``tdcs`` alone and of ``--validate`` alone (dests).
TDCS_ONLY = (*(d for d, *_ in TDCS_NUMBERS), "cores_per_node", "cpu_costs", "scaling", "quick_scaling", "plot")
VALIDATE_ONLY = ("netns", "calibration", "made_up_layout", "demo")


def _opt(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _write_json(path: str | None, report: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=1, default=float)
        print(f"wrote {path}")


def _check_output(option: str, path: str | None) -> None:
    """Refuse an output path whose directory does not exist, before minutes of modelling."""
    if path:
        where = os.path.dirname(path) or "."
        if os.path.isdir(path):
            raise ValueError(f"{option} {path}: is a directory, not a file to write")
        if not os.path.isdir(where):
            raise ValueError(f"{option} {path}: no directory {where} to write it in")


def check_options(a) -> None:
    """Refuse, naming the option, what ``stoker simulate`` would otherwise ignore or crash on: an
    option of the other mode (``tdcs`` against ``--validate``), ``--plot`` or ``--quick-scaling``
    without ``--scaling``, both ``--decode-rate`` and ``--decode``, a ``tdcs`` number out of range
    (:data:`TDCS_NUMBERS`), ``--jobs`` that do not divide the GPUs, an output whose directory does
    not exist. Raises ValueError."""

    def given(dest: str) -> bool:  # 0 given is given: compare by identity, 0 == False
        v = getattr(a, dest, None)
        return v is not None and v is not False

    if a.what == "tdcs":
        if a.validate:
            raise ValueError(
                "--validate and tdcs are two runs: give one (stoker simulate --validate, or stoker simulate tdcs)"
            )
        for dest in VALIDATE_ONLY:
            if given(dest):
                raise ValueError(f"{_opt(dest)} is an option of stoker simulate --validate, not of tdcs")
        for dest in ("plot", "quick_scaling"):
            if given(dest) and not a.scaling:
                raise ValueError(f"{_opt(dest)} is about the scaling curves: give --scaling too")
        if a.decode_rate is not None and a.decode is not None:
            raise ValueError("--decode-rate and --decode both give the decode rate: give one")
        for dest, low, strict in TDCS_NUMBERS:
            v = getattr(a, dest)
            if v is None:
                continue
            if not math.isfinite(v):
                raise ValueError(f"{_opt(dest)} must be a finite number, got {v}")
            if v < low or (strict and v == low):
                raise ValueError(
                    f"{_opt(dest)} must be {'>' if strict else '>='} {low}, got {v:g}"
                    + (" (--decode-cores 0: no decode cost)" if dest == "decode_rate" else "")
                )
        _check_output("--plot", a.plot)
    else:
        for dest in TDCS_ONLY:
            if given(dest):
                raise ValueError(f"{_opt(dest)} is an option of stoker simulate tdcs, not of --validate")
    _check_output("--json", a.json)


def default_netns(paths: list[str]) -> tuple[list[str], list[str]]:
    """The ``--netns`` reports ``--validate`` uses by default, and those it leaves out, with why.

    A report's ``runs`` are the placements' epochs, all run before any injected fault (``stoker
    bench cluster --netns`` runs its fault runs after the placements and reports them apart, in
    ``faults``), so a report with faults is used like any other. One without a cold ``direct``
    epoch (a faults-only run of one placement) is left out: the links' delivered fraction is
    fitted on that epoch (:func:`stoker_lab.sim.calibrate.cold_direct_row`). Raises ValueError
    naming the report for one that is unreadable or not a ``--netns`` report
    (:func:`stoker_lab.sim.reports.load_netns`)."""
    from ..sim.calibrate import cold_direct_row
    from ..sim.reports import load_netns

    used, skipped = [], []
    for p in paths:
        report = load_netns(p, "--netns (default)")
        try:
            cold_direct_row(report, p)
        except ValueError as e:
            skipped.append(f"{p} ({e})")
            continue
        used.append(p)
    return used, skipped


def validate_inputs(a) -> tuple[list[str], str | None, str | None]:
    """``(netns reports, demo report or None, decode report or None)`` of ``--validate``: the
    options, or the defaults (:data:`NETNS_DEFAULT`, :data:`DEMO_DEFAULT`, :data:`DECODE_DEFAULT`)
    in the source checkout, else the current directory. ``--demo ''``/``--decode ''`` leave that
    report out; a missing default decode report is left out, saying so. Raises ValueError for a
    missing default demo report and when nothing is left to validate."""
    from ..sim.reports import default_path

    netns, why_none = a.netns or [], "none given"
    if not a.netns:
        pattern = default_path(NETNS_DEFAULT)
        found = sorted(glob.glob(pattern))
        netns, skipped = default_netns(found)
        for why in skipped:
            print(f"left out: {why}")
        why_none = (
            f"none of the {len(found)} default reports {pattern} has a cold direct epoch"
            if found
            else f"no default report {pattern}"
        )
        if not netns:
            print(f"no --netns report: {why_none}")
    demo = a.demo
    if demo is None:
        demo = default_path(DEMO_DEFAULT)
        if not os.path.exists(demo):
            raise ValueError(
                f"--demo: the default report {demo} does not exist (pass --demo PATH, or --demo '' "
                "to leave the demo out)"
            )
    decode = a.decode
    if decode is None:
        decode = default_path(DECODE_DEFAULT)
        if not os.path.exists(decode):
            print(
                f"no --decode report: the default {decode} does not exist (the demo's decode pipeline "
                "efficiency is taken as 1)"
            )
            decode = ""
    if not netns and not demo:
        raise ValueError(f"nothing to validate: no --netns report ({why_none}) and --demo ''")
    return netns, demo or None, decode or None


def cmd_validate(a) -> int:
    """``stoker simulate --validate``: predicted against measured, per epoch and placement."""
    from ..sim.validate import table, validate

    netns, demo, decode = validate_inputs(a)
    report = validate(netns, demo, decode, a.calibration, measured=not a.made_up_layout)
    print("parameters:")
    for k, v in report["parameters"].items():
        print(f"  {k} = {v['value']:.6g}   ({v['source']})")
    print(table(report))
    print(json.dumps(report["summary"]))
    _write_json(a.json, report)
    return 0


def tdcs_config(a):
    """``(TdcsConfig, sources)`` of ``stoker simulate tdcs``'s options (:func:`check_options` first):
    each option given, else its default; the decode rate from ``--decode-rate``, else ``--decode``'s
    report (default :data:`DECODE_DEFAULT`: its ``per_core.stoker``), else the built-in default,
    its source saying which. Raises ValueError for an unusable ``--decode`` report."""
    from ..sim.reports import default_path, load_decode
    from ..sim.tdcs import TdcsConfig, assumptions

    base = assumptions(TdcsConfig())
    given = {dest: getattr(a, dest) for dest, *_ in TDCS_NUMBERS if getattr(a, dest) is not None}
    cfg = TdcsConfig(**given)
    sources = {k: f"given on the command line (the default, {base[k]['value']:g}: {base[k]['source']})" for k in given}
    if cfg.decode_cores == 0:
        sources["decode_cores"] = "given on the command line: 0, decoding costs nothing (the model leaves it out)"
    sources |= cpu_config(a, cfg)
    if a.decode_rate is not None:
        sources["decode_rate"] = "--decode-rate"
        return cfg, sources
    path = a.decode if a.decode is not None else default_path(DECODE_DEFAULT)
    if path and (a.decode is not None or os.path.exists(path)):
        cfg.decode_rate = float(load_decode(path)["per_core"]["stoker"])
        sources["decode_rate"] = (
            f"{path}: per_core.stoker (stoker bench decode: a core of the machine that report was made on)"
        )
    else:
        why = "--decode ''" if a.decode is not None else f"no report {path}"
        sources["decode_rate"] = (
            f"{base['decode_rate']['source']}; not this machine's ({why}: measure it with "
            "stoker bench decode --json, or give --decode-rate)"
        )
    return cfg, sources


def cpu_config(a, cfg) -> dict[str, str]:
    """Set ``cfg``'s node cores and decode cores (``--cores-per-node`` and ``--decode-cores``, the one
    given setting the other: :func:`stoker_lab.sim.byte_cpu.node_cores`) and, with ``--cpu-costs
    PATH``, each byte path's CPU-s/GB from that ``stoker bench io --json`` report
    (:func:`stoker_lab.sim.byte_cpu.from_bench_io`); return their sources. Raises ValueError naming the option."""
    from ..sim.byte_cpu import FIELDS, from_bench_io, node_cores

    cfg.cores_per_node, cfg.decode_cores, sources = node_cores(
        a.cores_per_node, cfg.decode_cores, a.decode_cores is not None
    )
    if a.cpu_costs is not None:
        for path, cost in from_bench_io(a.cpu_costs).items():
            setattr(cfg, FIELDS[path], cost.cpu_s_per_GB)
            sources[FIELDS[path]] = cost.source
    return sources


def cmd_tdcs(a) -> int:
    """``stoker simulate tdcs``: the four setups at the configured scale (and ``--scaling``)."""
    from ..sim.scaling import plot, scaling
    from ..sim.tdcs import experiment

    cfg, sources = tdcs_config(a)
    gpus = cfg.nodes * cfg.gpus_per_node
    if gpus % cfg.jobs:
        raise ValueError(
            f"--jobs {cfg.jobs} does not divide the {gpus} GPUs (--nodes {cfg.nodes} x "
            f"--gpus-per-node {cfg.gpus_per_node}) evenly"
        )
    report = experiment(cfg, sources=sources)
    print("assumptions:")
    for k, v in report["assumptions"].items():
        print(f"  {k} = {v['value']}   ({v['source']})")
    print(
        "| setup | epoch | GPUs | epoch s | GPU utilisation | origin GB | host-to-host GB | local GB "
        "| byte-moving cores/node | decode cores/node | busiest |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in report["rows"]:
        b, u = r["bytes"], r["gpu_utilization"]
        print(
            f"| {r['setup']} | {r['epoch']} | {r['gpus']} | {r['epoch_s']:.1f} | "
            f"{'n/a' if u is None else f'{u:.2f}'} | {b['origin'] / 1e9:.1f} | {b['host_to_host'] / 1e9:.1f} | "
            f"{b['local'] / 1e9:.1f} | {r['byte_cores_per_node']['total']:.1f} | {r['decode_cores_per_node']:.1f} | "
            f"{r['bottleneck']['name']} |"
        )
    print(json.dumps(report["summary"]))
    if a.scaling:
        t0 = time.process_time()

        def show(pt: dict) -> None:
            print(
                f"scaling: {pt['setup']}, {pt['nodes']} nodes, {pt['jobs']} jobs, cache {pt['cache_fraction']:g}: "
                f"cold {pt['cold_epoch_s']:.1f} s ({pt['cold_bottleneck']['name']}), warm {pt['warm_epoch_s']:.2f} s "
                f"({pt['warm_bottleneck']['name']}); {time.process_time() - t0:.0f} s of CPU so far",
                flush=True,
            )

        report["scaling"] = scaling(cfg, sources, quick=a.quick_scaling, on_point=show)
        report["scaling"]["cpu_s"] = time.process_time() - t0
        if a.plot:
            plot(report, a.plot)
            print(f"wrote {a.plot}")
    _write_json(a.json, report)
    return 0


def cmd_simulate(a) -> int:
    """Dispatch ``stoker simulate`` to ``--validate`` or ``tdcs``, its options checked first
    (:func:`check_options`)."""
    if a.what != "tdcs" and not a.validate:
        print("stoker simulate: give --validate or tdcs (see --help)", file=sys.stderr)
        return 2
    check_options(a)
    return cmd_tdcs(a) if a.what == "tdcs" else cmd_validate(a)


def add_parsers(sub) -> None:
    """Register ``simulate`` on the top-level subparsers ``sub``."""
    from ..sim.tdcs_config import TdcsConfig  # no SimPy: every command builds this parser

    d = TdcsConfig()
    s = sub.add_parser(
        "simulate",
        help="the cluster model: --validate against measured runs, or tdcs "
        "(the TDCS experiment at 128 GPUs and scaling curves)",
        description="Default reports are looked for in the stoker source checkout this command "
        "runs from, else in the current directory.",
    )
    s.add_argument("what", nargs="?", choices=["tdcs"], help="tdcs: the paper's experiment on the model")
    s.add_argument("--validate", action="store_true", help="predict the measured runs and compare")
    s.add_argument("--json", help="write the report here")
    s.add_argument(
        "--netns",
        action="append",
        help="--validate: a stoker bench cluster --netns report "
        f"(repeatable; default {NETNS_DEFAULT} with a cold direct "
        "epoch)",
    )
    s.add_argument(
        "--calibration",
        help="--validate: the --netns report (one of those validated) the local read "
        "time is taken from, and the peer request time for reports without their "
        "own peer probe (default: the first)",
    )
    s.add_argument(
        "--made-up-layout",
        action="store_true",
        help="--validate: model the namespace runs on a made-up dataset layout and node names, plain "
        "rate-limited links, ranks drawn by the model and started together (not the runs' own "
        "dataset, node keys, rank hosts, rank starts and token buckets); without it a run whose "
        "dataset cannot be made again exactly as reported is an error",
    )
    s.add_argument("--demo", help=f"--validate: a stoker demo --json report (default {DEMO_DEFAULT}; '' = skip)")
    s.add_argument(
        "--decode",
        help="a stoker bench decode --json report (decode rate per core, pipeline "
        f"efficiency; default {DECODE_DEFAULT} if it exists; '' = none)",
    )
    t = s.add_argument_group("tdcs")
    t.add_argument("--nodes", type=int, help=f"nodes (>= 1; default {d.nodes})")
    t.add_argument("--gpus-per-node", type=int, help=f">= 1 (default {d.gpus_per_node})")
    t.add_argument(
        "--gpu-rate",
        type=float,
        help=f"samples/s per GPU, > 0 (default {d.gpu_rate:g}: ResNet-50, V100, NVIDIA's published figure)",
    )
    t.add_argument("--samples", type=int, help=f"dataset samples, >= 1 (default {d.samples}: ImageNet-1k train)")
    t.add_argument("--store-gbit", type=float, help=f"remote store bandwidth, Gbit/s, > 0 (default {d.store_gbit:g})")
    t.add_argument("--store-latency-ms", type=float, help=f"per request, >= 0 (default {d.store_latency_ms:g})")
    t.add_argument("--nic-gbit", type=float, help=f"per node and direction, > 0 (default {d.nic_gbit:g})")
    t.add_argument(
        "--cache-fraction",
        type=float,
        help=f"cache per node as a fraction of dataset / nodes, >= 0 (default {d.cache_fraction:g})",
    )
    t.add_argument(
        "--decode-cores",
        type=int,
        help=f"per node, >= 0 (default: --cores-per-node if given, else {d.decode_cores}); 0: decode costs nothing "
        "(the model leaves decoding out)",
    )
    t.add_argument(
        "--decode-rate",
        type=float,
        help="samples/s per core, > 0 (default: from --decode's report, else a built-in figure)",
    )
    t.add_argument("--peer-latency-ms", type=float, help=f"per peer request, >= 0 (default {d.peer_latency_ms:g})")
    t.add_argument(
        "--cores-per-node",
        type=int,
        help=f"CPU cores of a node, which decoding and moving bytes share, >= 1 (default: --decode-cores if "
        f"given, else {d.cores_per_node}; given alone, decoding has them all)",
    )
    t.add_argument(
        "--cpu-costs",
        metavar="PATH",
        help="a stoker bench io --json report: the CPU-s/GB of each byte path measured there (origin to cache, "
        "peer send, peer receive, cache to worker); a figure it lacks keeps its default",
    )
    t.add_argument("--epochs", type=int, help=f">= 1 (default {d.epochs})")
    t.add_argument(
        "--jobs",
        type=int,
        help=f"jobs sharing the dataset (GPUs split between them; must divide them; default {d.jobs})",
    )
    t.add_argument("--scaling", action="store_true", help="also the curves over nodes, cache and jobs")
    t.add_argument("--quick-scaling", action="store_true", help="with --scaling: fewer points on the curves")
    t.add_argument("--plot", help="with --scaling: write the scaling curves as a PNG here")
    s.set_defaults(fn=cmd_simulate)
