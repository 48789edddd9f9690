"""The augmentation generators of a batch's samples, made for the batch at once.

A sample's crop and flip are drawn from ``numpy.random.default_rng(sample_seed(seed, epoch, id))``
(:func:`stoker.order.sample_seed`: a ``SeedSequence`` of ``[seed, epoch, id, 0xA06]`` seeding a
``PCG64``). Made that way, one generator costs two objects and a hash per sample, about 20 us,
as much as reading the sample from the node cache. :class:`BatchRngs` makes the same generators
for a whole batch: the ``SeedSequence`` hash of every sample computed together on numpy arrays,
then one ``PCG64`` reset to each sample's state in turn, so a sample gets the very random
numbers it got before (bit for bit: tests/loader/test_batch_decode.py compares the states and draws).

The algorithms, as numpy 1.17+ implements them (``numpy/random/bit_generator.pyx``,
``numpy/random/src/pcg64/pcg64.h``):

* ``SeedSequence`` (M. E. O'Neill's ``seed_seq_fe``, pool of 4 words): each entropy word goes
  through ``hashmix`` (xor with a running constant that starts at ``0x43b0d7e5`` and is multiplied
  by ``0x931e8875`` each use, multiply, xor-shift 16); then every pool word is mixed with the
  ``hashmix`` of every other (``mix(x, y) = (0xca01f9dd * x - 0x4973f715 * y) ^ >> 16``), all in
  32-bit arithmetic; ``generate_state(4, uint64)`` reads the pool cyclically through a second
  running constant (``0x8b51f9dd``, times ``0x58f38ded``) into 8 words, paired as the machine's uint64.
* ``PCG64`` seeding (``pcg_setseq_128_srandom_r``): with ``s = w0 << 64 | w1`` and
  ``i = w2 << 64 | w3``, ``inc = i << 1 | 1``, ``state = ((inc + s) * M + inc) mod 2^128``
  with ``M = 0x2360ED051FC65DA44385DF649FCCF645``.

An entropy word is a 32-bit unsigned integer: a seed, epoch or sample id of 2^32 or more takes
two words, and such a batch is made the plain way (:func:`stoker.order.sample_seed` per sample).
"""

from __future__ import annotations

import numpy as np

from ...order import sample_seed

__all__ = ["BatchRngs"]

_U32 = np.uint32
_MASK128 = (1 << 128) - 1
_PCG_MULT = 0x2360ED051FC65DA44385DF649FCCF645
_SALT = 0xA06  # the last entropy word of stoker.order.sample_seed


def _hashmix(value: np.ndarray, const: list[int]) -> np.ndarray:
    """``seed_seq_fe``'s hashmix of the uint32 words ``value`` with the running constant
    ``const[0]`` (advanced in place)."""
    value = value ^ _U32(const[0])
    const[0] = (const[0] * 0x931E8875) & 0xFFFFFFFF
    value = value * _U32(const[0])
    return value ^ (value >> _U32(16))


def _mix(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    result: np.ndarray = _U32(0xCA01F9DD) * x - _U32(0x4973F715) * y
    return result ^ (result >> _U32(16))


def _seed_words(seed: int, epoch: int, ids: np.ndarray) -> np.ndarray:
    """uint32 (N, 8): ``SeedSequence([seed, epoch, id, 0xA06]).generate_state(8, uint32)`` of
    every ``id`` of ``ids`` (each of ``seed``, ``epoch`` and the ids one 32-bit word)."""
    n = len(ids)
    entropy = [np.full(n, seed, _U32), np.full(n, epoch, _U32), ids.astype(_U32), np.full(n, _SALT, _U32)]
    const = [0x43B0D7E5]
    with np.errstate(over="ignore"):
        pool = [_hashmix(word, const) for word in entropy]
        for src in range(4):
            for dst in range(4):
                if src != dst:
                    pool[dst] = _mix(pool[dst], _hashmix(pool[src], const))
        out = np.empty((n, 8), _U32)
        hconst = 0x8B51F9DD
        for k in range(8):
            word = pool[k % 4] ^ _U32(hconst)
            hconst = (hconst * 0x58F38DED) & 0xFFFFFFFF
            word = word * _U32(hconst)
            out[:, k] = word ^ (word >> _U32(16))
    return out


def _pcg_states(words: np.ndarray) -> list[tuple[int, int]]:
    """``(state, inc)`` of the ``PCG64`` seeded by each row of ``words`` (uint32 (N, 8), as
    ``SeedSequence.generate_state`` gives them)."""
    w64 = np.ascontiguousarray(words).view(np.uint64)  # paired as generate_state pairs them
    out = []
    for a, b, c, d in w64.tolist():
        inc = (((c << 64) | d) << 1 | 1) & _MASK128
        state = ((inc + ((a << 64) | b)) * _PCG_MULT + inc) & _MASK128
        out.append((state, inc))
    return out


class BatchRngs:
    """The generators of one batch's samples: ``rngs[k]`` draws exactly what
    ``numpy.random.default_rng(sample_seed(seed, epoch, ids[k]))`` draws.

    Every generator handed out is one and the same ``Generator`` (its ``PCG64`` reset to the
    sample's state by ``rngs[k]``): use each before asking for the next, and keep none.

    Args:
        seed: the loader's seed (an int >= 0).
        epoch: the epoch (an int >= 0).
        ids: the batch's sample ids (ints >= 0).
    """

    def __init__(self, seed: int, epoch: int, ids):
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        self._plain: list | None = None
        if all(0 <= v < 1 << 32 for v in (int(seed), int(epoch))) and (
            len(ids) == 0 or (int(ids.min()) >= 0 and int(ids.max()) < 1 << 32)
        ):
            self._states = _pcg_states(_seed_words(int(seed), int(epoch), ids))
        else:  # several entropy words per value: the plain way
            self._plain = [sample_seed(seed, epoch, int(i)) for i in ids.tolist()]
        self._bits = np.random.PCG64(0)
        self._gen = np.random.Generator(self._bits)
        self._state = self._bits.state

    def __len__(self) -> int:
        return len(self._plain) if self._plain is not None else len(self._states)

    def __getitem__(self, k: int) -> np.random.Generator:
        """Sample ``k``'s generator, at the start of its stream."""
        if self._plain is not None:
            return np.random.default_rng(self._plain[k])
        st = self._state
        st["state"]["state"], st["state"]["inc"] = self._states[k]
        st["has_uint32"], st["uinteger"] = 0, 0
        self._bits.state = st
        return self._gen
