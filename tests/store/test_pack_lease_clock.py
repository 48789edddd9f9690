"""The pack lease judges an owner's liveness by change, not by comparing clocks: a second packer
whose clock runs an hour ahead (or behind) is refused while the first renews, and still takes over
a frozen first packer after the lease time; on local files and on S3 (moto on 127.0.0.1).

The second packer is a separate process whose ``time.time()`` is moved before stoker is imported:
a packer on a host whose clock disagrees with the first's."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from _helpers import make_image_folder
from stoker.errors import PackLeaseError, PackLeaseLostError
from stoker.storage import Origin
from stoker.store.dataset import open_dataset
from stoker.store.index import INDEX_NAME
from stoker.store.lease import LEASE_NAME, PackLease

LEASE_S = 3.0  # the first packer renews every second; a watch lasts 3 s

SKEWED_PACK = """
import json, sys, time
real = time.time
time.time = lambda: real() + float(sys.argv[1])  # this host's clock, an hour off
from stoker.errors import PackLeaseError
from stoker.store.pack import pack
from stoker.store.pack_options import PackOptions
src, dst, opts = sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
try:
    r = pack(src, dst, progress=False, options=PackOptions(dst_storage_options=opts or None, lease_s=3.0))
    print(json.dumps({"samples": r.samples}))
except PackLeaseError as e:
    print(json.dumps({"refused": str(e)}))
"""


def _skewed_pack(src, dst: str, opts: dict, skew_s: float) -> dict:
    """``pack(src, dst)`` in a process whose clock runs ``skew_s`` seconds off: its result
    (``samples``) or its refusal's message (``refused``)."""
    r = subprocess.run(
        [sys.executable, "-c", SKEWED_PACK, str(skew_s), str(src), dst, json.dumps(opts)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    return {**json.loads(r.stdout.strip().splitlines()[-1]), "log": r.stderr}


@pytest.fixture(params=["local", "s3"])
def destination(request, tmp_path):
    """(destination URL, its storage options) on local files or on the emulated S3 origin."""
    if request.param == "local":
        return str(tmp_path / "dst"), {}
    s3 = request.getfixturevalue("s3_origin")
    return s3.url(f"lease-clock/{tmp_path.name}"), s3.storage_options(throttled=False)


def _tree(root):
    return make_image_folder(root, {f"c{i % 2}/img{i}.jpg": b"b" * (500 + i) for i in range(6)})


@pytest.mark.parametrize("skew_s", [3600.0, -3600.0], ids=["ahead", "behind"])
def test_a_packer_with_a_skewed_clock_is_refused_while_the_owner_renews(destination, tmp_path, skew_s):
    """The first packer renews every second; the second, its clock an hour off, finds the claim
    run out (or renewed an hour in the future) by its own clock, watches it change, and is
    refused with PackLeaseError, not a take-over. (Comparing clocks, a packer an hour ahead took
    the live pack over.)"""
    dst, opts = destination
    with PackLease(Origin(dst, opts), ttl_s=LEASE_S) as owner:
        out = _skewed_pack(_tree(tmp_path / "B"), dst, opts, skew_s)
        owner.check()  # still its own
        owner.renew()
    assert "refused" in out, out
    text = out["refused"]
    assert text.startswith(f"{dst}: another pack is writing this destination") and owner.run in text, text
    assert "It is alive: it renewed its claim while this pack watched it" in text, text
    assert "clocks disagree by about 60 min" in text, text
    assert not Origin(dst, opts).exists(LEASE_NAME)  # released by its owner, untouched by the other
    assert not Origin(dst, opts).exists(INDEX_NAME)


@pytest.mark.parametrize("skew_s", [3600.0, -3600.0], ids=["ahead", "behind"])
def test_a_frozen_owner_is_still_taken_over_after_the_lease_time(destination, tmp_path, skew_s):
    """The first packer took the lease and stopped renewing (frozen): the second, its clock an hour
    off, sees the claim unchanged for the lease time on its own monotonic clock and takes it over;
    its pack completes, and the first finds its claim lost."""
    dst, opts = destination
    frozen = PackLease(Origin(dst, opts), ttl_s=LEASE_S)
    frozen.acquire()  # never renewed: a packer that froze
    out = _skewed_pack(_tree(tmp_path / "B"), dst, opts, skew_s)
    assert out["samples"] == 6, out
    # it watched the claim for the lease time before it took it over
    assert f"watching it for up to {LEASE_S:g} s" in out["log"], out["log"]
    assert "taking over from a pack that died while writing it (host" in out["log"], out["log"]
    assert f"its claim did not change for {LEASE_S:g} s, watched on this host's clock" in out["log"], out["log"]
    with pytest.raises(PackLeaseLostError) as err:
        frozen.renew()
    text = str(err.value)  # the other pack took it over, finished and released it
    assert "its claim was removed by another run" in text and "without installing an index" in text, text
    assert len(open_dataset(dst, storage_options=opts, cache=False)) == 6
    frozen.release()  # not its lease any more: leaves it alone (the other pack released its own)
    assert not Origin(dst, opts).exists(LEASE_NAME)


def test_a_lease_whose_times_agree_with_this_clock_refuses_at_once(tmp_path, caplog):
    """Clocks that agree: a fresh claim is refused without watching it (no wait for a renewal)."""
    dest = Origin(str(tmp_path / "dst"))
    with PackLease(dest, ttl_s=600) as owner:
        with pytest.raises(PackLeaseError, match=owner.run) as err:
            PackLease(dest, ttl_s=600).acquire()
    assert "If that pack died, it stops blocking by itself at" in str(err.value)
    assert "watching it" not in caplog.text
