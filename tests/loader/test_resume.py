"""Resume: state saved at any batch and restored (also in a new process) gives the identical rest of the stream."""

import atexit
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import pytest

from _helpers import SpeechDecode, require
from stoker import Loader, ReadOptions, open_dataset, pack
from stoker.collate import pack_tokens, pad

CFG = dict(batch_size=16, seed=11, transform="train")


def _digest(images, labels) -> str:
    return hashlib.sha1(images.numpy().tobytes() + labels.numpy().tobytes()).hexdigest()


def _item(x):
    """A comparable digest of one stream item: a batch (images, labels), a user-collated batch
    (a dict of tensors, and of lists of strings) or a sample id."""
    if isinstance(x, dict):
        return hashlib.sha1(
            b"".join(
                k.encode() + (v.numpy().tobytes() if hasattr(v, "numpy") else repr(v).encode())
                for k, v in sorted(x.items())
            )
        ).hexdigest()
    return _digest(*x) if isinstance(x, tuple) else int(x)


def _bytes_decode(fields, rng):
    """A user decode with augmentation: a random-length prefix of the sample's bytes as tokens."""
    data = next(iter(fields.values()))
    return np.frombuffer(data[: 40 + int(rng.integers(0, 200))], np.uint8).astype(np.int32)


def _stream(loader, epochs):
    out = []
    for _ in range(epochs):
        out.extend(_item(x) for x in loader)
    return out


# Every stage that holds state, built fresh by a factory (ds, cache_dir) -> stage. Each is
# iterated one epoch per iter() and implements state_dict()/load_state_dict().
def _loader(cache_bytes=64 << 20, **kw):
    def make(ds_url, cache_dir):
        ds = open_dataset(ds_url, cache_dir=cache_dir, cache_bytes=cache_bytes)
        return Loader(ds, **{**CFG, **kw})

    return make


def _stream_stage(**kw):
    def make(ds_url, cache_dir):
        from stoker.order import SampleStream

        ds = open_dataset(ds_url, cache=False)
        return SampleStream(len(ds), seed=5, groups=ds.blocks.sample_block, **kw)

    return make


_REAL: dict = {}


def _real(kind):
    """(local dataset URL, decode) of real data packed with --source files, made once: the
    standard library's .py files with a BPE trained on them, or Debian's ALSA recordings (alone,
    or with a transcript each: speech)."""
    if kind not in _REAL:
        from stoker_lab.bench import realdata

        tmp = tempfile.mkdtemp(prefix=f"stoker-resume-{kind}-")
        atexit.register(shutil.rmtree, tmp, True)
        if kind == "text":
            require("text corpus tokenizer", "tokenizers")
            rels = realdata.copy_stdlib_corpus(tmp + "/src", max_files=40, max_file_bytes=3000)
            decode = realdata.TokenizeDecode(realdata.train_bpe([f"{tmp}/src/{r}" for r in rels], 400))
        else:
            require("audio decode", "soundfile", realdata.ALSA_DIR)
            shutil.copytree(realdata.ALSA_DIR, tmp + "/src")
            decode = realdata.AudioDecode(seconds=0.1)
            if kind == "speech":
                for n in os.listdir(tmp + "/src"):
                    with open(f"{tmp}/src/{n[:-4]}.txt", "w") as f:
                        f.write(n[:-4].replace("_", " "))
                decode = SpeechDecode(0.1)
        pack(tmp + "/src", tmp + "/ds", source="files", shard_bytes=32 << 10, progress=False)
        _REAL[kind] = (tmp + "/ds", decode)
    return _REAL[kind]


def _real_loader(kind, **kw):
    def make(ds_url, cache_dir):
        url, decode = _real(kind)
        ds = open_dataset(url, cache_dir=cache_dir, cache_bytes=64 << 20)
        return Loader(ds, **{**CFG, "decode": decode, **kw})

    return make


STAGES = {
    "loader-w0": _loader(num_workers=0),
    "loader-w2": _loader(num_workers=2),
    "loader-uniform-w1": _loader(num_workers=1, read=ReadOptions(order="uniform"), world_size=2, rank=1),
    # the cache-aware order depends on what is cached: the state carries the cached-block map
    "loader-cache-aware-w1": _loader(num_workers=1, read=ReadOptions(cache_aware_window=32), cache_bytes=2 << 20),
    # the user's decode (with its per-sample rng) and collates; pack_tokens carries tokens
    # from batch to batch, and its state carries them too
    "loader-user-pad-w2": _loader(num_workers=2, decode=_bytes_decode, collate=pad()),
    "loader-pack-tokens-w2": _loader(num_workers=2, decode=_bytes_decode, collate=pack_tokens(97, eos_id=256)),
    "loader-pack-tokens-w0": _loader(num_workers=0, decode=_bytes_decode, collate=pack_tokens(211, eos_id=256)),
    # real data: text tokenized and packed into rows, audio decoded and cropped by the rng
    "real-text-pack-tokens-w2": _real_loader("text", batch_size=4, num_workers=2, collate=pack_tokens(64, eos_id=0)),
    "real-audio-w2": _real_loader("audio", batch_size=2, num_workers=2),
    # arrays mixed with strings ({"audio", "lengths", "text": [str]}): the audio through shared
    # memory, the text pickled, slots grown by the varying widths
    "real-speech-pad-w2": _real_loader("speech", batch_size=2, num_workers=2, collate=pad("audio")),
    "sample-stream": _stream_stage(),
    "sample-stream-rank2of3": _stream_stage(order="uniform", rank=2, world_size=3, even="drop"),
}
_REFS: dict = {}


def _close(stage):
    getattr(stage, "close", lambda: None)()


def _reference(name, packed_local, cache_dir):
    if name not in _REFS:
        warm = STAGES[name](packed_local, cache_dir)  # the cache as every later run finds it:
        used = -1  # read until no block fits any more
        while getattr(warm, "dataset", None) is not None and warm.dataset.cache.used_bytes() != used:
            used = warm.dataset.cache.used_bytes()
            _stream(warm, 1)
        _close(warm)
        stage = STAGES[name](packed_local, cache_dir)
        _REFS[name] = _stream(stage, 2)
        _close(stage)
    return _REFS[name]


@pytest.fixture(scope="module")
def reference(packed_local, tmp_path_factory):
    return _reference("loader-w2", packed_local, str(tmp_path_factory.mktemp("c")))


@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory):
    """One cache for every run of a stage: a cache-aware order then sees the same cached set
    (2 MiB under the no-eviction rule: filled by the first epoch read, never changed)."""
    return str(tmp_path_factory.mktemp("shared-cache"))


@pytest.mark.parametrize("cut", ["start", "first", "mid", "epoch_last", "next_mid", "end"])
@pytest.mark.parametrize("name", sorted(STAGES))
def test_resume_is_identical_for_every_stage(packed_local, shared_cache, name, cut):
    """The generic save/restore test: saved after any item (the last of an epoch too) and
    restored into a fresh stage, the rest of the stream is identical, item for item."""
    cache_dir = os.path.join(shared_cache, name)
    ref = _reference(name, packed_local, cache_dir)
    per_epoch = len(ref) // 2
    save_after = {
        "start": 0,
        "first": 1,
        "mid": per_epoch // 2,
        "epoch_last": per_epoch,
        "next_mid": per_epoch + per_epoch // 2 + 1,
        "end": 2 * per_epoch,
    }[cut]
    first = STAGES[name](packed_local, cache_dir)
    got, state = [], first.state_dict()
    it = None
    while len(got) < save_after:
        it = iter(first) if it is None else it
        try:
            x = next(it)
        except StopIteration:
            it = None
            continue
        got.append(_item(x))
        state = first.state_dict()
    state = json.loads(json.dumps(state))  # survives serialisation
    _close(first)
    second = STAGES[name](packed_local, cache_dir)
    second.load_state_dict(state)
    rest = []
    while len(got) + len(rest) < len(ref):
        before = len(rest)
        rest.extend(_item(x) for x in second)
        assert len(rest) > before, "the restored stage yields nothing"
    _close(second)
    assert got + rest == ref


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
    assert rest[: len(reference) - 3] == reference[3:]


def test_resume_refuses_a_different_configuration(packed_local):
    ds = open_dataset(packed_local, cache=False)
    state = Loader(ds, num_workers=0, **CFG).state_dict()
    other = Loader(ds, num_workers=0, batch_size=8, seed=11)
    with pytest.raises(ValueError, match="batch_size"):
        other.load_state_dict(state)
    with pytest.raises(ValueError, match="samples_done"):
        Loader(ds, num_workers=0, **CFG).load_state_dict(dict(state, samples_done=len(ds) + 1))


@pytest.mark.parametrize("position", ["samples_done", "batches_done"])
def test_resume_refuses_a_state_without_its_identity_keys(packed_local, position):
    """A trainer that kept only {epoch, batches_done}: nothing says the state is this loader's (a
    state of another seed resumed here repeats and skips samples), so it is refused by name, or
    resumed with strict=False and a warning that names what it lacks."""
    ds = open_dataset(packed_local, cache=False)
    saved = Loader(ds, num_workers=0, **{**CFG, "seed": 5})  # another seed than the one resuming
    it = iter(saved)
    for _ in range(3):
        next(it)
    trimmed = {k: saved.state_dict()[k] for k in ("epoch", position)}
    other = Loader(ds, num_workers=0, **CFG)
    with pytest.raises(ValueError, match="lacks seed, order.*dataset_version") as info:
        other.load_state_dict(trimmed)
    assert "strict=False" in str(info.value) and other.state_dict()["batches_done"] == 0  # nothing changed
    with pytest.warns(RuntimeWarning, match="lacks seed, order"):
        other.load_state_dict(trimmed, strict=False)
    assert (other.state_dict()["epoch"], other.state_dict()["batches_done"]) == (0, 3)
    full = saved.state_dict()
    del full["carry_from"]  # one key missing is named alone
    with pytest.raises(ValueError, match="lacks carry_from,"):
        Loader(ds, num_workers=0, **{**CFG, "seed": 5}).load_state_dict(full)
