"""Real non-image data end to end: a text corpus (the Python standard library's .py files,
tokenized with a byte-level BPE trained here) and an audio set (Debian's alsa-utils recordings,
decoded with libsndfile), each packed to the emulated S3 origin with `--source files` and read by
the Loader with the user's decode/collate at 2 workers."""

import io
import os

import numpy as np
import pytest

from _helpers import SpeechDecode, require
from stoker import Loader, open_dataset, pack
from stoker.collate import pack_tokens, pad
from stoker.order import sample_seed

ALSA = "/usr/share/sounds/alsa"
EOS = 0


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """(local tree, relative paths, tokenizer JSON): 60 small standard-library files and a BPE."""
    require("text corpus tokenizer", "tokenizers")
    from stoker_lab.bench.realdata import copy_stdlib_corpus, train_bpe

    root = tmp_path_factory.mktemp("corpus")
    rels = copy_stdlib_corpus(str(root), max_files=60, max_file_bytes=3000)
    return root, rels, train_bpe([str(root / r) for r in rels], vocab_size=600)


@pytest.fixture(scope="module")
def corpus_s3(s3_origin, corpus):
    from stoker_lab.bench.origin import upload_tree

    opts = s3_origin.storage_options()
    upload_tree(str(corpus[0]), s3_origin.url("real/corpus-raw"), opts)
    url = s3_origin.url("real/corpus")
    pack(
        s3_origin.url("real/corpus-raw"),
        url,
        source="files",
        storage_options=opts,
        progress=False,
        overwrite=True,
        shard_bytes=64 << 10,
    )
    return url, opts


@pytest.fixture(scope="module")
def audio_s3(s3_origin, tmp_path_factory):
    require("audio decode", "soundfile", ALSA)
    from stoker_lab.bench.origin import upload_tree

    root = tmp_path_factory.mktemp("wavs")
    for n in sorted(os.listdir(ALSA)):
        if n.endswith(".wav"):
            (root / n).write_bytes(open(os.path.join(ALSA, n), "rb").read())
            (root / n.replace(".wav", ".txt")).write_text(n[:-4].replace("_", " "))
    opts = s3_origin.storage_options()
    upload_tree(str(root), s3_origin.url("real/audio-raw"), opts)
    url = s3_origin.url("real/audio")
    pack(
        s3_origin.url("real/audio-raw"),
        url,
        source="files",
        storage_options=opts,
        progress=False,
        overwrite=True,
        shard_bytes=256 << 10,
    )
    return url, opts


def test_pack_tokens_serves_every_token_of_the_corpus_once_per_epoch(corpus, corpus_s3, tmp_path):
    from stoker_lab.bench.realdata import TokenizeDecode

    root, rels, tok_json = corpus
    url, opts = corpus_s3
    decode = TokenizeDecode(tok_json)
    ds = open_dataset(url, storage_options=opts, cache_dir=str(tmp_path), cache_bytes=64 << 20)
    assert len(ds) == len(rels)
    with Loader(ds, 8, decode=decode, collate=pack_tokens(128, eos_id=EOS), num_workers=2, seed=4) as loader:
        for epoch in range(2):
            plan = loader.plan()
            rows = list(loader)
            st = loader.stats
            assert st.exactly_once and st.samples == len(rels) and st.pickled_batches == 0
            assert st.shm_batches == -(-len(rels) // 8)
            assert all(r["input_ids"].shape[1] == 128 for r in rows)
            got = np.concatenate(
                [r["input_ids"][j, : int(n)].numpy() for r in rows for j, n in enumerate(r["lengths"])]
            )
            # the concatenated corpus in this epoch's order, each document tokenized straight from its file
            want = np.concatenate(
                [np.append(decode.tokenize((root / f"{ds.key(int(s))}.py").read_text()), EOS) for s in plan]
            )
            assert got.tolist() == want.tolist(), f"epoch {epoch}"


def test_audio_batches_of_fixed_shape_come_through_shared_memory(audio_s3, tmp_path):
    sf = require("audio decode", "soundfile", ALSA)
    from stoker_lab.bench.realdata import AudioDecode

    url, opts = audio_s3
    ds = open_dataset(url, storage_options=opts, cache_dir=str(tmp_path), cache_bytes=64 << 20)
    dec = AudioDecode(seconds=0.25)
    with Loader(ds, 4, decode=dec, num_workers=2, seed=9) as loader:
        plan = loader.plan()
        batches = list(loader)
        st = loader.stats
    assert st.exactly_once and st.shm_batches == len(batches) == 3 and st.pickled_batches == 0
    assert all(tuple(b["audio"].shape[1:]) == (12000,) and b["audio"].dtype.is_floating_point for b in batches)
    for b, batch in enumerate(batches):
        for j, sid in enumerate(plan[b * 4 : (b + 1) * 4]):
            key = ds.key(int(sid))
            data, rate = sf.read(
                io.BytesIO(open(os.path.join(ALSA, key + ".wav"), "rb").read()), dtype="float32", always_2d=True
            )
            want = dec(
                {"wav": open(os.path.join(ALSA, key + ".wav"), "rb").read()},
                np.random.default_rng(sample_seed(9, 0, int(sid))),
            )
            assert rate == int(batch["rate"][j]) == 48000
            assert np.array_equal(batch["audio"][j].numpy(), want["audio"])


def test_speech_batches_move_the_audio_through_shared_memory_and_pickle_only_the_text(audio_s3, tmp_path):
    """The speech example of docs/guide.md: ``{"audio": padded tensor, "lengths", "text": [str, ...]}``.
    The arrays go through the slot, only the strings are pickled, and the batches are those the
    training process makes itself (num_workers=0), same values, structure and types."""
    torch = require("torch", "torch")
    require("audio decode", "soundfile", ALSA)
    url, opts = audio_s3
    runs = {}
    for nw in (0, 2):
        ds = open_dataset(url, storage_options=opts, cache_dir=str(tmp_path / f"w{nw}"), cache_bytes=64 << 20)
        with Loader(ds, 4, decode=SpeechDecode(0.3), collate=pad("audio"), num_workers=nw, seed=9) as loader:
            plan = loader.plan()
            runs[nw] = list(loader), loader.stats
    (ref, _), (got, st) = runs[0], runs[2]
    texts = [t for b in got for t in b["text"]]
    assert texts == [ds.key(int(s)).replace("_", " ") for s in plan]
    assert st.exactly_once and st.shm_batches == len(got) == 3 and st.pickled_batches == 0
    # the transcripts and a little framing per string and per batch; the audio is ~100 times more
    assert 0 < st.pickled_bytes <= sum(len(t.encode()) + 8 for t in texts) + 64 * len(got)
    assert sum(b["audio"].numel() * 4 for b in got) > 100 * st.pickled_bytes
    assert len({b["audio"].shape[1] for b in got}) > 1  # widths differ: the slots grew
    for a, b in zip(ref, got, strict=True):
        assert type(b) is dict and list(b) == list(a) and set(b) == {"audio", "lengths", "text"}
        assert type(b["audio"]) is type(b["lengths"]) is torch.Tensor and type(b["text"]) is list
        assert torch.equal(a["audio"], b["audio"]) and torch.equal(a["lengths"], b["lengths"])
        assert a["text"] == b["text"]
