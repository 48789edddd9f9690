"""The public face of stoker: ``__all__`` is exact, every error shares one base and keeps its
builtin base, and the errors ``open_dataset`` documents are all exported."""

import ast
import importlib
import pathlib
import pickle
import re
import tarfile

import pytest

import stoker
from stoker import errors

SRC = pathlib.Path(stoker.__file__).parent

EXPECTED_ALL = [
    "CacheDirError",
    "CacheInUseError",
    "CacheLockTimeout",
    "CacheModeError",
    "CacheOptions",
    "CacheUnwritableError",
    "CapacityError",
    "ChecksumError",
    "CollateError",
    "Dataset",
    "DatasetChangedError",
    "DatasetExistsError",
    "DecodeError",
    "EntryError",
    "EpochStats",
    "ExtenderRequestError",
    "ForkUnsafeError",
    "ImageOptions",
    "ImageTooLarge",
    "IndexFormatError",
    "Loader",
    "Mixture",
    "NotACacheError",
    "NotADataLoaderError",
    "NotADatasetError",
    "OriginError",
    "OriginNotFoundError",
    "OriginPermissionError",
    "PackLeaseError",
    "PackLeaseLostError",
    "PackOptions",
    "PeerUnavailable",
    "ProcessGroupError",
    "RankSetupError",
    "ReadOptions",
    "RunOptions",
    "SampleFnError",
    "ServiceStartError",
    "SharedMemoryError",
    "SourceArchiveError",
    "SourceError",
    "SourceNotFoundError",
    "StaleIteratorError",
    "StokerError",
    "UnsafePathError",
    "WorkerError",
    "WorkerStartError",
    "Writer",
    "__version__",
    "collate",
    "decode",
    "mix",
    "open_dataset",
    "pack",
    "parse_size",
]

# Each public error and the builtin base it keeps (so older `except` clauses still catch it).
BUILTIN_BASE = {
    "CacheDirError": NotADirectoryError,
    "CacheInUseError": RuntimeError,
    "CacheLockTimeout": TimeoutError,
    "CacheModeError": ValueError,
    "CacheUnwritableError": PermissionError,
    "CapacityError": RuntimeError,
    "ChecksumError": OSError,
    "CollateError": ValueError,
    "SampleFnError": ValueError,
    "ServiceStartError": RuntimeError,
    "RankSetupError": RuntimeError,
    "DatasetChangedError": OSError,
    "DatasetExistsError": FileExistsError,
    "DecodeError": ValueError,
    "EntryError": ValueError,
    "ExtenderRequestError": ValueError,
    "ForkUnsafeError": RuntimeError,
    "ImageTooLarge": ValueError,
    "IndexFormatError": ValueError,
    "NotACacheError": ValueError,
    "OriginError": OSError,
    "OriginNotFoundError": FileNotFoundError,
    "OriginPermissionError": PermissionError,
    "PackLeaseError": FileExistsError,
    "PackLeaseLostError": OSError,
    "PeerUnavailable": OSError,
    "ProcessGroupError": RuntimeError,
    "SharedMemoryError": OSError,
    "SourceArchiveError": tarfile.TarError,
    "SourceError": ValueError,
    "SourceNotFoundError": FileNotFoundError,
    "UnsafePathError": PermissionError,
    "WorkerError": RuntimeError,
    "WorkerStartError": RuntimeError,
    "StaleIteratorError": RuntimeError,
    "NotADataLoaderError": AttributeError,
    "NotADatasetError": TypeError,
}

# Where each error used to be defined: those names must stay importable and be the same class.
OLD_HOMES = {
    "stoker.storage": ["OriginError", "OriginNotFoundError", "OriginPermissionError"],
    "stoker.loader": ["WorkerError"],
    "stoker.cache.disk": ["CacheLockTimeout"],
    "stoker.cache.status": ["NotACacheError", "CacheInUseError"],
    "stoker.decode.image": ["DecodeError", "ImageTooLarge"],
    "stoker.decode.forms": ["EntryError"],
    "stoker.store.dataset": ["ChecksumError"],
    "stoker.store.verify": ["DatasetChangedError"],
    "stoker.store.pack": ["DatasetExistsError"],
    "stoker.store.index": ["IndexFormatError"],
    "stoker.store.lease": ["PackLeaseError", "PackLeaseLostError"],
    "stoker.cluster.service.reader": ["PeerUnavailable"],
}


def test_all_is_exact_and_sorted():
    assert stoker.__all__ == EXPECTED_ALL
    assert stoker.__all__ == sorted(stoker.__all__)


def test_every_name_in_all_is_importable():
    ns: dict = {}
    exec("from stoker import *", ns)
    for name in EXPECTED_ALL:
        assert name in ns or name == "__version__", name
        assert getattr(stoker, name) is not None
    assert re.fullmatch(r"\d+\.\d+\.\d+\S*", stoker.__version__)


def test_every_error_is_a_stoker_error_with_its_builtin_base():
    exported = {
        n
        for n in EXPECTED_ALL
        if isinstance(getattr(stoker, n), type) and issubclass(getattr(stoker, n), BaseException)
    }
    assert exported == set(BUILTIN_BASE) | {"StokerError"}
    assert set(errors.__all__) == exported
    for name, base in BUILTIN_BASE.items():
        cls = getattr(stoker, name)
        assert cls is getattr(errors, name)
        assert issubclass(cls, stoker.StokerError), name
        assert issubclass(cls, base), name


def test_old_import_paths_give_the_same_classes():
    for module, names in OLD_HOMES.items():
        mod = importlib.import_module(module)
        for name in names:
            assert getattr(mod, name) is getattr(stoker, name), f"{module}.{name}"
    from stoker.cluster.extender.scoring import BadRequest
    from stoker.store.index import IndexError_

    assert IndexError_ is stoker.IndexFormatError
    assert BadRequest is stoker.ExtenderRequestError


def test_lab_errors_live_in_the_lab():
    """The benchmarks' errors left ``stoker``'s face; the lab defines them, still StokerErrors."""
    from stoker_lab import errors as lab_errors
    from stoker_lab.bench.netcluster import NetnsUnavailable
    from stoker_lab.bench.venvs import VenvError

    for name, cls in (("NetnsUnavailable", NetnsUnavailable), ("VenvError", VenvError)):
        assert not hasattr(stoker, name) and not hasattr(errors, name)
        assert cls is getattr(lab_errors, name)
        assert issubclass(cls, stoker.StokerError) and issubclass(cls, RuntimeError)


def test_no_public_error_class_defined_outside_errors_module():
    """Every public exception class lives in stoker/errors.py (private ``_X`` ones may stay local)."""
    found = []
    for path in SRC.rglob("*.py"):
        if path.name == "errors.py" and path.parent == SRC:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                bases = {ast.unparse(b) for b in node.bases}
                if any(re.search(r"(Error|Exception|Timeout|Unavailable|Request|TooLarge)$", b) for b in bases):
                    found.append(f"{path.relative_to(SRC)}:{node.lineno} {node.name}")
    assert found == []


def test_open_dataset_documents_only_exported_errors():
    doc = stoker.open_dataset.__doc__
    named = set(re.findall(r":class:`(?:stoker\.)?(\w+)`", doc))
    documented = {n for n in named if n.endswith(("Error", "Timeout", "Unavailable"))}
    assert {"OriginError", "OriginNotFoundError", "DatasetChangedError", "IndexFormatError"} <= documented
    for name in documented:
        assert name in stoker.__all__, name
        assert issubclass(getattr(stoker, name), stoker.StokerError)


ONE_OF_EACH = [
    stoker.OriginError("s3://b/d/shards/0.tar", "SlowDown", 0, 1023, 5, code="SlowDown", status=503, elapsed_s=30.0),
    stoker.OriginNotFoundError("s3://b/d/index.parquet", "not found"),
    stoker.OriginPermissionError("s3://b/d/index.parquet", "AccessDenied", code="AccessDenied", status=403),
    stoker.ChecksumError("sample 'a/1' in shard 0.tar of s3://b/d: checksum mismatch"),
    stoker.DatasetChangedError("shard 0.tar changed"),
    stoker.DatasetExistsError("s3://b/d holds a dataset"),
    stoker.IndexFormatError("s3://b/d/index.parquet: not a stoker index"),
    stoker.PackLeaseError(
        "s3://b/d",
        {"host": "n1", "pid": 7, "run": "r", "started_unix": 1.7e9, "expires_unix": 1.7e9 + 60},
    ),
    stoker.PackLeaseLostError("s3://b/d: this pack lost its claim on the destination"),
    stoker.CacheLockTimeout("block 3 of v1"),
    stoker.NotACacheError("/tmp/x is not a stoker cache"),
    stoker.CacheInUseError("in use by pid 7"),
    stoker.CacheModeError("cache /c was made with mode 0600, opened with 0640"),
    stoker.UnsafePathError("/dev/shm/stoker-cache-1 is owned by uid 1001"),
    stoker.CacheDirError("cache directory /data/c is a file, not a directory"),
    stoker.CacheUnwritableError("/data/c", "a read-only filesystem: /data/c/.lock", 30),
    stoker.DecodeError("a/1.jpg", "truncated"),
    stoker.ImageTooLarge("a/2.jpg", "too many pixels"),
    stoker.EntryError("entry 3: bad magic"),
    stoker.CollateError(2, "it is array of shape (4,)"),
    stoker.SampleFnError("k1", "decode function m.f failed on sample 'k1'"),
    stoker.WorkerError("worker 3 died on sample 'a/1'"),
    stoker.WorkerStartError("worker 0 (pid 7) could not start: it ran the training code of the main script"),
    stoker.StaleIteratorError("the iterator of epoch 2 was ended by a later iter() (epoch 3)"),
    stoker.NotADataLoaderError("a stoker Loader has no batch_sampler"),
    stoker.NotADatasetError("Loader() takes a stoker Dataset, not a torch.utils.data.Subset over one"),
    stoker.ForkUnsafeError("threads: tokio-runtime-worker"),
    stoker.SharedMemoryError("/dev/shm", 1 << 20, 4096),
    stoker.PeerUnavailable("peer node-2 timed out"),
    stoker.ExtenderRequestError("body too large", 413),
    stoker.CapacityError("4 ranks asking for {'CPU': 2.0} each do not fit"),
    stoker.SourceError("source /data/train: duplicate key 'cat/1' from 'cat/1.jpg' and 'cat/1.png'"),
    stoker.SourceArchiveError("archive /data/s-0.tar: not a readable tar archive"),
    stoker.SourceNotFoundError("source /data/train does not exist"),
    stoker.ServiceStartError("cache service of node 5f3a could not start: UnsafePathError: /c/node-h-2"),
    stoker.ProcessGroupError("rank 1: rank 0 did not publish its address for the 'gloo' group within 60 s"),
    stoker.RankSetupError("job 'train': ranks [1] of 2 did not report within 120.0 s (round 1)"),
]


def test_one_of_each_covers_every_error():
    assert {type(e).__name__ for e in ONE_OF_EACH} == set(BUILTIN_BASE)


@pytest.mark.parametrize("err", ONE_OF_EACH, ids=lambda e: type(e).__name__)
def test_errors_cross_process_boundaries(err):
    """Errors pickle to an equal error (multiprocessing queues, Ray), attributes included."""
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is type(err) and str(back) == str(err) and back.args == err.args
    assert vars(back) == vars(err)
    if isinstance(err, OSError):
        assert (back.errno, back.strerror, back.filename) == (err.errno, err.strerror, err.filename)


def test_catching_the_base_catches_a_real_failure(tmp_path):
    with pytest.raises(stoker.StokerError) as info:
        stoker.open_dataset(f"file://{tmp_path}/not-a-dataset/", cache=False)
    assert isinstance(info.value, FileNotFoundError)
    assert "not-a-dataset" in str(info.value) and "not a packed stoker dataset" in str(info.value)
