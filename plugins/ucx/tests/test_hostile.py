"""Hostile peers against the ucx backend, speaking UCX directly.

The tag-message target these cases once killed is gone (RMA needs no code at
the target), so the attacks left are the ones a UCX peer can still make:
active messages on kvt's notification id (oversized, flooding, under another
peer's name) and traffic while a victim's transfer is in flight.  The
attacker is a raw ``kvt_ucx._ucp`` worker in another process, not a kvt agent.
"""

from __future__ import annotations

import multiprocessing as mp
import time

import numpy as np
import pytest
from conftest import TIMEOUT
from kvt.types import Descs, Op
from ucx_peer import LOOPBACK_ONLY, NBYTES, pattern, settle

pytestmark = pytest.mark.multiprocess

MAX_NOTIF = 1 << 20  # the backend's notification limit


def _attack(conn, address: bytes, name: str, messages: list[bytes]) -> None:
    """Send ``messages`` as notifications claiming to come from ``name``, then a marker."""
    from kvt_ucx import native

    ucp = native.load()
    w = ucp.Worker(name.encode(), LOOPBACK_ONLY, 64 * MAX_NOTIF, 1 << 16, 1 << 30)
    ep = w.connect(address, False)
    for m in messages:
        ep.notify(m)
    ep.notify(b"marker")
    conn.send(True)
    conn.poll(60)  # stay connected until the victim saw the marker (closing may drop queued sends)
    ep.close()
    w.close()


def _attacker(backend, name: str, messages: list[bytes]):
    from kvt.wire import decode
    from kvt_ucx.backend import UcxMetadata

    address = decode(backend.local_metadata(), UcxMetadata).address
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=_attack, args=(theirs, address, name, messages), daemon=True)
    proc.start()
    assert ours.poll(60), "attacker did not start"
    ours.recv()
    return proc, ours


def _notifs_until_marker(backend, timeout: float = 30.0) -> list[tuple[str, bytes]]:
    got, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        got += [(s, m) for s, msgs in backend.get_notifs().items() for m in msgs]
        if any(m == b"marker" for _, m in got):
            return got
        time.sleep(0.005)
    raise AssertionError(f"the attacker's marker never arrived ({len(got)} notifications)")


def _finish(proc, conn) -> None:
    conn.send(True)
    proc.join(30)
    if proc.is_alive():
        proc.kill()


def _assert_serves(backend, peer, seed: int) -> None:
    """The victim still moves the honest peer's bytes correctly."""
    expect = peer.fill(seed)
    local = np.zeros(NBYTES, np.uint8)
    backend.register(Descs.from_buffers([local]))
    name = backend.add_remote(peer.metadata())
    lp = backend.prep(None, Descs.from_buffers([local]))
    rp = backend.prep(name, Descs.from_regions([peer.main_addr], [NBYTES]))
    h = backend.transfer(Op.READ, lp, None, rp, None)
    assert settle(backend, h, TIMEOUT + 10).done
    assert (local == expect).all()


def test_oversized_notification_is_dropped_and_the_victim_goes_on(backend, peer):
    proc, conn = _attacker(backend, "mallory", [b"x" * (MAX_NOTIF + 1), b"y" * MAX_NOTIF])
    try:
        got = _notifs_until_marker(backend)
    finally:
        _finish(proc, conn)
    assert [len(m) for _, m in got] == [MAX_NOTIF, len(b"marker")]
    _assert_serves(backend, peer, 1)


def test_notification_flood_is_bounded_by_the_queue(make_backend, peer):
    victim = make_backend("victim", notif_queue=32)
    proc, conn = _attacker(victim, "mallory", [b"%d" % i for i in range(2000)])
    try:
        # nobody drains the victim meanwhile: 32 are held, the rest (and the marker) dropped at arrival
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and victim._worker.dropped() < 2001 - 32:
            time.sleep(0.005)
        held = [m for msgs in victim.get_notifs().values() for m in msgs]
    finally:
        _finish(proc, conn)
    assert len(held) == 32
    _assert_serves(victim, peer, 2)


def test_third_party_cannot_complete_or_feed_a_read(backend, peer):
    """UCX completes a READ locally once every get landed: a third party's
    messages, even under the target's name, neither end it nor change its bytes."""
    expect = peer.fill(3)
    local = np.zeros(NBYTES, np.uint8)
    backend.register(Descs.from_buffers([local]))
    name = backend.add_remote(peer.metadata())
    lp = backend.prep(None, Descs.from_buffers([local]))
    rp = backend.prep(name, Descs.from_regions([peer.main_addr], [NBYTES]))
    flood = [b"\x00" * 4096] * 500
    proc, conn = _attacker(backend, name, flood)
    try:
        for _ in range(20):
            h = backend.transfer(Op.READ, lp, None, rp, None)
            assert settle(backend, h, TIMEOUT + 10).done
            backend.release(h)
            assert (local == expect).all()
            local[:] = 0
    finally:
        _finish(proc, conn)


_FORGED_ADDRESS = """
import msgspec
from kvt.errors import WireError
from kvt_ucx import UcxBackend
lo = {"ucx": {"NET_DEVICES": "lo"}}
with UcxBackend("victim", lo) as victim, UcxBackend("peer", lo) as peer:
    md = msgspec.msgpack.decode(peer.local_metadata())
    md["address"] = bytes([md["address"][0] ^ 0x0F]) + md["address"][1:]  # another format version
    try:
        victim.add_remote(msgspec.msgpack.encode(md))
    except WireError as e:
        print("refused:", e)
"""


def test_worker_address_of_another_format_is_refused():
    """UCX asserts (aborts the process) unpacking a worker address of another
    format version; found by tests/security's fuzzing of ucx metadata."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _FORGED_ADDRESS], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "refused:" in proc.stdout, proc.stderr[-2000:]


_FORGED_KEY = """
import sys, msgspec
from kvt.errors import WireError
from kvt_ucx import UcxBackend
import numpy as np
lo = {"ucx": {"NET_DEVICES": "lo"}}
with UcxBackend("victim", lo) as victim, UcxBackend("peer", lo) as peer:
    keep = np.zeros(1 << 16, np.uint8)
    peer.register(keep)
    md = msgspec.msgpack.decode(peer.local_metadata())
    k = md["rkeys"][0]
    md["rkeys"][0] = {"mem_type": k[:8] + b"\\xfe" + k[9:], "truncated": k[:-1], "trailing": k + b"\\x00",
                      "md_map": b"\\x00" * 8 + k[8:]}[sys.argv[1]]
    try:
        victim.add_remote(msgspec.msgpack.encode(md))
    except WireError as e:
        print("refused:", e)
"""


@pytest.mark.parametrize("forgery", ["mem_type", "truncated", "trailing", "md_map"])
def test_remote_key_not_laid_out_as_ucx_packs_one_is_refused(forgery):
    """A key whose memory type is forged sends UCX's protocol selection
    reading out of bounds (a segfault, found by fuzzing); every key must be a
    host-memory key exactly as ucp_rkey_pack lays one out."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _FORGED_KEY, forgery], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "refused:" in proc.stdout, proc.stderr[-2000:]


_DIES_ON_FIRST_REQUEST = "import os, sys; sys.stdout.buffer.write(b'up'); sys.stdout.flush(); sys.stdin.read(1); os.abort()"


def test_metadata_that_kills_the_sandbox_is_refused_and_the_next_check_starts_a_new_one(backend, peer, monkeypatch):
    """Bytes that pass the envelope checks but make UCX crash are tried in the
    sandbox process first.  The double here is a sandbox that always dies."""
    import sys

    from kvt import sandbox
    from kvt.errors import WireError

    monkeypatch.setattr(sandbox, "_children", {})
    monkeypatch.setattr(sandbox, "CHILD", [sys.executable, "-c", _DIES_ON_FIRST_REQUEST])
    with pytest.raises(WireError, match="sandbox"):
        backend.add_remote(peer.metadata())
    monkeypatch.undo()
    monkeypatch.setattr(sandbox, "_children", {})
    assert backend.add_remote(peer.metadata()) == "peer"


def _forged(backend, peer, forgery: str) -> bytes:
    """The peer's metadata, changed the way ``forgery`` says."""
    import msgspec
    from kvt.procs import start_time
    from kvt.wire import decode, encode
    from kvt_ucx.backend import UcxMetadata

    md, ours = decode(peer.metadata(), UcxMetadata), decode(backend.local_metadata(), UcxMetadata)
    rows = np.frombuffer(md.rows, np.uint64).reshape(-1, 3).copy()
    if forgery == "wider rows":  # the peer's unregistered memory past its main buffer
        rows[:, 1] += 1 << 20
        return encode(msgspec.structs.replace(md, rows=rows.tobytes()))
    if forgery == "another process's address":  # the peer's pid and page, our worker: cma would act on us
        return encode(msgspec.structs.replace(md, address=ours.address))
    if forgery == "our own process":  # our pid, page and address with the peer's rows: cma on our own memory
        return encode(msgspec.structs.replace(md, pid=ours.pid, start=start_time(ours.pid), epoch_fd=ours.epoch_fd,
                                              epoch=ours.epoch, address=ours.address))
    if forgery == "no epoch":
        return encode(msgspec.structs.replace(md, epoch_fd=-1))
    raise AssertionError(forgery)


@pytest.mark.parametrize("forgery", ["wider rows", "another process's address", "our own process", "no epoch"])
def test_same_host_metadata_its_owner_does_not_vouch_for_is_refused(backend, peer, forgery):
    """UCX's cma copies whatever rows the metadata names, in whatever process
    its worker address names, asking that process nothing: forged metadata
    handed to us (say through ``kv_transfer_params``) made our READ and
    WRITE act on memory nobody registered, the peer's or our own.  A
    same-host owner vouches for its rows and address on its epoch page;
    anything else is refused before UCX sees it."""
    from kvt.errors import WireError

    with pytest.raises(WireError, match="vouches for|no registration epoch"):
        backend.add_remote(_forged(backend, peer, forgery))
    assert not backend._peers
    _assert_serves(backend, peer, 4)  # the honest metadata loads and moves


def test_metadata_taken_before_the_owner_deregistered_is_refused_and_fresh_metadata_loads(backend, peer):
    """It used to load, and each post was refused (the epoch had moved); now
    add_remote says to fetch it again."""
    from kvt.errors import WireError

    old = peer.metadata()
    peer.withdraw_extra()
    with pytest.raises(WireError, match="fetch it again"):
        backend.add_remote(old)
    _assert_serves(backend, peer, 5)
