"""`stoker simulate` refuses bad input in one line naming the option or report, exit 2, before any
model runs: report files, peer probes, the calibration run, runs whose dataset cannot be made
again, default paths, tdcs options and options of the other mode."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import pytest

from stoker.cli import main

REPO = Path(__file__).resolve().parents[3]
NETNS = REPO / "benchmarks" / "bench_cluster_netns.json"
NETNS_5 = REPO / "benchmarks" / "bench_cluster_netns_5hosts.json"
DEMO = REPO / "docs" / "demo.json"
DECODE = REPO / "benchmarks" / "bench_decode.json"


class Reached(Exception):
    """Raised by a stand-in for the model: the input checks let the run through."""


def refused(capsys, argv: list[str]) -> str:
    """Run the CLI; assert exit 2 and one line on stderr starting ``stoker simulate: ``; return it."""
    rc = main(["simulate", *argv])
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("stoker simulate: "), err
    return lines[0]


def write(tmp_path: Path, name: str, report) -> str:
    path = tmp_path / name
    path.write_text(json.dumps(report))
    return str(path)


def netns() -> dict:
    return json.loads(NETNS.read_text())


# 1. report files ---------------------------------------------------------------------------------


@pytest.mark.parametrize("option,source", [("--netns", NETNS), ("--demo", DEMO), ("--decode", DECODE)])
def test_a_truncated_report_is_named_as_not_json(tmp_path, capsys, option, source):
    bad = tmp_path / "cut.json"
    bad.write_text(source.read_text()[:200])
    argv = ["--validate", "--netns", str(NETNS), "--demo", "", option, str(bad)]
    if option == "--netns":
        argv = ["--validate", "--demo", "", "--netns", str(bad)]
    line = refused(capsys, argv)
    assert f"{bad}: not valid JSON: " in line


@pytest.mark.parametrize("option", ["--netns", "--demo", "--decode"])
def test_a_missing_report_given_explicitly_is_an_error_naming_the_option(tmp_path, capsys, option):
    nope = str(tmp_path / "nope.json")
    argv = ["--validate", "--netns", str(NETNS), "--demo", str(DEMO), option, nope]
    line = refused(capsys, argv)
    assert line == f"stoker simulate: {option} {nope}: no such file"


def test_tdcs_refuses_a_missing_decode_report_instead_of_ignoring_it(tmp_path, capsys):
    nope = str(tmp_path / "nope.json")
    assert refused(capsys, ["tdcs", "--decode", nope]) == f"stoker simulate: --decode {nope}: no such file"


@pytest.mark.parametrize(
    "option,wrong,kind,missing",
    [
        ("--netns", DEMO, "stoker bench cluster --netns", "hosts"),
        ("--demo", NETNS, "stoker demo --json", "config.workers"),
        ("--decode", DEMO, "stoker bench decode --json", "per_core.stoker"),
    ],
)
def test_a_report_of_another_kind_is_named_with_the_field_it_lacks(capsys, option, wrong, kind, missing):
    argv = ["--validate", "--netns", str(NETNS), "--demo", str(DEMO), option, str(wrong)]
    if option == "--netns":
        argv = ["--validate", "--demo", "", "--netns", str(wrong)]
    line = refused(capsys, argv)
    assert line == f"stoker simulate: {wrong}: not a `{kind}` report (missing '{missing}')"


def test_a_report_whose_hosts_disagree_with_its_links_is_refused(tmp_path, capsys):
    rep = netns()
    rep["hosts"] = 4
    path = write(tmp_path, "hosts.json", rep)
    line = refused(capsys, ["--validate", "--demo", "", "--netns", path])
    assert f"{path}: hosts is 4 but its links name the hosts h0, h1, h2" in line


@pytest.mark.parametrize(
    "change,what",
    [
        (lambda r: r["runs"][0].update(job="job9"), "runs[0].job 'job9' is none of the config's 2 jobs"),
        (lambda r: r["runs"][0].update(epoch=3), "runs[0].epoch must be < 3, got 3"),
        (lambda r: r["dataset"].update(samples="900"), "dataset.samples is '900', not an integer"),
        (lambda r: r["links"]["h1"].update(mbit=0), "links.h1.mbit must be > 0, got 0"),
        (lambda r: r["runs"][1]["stoker"].pop("peer_bytes"), "missing 'runs[1].stoker.peer_bytes'"),
        (lambda r: r.update(runs=[]), "no runs"),
    ],
)
def test_a_netns_report_missing_or_out_of_range_fields_is_refused_naming_them(tmp_path, capsys, change, what):
    rep = netns()
    change(rep)
    path = write(tmp_path, "bad.json", rep)
    assert f"{path}: " in (line := refused(capsys, ["--validate", "--demo", "", "--netns", path]))
    assert what in line


def test_the_loaders_accept_every_report_in_the_repository():
    from stoker_lab.sim.reports import load_decode, load_demo, load_netns

    for path in sorted((REPO / "benchmarks").glob("bench_cluster_netns*.json")):
        assert load_netns(str(path))["hosts"] >= 1
    assert load_demo(str(DEMO))["runs"]
    assert load_decode(str(DECODE))["per_core"]["stoker"] > 0


# 2. the peer probe -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "change,what",
    [
        (lambda p: p.update(seconds=0), "seconds must be a number > 0, got 0"),
        (lambda p: p.pop("ids"), "missing 'ids'"),
        (lambda p: p.pop("rank_start_s"), "missing 'rank_start_s'"),
        (lambda p: p["ids"][1].__setitem__(0, 900), "rank 1: id 900 is not a sample of the dataset (0..899)"),
        (lambda p: p["ids"][0].__setitem__(3, -1), "rank 0: id -1 is not a sample of the dataset"),
        (lambda p: p.update(rank_hosts=[0, 7, 2]), "rank_hosts [0, 7, 2]: each must be a host in 0..2"),
        (lambda p: p.update(rank_hosts=[0, -1, 2]), "rank_hosts [0, -1, 2]: each must be a host in 0..2"),
        (lambda p: p.update(rank_start_s=[0.0, 0.1]), "rank_start_s must be 3 numbers >= 0"),
        (lambda p: p.update(rank_start_s=[0.0, -0.1, 0.0]), "rank_start_s must be 3 numbers >= 0"),
        (lambda p: p.update(ids=[[], [], []]), "no ids read"),
        (lambda p: p.update(ids=p["ids"][:2]), "ids must be 3 lists of sample ids"),
        (lambda p: p["ids"][2].append(5), "rank 2 read 201 ids, more than samples_per_rank 200"),
    ],
)
def test_a_bad_peer_probe_is_refused_naming_the_report_and_what(tmp_path, capsys, change, what):
    rep = netns()
    change(rep["peer_probe"])
    path = write(tmp_path, "probe.json", rep)
    line = refused(capsys, ["--validate", "--demo", "", "--netns", path])
    assert line.startswith(f"stoker simulate: {path}: peer_probe: ")
    assert what in line


def test_a_probe_rank_reading_fewer_than_samples_per_rank_is_accepted():
    # the driver reads at most samples_per_rank of the samples a rank's peers hold
    from stoker_lab.sim.reports import check_peer_probe

    probe = copy.deepcopy(netns()["peer_probe"])
    probe["ids"][0] = probe["ids"][0][:50]
    check_peer_probe(probe, "x.json", 3, 900)
    probe["ids"][0] = []
    check_peer_probe(probe, "x.json", 3, 900)


# 3. the calibration run --------------------------------------------------------------------------


def test_the_calibration_run_must_be_one_of_the_netns_reports(tmp_path, capsys):
    line = refused(capsys, ["--validate", "--demo", "", "--netns", str(NETNS), "--calibration", str(NETNS_5)])
    assert line == (
        f"stoker simulate: --calibration {NETNS_5}: not one of the --netns reports ({NETNS}): "
        "the calibration run must be one of those validated"
    )


def test_a_calibration_run_not_among_the_default_reports_is_refused(tmp_path, capsys):
    other = write(tmp_path, "nc.json", netns())
    line = refused(capsys, ["--validate", "--demo", "", "--calibration", other])
    assert f"--calibration {other}: not one of the --netns reports" in line
    nope = str(tmp_path / "nope.json")
    assert (
        refused(capsys, ["--validate", "--demo", "", "--calibration", nope])
        == f"stoker simulate: --calibration {nope}: no such file"
    )


def test_the_same_report_twice_is_refused(tmp_path, capsys, monkeypatch):
    line = refused(capsys, ["--validate", "--demo", "", "--netns", str(NETNS), "--netns", str(NETNS)])
    assert line == f"stoker simulate: --netns {NETNS}: given twice"
    monkeypatch.chdir(NETNS.parent)
    line = refused(capsys, ["--validate", "--demo", "", "--netns", str(NETNS), "--netns", f"./{NETNS.name}"])
    assert line == f"stoker simulate: --netns ./{NETNS.name}: given twice (as {NETNS} too)"


# 4. a run whose dataset cannot be made again -----------------------------------------------------


def test_a_dataset_that_cannot_be_made_again_is_an_error_unless_a_made_up_layout_is_asked_for(capsys, monkeypatch):
    import stoker_lab.sim.measured as measured
    import stoker_lab.sim.validate as validate

    asked = []

    def cannot(report, path, workdir=None):
        asked.append(path)
        return None, f"{path}: dataset could not make it again (ModuleNotFoundError: No module named 'skimage')"

    def model_runs(*a, **k):
        raise Reached

    monkeypatch.setattr(measured, "netns_dataset", cannot)
    monkeypatch.setattr(validate, "measure_cache_read_Bps", model_runs)
    line = refused(capsys, ["--validate", "--demo", "", "--netns", str(NETNS)])
    assert line == (
        f"stoker simulate: {NETNS}: its dataset cannot be made again exactly as reported (dataset "
        "could not make it again (ModuleNotFoundError: No module named 'skimage')), so the model "
        "cannot place blocks and ranks as the run did; --made-up-layout models it on a made-up "
        "layout instead"
    )
    asked.clear()
    with pytest.raises(Reached):
        main(["simulate", "--validate", "--demo", "", "--netns", str(NETNS), "--made-up-layout"])
    assert asked == []


# 5. default paths --------------------------------------------------------------------------------


def test_the_source_root_is_the_checkout_holding_the_package(tmp_path):
    from stoker_lab.sim.reports import source_root

    (tmp_path / "proj" / "src" / "stoker").mkdir(parents=True)
    (tmp_path / "proj" / "pyproject.toml").write_text('[project]\nname = "stoker"\n')
    assert source_root(tmp_path / "proj" / "src" / "stoker") == str(tmp_path / "proj")
    (tmp_path / "site-packages" / "stoker").mkdir(parents=True)
    assert source_root(tmp_path / "site-packages" / "stoker") is None
    (tmp_path / "other" / "stoker").mkdir(parents=True)
    (tmp_path / "other" / "pyproject.toml").write_text('[project]\nname = "something-else"\n')
    assert source_root(tmp_path / "other" / "stoker") is None


def test_defaults_are_the_checkouts_reports_wherever_it_runs(tmp_path, capsys, monkeypatch):
    import stoker
    import stoker_lab.sim.validate as validate

    if Path(stoker.__file__).resolve().parents[2] != REPO:
        pytest.skip("stoker is not imported from this checkout")
    seen = {}

    def record(netns_paths, demo_path, decode_path, calibration_path=None, measured=True):
        seen.update(netns=netns_paths, demo=demo_path, decode=decode_path)
        raise Reached

    monkeypatch.setattr(validate, "validate", record)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(Reached):
        main(["simulate", "--validate"])
    assert str(NETNS) in seen["netns"] and all(p.startswith(str(REPO / "benchmarks")) for p in seen["netns"])
    assert seen["demo"] == str(DEMO) and seen["decode"] == str(DECODE)


@pytest.fixture
def elsewhere(tmp_path, monkeypatch):
    """An installed package run from an empty directory: no default report anywhere."""
    import stoker_lab.sim.reports as reports

    monkeypatch.setattr(reports, "source_root", lambda package_dir=None: None)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_nothing_left_to_validate_is_an_error(elsewhere, capsys):
    line = refused(capsys, ["--validate", "--demo", ""])
    assert line.startswith("stoker simulate: nothing to validate: no --netns report (no default report ")


def test_a_missing_default_demo_report_says_how_to_give_or_skip_it(elsewhere, capsys):
    line = refused(capsys, ["--validate", "--netns", str(NETNS)])
    assert line == (
        f"stoker simulate: --demo: the default report {os.path.join('docs', 'demo.json')} does not "
        "exist (pass --demo PATH, or --demo '' to leave the demo out)"
    )
    nope = str(elsewhere / "nope.json")
    assert "pass" not in refused(capsys, ["--validate", "--netns", str(NETNS), "--demo", nope])


def test_tdcs_says_a_decode_rate_is_the_built_in_default_when_no_report_is_there(elsewhere, capsys):
    out = elsewhere / "t.json"
    assert (
        main(
            [
                "simulate",
                "tdcs",
                "--nodes",
                "1",
                "--gpus-per-node",
                "1",
                "--samples",
                "2000",
                "--epochs",
                "1",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    src = json.loads(out.read_text())["assumptions"]["decode_rate"]["source"]
    assert "built-in default" in src and "not this machine's" in src and "stoker bench decode)" not in src
    assert (
        main(
            [
                "simulate",
                "tdcs",
                "--nodes",
                "1",
                "--gpus-per-node",
                "1",
                "--samples",
                "2000",
                "--epochs",
                "1",
                "--decode",
                str(DECODE),
                "--json",
                str(out),
            ]
        )
        == 0
    )
    rep = json.loads(out.read_text())["assumptions"]["decode_rate"]
    assert rep["value"] == json.loads(DECODE.read_text())["per_core"]["stoker"] and str(DECODE) in rep["source"]


# 6. tdcs options ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--nodes", "0"], "--nodes must be >= 1, got 0"),
        (["--nodes", "-3"], "--nodes must be >= 1, got -3"),
        (["--jobs", "0"], "--jobs must be >= 1, got 0"),
        (["--gpus-per-node", "0"], "--gpus-per-node must be >= 1, got 0"),
        (["--gpu-rate", "0"], "--gpu-rate must be > 0, got 0"),
        (["--samples", "0"], "--samples must be >= 1, got 0"),
        (["--cache-fraction", "-1"], "--cache-fraction must be >= 0, got -1"),
        (["--cache-fraction", "nan"], "--cache-fraction must be a finite number, got nan"),
        (["--store-gbit", "inf"], "--store-gbit must be a finite number, got inf"),
        (["--peer-latency-ms", "-1"], "--peer-latency-ms must be >= 0, got -1"),
        (["--store-latency-ms", "-20"], "--store-latency-ms must be >= 0, got -20"),
        (["--store-gbit", "0"], "--store-gbit must be > 0, got 0"),
        (["--nic-gbit", "-5"], "--nic-gbit must be > 0, got -5"),
        (["--decode-rate", "0"], "--decode-rate must be > 0, got 0 (--decode-cores 0: no decode cost)"),
        (["--decode-cores", "-1"], "--decode-cores must be >= 0, got -1"),
        (["--epochs", "0"], "--epochs must be >= 1, got 0"),
        (
            ["--nodes", "2", "--gpus-per-node", "2", "--jobs", "3"],
            "--jobs 3 does not divide the 4 GPUs (--nodes 2 x --gpus-per-node 2) evenly",
        ),
    ],
)
def test_tdcs_refuses_numbers_out_of_range_naming_the_option(capsys, argv, message):
    assert refused(capsys, ["tdcs", *argv]) == f"stoker simulate: {message}"


def test_no_decode_cores_means_decoding_costs_nothing(tmp_path):
    def epoch_s(cores: str) -> float:
        out = tmp_path / f"d{cores}.json"
        assert (
            main(
                [
                    "simulate",
                    "tdcs",
                    "--nodes",
                    "1",
                    "--gpus-per-node",
                    "1",
                    "--samples",
                    "2000",
                    "--epochs",
                    "1",
                    "--gpu-rate",
                    "1000",
                    "--decode-rate",
                    "100",
                    "--decode-cores",
                    cores,
                    "--json",
                    str(out),
                ]
            )
            == 0
        )
        rep = json.loads(out.read_text())
        return next(r["epoch_s"] for r in rep["rows"] if r["setup"] == "colocated")

    assert epoch_s("1") >= 2000 / 100  # one core at 100 samples/s decodes 2000 samples
    assert epoch_s("0") < 2000 / 1000 * 1.5  # the accelerator's 2 s and the fetch, no decode


# 7. options that would do nothing ----------------------------------------------------------------


@pytest.mark.parametrize(
    "argv,message",
    [
        (["tdcs", "--plot", "x.png"], "--plot is about the scaling curves: give --scaling too"),
        (["tdcs", "--quick-scaling"], "--quick-scaling is about the scaling curves: give --scaling too"),
        (["tdcs", "--validate"], "--validate and tdcs are two runs: give one"),
        (["tdcs", "--netns", str(NETNS)], "--netns is an option of stoker simulate --validate, not of tdcs"),
        (["tdcs", "--demo", ""], "--demo is an option of stoker simulate --validate, not of tdcs"),
        (["tdcs", "--made-up-layout"], "--made-up-layout is an option of stoker simulate --validate, not of tdcs"),
        (["tdcs", "--decode-rate", "500", "--decode", str(DECODE)], "--decode-rate and --decode both give"),
        (["--validate", "--nodes", "4"], "--nodes is an option of stoker simulate tdcs, not of --validate"),
        (["--validate", "--scaling"], "--scaling is an option of stoker simulate tdcs, not of --validate"),
        (
            ["--validate", "--decode-cores", "0"],
            "--decode-cores is an option of stoker simulate tdcs, not of --validate",
        ),
        (["tdcs", "--scaling", "--plot", "/nonexistent-dir/x.png"], "--plot /nonexistent-dir/x.png: no directory"),
    ],
)
def test_options_that_would_be_ignored_are_refused(capsys, argv, message):
    assert message in refused(capsys, argv)
