"""The command line lives in ``stoker.cli`` only: no library module declares arguments."""

from __future__ import annotations

import ast
import pathlib

SRC = pathlib.Path(__file__).resolve().parents[2] / "src" / "stoker"


def _library_modules():
    for p in sorted(SRC.rglob("*.py")):
        if "cli" not in p.relative_to(SRC).parts[:1]:
            yield p


def test_no_library_module_uses_argparse():
    bad = []
    for p in _library_modules():
        tree = ast.parse(p.read_text(), str(p))
        for node in ast.walk(tree):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            if any(n.split(".")[0] == "argparse" for n in names):
                bad.append(f"{p.relative_to(SRC)}:{node.lineno} imports argparse")
            if isinstance(node, ast.Attribute) and node.attr in ("add_parser", "add_argument", "add_subparsers"):
                bad.append(f"{p.relative_to(SRC)}:{node.lineno} declares command-line arguments ({node.attr})")
    assert not bad, "argparse outside stoker.cli:\n" + "\n".join(bad)


def test_every_command_group_registers():
    from stoker import cli

    p = cli.build_parser()
    sub = next(a for a in p._actions if a.dest == "cmd")
    assert {
        "sample-data",
        "pack",
        "ls",
        "stat",
        "verify",
        "demo",
        "origin-server",
        "bench",
        "warm",
        "cluster-state",
        "extender",
        "cache",
    } <= set(sub.choices)
    bench = next(a for a in sub.choices["bench"]._actions if a.dest == "bench")
    assert {"decode", "cache", "peers", "cluster"} <= set(bench.choices)


def test_origin_server_arguments_reach_the_library(monkeypatch):
    import stoker_lab.bench.origin as origin
    from stoker.cli import main

    seen = {}
    monkeypatch.setattr(origin, "serve_origin", lambda **kw: seen.update(kw))
    assert (
        main(
            [
                "origin-server",
                "--latency-ms",
                "5",
                "--bandwidth-mbps",
                "0",
                "--bucket",
                "a",
                "--bucket",
                "b",
                "--no-fast-range",
                "--parent-pid",
                "7",
                "--host",
                "10.231.0.254",
                "--port",
                "9123",
            ]
        )
        == 0
    )
    assert seen == {
        "latency_ms": 5.0,
        "bandwidth_MBps": 0.0,
        "ready_file": None,
        "buckets": ("a", "b"),
        "fast_range": False,
        "parent_pid": 7,
        "host": "10.231.0.254",
        "port": 9123,
        "announce": True,
    }
    seen.clear()
    assert main(["origin-server"]) == 0  # the guide's S3 example's endpoint port and bucket
    assert seen["port"] == 9000 and seen["buckets"] == ("my-bucket",)
