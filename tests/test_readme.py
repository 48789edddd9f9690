"""The README is for users and stays true: its sections are the ones users look for, in order, its
first example imports only stoker, it names no package index stoker is not on, it links what its
first two commands cost (docs/guide.md), every ``loader.stats`` field is documented (in
docs/stats.md and in ``help(stoker.Loader)``), and the runnable code blocks of the README and the
docs pages run. Its links are checked with the docs pages' in tests/test_docs.py.

A fenced block preceded by a marker comment is run in a subprocess, in a temporary directory,
with this checkout's ``src`` on ``PYTHONPATH``:

- ``<!-- test: run -->``: the block saved as a script and run by this Python;
- ``<!-- test: run-s3 -->``: the same, against ``stoker origin-server`` started here as the guide
  says (its default bucket ``my-bucket``), reached only through the AWS environment it prints
  (``AWS_ENDPOINT_URL`` and keys);
- ``<!-- test: torchrun -->``: the script under ``torchrun --standalone --nproc_per_node=2``, with a
  work directory as its argument (gloo on the CPU; the recipes are in docs/guide.md);
- ``<!-- test: lightning -->``: the script run by this Python with a work directory as its
  argument; it starts its second rank itself (PyTorch Lightning's ``ddp`` on the CPU) and must exit
  by itself;
- ``<!-- test: ray-train -->``: the script run by this Python with a work directory as its
  argument; it starts a one-node Ray itself (Ray Train's ``TorchTrainer``, gloo on the CPU);
- ``<!-- test: ray-data -->``: the script run by this Python with a work directory as its
  argument; it starts a one-node Ray itself (``stoker.ray_data.read``, two passes);
- ``<!-- test: accelerate -->``: the script under the guide's own launch line,
  ``accelerate launch --multi_gpu --num_processes 2`` (two processes on the CPU, gloo), with a
  work directory as its argument: both ranks must report.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
STATS = ROOT / "docs" / "stats.md"
GUIDE = ROOT / "docs" / "guide.md"
# the pages whose marked blocks run: the README first, then the docs pages
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
SECTIONS = [
    "## Install",
    "## Quick start",
    "## Use it",
    "## Command line",
    "## Cluster mode (Ray)",
    "## Results",
    "## Documentation",
    "## Known limits",
]
MARKED = re.compile(r"<!-- test: ([\w-]+) -->\s*\n```(\w*)\n(.*?)\n```", re.DOTALL)
BUCKET = "my-bucket"


def _text() -> str:
    return README.read_text()


def _blocks(kind: str) -> list[str]:
    return [code for page in PAGES for k, _lang, code in MARKED.findall(page.read_text()) if k == kind]


def _section(name: str) -> str:
    return _text().split(name + "\n", 1)[1].split("\n## ", 1)[0]


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), *filter(None, [env.get("PYTHONPATH")])])
    env.update(extra)
    return env


def _run(cmd: list[str], cwd: Path, env: dict, timeout_s: float = 240) -> str:
    res = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout_s)
    assert res.returncode == 0, (
        f"README block failed ({res.returncode}): {cmd}\n{res.stdout[-3000:]}\n{res.stderr[-5000:]}"
    )
    return res.stdout


def test_readme_sections_in_order_and_opens_with_the_two_commands():
    text = _text()
    heads = [line for line in text.splitlines() if line.startswith("## ")]
    assert heads == SECTIONS, heads
    first = text.split("```", 2)[1]
    assert first.strip() == "make demo\nmake test", first
    assert text.index("```") < text.index("## Install")


def test_readme_links_the_cost_of_the_first_two_commands_and_states_the_default_cache():
    """Before the first section: a link to what `make demo` and `make test` cost, and the default
    cache's place and budget. The guide's section holds the cost: the time and disk of each (a row
    each, in minutes and bytes) and that `make clean` removes them."""
    head = _text().split("## Install", 1)[0]
    assert "(docs/guide.md#the-demo-and-the-tests)" in head and "`make clean`" in head
    assert "~/.cache/stoker" in head and "8 GiB" in head
    demo = GUIDE.read_text().split("## The demo and the tests\n", 1)[1].split("\n## ", 1)[0]
    for cmd in ("make demo", "make test"):
        row = next((line for line in demo.splitlines() if line.startswith(f"| `{cmd}`")), None)
        assert row is not None, f"no row for {cmd}"
        assert re.search(r"\d+(\.\d+)? min", row) and re.search(r"\d+(\.\d+)? (MB|GB)", row), row
    assert re.search(r"environment.*\| [\d.]+ min \| [\d.]+ GB", demo)
    assert "`make clean` removes" in demo and "2-core" in demo


def test_quick_start_imports_only_stoker():
    """The first example needs nothing but stoker: it makes its own images, with no lab package."""
    (block,) = [code for kind, _lang, code in MARKED.findall(_section("## Quick start")) if kind == "run"]
    imports = [line.strip() for line in block.splitlines() if re.match(r"\s*(import|from)\s", line)]
    assert imports == ["import stoker"], imports


def test_readme_names_no_package_index_and_no_internal_history():
    text = _text()
    for bad in [
        r"pip install\s+['\"]?stoker\b",
        r"pip install\s+['\"]?stoker\[",
        r"pypi\.org",
        r"fresh-user",
        r"issue \d",
        r"\bissues?'s\b",
    ]:
        assert not re.search(bad, text, re.IGNORECASE), bad
    install = _section("## Install")
    assert "python -m build" in install and "pip install -e '.[cluster,lab]'" in install
    assert "-c constraints-dev.txt" in install


def test_every_stats_field_is_documented_in_stats_page_and_epoch_stats_help():
    import stoker
    from stoker.loader.epoch_stats import EpochStats

    fields = [f.name for f in dataclasses.fields(EpochStats)]
    stats = STATS.read_text()
    doc = EpochStats.__doc__ or ""
    missing_page = [f for f in fields if f"`{f}`" not in stats]
    missing_doc = [f for f in fields if f"``{f}``" not in doc]
    assert not missing_page, f"docs/stats.md lacks {missing_page}"
    assert not missing_doc, f"help(EpochStats) lacks {missing_doc}"
    assert "EpochStats" in (stoker.Loader.__doc__ or "")  # the Loader's help points there


def test_quick_start_says_what_stall_means_and_does_not_print_it_without_a_consumer():
    """A loop that does nothing between batches waits for every one: its stall is near 1 by
    definition, and printed bare it reads as a starved accelerator."""
    quick = _section("## Quick start")
    (block,) = [code for kind, _lang, code in MARKED.findall(quick) if kind == "run"]
    assert "stall" not in block
    assert "`stall_fraction`" in quick and "waiting in `next()`" in quick and "near 1" in quick
    stats = STATS.read_text()
    assert "## Data stall" in stats and "near 1 however fast the loader is" in stats


def test_quick_start_runs(tmp_path):
    blocks = _blocks("run")
    assert blocks, "no <!-- test: run --> block in the README or docs/"
    for i, code in enumerate(blocks):
        script = tmp_path / f"block{i}.py"
        script.write_text(code)
        out = _run([sys.executable, str(script)], tmp_path, _env())
        assert "epoch 1" in out, out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def origin_server(tmp_path):
    """``stoker origin-server --port <free port>`` in a subprocess, as the guide tells a user to start
    it (the default bucket, ``my-bucket``): ``{"env": its printed ``export`` line as a dict,
    "storage_options": its printed options}``. Stopped with SIGINT (Ctrl-C) after the test, which
    checks that it exits 0, saying so."""
    pytest.importorskip("moto.server")
    cmd = [sys.executable, "-m", "stoker.cli", "origin-server", "--port", str(_free_port()), "--latency-ms", "0"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True)
    reader.start()
    try:
        printed = []
        with contextlib.suppress(queue.Empty):
            while len(printed) < 6:  # the lines it prints once it listens; a server that hangs fails here
                printed.append(lines.get(timeout=60))
        export = [line for line in printed if line.strip().startswith("export ")]
        assert export and proc.poll() is None, printed
        env = dict(kv.split("=", 1) for kv in export[0].split()[1:])
        options = json.loads(printed[-2])
        assert BUCKET in printed[0] and env["AWS_ENDPOINT_URL"] == options["endpoint_url"], printed
        yield {"env": env, "storage_options": options}
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        err = proc.stderr.read()
        reader.join(10)  # the rest of its output, to the end
    out = "".join(lines.get() for _ in range(lines.qsize()))
    assert proc.returncode == 0 and "stopped" in out and not err.strip(), (proc.returncode, out, err)


def test_quick_start_on_s3_through_the_aws_environment(tmp_path, origin_server):
    blocks = _blocks("run-s3")
    assert blocks, "no <!-- test: run-s3 --> block in the README or docs/"
    env = _env(
        **origin_server["env"],  # what `stoker origin-server` printed, pasted
        AWS_CONFIG_FILE=str(tmp_path / "no-config"),
        AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "no-credentials"),
    )
    for i, code in enumerate(blocks):
        assert "endpoint_url" not in code  # the environment alone says where S3 is
        script = tmp_path / f"s3block{i}.py"
        script.write_text(code)
        out = _run([sys.executable, str(script)], tmp_path, env)
        assert "epoch 1" in out, out


def test_the_origin_servers_storage_options_pack_and_read_back(tmp_path, origin_server):
    """The ``storage_options=`` line ``stoker origin-server`` prints reaches its bucket: a dataset
    packed there reads back sample for sample (in a child: obstore's runtime stays out of this one)."""
    code = f"""
import json, sys
import stoker
from stoker_lab.sample_data import make_sample_data
opts = json.loads(sys.argv[1])
make_sample_data("raw", images=12, classes=2)
stoker.pack("raw/train", "s3://{BUCKET}/tried/train", storage_options=opts, progress=False)
ds = stoker.open_dataset("s3://{BUCKET}/tried/train", storage_options=opts, cache=False)
stoker.pack("raw/train", "packed", progress=False)
local = stoker.open_dataset("packed", cache=False)
assert len(ds) == len(local) == 12 and all(ds[i] == local[i] for i in range(len(ds)))
print("read back", len(ds))
"""
    script = tmp_path / "tried.py"
    script.write_text(code)
    env = _env(AWS_CONFIG_FILE=str(tmp_path / "no-config"), AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "no-creds"))
    out = _run([sys.executable, str(script), json.dumps(origin_server["storage_options"])], tmp_path, env)
    assert "read back 12" in out


def test_origin_server_on_a_taken_port_says_which(tmp_path):
    pytest.importorskip("moto.server")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "stoker.cli", "origin-server", "--port", str(port)]
        res = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=60)
    assert res.returncode != 0 and f"port {port} on 127.0.0.1 is taken" in res.stderr, res.stderr
    assert "--port" in res.stderr and "Traceback" not in res.stderr


def _run_recipes(tmp_path: Path, tag: str, launch: list[str], env: dict, timeout_s: float = 240) -> list[str]:
    """Run each ``<!-- test: tag -->`` block of the README and docs/ as a script, started by
    ``launch + [script, workdir]``, each in a work folder of its own; their outputs."""
    blocks = _blocks(tag)
    assert blocks, f"no <!-- test: {tag} --> block in the README or docs/"
    outs = []
    for i, code in enumerate(blocks):
        script = tmp_path / f"recipe_{tag}{i}.py"
        script.write_text(code)
        work = tmp_path / f"work{i}"
        work.mkdir()
        outs.append(_run([*launch, str(script), str(work)], tmp_path, env, timeout_s))
    return outs


def test_ddp_recipe_runs_under_torchrun(tmp_path):
    pytest.importorskip("torch.distributed")
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    for out in _run_recipes(tmp_path, "torchrun", launch, _env(OMP_NUM_THREADS="1")):
        for rank in (0, 1):
            assert f"rank {rank} epoch 1" in out, out


def test_accelerate_recipe_starts_two_processes_with_the_guides_launch_line(tmp_path):
    """``accelerate launch --cpu --num_processes 2`` starts one process; the guide's line starts two."""
    pytest.importorskip("accelerate")
    launch = "accelerate launch --multi_gpu --num_processes 2"
    assert f"`{launch} ./train_acc.py" in GUIDE.read_text()
    exe = [sys.executable, "-m", "accelerate.commands.launch", *launch.split()[2:]]
    for out in _run_recipes(tmp_path, "accelerate", exe, _env(OMP_NUM_THREADS="1")):
        for rank in (0, 1):
            assert f"rank {rank} epoch 1: 16 samples, exactly once: True" in out, out


def test_lightning_recipe_trains_two_epochs_on_two_ranks_and_exits(tmp_path):
    pytest.importorskip("lightning")
    for out in _run_recipes(tmp_path, "lightning", [sys.executable], _env(OMP_NUM_THREADS="1")):
        for rank in (0, 1):
            for epoch in (0, 1):
                assert f"rank {rank} epoch {epoch}: 16 samples" in out, out
            assert f"rank {rank} validated 13 samples" in out, out  # the pad sample left out


def test_ray_train_recipe_reads_the_cluster_cache_on_two_workers(tmp_path):
    pytest.importorskip("ray.train")
    env = _env(OMP_NUM_THREADS="1", RAY_DEDUP_LOGS="0")  # every rank's line, not one per pattern
    for out in _run_recipes(tmp_path, "ray-train", [sys.executable], env, timeout_s=420):
        for rank in (0, 1):
            assert f"rank {rank} epoch 0: 16 samples" in out, out
            assert f"rank {rank} epoch 1: 16 samples, local 100%" in out, out  # one node: all cached there


def test_ray_data_recipe_reads_every_sample_once_each_pass(tmp_path):
    pytest.importorskip("ray.data")
    for out in _run_recipes(tmp_path, "ray-data", [sys.executable], _env(OMP_NUM_THREADS="1"), timeout_s=300):
        for epoch in (0, 1):
            assert f"epoch {epoch}: 32 rows, every sample once: True, 32 decoded" in out, out
