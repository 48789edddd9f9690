"""``stoker plan`` against the namespace cluster's training-like runs (``stoker bench cluster --netns
--consumer-rate``): the plan's input built from a report's own figures (:func:`plan_argv`), the
plan run as the command line runs it (:func:`run_plan`), and its epoch times set against the
measured medians over the report's repeats (:func:`compare`, :func:`table`).

``python -m stoker_lab.cli.plan_check REPORT.json ...`` prints the table.
"""

from __future__ import annotations

import argparse
import statistics
import sys

#: The bench's placements and the plan setups that stand for them
#: (:data:`stoker_lab.sim.plan.SETUP_NOTES` says where each pair differs).
BENCH_TO_PLAN = {"direct": "direct-cached", "random": "random", "colocated": "colocated"}


def plan_argv(report: dict) -> list[str]:
    """``stoker plan``'s arguments for a ``--netns`` training report: its hosts (``--nodes``), ranks
    a job over hosts (``--gpus-per-node``), ``config.consumer_rate`` (``--gpu-rate``), the dataset's
    samples and bytes, ``config.cache_bytes_per_node``, the origin's and the hosts' tbf rates
    (``--origin-bandwidth``, ``--nic``: the slowest host's), the origin's latency, the peer probe's
    seconds per sample a rank (``--peer-latency``: every rank reading from peers at once, apart
    from the epochs), and, where the run decodes (``config.decode``), one decode core a node at
    the decode probe's rate (1 / ``decode_probe.cpu_s_per_sample``), else none; ``--epochs`` the
    run's, ``--no-read-ahead`` (the bench's ranks read, decode, then step) and the setups of
    :data:`BENCH_TO_PLAN`. Raises KeyError for a report without these figures and ValueError for
    one whose ranks do not split evenly over its hosts or that has no accelerator."""
    cfg, links = report["config"], report["links"]
    hosts = int(report["hosts"])
    ranks = int(cfg["ranks_per_job"])
    if ranks % hosts:
        raise ValueError(f"{ranks} ranks a job do not split evenly over {hosts} hosts")
    rate = float(cfg.get("consumer_rate", 0.0))
    if rate <= 0:
        raise ValueError("the report has no accelerator (config.consumer_rate): not a training-like run")
    probe = report["peer_probe"]
    peer_ms = 1e3 * float(probe["seconds"]) / int(probe["samples_per_rank"])
    nic = min(v["mbit"] for k, v in links.items() if k != "origin")
    argv = [
        "plan",
        "--nodes",
        str(hosts),
        "--gpus-per-node",
        str(ranks // hosts),
        "--gpu-rate",
        f"{rate:g}",
        "--samples",
        str(int(report["dataset"]["samples"])),
        "--dataset-bytes",
        f"{int(report['dataset']['bytes'])}B",
        "--cache-per-node",
        f"{int(cfg['cache_bytes_per_node'])}B",
        "--origin-bandwidth",
        f"{float(links['origin']['mbit']):g}Mbit",
        "--nic",
        f"{float(nic):g}Mbit",
        "--origin-latency",
        f"{float(report['origin']['latency_ms']):g}ms",
        "--peer-latency",
        f"{peer_ms:.4g}ms",
        "--epochs",
        str(int(cfg["epochs"])),
        "--no-read-ahead",
        "--setups",
        ",".join(BENCH_TO_PLAN.values()),
    ]
    if cfg.get("decode"):
        argv += [
            "--decode-cores",
            "1",
            "--decode-rate",
            f"{1.0 / float(report['decode_probe']['cpu_s_per_sample']):.6g}",
        ]
    else:
        argv += ["--decode-cores", "0"]
    return argv


def run_plan(argv: list[str]) -> dict:
    """The plan of ``stoker plan`` ``argv`` (``argv[0]`` is ``plan``), read and checked by the
    command's own parser and :func:`stoker_lab.cli.plan.inputs`, without printing it. Raises
    ValueError for bad input, as the command does."""
    from ..sim.plan import plan
    from .plan import add_parsers, inputs, setups

    parser = argparse.ArgumentParser(prog="stoker")
    add_parsers(parser.add_subparsers())
    a = parser.parse_args(argv)
    cfg, cache, disk, src = inputs(a)
    return plan(cfg, cache, src, disk, setups=setups(a.setups))


def measured(report: dict) -> dict:
    """``{(placement, job, epoch): [seconds of each repeat]}`` of a report's runs."""
    out: dict = {}
    for r in report["runs"]:
        out.setdefault((r["placement"], r["job"], int(r["epoch"])), []).append(float(r["seconds"]))
    return out


def compare(report: dict, path: str, plan_report: dict | None = None) -> dict:
    """``{report, argv, setup_notes, rows, summary}``: for each bench placement, job and epoch, the
    plan's epoch time (setup :data:`BENCH_TO_PLAN`; job1's epoch e against the plan's epoch e,
    job2's, whose caches job1 warmed, against the plan's last epoch) set against the median of the
    report's repeats: ``predicted_s``, ``measured_s`` (each repeat), ``median_s``, ``error``
    (predicted / median - 1) and ``spread`` (slowest / fastest repeat - 1). ``summary``: rows,
    median and largest absolute error, rows within 15%, and the same for job1 alone.
    ``plan_report``: a plan already made of :func:`plan_argv` (None: made here)."""
    argv = plan_argv(report)
    rep = plan_report if plan_report is not None else run_plan(argv)
    last = len(next(iter(rep["setups"].values()))["epoch_s"]) - 1
    rows = []
    for (placement, job, epoch), secs in sorted(measured(report).items()):
        setup = BENCH_TO_PLAN.get(placement)
        if setup is None or setup not in rep["setups"]:
            continue
        pe = epoch if job == "job1" else last
        if pe > last:
            continue
        pred = float(rep["setups"][setup]["epoch_s"][pe])
        med = statistics.median(secs)
        rows.append(
            {
                "placement": placement,
                "setup": setup,
                "job": job,
                "epoch": epoch,
                "plan_epoch": pe,
                "predicted_s": pred,
                "measured_s": secs,
                "median_s": med,
                "error": pred / med - 1,
                "spread": max(secs) / min(secs) - 1,
            }
        )
    return {
        "report": path,
        "argv": argv,
        "setup_notes": rep.get("setup_notes", {}),
        "rows": rows,
        "summary": {"all": _summary(rows), "job1": _summary([r for r in rows if r["job"] == "job1"])},
    }


def _summary(rows: list[dict]) -> dict:
    errs = [abs(r["error"]) for r in rows]
    return {
        "rows": len(rows),
        "within_15pct": sum(e <= 0.15 for e in errs),
        "median_abs_error": statistics.median(errs) if errs else None,
        "largest_abs_error": max(errs, default=None),
    }


def table(results: list[dict]) -> str:
    """A Markdown table of :func:`compare` results: one row per report, placement and job, the
    plan's and the measured medians' seconds of each epoch and their errors."""
    out = [
        "| report | bench placement (plan setup) | job | epoch | plan s | measured median s (repeats) | error |",
        "|---|---|---|---|---|---|---|",
    ]
    for res in results:
        name = res["report"].rsplit("/", 1)[-1]
        for r in res["rows"]:
            reps = ", ".join(f"{s:.1f}" for s in r["measured_s"])
            out.append(
                f"| `{name}` | {r['placement']} ({r['setup']}) | {r['job']} | {r['epoch']} | {r['predicted_s']:.1f} | "
                f"{r['median_s']:.1f} ({reps}) | {r['error']:+.0%} |"
            )
    return "\n".join(out)


def main(paths: list[str]) -> int:
    """Print :func:`table` and each report's summary for the reports at ``paths``."""
    import json

    results = []
    for p in paths:
        with open(p) as f:
            results.append(compare(json.load(f), p))
    print(table(results))
    for res in results:
        print(res["report"], " ".join(res["argv"]), json.dumps(res["summary"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
