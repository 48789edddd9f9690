"""``stoker plan``: how much cache per node a training job needs, whether its GPUs will wait, and
where the bottleneck is, from the user's figures (:mod:`stoker_lab.sim.plan` on the TDCS model).

Sizes are read by :func:`stoker.parse_size` (``140GB``, ``2TiB``), link rates by
:func:`link_rate` (``10Gbit``, ``400Mbit/s``, ``1.25GB/s``), latencies by :func:`latency`
(``20ms``, ``0.02s``). Every option is taken as text and checked before any model runs: bad input
is a ValueError naming the option, which :func:`stoker.cli.main` prints in one line as
``stoker plan: ...``, exit 2."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import sys

from stoker._units import parse_size

#: Link rate units: bits (decimal and binary prefixes) and bytes per second.
_BITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "ki": 1024, "mi": 1024**2, "gi": 1024**3, "ti": 1024**4}
_BIT_RATE = re.compile(
    r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMgGtT]i?)?(?:[bB][iI][tT][sS]?|b)(?:/s|ps)?\s*"
)


def link_rate(text: str, option: str) -> float:
    """A link rate in bytes/s from text: bits (``10Gbit``, ``400Mbit/s``, ``25Gbps``, ``10Gb/s``: a
    lowercase b is a bit; k/M/G/T are powers of 1000, Ki/Mi/Gi/Ti of 1024) or bytes per second (``1.25GB/s``,
    ``800MiB/s``, the size read by :func:`stoker.parse_size`). A bare number is refused (bits or
    bytes differ by 8x). Raises ValueError naming ``option`` for text that is neither, or a rate
    that is not > 0."""
    t = text.strip()
    m = _BIT_RATE.fullmatch(t)
    if m:  # a lowercase b is bits (Gb, Mbps), as network rates are written
        rate = float(m.group(1)) * _BITS[(m.group(2) or "").lower()] / 8
    elif t.lower().endswith("/s"):
        try:
            rate = float(parse_size(t[:-2], option))
        except (ValueError, TypeError) as e:
            raise ValueError(f"{option} {text!r}: {e}") from None
    else:
        raise ValueError(f"{option} {text!r}: give a link rate with its unit, such as 10Gbit, 400Mbit/s or 1.25GB/s")
    if not math.isfinite(rate) or rate <= 0:
        raise ValueError(f"{option} {text!r}: a link rate must be > 0")
    return rate


def latency(text: str, option: str) -> float:
    """A latency in seconds from ``20ms``, ``0.02s`` or ``500us``. A bare number is refused (as a
    link rate's: which unit it means is a guess). Raises ValueError naming ``option`` for other
    text or a negative value."""
    m = re.fullmatch(r"\s*(-?)([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*(ms|s|us)?\s*", text, re.I)
    if not m:
        raise ValueError(f"{option} {text!r}: give a latency such as 20ms or 0.02s")
    if m.group(1):
        raise ValueError(f"{option} {text!r}: a latency must be >= 0")
    if not m.group(3):
        raise ValueError(f"{option} {text!r}: give a latency with its unit, e.g. 20ms")
    return float(m.group(2)) * {"ms": 1e-3, "s": 1.0, "us": 1e-6}[m.group(3).lower()]


def size(text: str, option: str) -> int:
    """A byte size (:func:`stoker.parse_size`), > 0. Raises ValueError naming ``option``."""
    try:
        n = parse_size(text, option)
    except (ValueError, TypeError) as e:
        why = str(e).removeprefix(f"{option}:").strip()  # parse_size names the option too: once
        raise ValueError(f"{option} {text!r}: {why}") from None
    if n <= 0:
        raise ValueError(f"{option} {text!r}: must be more than 0 bytes")
    return n


def number(text: str, option: str, low: float, integer: bool = False, strict: bool = False) -> float:
    """A finite number >= ``low`` (> with ``strict``; an integer with ``integer``). Raises
    ValueError naming ``option``."""
    try:
        v = int(text) if integer else float(text)
    except ValueError:
        raise ValueError(f"{option} {text!r}: not {'an integer' if integer else 'a number'}") from None
    if not math.isfinite(v) or v < low or (strict and v == low):
        raise ValueError(f"{option} must be {'>' if strict else '>='} {low:g}, got {text}")
    return v


def _check_output(option: str, path: str | None) -> None:
    if path:
        where = os.path.dirname(path) or "."
        if os.path.isdir(path):
            raise ValueError(f"{option} {path}: is a directory, not a file to write")
        if not os.path.isdir(where):
            raise ValueError(f"{option} {path}: no directory {where} to write it in")


def _check_plot_format(path: str) -> None:
    """Refuse a ``--plot`` path whose extension is not a format matplotlib writes (ValueError)."""
    from matplotlib.backend_bases import FigureCanvasBase

    kinds = FigureCanvasBase.get_supported_filetypes()
    ext = os.path.splitext(path)[1].lstrip(".").lower()
    if ext not in kinds:
        shown = ", ".join(sorted(kinds))
        raise ValueError(f"--plot {path}: name a file ending in a format matplotlib writes ({shown})")


def measure_decode_rate() -> float:
    """This machine's decode + RandomResizedCrop rate of one core, samples/s: the median CPU-clock
    rate of 3 rounds of :func:`stoker_lab.decode_rate.measure_decode_rounds` over 64 sample photos
    (:func:`stoker_lab.sample_data.make_sample_data`, in a temporary directory removed after)."""
    import tempfile

    from stoker_lab.decode_rate import measure_decode_rounds, median_rate

    from ..sample_data import make_sample_data

    with tempfile.TemporaryDirectory(prefix="stoker-plan-") as tmp:
        make_sample_data(tmp, images=64, classes=4, seed=0, workers=1)
        files = sorted(os.path.join(d, f) for d, _, fs in os.walk(tmp) for f in fs if f.endswith(".JPEG"))
        payloads = []
        for f in files:
            with open(f, "rb") as fh:
                payloads.append(fh.read())
    rounds = measure_decode_rounds(payloads, rounds=3, recipes=("stoker",), round_seconds=0.5)
    return median_rate([r.cpu_rate for r in rounds["stoker"]])


def inputs(a) -> tuple:
    """``(TdcsConfig, cache per node bytes, disk bytes or None, sources)`` of the options, every one
    checked (module docstring). Raises ValueError naming the option."""
    from ..sim.tdcs_config import GPU_MODELS, TdcsConfig

    for opt, dest in (
        ("--nodes", "nodes"),
        ("--gpus-per-node", "gpus_per_node"),
        ("--samples", "samples"),
        ("--dataset-bytes", "dataset_bytes"),
        ("--cache-per-node", "cache_per_node"),
    ):
        if getattr(a, dest) is None:
            raise ValueError(f"{opt} is needed (see stoker plan --help)")
    if a.gpu_rate is not None and a.model is not None:
        raise ValueError("give only one of --gpu-rate or --model")
    if a.gpu_rate is None and a.model is None:
        raise ValueError("give one of --gpu-rate (images/s per GPU) and --model (" + ", ".join(GPU_MODELS) + ")")
    if a.measure and a.decode_rate is not None:
        raise ValueError("--measure and --decode-rate both give the decode rate: give one")
    src: dict[str, str] = {}
    nodes = int(number(a.nodes, "--nodes", 1, integer=True))
    gpn = int(number(a.gpus_per_node, "--gpus-per-node", 1, integer=True))
    samples = int(number(a.samples, "--samples", 1, integer=True))
    data = size(a.dataset_bytes, "--dataset-bytes")
    if data < samples:
        raise ValueError(f"--dataset-bytes {a.dataset_bytes} is less than one byte for each of the {samples} samples")
    cache = size(a.cache_per_node, "--cache-per-node")  # no cache at all: the direct setup
    disk = size(a.disk, "--disk") if a.disk is not None else None
    if disk is not None and cache > disk:
        raise ValueError(f"--cache-per-node {a.cache_per_node} is larger than the node's disk (--disk {a.disk})")
    if a.model is not None:
        if a.model not in GPU_MODELS:
            raise ValueError(f"--model {a.model!r}: not one of {', '.join(GPU_MODELS)} (or give --gpu-rate)")
        gpu_rate, src["gpu_rate"] = GPU_MODELS[a.model][0], f"--model {a.model}: {GPU_MODELS[a.model][1]}"
    else:
        gpu_rate, src["gpu_rate"] = number(a.gpu_rate, "--gpu-rate", 0, strict=True), "given (--gpu-rate)"
    d = TdcsConfig()
    cfg = TdcsConfig(
        nodes=nodes,
        gpus_per_node=gpn,
        gpu_rate=gpu_rate,
        samples=samples,
        mean_sample_bytes=data / samples,
        epochs=int(number(a.epochs, "--epochs", 1, integer=True)) if a.epochs is not None else d.epochs,
    )
    src |= {
        "nodes": "given (--nodes)",
        "gpus_per_node": "given (--gpus-per-node)",
        "samples": "given (--samples)",
        "mean_sample_bytes": f"--dataset-bytes {a.dataset_bytes} / --samples {samples}",
        "cache_fraction": f"--cache-per-node {a.cache_per_node} / (dataset / nodes)",
    }
    if a.epochs is not None:
        src["epochs"] = "given (--epochs)"
    for opt, dest, field, scale in (
        ("--origin-bandwidth", "origin_bandwidth", "store_gbit", 8e-9),
        ("--nic", "nic", "nic_gbit", 8e-9),
        ("--cache-read", "cache_read", "cache_read_GBps", 1e-9),
    ):
        text = getattr(a, dest)
        if text is not None:
            setattr(cfg, field, link_rate(text, opt) * scale)
            src[field] = f"given ({opt} {text})"
    if a.origin_latency is not None:
        cfg.store_latency_ms = latency(a.origin_latency, "--origin-latency") * 1e3
        src["store_latency_ms"] = f"given (--origin-latency {a.origin_latency})"
    if a.decode_cores is not None:
        cfg.decode_cores = int(number(a.decode_cores, "--decode-cores", 0, integer=True))
        src["decode_cores"] = "given (--decode-cores)" + (
            ": 0, decoding costs nothing" if cfg.decode_cores == 0 else ""
        )
    if a.decode_rate is not None:
        cfg.decode_rate = number(a.decode_rate, "--decode-rate", 0, strict=True)
        src["decode_rate"] = "given (--decode-rate)"
    cpu_inputs(a, cfg, src)
    if a.peer_latency is not None:
        cfg.peer_latency_ms = latency(a.peer_latency, "--peer-latency") * 1e3
        src["peer_latency_ms"] = f"given (--peer-latency {a.peer_latency})"
    if a.no_read_ahead:
        cfg.read_ahead = False
        src["read_ahead"] = (
            "given (--no-read-ahead): each rank reads one sample at a time (one request in flight), decodes it "
            "and hands it to its GPU before the next read: time per sample = read + decode + 1 / gpu_rate"
        )
    _check_output("--json", a.json)
    _check_output("--plot", a.plot)
    if a.plot and importlib.util.find_spec("matplotlib") is None:
        raise ModuleNotFoundError("No module named 'matplotlib'", name="matplotlib")
    if a.plot:
        _check_plot_format(a.plot)
    if a.measure:
        for name in ("skimage", "sklearn"):  # the sample photos' maker needs them (the lab extra)
            if importlib.util.find_spec(name) is None:
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        cfg.decode_rate = measure_decode_rate()
        src["decode_rate"] = (
            "measured here (--measure): one core's stoker decode + RandomResizedCrop(224), median of 3 rounds "
            "on the CPU clock over 64 sample photos (stoker_lab.decode_rate.measure_decode_rounds)"
        )
    return cfg, cache, disk, src


def cpu_inputs(a, cfg, src: dict[str, str]) -> None:
    """Set ``cfg``'s node cores and decode cores (``--cores-per-node`` and ``--decode-cores``, the one
    given setting the other: :func:`stoker_lab.sim.byte_cpu.node_cores`) and, with ``--cpu-costs
    PATH``, each byte path's CPU-s/GB from that ``stoker bench io --json`` report
    (:func:`stoker_lab.sim.byte_cpu.from_bench_io`), their sources into ``src``. Raises ValueError
    naming the option."""
    from ..sim.byte_cpu import FIELDS, from_bench_io, node_cores

    given = int(number(a.cores_per_node, "--cores-per-node", 1, integer=True)) if a.cores_per_node is not None else None
    cfg.cores_per_node, cfg.decode_cores, why = node_cores(given, cfg.decode_cores, a.decode_cores is not None)
    src |= why
    if a.cpu_costs is not None:
        for path, cost in from_bench_io(a.cpu_costs).items():
            setattr(cfg, FIELDS[path], cost.cpu_s_per_GB)
            src[FIELDS[path]] = cost.source


def setups(text: str | None) -> tuple[str, ...]:
    """The setups of ``--setups`` (comma-separated; None: :data:`stoker_lab.sim.plan.PLAN_SETUPS`).
    Raises ValueError naming the option for an unknown one."""
    from ..sim.plan import PLAN_SETUPS, SETUP_NOTES

    if text is None:
        return PLAN_SETUPS
    got = tuple(dict.fromkeys(x.strip() for x in text.split(",") if x.strip()))
    bad = [x for x in got if x not in SETUP_NOTES]
    if bad or not got:
        raise ValueError(f"--setups {text!r}: give some of {', '.join(SETUP_NOTES)}, comma-separated")
    return got


def cmd_plan(a) -> int:
    """``stoker plan``: check the options (:func:`inputs`), plan (:func:`stoker_lab.sim.plan.plan`),
    print the report, write ``--json`` and ``--plot``."""
    chosen = setups(a.setups)
    cfg, cache, disk, src = inputs(a)
    from ..sim.plan import plan
    from ..sim.plan_report import plot, text

    report = plan(
        cfg,
        cache,
        src,
        disk,
        curve_fractions=(0.1, 0.25, 0.5, 0.75, 0.9, 1.0, 1.25) if a.plot else (),
        on_step=lambda line: print(f"stoker plan: {line}", file=sys.stderr, flush=True),
        setups=chosen,
    )
    print(text(report))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {a.json}")
    if a.plot:
        plot(report, a.plot)
        print(f"wrote {a.plot}")
    return 0


def add_parsers(sub) -> None:
    """Register ``plan`` on the top-level subparsers ``sub``."""
    from ..sim.tdcs_config import GPU_MODELS, TdcsConfig  # no SimPy: every command builds this parser

    d = TdcsConfig()
    p = sub.add_parser(
        "plan",
        help="capacity planner: cache per node, GPU utilisation, cores moving bytes and bottleneck for direct reads, "
        "presence-only affinity and co-located scheduling (the cluster model)",
        description="Sizes as 140GB or 2TiB, link rates as 10Gbit, 400Mbit/s or 1.25GB/s, latencies as "
        "20ms. Every assumption is printed with its source.",
    )
    p.add_argument("--nodes", help="nodes (>= 1)")
    p.add_argument(
        "--gpus-per-node", help="accelerators (GPUs) on each node, one training rank each (>= 1; ranks = nodes x this)"
    )
    p.add_argument("--gpu-rate", help="images (samples)/s one GPU trains on, > 0 (or --model)")
    p.add_argument("--model", help=f"a published GPU rate instead of --gpu-rate: {', '.join(GPU_MODELS)}")
    p.add_argument("--samples", help="samples in the dataset (>= 1)")
    p.add_argument("--dataset-bytes", help="the dataset's size, e.g. 140GB")
    p.add_argument("--cache-per-node", help="cache per node, e.g. 2TB (> 0; the direct setup has none)")
    p.add_argument("--disk", help="the node's disk size: the cache search goes no higher (optional)")
    p.add_argument("--origin-bandwidth", help=f"the remote store's aggregate bandwidth (default {d.store_gbit:g}Gbit)")
    p.add_argument("--origin-latency", help=f"per request to the remote store (default {d.store_latency_ms:g}ms)")
    p.add_argument("--nic", help=f"each node's NIC, per direction (default {d.nic_gbit:g}Gbit)")
    p.add_argument("--cache-read", help=f"each node's cache read bandwidth (default {d.cache_read_GBps:g}GB/s)")
    p.add_argument(
        "--decode-cores",
        help=f"decode cores per node, >= 0 (default: --cores-per-node if given, else {d.decode_cores}; 0: decode "
        "is free)",
    )
    p.add_argument("--decode-rate", help=f"samples/s per decode core, > 0 (default {d.decode_rate:g})")
    p.add_argument("--measure", action="store_true", help="measure this machine's decode rate per core (a few s)")
    p.add_argument("--peer-latency", help=f"per request to a peer's cache (default {d.peer_latency_ms:g}ms)")
    p.add_argument(
        "--cores-per-node",
        help=f"CPU cores of a node, which decoding and moving bytes share, >= 1 (default: --decode-cores if "
        f"given, else {d.cores_per_node}; given alone, decoding has them all)",
    )
    p.add_argument(
        "--cpu-costs",
        metavar="PATH",
        help="a stoker bench io --json report: the CPU-s/GB of each byte path measured there (origin to cache, "
        "peer send, peer receive, cache to worker); a figure it lacks keeps its default",
    )
    p.add_argument(
        "--no-read-ahead",
        action="store_true",
        help="ranks read one sample at a time, decode it and hand it to the GPU before the next read "
        "(time per sample = read + decode + 1 / GPU rate); default: stoker's Loader, which reads ahead",
    )
    p.add_argument(
        "--setups",
        help="comma-separated, of direct, direct-cached (the bench's direct: a node cache each, unshared), "
        "random, presence, colocated (default direct,presence,colocated)",
    )
    p.add_argument("--epochs", help=f">= 1 (default {d.epochs})")
    p.add_argument("--json", help="write the plan here")
    p.add_argument("--plot", help="write GPU utilisation against cache per node here (.png, .pdf, .svg, ...)")
    p.set_defaults(fn=cmd_plan)
    p.error = _one_line  # type: ignore[method-assign]


#: What each option's value is, for argparse's "expected one argument" (a value starting with '-').
_WHAT = {
    "--dataset-bytes": "a size, > 0",
    "--cache-per-node": "a size, > 0",
    "--disk": "a size, > 0",
    "--origin-latency": "a latency, >= 0",
    "--peer-latency": "a latency, >= 0",
    "--origin-bandwidth": "a link rate, > 0",
    "--nic": "a link rate, > 0",
    "--cache-read": "a bandwidth, > 0",
    "--nodes": "a number of nodes, >= 1",
    "--gpus-per-node": "a number of GPUs, >= 1",
    "--samples": "a number of samples, >= 1",
    "--epochs": "a number of epochs, >= 1",
    "--decode-cores": "a number of cores, >= 0",
    "--cores-per-node": "a number of cores, >= 1",
    "--cpu-costs": "a stoker bench io --json report",
    "--gpu-rate": "samples/s, > 0",
    "--decode-rate": "samples/s, > 0",
}


def _one_line(message: str) -> None:
    """argparse's errors of ``stoker plan``'s own options (an option without its value) in one
    line, exit 2, as the checked options' are. ``--dataset-bytes -5GB`` reads to argparse as an
    option without a value: the line says so, and what the option's value must be."""
    m = re.match(r"argument (--[a-z-]+): expected one argument", message)
    if m:
        opt = m.group(1)
        what = f"; it takes {_WHAT[opt]}" if opt in _WHAT else ""
        message += f" (a value starting with '-' is written {opt}=VALUE{what})"
    print(f"stoker plan: {message}", file=sys.stderr)
    raise SystemExit(2)
