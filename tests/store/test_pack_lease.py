"""One pack at a time per destination: the pack lease, on local files and on S3 (moto)."""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
import threading
import time

import pytest

from _helpers import make_image_folder
from stoker.storage import Origin

pack_mod = importlib.import_module("stoker.store.pack")
manifests = importlib.import_module("stoker.store.manifests")
from stoker.store.dataset import open_dataset
from stoker.store.index import INDEX_NAME
from stoker.store.lease import LEASE_NAME, PackLease, PackLeaseError, PackLeaseLostError
from stoker.store.pack_options import PackOptions


def _tree(root, tag: bytes, n: int = 6):
    return make_image_folder(root, {f"c{i % 2}/img{i}.jpg": tag * (500 + i) for i in range(n)})


def _paused_pack(monkeypatch, src, dst, **kw):
    """Start pack(src, dst) in a thread that stops before its first shard write; returns
    (thread, result dict, event that lets it go on)."""
    go, at_write = threading.Event(), threading.Event()
    real = manifests.write_shard

    def slow_write(*a, **k):
        at_write.set()
        assert go.wait(30)
        return real(*a, **k)

    monkeypatch.setattr(manifests, "write_shard", slow_write)
    out: dict = {}

    def run():
        try:
            out["result"] = pack_mod.pack(str(src), str(dst), progress=False, shard_bytes=1024, **kw)
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            out["error"] = exc

    t = threading.Thread(target=run)
    t.start()
    assert at_write.wait(30)
    return t, out, go


def _says_what_a_user_needs(text: str, dst: str) -> None:
    """A refusal names the destination, who packs it and since when, and how a dead pack's
    claim clears; never the lease object's internal name."""
    assert LEASE_NAME not in text and "_stoker" not in text, text
    assert text.startswith(f"{dst}: another pack is writing this destination (host "), text
    assert re.search(r"pid \d+, run [0-9a-f]{32}\), since \d{4}-\d\d-\d\dT[\d:]+Z \(\d+ s ago\)", text), text
    assert re.search(r"If that pack died, it stops blocking by itself at \S+Z \(in \d+ s", text), text


def test_second_pack_into_a_destination_being_packed_refuses_naming_the_first(tmp_path, monkeypatch):
    a, b = _tree(tmp_path / "A", b"a"), _tree(tmp_path / "B", b"b")
    dst = tmp_path / "dst"
    t, out, go = _paused_pack(monkeypatch, a, dst)
    try:
        with pytest.raises(PackLeaseError) as err:
            pack_mod.pack(str(b), str(dst), progress=False, shard_bytes=1024)
    finally:
        go.set()
        t.join(60)
    assert "error" not in out, out
    _says_what_a_user_needs(str(err.value), str(dst))
    assert isinstance(err.value, FileExistsError) and err.value.url == str(dst)
    ds = open_dataset(str(dst), cache=False)
    assert all(ds[i][0].startswith(b"aaaa") for i in range(len(ds)))  # every sample is A's
    assert not (dst / LEASE_NAME).exists()  # released


def test_pack_that_lost_its_lease_installs_no_index(tmp_path, monkeypatch):
    a = _tree(tmp_path / "A", b"a")
    dst = tmp_path / "dst"
    t, out, go = _paused_pack(monkeypatch, a, dst)
    try:
        # another run takes the destination over (as if the first had been frozen past its expiry)
        monkeypatch.setattr(PackLease, "_judge", lambda self, owner, token: ("gone", owner, token))
        other = PackLease(Origin(str(dst)))
        other.acquire()
    finally:
        go.set()
        t.join(60)
    assert isinstance(out.get("error"), PackLeaseLostError), out
    text = str(out["error"])
    assert text.startswith(f"{dst}: this pack lost its claim on the destination (taken over by the pack on host ")
    assert f"pid {os.getpid()}, run {other.run}" in text and "without installing an index" in text
    assert LEASE_NAME not in text, text
    assert not (dst / INDEX_NAME).exists()
    other.release()
    assert not (dst / LEASE_NAME).exists()


def test_racing_acquirers_exactly_one_wins(tmp_path):
    dest = Origin(str(tmp_path / "dst"))
    barrier = threading.Barrier(8)
    won, refused = [], []

    def race():
        lease = PackLease(dest)
        barrier.wait()
        try:
            lease.acquire()
            won.append(lease)
        except PackLeaseError:
            refused.append(lease)

    threads = [threading.Thread(target=race) for _ in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    assert len(won) == 1 and len(refused) == 7
    won[0].release()


def test_expired_lease_is_taken_over(tmp_path, caplog):
    src, dst = _tree(tmp_path / "A", b"a"), tmp_path / "dst"
    crashed = PackLease(Origin(str(dst)), ttl_s=0.05)
    crashed.acquire()  # never released nor renewed: a packer that stopped
    time.sleep(0.1)
    r = pack_mod.pack(str(src), str(dst), progress=False)
    assert r.samples == 6
    assert "taking over from a pack that died" in caplog.text
    with pytest.raises(PackLeaseLostError):
        crashed.renew()


def test_lease_of_a_dead_process_on_this_host_is_taken_over_at_once(tmp_path):
    src, dst = _tree(tmp_path / "A", b"a"), tmp_path / "dst"
    code = (
        "import os, sys; from stoker.storage import Origin; from stoker.store.lease import PackLease; "
        "PackLease(Origin(sys.argv[1]), ttl_s=3600).acquire(); os._exit(0)"
    )
    subprocess.run([sys.executable, "-c", code, str(dst)], check=True, timeout=60)
    assert (dst / LEASE_NAME).exists()
    assert pack_mod.pack(str(src), str(dst), progress=False).samples == 6


def test_lease_on_s3_is_conditional(s3_origin, tmp_path, monkeypatch):
    opts = s3_origin.storage_options()
    dest = Origin(s3_origin.url("lease/dst"), opts)
    first = PackLease(dest)
    first.acquire()
    with pytest.raises(PackLeaseError, match=first.run):
        PackLease(dest).acquire()
    with pytest.raises(FileExistsError) as err:
        pack_mod.pack(
            str(_tree(tmp_path / "A", b"a")), s3_origin.url("lease/dst"), options=PackOptions(dst_storage_options=opts)
        )
    _says_what_a_user_needs(str(err.value), s3_origin.url("lease/dst"))
    first.renew()
    monkeypatch.setattr(PackLease, "_judge", lambda self, owner, token: ("gone", owner, token))  # as if it had died
    second = PackLease(dest)
    second.acquire()  # took the expired lease over with If-Match on its ETag
    with pytest.raises(PackLeaseLostError):
        first.renew()
    first.release()  # not its lease any more: leaves it alone
    assert dest.exists(LEASE_NAME)
    second.release()
    assert not dest.exists(LEASE_NAME)


def test_a_failed_claim_on_s3_names_the_destination(s3_origin, tmp_path):
    """A destination the pack cannot write (here: its bucket does not exist): the error names the
    destination, not the lease object."""
    from stoker import OriginNotFoundError

    dst = "s3://no-such-bucket/lease/dst"
    with pytest.raises(OriginNotFoundError) as err:
        pack_mod.pack(
            str(_tree(tmp_path / "A", b"a")), dst, options=PackOptions(dst_storage_options=s3_origin.storage_options())
        )
    text = str(err.value)
    assert err.value.url == f"{dst} (marking it as being packed)" and "'no-such-bucket' does not exist" in text, text
    assert LEASE_NAME not in text, text
