"""Shared pytest fixtures: a local emulated S3 origin (and a fault proxy in front of it), the shared cases,
sample images."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent

# Every Ray of the tests on the loopback address, set before anything imports Ray (it reads the
# setting once, at import) and inherited by every process the tests start. Ray 2.60 otherwise
# takes the address of the machine's route out, even for a node started on 127.0.0.1 or a driver
# joining 127.0.0.1:<port> (``ray.init`` and ``ray start`` turn a loopback address into that
# one), and on a machine with a second address a test can hang on it. Ray's name for the switch
# is its Windows/macOS one: "0" makes its local address 127.0.0.1 on any system. The namespace
# cluster's ``ray start`` (stoker_lab.bench.netcluster_ray) takes it out of its environment: its
# nodes keep their namespace addresses. tests/cluster/conftest.py also names 127.0.0.1 for each node.
LOOPBACK_RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
os.environ.update(LOOPBACK_RAY_ENV)

# No Ray starts by itself in a test process: Ray 2.60 calls ``ray.init()`` from ``ray.get``,
# ``ray.get_actor``, an actor's ``.remote()`` and others when no Ray is connected, and a test that
# reaches one of them by mistake (a cache service made in-process without its Ray calls stood in)
# would leave a local Ray behind, so the next module's ``ray.init(address=...)`` of the session's
# test cluster fails with "called ray.init twice". With auto-connect off the mistake fails in the
# test that made it. Every test and script that wants Ray calls ``ray.init`` itself.
os.environ["RAY_ENABLE_AUTO_CONNECT"] = "0"


def _parse_again_after_a_false_depth_error(parse):
    """``ast.parse`` that parses once more after CPython 3.11's spurious "AST constructor recursion
    depth mismatch" SystemError (CPython's own tracker calls it an incorrect SystemError, seen in
    threaded processes; fixed in later releases): the tests that read src/ with ``ast`` (layers,
    shapes, option walks) run in processes whose other tests left threads running, and one such
    error failed a clean run once. Any other error, or the same one twice, is raised."""

    def parse_source(*args, **kwargs):
        try:
            return parse(*args, **kwargs)
        except SystemError as exc:
            if "recursion depth mismatch" not in str(exc):
                raise
            return parse(*args, **kwargs)

    return parse_source


ast.parse = _parse_again_after_a_false_depth_error(ast.parse)

# Under pytest-xdist (`make test` runs two workers) each worker gets a node cache of its own: the
# tests that name no cache directory use $STOKER_CACHE_DIR, and two workers' tests must not see
# or evict each other's blocks. Set before anything reads it, inherited by the tests' children.
if os.environ.get("PYTEST_XDIST_WORKER") and os.environ.get("STOKER_CACHE_DIR"):
    os.environ["STOKER_CACHE_DIR"] = os.path.join(os.environ["STOKER_CACHE_DIR"], os.environ["PYTEST_XDIST_WORKER"])


@pytest.fixture(scope="module", autouse=True)
def _no_fork_hazard_left(request):
    """After each module, the test process holds no runtime that a fork cannot survive (tokio,
    from obstore): tests fork children (`_helpers.in_child`, loaders with ``fork``), and one module
    that read through obstore here made every later fork hang or switch start methods. Code that
    uses obstore runs in a child (`_helpers.in_child`) or a subprocess."""
    from stoker._procs import fork_hazards

    before = fork_hazards()
    yield
    after = [h for h in fork_hazards() if h not in before]
    if after:
        pytest.fail(f"{request.module.__name__} left this process unsafe to fork: {'; '.join(after)}")


@pytest.fixture(scope="session")
def s3_origin():
    """A running :class:`stoker_lab.bench.origin.LocalS3Origin` (2 ms latency, 1000 MB/s cap)."""
    from stoker_lab.bench.origin import LocalS3Origin

    origin = LocalS3Origin(latency_ms=2, bandwidth_MBps=1000, nice=0).start()  # tests: same priority
    try:
        yield origin
    finally:
        origin.stop()


@pytest.fixture
def origin_faults(s3_origin):
    """``(proxy, storage options through it)``: a :class:`stoker_lab.bench.faultproxy.FaultProxy` in
    front of ``s3_origin``'s throttled endpoint, forwarding everything until the test sets a fault;
    stopped after the test. The one way tests inject origin faults (the origin has none of its own)."""
    from _helpers import fault_proxy

    proxy, options = fault_proxy(s3_origin.storage_options())
    with proxy:
        yield proxy, options


@pytest.fixture(scope="session")
def cases_dir() -> Path:
    """The shared test cases: ``$STOKER_CASES`` or ``<repo>/../shared/cases``.

    Missing: fails under CI (``$CI`` set), skips otherwise.
    """
    path = Path(os.environ.get("STOKER_CASES") or REPO_ROOT.parent / "shared" / "cases")
    if not path.is_dir():
        message = f"shared cases directory not found: {path} (set STOKER_CASES)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return path


@pytest.fixture(scope="session")
def sample_tree(tmp_path_factory) -> Path:
    """Root of a small ImageNet-style tree (120 images, 4 classes, seed 0): ``root/train/...``."""
    from stoker_lab.sample_data import make_sample_data

    root = tmp_path_factory.mktemp("sample-data")
    make_sample_data(str(root), images=120, classes=4, seed=0)
    return root


@pytest.fixture(scope="session")
def packed_local(sample_tree, tmp_path_factory) -> str:
    """The sample tree packed into a local dataset with ~1 MiB shards (several shards)."""
    from stoker.store.pack import pack

    dst = tmp_path_factory.mktemp("packed") / "train"
    pack(str(sample_tree / "train"), str(dst), shard_bytes=1 << 20, progress=False)
    return str(dst)


@pytest.fixture(scope="session")
def cases_packed(cases_dir, tmp_path_factory) -> str:
    """The shared Pillow JPEG cases as a one-class ImageFolder tree (class ``pillow``), packed."""
    import shutil

    from stoker.store.pack import pack

    root = tmp_path_factory.mktemp("cases")
    src = root / "src" / "pillow"
    src.mkdir(parents=True)
    for f in sorted((cases_dir / "pillow-jpeg").iterdir()):
        shutil.copy(f, src / f.name)
    pack(str(root / "src"), str(root / "packed"), progress=False)
    return str(root / "packed")


@pytest.fixture(scope="session")
def s3_packed(s3_origin, sample_tree):
    """The sample tree uploaded to the emulated S3 origin and packed there: (dataset URL, storage options)."""
    from stoker.store.pack import pack
    from stoker_lab.bench.origin import upload_tree

    opts = s3_origin.storage_options()
    upload_tree(str(sample_tree / "train"), s3_origin.url("s3packed/raw"), opts)
    url = s3_origin.url("s3packed/packed")
    pack(s3_origin.url("s3packed/raw"), url, storage_options=opts, progress=False, overwrite=True)
    return url, opts
