"""Bad input gets a typed kvt error before any byte moves, and leaves the
backend (and the peer's memory) as it was."""

from __future__ import annotations

from pathlib import Path

import msgspec
import numpy as np
import pytest
from kvt.errors import (ClosedError, IncompatiblePeer, InvalidArgument, InvalidDescriptor, InvalidHandle, UnknownPeer,
                        VersionMismatch, WireError)
from kvt.types import Descs, Op
from kvt.wire import AgentInfo, encode
from kvt_nixl.metadata import NixlMetadata
from peerproc import BLOCK, NUM_BLOCKS, load, pattern, settle


@pytest.fixture
def ready(make_backend, peer, local_buf):
    b = make_backend()
    b.register(Descs.from_buffers([local_buf]))
    name = load(b, peer)
    lp = b.prep(None, Descs.from_blocks(local_buf.ctypes.data, BLOCK, range(NUM_BLOCKS)))
    rp = b.prep(name, peer.blocks(range(NUM_BLOCKS)))
    yield b, peer, name, lp, rp
    np.testing.assert_array_equal(peer.contents(), pattern(), "a refused call moved bytes to the peer")


def test_local_descriptors_outside_registered_memory(ready):
    b, *_ = ready
    other = np.zeros(4 * BLOCK, np.uint8)
    with pytest.raises(InvalidDescriptor, match="outside registered DRAM memory"):
        b.prep(None, Descs.from_blocks(other.ctypes.data, BLOCK, range(4)))


def test_remote_descriptors_outside_what_the_peer_advertised(ready):
    b, peer, name, *_ = ready
    with pytest.raises(InvalidDescriptor, match=f"descriptors of peer '{name}'"):
        b.prep(name, peer.blocks([NUM_BLOCKS - 1, NUM_BLOCKS]))  # the second runs past its buffer
    with pytest.raises(InvalidDescriptor):
        b.prep(name, Descs.from_regions(peer.addr + 1, NUM_BLOCKS * BLOCK))  # one byte too far


@pytest.mark.parametrize("bad", [np.array([NUM_BLOCKS], np.int32), np.array([-1], np.int32),
                                 np.array([2**32], np.int64), np.array([-1]), [0.5]],
                         ids=["int32-past-end", "int32-negative", "int64-wraps-to-0", "negative", "float"])
def test_indices_out_of_range_or_not_integers(ready, bad):
    """int32 goes straight to NIXL (which checks it); anything else is checked
    by kvt first, so 2**32 cannot wrap around to block 0."""
    b, peer, name, lp, rp = ready
    with pytest.raises(InvalidArgument, match="remote_idx"):
        b.transfer(Op.WRITE, lp, np.array([0], np.int32), rp, bad)


def test_paired_lengths_and_counts_must_match(ready, local_buf):
    b, peer, name, lp, rp = ready
    half = b.prep(None, Descs.from_blocks(local_buf.ctypes.data, BLOCK // 2, range(4)))
    with pytest.raises(InvalidArgument, match="differ in length"):
        b.transfer(Op.WRITE, half, np.array([0], np.int32), rp, np.array([0], np.int32))
    with pytest.raises(InvalidArgument, match="paired one to one"):
        b.transfer(Op.WRITE, lp, [0, 1], rp, [0])


def test_local_side_must_be_our_own_list(ready):
    b, peer, name, lp, rp = ready
    with pytest.raises(InvalidArgument, match="local_prep"):
        b.transfer(Op.WRITE, rp, [0], rp, [1])


def test_empty_notification_on_a_transfer(ready):
    b, peer, name, lp, rp = ready
    with pytest.raises(InvalidArgument, match="empty notification"):
        b.transfer(Op.WRITE, lp, [0], rp, [0], notif=b"")


def test_unknown_peer(ready, local_buf):
    b, *_ = ready
    with pytest.raises(UnknownPeer, match="'nobody'"):
        b.prep("nobody", Descs.from_blocks(local_buf.ctypes.data, BLOCK, [0]))
    with pytest.raises(UnknownPeer):
        b.notify("nobody", b"x")
    with pytest.raises(UnknownPeer):
        b.remove_remote("nobody")


def test_released_and_unknown_handles(ready):
    b, peer, name, lp, rp = ready
    h = b.transfer(Op.READ, lp, [0], rp, [0])
    assert settle(b, h).done
    b.release(h)
    for call in (lambda: b.release(h), lambda: b.check_state(h), lambda: b.release(12345)):
        with pytest.raises(InvalidHandle):
            call()
    b.release(rp)
    with pytest.raises(InvalidHandle):
        b.transfer(Op.READ, lp, [0], rp, [0])
    reg = b.register(Descs.from_regions(peer.addr, 0))  # an empty region is fine
    b.deregister(reg)
    with pytest.raises(InvalidHandle):
        b.deregister(reg)


def test_deregistered_memory_invalidates_old_preps(make_backend):
    b = make_backend()
    buf = np.zeros(8 * BLOCK, np.uint8)
    reg = b.register(Descs.from_buffers([buf]))
    p = b.prep(None, Descs.from_blocks(buf.ctypes.data, BLOCK, range(8)))
    b.deregister(reg)
    with pytest.raises(InvalidDescriptor):
        b.transfer(Op.WRITE, p, [0], p, [1])
    b.register(Descs.from_buffers([buf]))  # registered again: the same list works again
    assert settle(b, b.transfer(Op.WRITE, p, [0], p, [1])).done


def _bad_metadata(good: bytes, name: str) -> dict[str, bytes]:
    from kvt.wire import decode
    md = decode(good, NixlMetadata)
    return {
        "garbage": b"\x00garbage",
        "truncated": good[: len(good) // 2],
        "another-message": encode(AgentInfo(name="x", backend="nixl", metadata=b"")),
        "nixl-blob-corrupt": encode(NixlMetadata(name=md.name, nixl=md.nixl[:40], regions=md.regions)),
        "name-mismatch": encode(NixlMetadata(name="impostor", nixl=md.nixl, regions=md.regions)),
        "region-table": encode(NixlMetadata(name=md.name, nixl=md.nixl, regions={"DRAM": b"12345"})),
        "memory-kind": encode(NixlMetadata(name=md.name, nixl=md.nixl, regions={"FLOPPY": b""})),
    }


def test_malformed_metadata_is_a_wire_error(make_backend, peer):
    b, other = make_backend(), make_backend()
    for case, data in _bad_metadata(other.local_metadata(), other.agent_name).items():
        with pytest.raises(WireError):
            b.add_remote(data)
            pytest.fail(f"{case}: accepted")
    with pytest.raises(VersionMismatch):
        b.add_remote(encode(NixlMetadata(name="x", nixl=b"", regions={}, v=99)))
    with pytest.raises(InvalidArgument, match="own"):
        b.add_remote(b.local_metadata())
    assert load(b, peer)  # and good metadata still loads afterwards


def test_connection_records_reach_nixl_padded_with_zeros(make_backend):
    """UCX parses a worker address without its length: each connection record
    goes to NIXL with ADDRESS_PAD zero bytes after it, so a truncated address
    reads zeros, not whatever follows it in memory (and the sandbox sees the
    same bytes as the agent).  The padding is bounded: a blob may carry at
    most 16 connection records."""
    from kvt.wire import decode
    from kvt_nixl.metadata import ADDRESS_PAD, _blob, _records, unpack

    data = make_backend().local_metadata()
    raw = decode(data, NixlMetadata)
    records = _records(raw.nixl, raw.name)
    address = dict(records)[b"c"]
    md, _, _ = unpack(data)
    padded = dict(_records(md.nixl, md.name))[b"c"]
    assert ADDRESS_PAD >= 4096 and padded == address + bytes(ADDRESS_PAD)
    assert [r for r in _records(md.nixl, md.name) if r[0] != b"c"] == [r for r in records if r[0] != b"c"]
    conns = records.index((b"", b"MemSection"))
    many = _blob(records[:1] + [(b"Conns", (17).to_bytes(8, "little"))] + records[2:conns] * 17 + records[conns:])
    with pytest.raises(WireError, match="Conns promises 17 entries"):
        unpack(encode(msgspec.structs.replace(raw, nixl=many)))


def _rec(tag: bytes, value: bytes) -> bytes:
    return tag + len(value).to_bytes(8, "little") + value + b"|"


def test_records_nixl_reads_are_the_records_kvt_checks(make_backend):
    """kvt used to guess each record's tag from the bytes (the longest run of
    letters that fit); NIXL reads the tag it expects next.  A connection
    record whose length's low byte is a letter then read, to kvt, as a short
    record and one swallowing the rest, so the memory section NIXL loads
    after it, with a forged UCX key, went unchecked (NIXL then crashed on it).
    Now kvt reads in NIXL's order and refuses anything else."""
    from kvt.wire import decode
    from kvt_nixl.metadata import _HEADER, _records, check_nixl_blob

    b, buf = make_backend(), np.zeros(1 << 16, np.uint8)
    b.register(Descs.from_buffers([buf]))
    raw = decode(b.local_metadata(), NixlMetadata)
    records = _records(raw.nixl, raw.name)
    forged = (Path(__file__).parents[3] / "tests/security/regressions/nixl_rkey-1-0.bin").read_bytes()
    tail = b"".join(_rec(t, v) for t, v in records[records.index((b"", b"MemSection")):-1])
    section = tail + _rec(b"", records[-1][1][:24] + forged)
    head = _HEADER + _rec(b"Agent", raw.name.encode()) + _rec(b"Conns", (2).to_bytes(8, "little")) + \
        b"".join(_rec(t, v) for t, v in records[2:4]) + _rec(b"t", b"ZZZ")
    length = 199 * 256 + ord("A")  # read as tag "cA" and a 199-byte value by the old guess
    value = bytearray(length)
    value[200] = ord("|")
    total = len(head) + 9 + length + 1 + len(section)
    value[201:210] = b"x" + (total - 1 - (len(head) + 9 + 201 + 9)).to_bytes(8, "little")  # swallows the rest
    hidden = head + b"c" + length.to_bytes(8, "little") + bytes(value) + b"|" + section
    with pytest.raises(WireError, match="remote key is not a host-memory key"):
        check_nixl_blob(hidden, raw.name)
    honest = _HEADER + b"".join(_rec(t, v) for t, v in records)
    check_nixl_blob(honest, raw.name)
    for bad in (honest + b"x", honest.replace(b"nixlSecElms", b"nixlSecElmz"), honest.replace(b"Conns", b"Connz")):
        with pytest.raises(WireError):
            check_nixl_blob(bad, raw.name)


def test_peer_without_a_transport_in_common_is_incompatible(make_backend):
    """Metadata that decodes but names no UCX transport we can reach."""
    narrow = {"ucx_env": {"UCX_TLS": "cma,self"}, "backend_params": {"UCX": {"ucx_error_handling_mode": "none"}}}
    a, b = make_backend(**narrow), make_backend(**narrow)
    with pytest.raises(IncompatiblePeer, match="NIXL_ERR_BACKEND"):
        a.add_remote(b.local_metadata())
    with pytest.raises(UnknownPeer):
        a.notify(b.agent_name, b"x")


def test_every_verb_after_close(make_backend, local_buf):
    b = make_backend()
    reg = b.register(Descs.from_buffers([local_buf]))
    p = b.prep(None, Descs.from_blocks(local_buf.ctypes.data, BLOCK, [0, 1]))
    b.close()
    b.close()  # idempotent
    calls = [lambda: b.register(Descs.from_buffers([local_buf])), lambda: b.deregister(reg),
             lambda: b.prep(None, Descs.from_regions(local_buf.ctypes.data, BLOCK)),
             lambda: b.transfer(Op.READ, p, [0], p, [1]), lambda: b.check_state(1), lambda: b.release(p),
             b.local_metadata, lambda: b.add_remote(b""), lambda: b.remove_remote("x"),
             lambda: b.notify("x", b"m"), b.get_notifs]
    for call in calls:
        with pytest.raises(ClosedError):
            call()


# A peer's NIXL blob with records rewritten, loaded by a victim in a child (a crash must not
# take the test run with it).
#  keys: its first UCX remote key (memory section, first descriptor); before kvt vetted the
#        keys, memory type 46 segfaulted add_remote_agent.
#  addresses: its connection record (the UCX worker address); the fuzzed addresses kept under
#        tests/security/regressions segfault add_remote_agent every time.
_FORGED = r"""
import sys
from pathlib import Path
import numpy as np
from kvt.errors import KvtError
from kvt.wire import decode, encode
from kvt_nixl.backend import NixlBackend
from kvt_nixl.metadata import NixlMetadata, _blob, _records

# every interface, as when these blobs were found (on loopback alone some fail to connect before they crash)
options = {"timeout": 2, "ucx_env": {"UCX_NET_DEVICES": "all"}}
peer, victim = NixlBackend("forger", options), NixlBackend("victim", options)
buf = np.zeros(1 << 16, np.uint8)
peer.register(buf)
md = decode(peer.local_metadata(), NixlMetadata)
records = _records(md.nixl, md.name)
d = next(i for i, (t, v) in enumerate(records) if t == b"" and len(v) > 24)
c = next(i for i, (t, v) in enumerate(records) if t == b"c")
head, key, address = records[d][1][:24], records[d][1][24:], records[c][1]
if sys.argv[1] == "keys":
    cases = {"original": {}, "memory type 46": {d: head + key[:8] + b"\x2e" + key[9:]},
             "memory type cuda": {d: head + key[:8] + b"\x01" + key[9:]}, "truncated": {d: head + key[:5]},
             "trailing byte": {d: head + key + b"\x01"}, "md record overruns": {d: head + key[:9] + b"\xc8" + key[10:]},
             "VRAM section": {d - 2: b"\x01\x00\x00\x00"}}  # d - 2: the list's memory type record
else:
    cases = {"original": {}, "truncated": {c: address[:40]}}
    cases.update({p.name: {c: p.read_bytes()} for p in sorted(Path(sys.argv[2]).glob("nixl_address-*.bin"))})
for case, changes in cases.items():
    blob = _blob([(t, changes.get(i, v)) for i, (t, v) in enumerate(records)])
    try:
        # as from another host: on this one the owner's epoch page vouches for its blob's connection records,
        # and forged ones are refused before NIXL (or the sandbox) could show what they do
        name = victim.add_remote(encode(NixlMetadata(name=md.name, nixl=blob, regions=md.regions, host_id="elsewhere")))
        victim.remove_remote(name)
        print("case", case, "loaded", flush=True)
    except KvtError as e:
        print("case", case, type(e).__name__, flush=True)
"""
_REGRESSIONS = Path(__file__).parents[3] / "tests" / "security" / "regressions"


def _forged(what: str) -> dict[str, str]:
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _FORGED, what, str(_REGRESSIONS)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, f"the victim died (exit {proc.returncode}): {proc.stderr[-2000:]}"
    # UCX logs to stdout too
    return dict(line[5:].rsplit(" ", 1) for line in proc.stdout.splitlines() if line.startswith("case "))


def test_forged_ucx_remote_keys_in_the_nixl_blob_are_wire_errors_not_crashes():
    assert _forged("keys") == {"original": "loaded", "memory type 46": "WireError", "memory type cuda": "WireError",
                               "truncated": "WireError", "trailing byte": "WireError",
                               "md record overruns": "WireError", "VRAM section": "WireError"}


def test_ucx_addresses_that_crash_nixl_are_refused_by_the_sandbox_not_loaded():
    """The fuzzed addresses under tests/security/regressions pass every
    envelope check and segfault ``add_remote_agent``; the sandbox loads them
    first and dies instead.  A truncated address is read with zeros after it
    (kvt pads connection records), so it is refused the same way every time."""
    seen = _forged("addresses")
    assert seen.pop("original") == "loaded" and seen.pop("truncated") in ("IncompatiblePeer", "WireError")
    assert seen == {"nixl_address-2-883.bin": "WireError", "nixl_address-3-513.bin": "WireError"}


def test_notifications_over_the_declared_size_from_a_raw_nixl_peer_are_dropped(make_backend):
    """NIXL delivers a message of any size from any agent that loaded our
    metadata; kvt peers cannot send more than max_notif_bytes, and nothing
    longer reaches the engine."""
    import time

    from kvt.wire import decode
    from kvt_nixl import native

    victim = make_backend()
    limit = victim.capabilities.max_notif_bytes
    raw = native.new_agent("raw-sender", ["UCX"], {}, 0, True, {})
    raw.add_remote_agent(decode(victim.local_metadata(), NixlMetadata).nixl)
    for n in (1, limit + 1, limit, 8 * limit):
        raw.send_notif(victim.agent_name, bytes([n % 251]) * n)
    got, deadline = [], time.monotonic() + 20
    while len(got) < 2 and time.monotonic() < deadline:
        got += victim.get_notifs().get("raw-sender", [])
        time.sleep(0.01)
    time.sleep(0.5)  # and nothing after them
    got += victim.get_notifs().get("raw-sender", [])
    assert [len(m) for m in got] == [1, limit]


@pytest.mark.parametrize("forgery", ["wider regions", "our own process", "another process's address", "no epoch"])
def test_same_host_metadata_its_owner_does_not_vouch_for_is_refused(make_backend, peer, local_buf, forgery):
    """UCX's cma copies whatever rows a remote descriptor names, in whatever
    process the blob's worker address names, asking that process nothing;
    kvt checks descriptors against the regions the metadata lists.  Forged
    metadata of a same-host owner (regions widened, or its pid paired with
    another process's addresses) made our READ and WRITE act on memory
    nobody registered.  The owner vouches for its regions and connection
    records on its epoch page; anything else is refused before NIXL sees it."""
    from kvt.handshake import request
    from kvt.procs import start_time
    from kvt.wire import decode
    from kvt_nixl.metadata import _blob, _records

    b = make_backend()
    b.register(Descs.from_buffers([local_buf]))
    md, ours = decode(request(peer.endpoint, b"metadata", 10.0), NixlMetadata), decode(b.local_metadata(), NixlMetadata)
    if forgery == "wider regions":  # the peer's unregistered memory past its buffer
        rows = np.frombuffer(md.regions["DRAM"], np.uint64).reshape(-1, 3).copy()
        rows[:, 1] += 1 << 20
        forged = msgspec.structs.replace(md, regions={"DRAM": rows.tobytes()})
    elif forgery == "our own process":  # our pid and page: the peer's regions would be looked up in us
        forged = msgspec.structs.replace(md, pid=ours.pid, start_time=start_time(ours.pid), epoch_fd=ours.epoch_fd,
                                         epoch=ours.epoch)
    elif forgery == "another process's address":  # the peer's pid and page, our worker's address
        mine = dict(_records(ours.nixl, ours.name))[b"c"]
        forged = msgspec.structs.replace(md, nixl=_blob([(t, mine if t == b"c" else v)
                                                         for t, v in _records(md.nixl, md.name)]))
    else:
        forged = msgspec.structs.replace(md, epoch_fd=-1)
    with pytest.raises(WireError, match="vouches for|no registration epoch"):
        b.add_remote(encode(forged))
    assert not b._peers
    assert load(b, peer)  # the honest metadata loads


def test_metadata_taken_before_the_owner_registered_is_refused_and_fresh_metadata_loads(make_backend):
    """Vouching covers the whole region table: metadata from before a
    registration is refused with a word to fetch it again."""
    owner, b = make_backend("owner"), make_backend()
    bufs = [np.zeros(BLOCK, np.uint8) for _ in range(2)]
    owner.register(Descs.from_buffers(bufs[:1]))
    old = owner.local_metadata()
    owner.register(Descs.from_buffers(bufs[1:]))
    with pytest.raises(WireError, match="fetch it again"):
        b.add_remote(old)
    assert b.add_remote(owner.local_metadata()) == owner.agent_name
