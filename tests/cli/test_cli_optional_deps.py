"""The `stoker` command works with the core install only: building its parser (every command's
`--help`) imports no optional extra (sim, metrics, cluster, demo). A wheel installed without
the `sim` extra once failed on every command because `simulate` imported SimPy while
registering its options."""

from __future__ import annotations

import subprocess
import sys
import textwrap

EXTRAS = ["simpy", "rich", "prometheus_client", "ray", "waitress", "moto", "boto3", "matplotlib", "soundfile"]

CHILD = textwrap.dedent("""
    import importlib.abc, sys
    BLOCKED = set(sys.argv[1].split(","))

    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)  # as if not installed
            return None

    sys.meta_path.insert(0, Block())
    from stoker.cli import build_parser, main
    p = build_parser()
    for cmd in ("pack", "stat", "simulate", "top", "warm", "demo", "bench"):
        try:
            p.parse_args([cmd, "--help"])
        except SystemExit as e:
            assert e.code == 0, (cmd, e.code)
    try:
        main(["--version"])
    except SystemExit as e:
        assert e.code in (0, None), e.code
    print("OK", sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED))
""")


def test_parser_and_help_need_no_optional_extra():
    res = subprocess.run([sys.executable, "-c", CHILD, ",".join(EXTRAS)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip().endswith("OK []"), res.stdout[-2000:]


def test_a_command_that_needs_an_extra_names_it(tmp_path):
    """`stoker simulate tdcs` without SimPy: one error naming the missing package, no traceback."""
    child = CHILD.split("from stoker.cli import")[0] + textwrap.dedent("""
        from stoker.cli import main
        sys.exit(main(["simulate", "tdcs", "--nodes", "1", "--epochs", "1"]))
    """)
    res = subprocess.run([sys.executable, "-c", child, "simpy"], capture_output=True, text=True, timeout=120)
    assert res.returncode != 0
    assert "simpy" in res.stderr.lower(), res.stderr[-2000:]
    assert "Traceback" not in res.stderr, res.stderr[-3000:]


def test_lab_commands_without_the_lab_extra_say_so_in_one_line(tmp_path):
    """The lab's commands are listed by `stoker --help` whether or not its extra is installed;
    without the extra's packages each ends in one line naming the package and the `lab` extra."""
    blocked = "skimage,sklearn,moto,boto3,matplotlib,waitress"
    for argv in (
        ["sample-data", str(tmp_path / "sd")],
        ["demo", "--quick", "--workdir", str(tmp_path / "demo")],
        ["bench", "io", "--json", str(tmp_path / "io.json")],
        ["origin-server"],
    ):
        child = CHILD.split("from stoker.cli import")[0] + textwrap.dedent(f"""
            from stoker.cli import main
            sys.exit(main({argv!r}))
        """)
        res = subprocess.run([sys.executable, "-c", child, blocked], capture_output=True, text=True, timeout=120)
        assert res.returncode == 2, (argv, res.returncode, res.stderr[-2000:])
        assert "Traceback" not in res.stderr, res.stderr[-3000:]
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and "'lab' extra" in lines[0], (argv, res.stderr)
    assert not (tmp_path / "sd").exists()
