"""Resume: state saved at any batch and restored (also in a new process) gives the identical rest of the stream."""
import hashlib
import json
import subprocess
import sys

import pytest

from stoker import Loader, open_dataset

CFG = dict(batch_size=16, seed=11, transform="train")


def _digest(images, labels) -> str:
    return hashlib.sha1(images.numpy().tobytes() + labels.numpy().tobytes()).hexdigest()


def _stream(loader, epochs):
    out = []
    for _ in range(epochs):
        out.extend(_digest(x, y) for x, y in loader)
    return out


@pytest.fixture(scope="module")
def reference(packed_local, tmp_path_factory):
    ds = open_dataset(packed_local, cache_dir=str(tmp_path_factory.mktemp("c")), cache_bytes=64 << 20)
    with Loader(ds, num_workers=2, **CFG) as loader:
        return _stream(loader, 2)  # 8 batches per epoch (120 samples / 16)


@pytest.mark.parametrize("save_after", [0, 1, 5, 8, 13, 16])  # 8 = after the last batch of epoch 0
@pytest.mark.parametrize("workers", [0, 2])
def test_resume_is_batch_for_batch_identical(packed_local, tmp_path, reference, save_after, workers):
    ds = open_dataset(packed_local, cache_dir=str(tmp_path), cache_bytes=64 << 20)
    first = Loader(ds, num_workers=workers, **CFG)
    got, state = [], first.state_dict()
    it = None
    while len(got) < save_after:
        it = iter(first) if it is None else it
        try:
            x, y = next(it)
        except StopIteration:
            it = None
            continue
        got.append(_digest(x, y))
        state = first.state_dict()
    state = json.loads(json.dumps(state))  # survives serialisation
    first.close()
    second = Loader(ds, num_workers=workers, **CFG)
    second.load_state_dict(state)
    rest = []
    while len(got) + len(rest) < len(reference):
        rest.extend(_digest(x, y) for x, y in second)
    second.close()
    assert got + rest == reference


def test_resume_in_a_new_process(packed_local, tmp_path, reference):
    ds = open_dataset(packed_local, cache_dir=str(tmp_path), cache_bytes=64 << 20)
    loader = Loader(ds, num_workers=0, **CFG)
    it = iter(loader)
    for _ in range(3):
        next(it)
    state = loader.state_dict()
    code = f"""
import hashlib, json, sys
from stoker import Loader, open_dataset
ds = open_dataset({packed_local!r}, cache_dir={str(tmp_path)!r}, cache_bytes=64 << 20)
loader = Loader(ds, num_workers=2, **{CFG!r})
loader.load_state_dict(json.loads(sys.argv[1]))
out = []
for _ in range(2):
    out.extend(hashlib.sha1(x.numpy().tobytes() + y.numpy().tobytes()).hexdigest() for x, y in loader)
print(json.dumps(out))
"""
    res = subprocess.run([sys.executable, "-c", code, json.dumps(state)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    rest = json.loads(res.stdout.strip().splitlines()[-1])
    assert rest[:len(reference) - 3] == reference[3:]


def test_resume_refuses_a_different_configuration(packed_local):
    ds = open_dataset(packed_local, cache=False)
    state = Loader(ds, num_workers=0, **CFG).state_dict()
    other = Loader(ds, num_workers=0, batch_size=8, seed=11)
    with pytest.raises(ValueError, match="batch_size"):
        other.load_state_dict(state)
    with pytest.raises(ValueError, match="batches_done"):
        Loader(ds, num_workers=0, **CFG).load_state_dict(dict(state, batches_done=99))
