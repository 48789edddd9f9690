"""Real non-image samples for the demo and the tests: text (the Python standard library's own
``.py`` files, tokenized with a byte-level BPE trained on them) and audio (recordings that a
Debian package ships, decoded with libsndfile).

The decode functions are small picklable classes, so they work with every start method:
:class:`TokenizeDecode` (``tokenizers``) and :class:`AudioDecode` (``soundfile``). Both packages
are dev/extra dependencies: they are imported when a function here runs, and a missing one is
an ImportError that says which package to install.
"""

from __future__ import annotations

import os
import shutil
import sysconfig
from typing import Any

import numpy as np

__all__ = ["ALSA_DIR", "AudioDecode", "TokenizeDecode", "copy_stdlib_corpus", "stdlib_py_files", "train_bpe"]

#: Debian's alsa-utils recordings ("Front Left", "Noise", ...: 48 kHz, 16-bit WAV).
ALSA_DIR = "/usr/share/sounds/alsa"


def _need(module: str, extra: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(
            f"{module} is needed for this ({exc}); install it: pip install -e '.[{extra}]' "
            f"in the stoker checkout, or pip install {module}"
        ) from exc


def stdlib_py_files(max_files: int | None = None, max_file_bytes: int | None = None) -> tuple[str, list[str]]:
    """``(stdlib root, relative paths)`` of the standard library's ``.py`` files (the running
    Python's ``sysconfig.get_paths()['stdlib']``; no site-packages, no test suites), in sorted
    order: the first ``max_files`` non-empty ones of at most ``max_file_bytes`` bytes each.

    Raises FileNotFoundError when the standard library holds no such file."""
    root = sysconfig.get_paths()["stdlib"]
    out = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(
            x
            for x in dirs
            if x not in ("site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__")
            and not x.startswith(".")
        )
        for f in sorted(files):
            if not f.endswith(".py") or f.count(".") != 1:
                continue
            size = os.path.getsize(os.path.join(d, f))
            if size == 0 or (max_file_bytes is not None and size > max_file_bytes):
                continue
            out.append(os.path.relpath(os.path.join(d, f), root))
            if max_files is not None and len(out) >= max_files:
                return root, out
    if not out:
        raise FileNotFoundError(f"no .py files (of at most {max_file_bytes} bytes) in the standard library at {root}")
    return root, out


def copy_stdlib_corpus(dst: str, max_files: int | None = None, max_file_bytes: int | None = None) -> list[str]:
    """Copy :func:`stdlib_py_files` into the tree ``dst`` (same relative paths); returns them."""
    root, rels = stdlib_py_files(max_files, max_file_bytes)
    for rel in rels:
        os.makedirs(os.path.join(dst, os.path.dirname(rel)), exist_ok=True)
        shutil.copyfile(os.path.join(root, rel), os.path.join(dst, rel))
    return rels


def train_bpe(paths: list[str], vocab_size: int = 4096) -> str:
    """A byte-level BPE (GPT-2's scheme, via Hugging Face ``tokenizers``) trained on the files at
    ``paths``, as its JSON string; the token ``<|endoftext|>`` gets id 0."""
    tokenizers = _need("tokenizers", "dev")
    tok = tokenizers.ByteLevelBPETokenizer()
    tok.train(paths, vocab_size=vocab_size, min_frequency=2, special_tokens=["<|endoftext|>"], show_progress=False)
    return tok._tokenizer.to_str()


class TokenizeDecode:
    """``decode(fields, rng) -> int32 token ids (n,)`` of the text in ``fields[field]`` (UTF-8),
    with the tokenizer given as JSON (:func:`train_bpe`); built once per process, on first use.

    Raises UnicodeDecodeError (the Loader names the sample) when the member is not UTF-8."""

    def __init__(self, tokenizer_json: str, field: str = "py"):
        self.tokenizer_json, self.field = tokenizer_json, field
        self._tok: Any = None

    def __getstate__(self):
        return {"tokenizer_json": self.tokenizer_json, "field": self.field, "_tok": None}

    def tokenize(self, text: str) -> np.ndarray:
        """Token ids (int32, (n,)) of ``text``."""
        if self._tok is None:
            os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # one thread per worker process
            self._tok = _need("tokenizers", "dev").Tokenizer.from_str(self.tokenizer_json)
        return np.asarray(self._tok.encode(text).ids, dtype=np.int32)

    def __call__(self, fields: dict, rng=None) -> np.ndarray:
        return self.tokenize(fields[self.field].decode("utf-8"))


class AudioDecode:
    """``decode(fields, rng) -> {"audio": float32 (samples,), "rate": int64 ()}``: the recording in
    ``fields[field]`` decoded by libsndfile (``soundfile``), mixed down to mono, and a crop of
    ``seconds`` at an offset drawn from ``rng`` (zero-padded at the end when shorter).

    Raises soundfile.LibsndfileError (the Loader names the sample) for bytes it cannot decode, and
    ValueError when the sample rate is not ``rate``."""

    def __init__(self, seconds: float = 0.5, rate: int = 48000, field: str = "wav"):
        self.seconds, self.rate, self.field = float(seconds), int(rate), field

    def __call__(self, fields: dict, rng) -> dict:
        import io

        sf = _need("soundfile", "audio")
        data, rate = sf.read(io.BytesIO(fields[self.field]), dtype="float32", always_2d=True)
        if rate != self.rate:
            raise ValueError(f"sample rate {rate} Hz, expected {self.rate} Hz")
        mono = data.mean(axis=1)
        n = int(round(self.seconds * rate))
        start = int(rng.integers(0, max(1, len(mono) - n + 1)))
        out = np.zeros(n, np.float32)
        clip = mono[start : start + n]
        out[: len(clip)] = clip
        return {"audio": out, "rate": np.int64(rate)}
