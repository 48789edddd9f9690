"""The user's decode and collate in the workers: batches through shared memory (or pickled),
the per-sample rng, the built-in collates, and the errors that name the sample."""

import collections
import pickle

import numpy as np
import pytest
import torch

from stoker import Loader, RunOptions, WorkerError, open_dataset
from stoker import collate as C
from stoker.order import sample_seed


@pytest.fixture(scope="module")
def ds(packed_local):
    return open_dataset(packed_local, cache=False)


def _payload(fields):
    return next(iter(fields.values()))


def head16(fields, rng):
    """Fixed shapes: the first 16 bytes, the length and one rng draw."""
    b = _payload(fields)
    return {"head": np.frombuffer(b[:16], np.uint8).copy(), "n": len(b), "r": rng.random()}


def var_tokens(fields, rng):
    """Variable length: a prefix of 10..59 bytes chosen by the rng."""
    b = _payload(fields)
    return np.frombuffer(b[: 10 + int(rng.integers(0, 50))], np.uint8).astype(np.int32)


def keyed_strings(samples):
    """Not arrays: pickled."""
    return [f"{len(s['head'])}:{int(s['n'])}" for s in samples]


Pair = collections.namedtuple("Pair", "heads keys")


def mixed(samples):
    """Arrays and tensors mixed with strings, numbers, a namedtuple, an OrderedDict and a bfloat16
    tensor (no numpy equal: pickled with the strings)."""
    heads = np.stack([s["head"] for s in samples])
    return {
        "x": Pair(torch.from_numpy(heads), [f"n={int(s['n'])}" for s in samples]),
        "meta": collections.OrderedDict(
            n=np.array([s["n"] for s in samples]), tag="batch", r=[s["r"] for s in samples]
        ),
        "bf": torch.tensor([s["r"] for s in samples], dtype=torch.bfloat16),
        "pair": (np.arange(len(samples), dtype=np.int16), len(samples)),
        "count": np.array(len(samples)),  # 0-d: must not come back with shape (1,)
        "rec": np.array([(s["n"], s["r"]) for s in samples], dtype=[("n", "i8"), ("r", "f8")]),
    }  # fields kept


def _same(a, b) -> bool:
    """Equal values, structure and types (tensors and arrays compared element by element)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def returns_none(fields, rng):
    return None


def raises(fields, rng):
    raise RuntimeError("bad bytes here")


def mismatched(fields, rng):
    return np.zeros(len(_payload(fields)) % 7 + 1, np.float32)


def fails_on_one(fields, rng):
    if len(_payload(fields)) % 5 == 0:
        raise ValueError("not this one")
    return np.zeros(3, np.float32)


def _expected_head16(ds, epoch, sid, seed=0):
    b = ds.read(sid)
    return b[:16], len(b), np.random.default_rng(sample_seed(seed, epoch, sid)).random()


def test_fixed_shape_batches_come_through_shared_memory_without_pickling(ds):
    with Loader(ds, 8, decode=head16, num_workers=2, seed=3) as loader:
        plan = loader.plan(0)
        got = list(loader)
        st = loader.stats
    assert st.exactly_once and st.samples == len(ds)
    assert st.shm_batches == len(got) == -(-len(ds) // 8) and st.pickled_batches == 0
    for b, batch in enumerate(got):
        assert set(batch) == {"head", "n", "r"} and batch["head"].shape[1:] == (16,)
        for j, sid in enumerate(plan[b * 8 : (b + 1) * 8]):
            head, n, r = _expected_head16(ds, 0, int(sid), seed=3)
            assert batch["head"][j].numpy().tobytes() == head and int(batch["n"][j]) == n
            assert float(batch["r"][j]) == pytest.approx(r)  # the rng of (seed, epoch, sample id)


def test_in_process_and_workers_give_the_same_batches(ds):
    outs = []
    for nw in (0, 2):
        with Loader(ds, 8, decode=var_tokens, collate=C.pad(), num_workers=nw, seed=1) as loader:
            outs.append([(p.numpy().tobytes(), n.numpy().tolist()) for p, n in loader])
    assert outs[0] == outs[1]


def test_pad_grows_slots_to_fit_and_reports_lengths(ds):
    with Loader(ds, 10, decode=var_tokens, collate=C.pad(pad_value=-1), num_workers=2, shuffle=False) as loader:
        batches = list(loader)
        assert loader.stats.shm_batches == len(batches)
    widths = {p.shape[1] for p, _ in batches}
    assert len(widths) > 1  # shapes vary from batch to batch
    sid = 0
    for padded, lengths in batches:
        for j in range(len(lengths)):
            want = var_tokens({"": ds.read(sid)}, np.random.default_rng(sample_seed(0, 0, sid)))
            n = int(lengths[j])
            assert padded[j, :n].numpy().tolist() == want.tolist()
            assert (padded[j, n:] == -1).all()
            sid += 1


def test_batches_that_are_not_arrays_are_pickled_and_counted(ds):
    with Loader(ds, 8, decode=head16, collate=keyed_strings, num_workers=2) as loader:
        got = [x for b in loader for x in b]
        st = loader.stats
    assert len(got) == len(ds) and all(isinstance(x, str) for x in got)
    assert st.pickled_batches == -(-len(ds) // 8) and st.shm_batches == 0 and st.pickled_bytes > 0


def test_a_mixed_batch_moves_its_arrays_through_shared_memory_and_keeps_its_types(ds):
    runs = {}
    for nw in (0, 2):
        with Loader(ds, 8, decode=head16, collate=mixed, num_workers=nw, seed=3) as loader:
            runs[nw] = list(loader), loader.stats
    (ref, _), (got, st) = runs[0], runs[2]
    assert len(got) == len(ref) == -(-len(ds) // 8) and all(_same(a, b) for a, b in zip(ref, got, strict=True))
    assert type(got[0]["x"]) is Pair and type(got[0]["meta"]) is collections.OrderedDict
    assert got[0]["bf"].dtype == torch.bfloat16 and got[0]["x"].heads.shape[1:] == (16,)
    assert st.exactly_once and st.shm_batches == len(got) and st.pickled_batches == 0
    # pickled: the strings, numbers, the bfloat16 tensor and two classes, not the 16-byte heads
    whole = sum(len(pickle.dumps(b, protocol=pickle.HIGHEST_PROTOCOL)) for b in got)
    assert 0 < st.pickled_bytes < whole


def test_pack_tokens_delivers_every_token_once_in_rows_of_seq_len(ds):
    L = 64
    with Loader(ds, 7, decode=var_tokens, collate=C.pack_tokens(L, eos_id=999), num_workers=2, seed=2) as loader:
        plan = loader.plan(0)
        rows = list(loader)
        assert loader.stats.exactly_once
    assert all(r["input_ids"].shape[1] == L for r in rows)
    assert all((r["lengths"][:-1] == L).all() for r in rows)
    flat = np.concatenate([r["input_ids"].numpy()[j, : int(n)] for r in rows for j, n in enumerate(r["lengths"])])
    docs = [var_tokens({"": ds.read(int(s))}, np.random.default_rng(sample_seed(2, 0, int(s)))) for s in plan]
    want = np.concatenate([np.append(d, 999) for d in docs])
    assert flat.tolist() == want.tolist()


@pytest.mark.parametrize("fn,match", [(raises, "bad bytes here"), (returns_none, "returned None")])
def test_a_failing_decode_names_the_sample(ds, fn, match):
    with Loader(ds, 8, decode=fn, num_workers=2, shuffle=False) as loader:
        with pytest.raises(WorkerError, match=match) as err:
            next(iter(loader))
    assert repr(ds.key(0)) in str(err.value) and fn.__name__ in str(err.value)


def test_mismatched_shapes_name_the_sample_and_both_shapes(ds):
    with Loader(ds, 16, decode=mismatched, num_workers=0, shuffle=False) as loader:
        with pytest.raises(Exception, match="shape") as err:
            next(iter(loader))
    first = len(ds.read(0)) % 7 + 1
    bad = next(i for i in range(16) if len(ds.read(i)) % 7 + 1 != first)
    assert repr(ds.key(bad)) in str(err.value) and f"({first},)" in str(err.value)


def test_on_error_skip_skips_the_samples_decode_fails_on(ds):
    bad = {i for i in range(len(ds)) if len(ds.read(i)) % 5 == 0}
    assert bad
    with Loader(ds, 8, decode=fails_on_one, num_workers=2, run=RunOptions(on_error="skip")) as loader:
        n = sum(len(b) for b in loader)
        st = loader.stats
    assert n == len(ds) - len(bad) and st.skipped == len(bad)
    assert sorted(st.skipped_keys) == sorted(ds.key(i) for i in bad)


def test_an_unpicklable_function_under_spawn_is_named_at_construction(ds):
    def local_decode(fields, rng):
        return 1

    with pytest.raises(TypeError, match="local_decode.*does not pickle"):
        Loader(ds, 8, decode=local_decode, num_workers=2, run=RunOptions(start_method="spawn"))
    with pytest.raises(TypeError, match="collate=.*<lambda>"):
        Loader(ds, 8, decode=head16, collate=lambda s: s, num_workers=1, run=RunOptions(start_method="forkserver"))
    Loader(ds, 8, decode=local_decode, num_workers=2, run=RunOptions(start_method="fork")).close()  # fork sends nothing


def test_default_collate_checks_shapes_before_stacking():
    out = C.default([{"a": np.zeros((2, 3)), "b": 1}, {"a": np.ones((2, 3)), "b": 2}])
    assert tuple(out["a"].shape) == (2, 2, 3) and out["b"].tolist() == [1, 2]
    with pytest.raises(C.CollateError, match=r"sample 2 of the batch.*\(4,\)") as err:
        C.default([np.zeros(3), np.zeros(3), np.zeros(4)])
    assert err.value.index == 2


def test_pack_tokens_cut_carries_the_remainder():
    pk = C.pack_tokens(4, eos_id=0, pad_id=-1)
    b = pk([np.array([1, 2, 3]), np.array([4, 5])])
    assert b["tokens"].tolist() == [1, 2, 3, 0, 4, 5, 0]
    rows, carry = pk.cut(None, b, last=False)
    assert rows["input_ids"].tolist() == [[1, 2, 3, 0]] and carry.tolist() == [4, 5, 0]
    rows, carry = pk.cut(carry, pk([np.array([6])]), last=True)
    assert rows["input_ids"].tolist() == [[4, 5, 0, 6], [0, -1, -1, -1]] and rows["lengths"].tolist() == [4, 1]
    assert len(carry) == 0


def test_the_carry_is_saved_and_only_another_pack_tokens_refuses_it(ds):
    with Loader(ds, 7, decode=var_tokens, collate=C.pack_tokens(64, eos_id=999), num_workers=0) as loader:
        it = iter(loader)
        next(it)
        state = loader.state_dict()
    assert state["carry"]["tokens"] and state["carry_from"].startswith("pack_tokens(seq_len=64")
    other = Loader(ds, 7, decode=var_tokens, collate=C.pack_tokens(32, eos_id=999), num_workers=0)
    with pytest.raises(ValueError, match="carry_from"):
        other.load_state_dict(state)
    same = Loader(ds, 7, decode=var_tokens, collate=C.pack_tokens(64, eos_id=999), num_workers=0)
    same.load_state_dict(state)
    assert same.state.carry.tolist() == state["carry"]["tokens"]


def test_a_batch_that_shared_memory_cannot_hold_is_pickled_instead(monkeypatch, tmp_path):
    import errno
    import os

    from stoker.loader.workers import batches

    slot = tmp_path / "slot"
    slot.write_bytes(bytes(4096))
    writer = batches.SlotWriter()
    small = batches.pack_reply(writer, str(slot), {"x": np.arange(100, dtype=np.int64)})
    assert small[0] == "shm" and small[3] == 4096  # fits: no growth
    real = os.posix_fallocate

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(batches.os, "posix_fallocate", full)
    big = batches.pack_reply(writer, str(slot), {"x": np.arange(10_000, dtype=np.int64)})
    assert big[0] == "pickle"  # a full /dev/shm: no SIGBUS, the batch still arrives
    monkeypatch.setattr(batches.os, "posix_fallocate", real)
    grown = batches.pack_reply(writer, str(slot), {"x": np.arange(10_000, dtype=np.int64)})
    assert grown[0] == "shm" and grown[3] >= 80_000 and slot.stat().st_size == grown[3]
    buf = np.fromfile(slot, dtype=np.uint8)
    assert batches.rebuild(grown[1], grown[2], buf)["x"].tolist() == list(range(10_000))
    writer.close()


def test_module_level_functions_work_under_spawn(ds):
    with Loader(
        ds, 16, decode=var_tokens, collate=C.pad(), num_workers=1, seed=5, run=RunOptions(start_method="spawn")
    ) as loader:
        got = [(p.numpy().tobytes(), n.tolist()) for p, n in loader]
        assert loader.start_method == "spawn" and loader.stats.exactly_once
    with Loader(ds, 16, decode=var_tokens, collate=C.pad(), num_workers=0, seed=5) as loader:
        assert got == [(p.numpy().tobytes(), n.tolist()) for p, n in loader]
