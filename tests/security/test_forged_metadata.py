"""Forged metadata must not turn a host agent's same-host paths (shm, cma)
against memory nobody shared, nor kill it; peer layouts are bounded."""

from __future__ import annotations

import multiprocessing as mp
import os

import msgspec
import numpy as np
import pytest
from kvt.agent import fetch_info
from kvt.errors import WireError
from kvt.procs import host_id, start_time
from kvt.types import Descs, Op
from kvt.wire import AgentInfo, decode, encode
from kvt_host.backend import HostBackend
from kvt_host.protocol import HostMetadata
from owner import REGION, owner_process


def _settle(b, h, timeout=20):
    from kvt.agent import poll_until

    def settled():
        s = b.check_state(h)
        return None if s.pending else s
    return poll_until(settled, timeout, "transfer")


def test_metadata_claiming_our_own_process_is_refused():
    """Used to make our READ copy our own unregistered memory into a KV block."""
    secret = np.full(4096, 0x5E, np.uint8)  # never registered
    with HostBackend("victim", {"timeout": 5}) as b:
        pid = os.getpid()
        forged = encode(HostMetadata(name="evil", endpoint="tcp://127.0.0.1:9", host_id=host_id(), pid=pid,
                                     start_time=start_time(pid),
                                     regions={"DRAM": np.array([[secret.ctypes.data, 4096, 0]], np.uint64).tobytes()}))
        with pytest.raises(WireError, match="this very process"):
            b.add_remote(forged)


@pytest.mark.parametrize("transport", ["auto", "cma"])
def test_metadata_naming_one_of_our_threads_is_not_taken_for_another_process(transport):
    """``/proc/<tid>`` answers for every thread, and cma or ``/proc/<tid>/fd``
    on a thread id act on its whole process: metadata naming one of our
    threads (with that thread's own start time and our epoch page) passed
    for another process, and our READ then copied our own unregistered
    memory into a registered block, our WRITE overwrote it."""
    secret = np.full(4096, 0x5E, np.uint8)  # never registered
    with HostBackend("victim", {"timeout": 1, "transport": transport}) as b:
        local = np.zeros(4096, np.uint8)
        b.register(local)
        mine = decode(b.local_metadata(), HostMetadata)
        tid = b._server._thread.native_id
        assert tid != os.getpid()
        with open(f"/proc/{tid}/stat") as f:  # the thread's own start time, as a forger reads it
            started = int(f.read().rsplit(")", 1)[1].split()[19])
        forged = encode(HostMetadata(name="evil", endpoint="tcp://127.0.0.1:9", host_id=host_id(), pid=tid,
                                     start_time=started, epoch_fd=mine.epoch_fd, epoch=mine.epoch,
                                     regions={"DRAM": np.array([[secret.ctypes.data, 4096, 0]], np.uint64).tobytes()}))
        try:
            name = b.add_remote(forged)
        except WireError:
            return
        lp, rp = b.prep(None, Descs([(local.ctypes.data, 4096, 0)])), b.prep(name, Descs([(secret.ctypes.data, 4096, 0)]))
        _settle(b, b.transfer(Op.READ, lp, None, rp, None))
        assert not (local == 0x5E).any(), "a READ copied this process's unregistered memory"
        local[:] = 0x11
        _settle(b, b.transfer(Op.WRITE, lp, None, rp, None))
        assert (secret == 0x5E).all(), "a WRITE overwrote this process's unregistered memory"


@pytest.mark.parametrize("rows", ["too many", "one fd twice"])
def test_a_segment_table_past_the_limit_or_naming_one_fd_twice_is_refused(rows):
    """Each segment row is one mapping here: 70,000 rows naming one real
    segment under as many addresses mapped it 65,000 times (the process's
    limit), left every mapping behind and failed with numpy's MemoryError."""
    from kvt_host.protocol import MAX_SEGMENTS
    n = MAX_SEGMENTS + 1 if rows == "too many" else 2
    segs = np.zeros((n, 3), np.uint64)
    segs[:, 0] = (np.arange(n, dtype=np.uint64) + 1) << np.uint64(24)  # distinct bases, 16 MiB apart
    segs[:, 1] = 1 << 20
    segs[:, 2] = np.arange(n) + 3 if rows == "too many" else 3
    with HostBackend("victim", {"timeout": 1}) as b:
        pid = os.getpid()
        md = HostMetadata(name="evil", endpoint="tcp://127.0.0.1:9", host_id="elsewhere", pid=pid,
                          start_time=start_time(pid), segments=segs.tobytes(),
                          regions={"DRAM": np.array([[1 << 24, 4096, 0]], np.uint64).tobytes()})
        with pytest.raises(WireError, match="segment"):
            b.add_remote(encode(md))


def _victim(md_bytes, write, q):
    """In its own process: a SIGBUS (or any crash) shows as its exit code."""
    from kvt_host.backend import HostBackend
    local = np.full(REGION, 0x42, np.uint8)
    with HostBackend("victim", {"timeout": 5}) as b:
        b.register(local)
        name = b.add_remote(md_bytes)
        md = decode(md_bytes, HostMetadata)
        rows = np.frombuffer(md.regions["DRAM"], np.uint64).reshape(-1, 3)
        lp = b.prep(None, Descs([(local.ctypes.data, REGION, 0)]))
        rp = b.prep(name, Descs([(int(rows[0, 0]), REGION, 0)]))
        h = b.transfer(Op.WRITE if write else Op.READ, lp, None, rp, None)
        q.put(repr(_settle(b, h)))


def _run_victim(md_bytes, write):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_victim, args=(md_bytes, write, q))
    p.start()
    p.join(60)
    if p.is_alive():
        p.kill()
    assert p.exitcode == 0, f"the victim died with exit code {p.exitcode}"
    return q.get(timeout=5)


@pytest.fixture(scope="module")
def owner():
    with owner_process({"timeout": 5}) as o:
        o.md = decode(fetch_info(o.endpoint, "t", 10).metadata, HostMetadata)
        yield o


def test_segment_bigger_than_its_file_does_not_kill_the_victim(owner):
    """A segment advertised 64x larger than it is used to SIGBUS the peer."""
    segs = np.frombuffer(owner.md.segments, np.uint64).reshape(-1, 3).copy()
    assert len(segs)
    segs[:, 1] *= 64
    # the claimed region reaches past the segment's end; the victim reads there
    past = int(segs[0, 0]) + (int(segs[0, 1]) // 64 + REGION)
    forged = msgspec.structs.replace(owner.md, segments=segs.tobytes(), regions={
        "DRAM": np.array([[past, REGION, 0]], np.uint64).tobytes()})
    state = _run_victim(encode(forged), write=False)
    assert "DONE" in state or "ERR" in state
    assert owner.ask("check") == (True, True)


def test_segment_naming_a_plain_file_is_not_mapped(owner):
    """fd numbers in metadata used to be opened as /proc/<pid>/fd/N whatever
    they were: a WRITE then landed in a file the owner never shared."""
    forged = msgspec.structs.replace(owner.md, segments=np.array(
        [[owner.base, REGION, owner.secret_fd]], np.uint64).tobytes())
    state = _run_victim(encode(forged), write=True)
    assert "DONE" in state  # by cma into the registered region instead
    assert owner.ask("secret") == b"S" * REGION
    assert owner.ask("check")[0]  # guards intact (the region itself was legitimately written)


@pytest.mark.parametrize("blocks,bases", [(2**26, 64), (2**40, 1), (17, 2**20), (2**40, 0), (2**64 - 1, 0)])
def test_peer_layout_is_bounded_before_use(blocks, bases):
    """num_blocks = 2**26 used to cost the victim GiBs when its descriptors were built;
    with no regions any num_blocks passed the row limit (0 rows), and the first
    transfer sized an array by it (fuzzing found 2**64 - 1)."""
    raw = msgspec.msgpack.encode({"v": 1, "t": "agent_info", "name": "p", "backend": "host", "metadata": b"",
                                  "layouts": {"kv": {"base_addrs": [4096] * bases, "block_len": 4096,
                                                     "num_blocks": blocks, "stride": 4096}}})
    with pytest.raises(WireError, match="limit"):
        decode(raw, AgentInfo)


@pytest.mark.parametrize("bad", [dict(block_len=0), dict(stride=-1), dict(num_blocks=-1), dict(kind="HBM"),
                                 dict(base_addrs=[2**64 - 4096], num_blocks=2), dict(base_addrs=[-1])])
def test_peer_layout_fields_are_validated(bad):
    fields = dict(base_addrs=[4096], block_len=4096, num_blocks=4, stride=4096) | bad
    raw = msgspec.msgpack.encode({"v": 1, "t": "agent_info", "name": "p", "backend": "host", "metadata": b"",
                                  "layouts": {"kv": fields}})
    with pytest.raises(WireError):
        decode(raw, AgentInfo)


@pytest.mark.parametrize("field,value", [("regions", {"DRAM": (np.array([[2**64 - 4096, 4096, 0]], np.uint64)).tobytes()}),
                                         ("regions", {"DRAM": b"\0" * 24}), ("regions", {"HBM": b""}),
                                         ("segments", b"\1" * 23), ("endpoint", "ipc:///tmp/x"),
                                         ("name", "n" * 1000), ("pid", 0), ("pid", 2**40)])
def test_bad_host_metadata_is_a_wire_error(owner, field, value):
    with HostBackend("victim", {"timeout": 5}) as b:
        with pytest.raises(WireError):
            b.add_remote(encode(msgspec.structs.replace(owner.md, **{field: value})))


def test_a_segment_not_sealed_against_shrinking_is_not_mapped():
    """A same-user process could hand us a kvt-named memfd and shrink it
    after we mapped it: the next copy from it died of SIGBUS.  Only a
    segment sealed against shrinking (as kvt.memory makes them) is mapped."""
    import errno
    import fcntl

    from kvt_host import memops

    fd = os.memfd_create("kvt-forged", os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, 1 << 16)
        with pytest.raises(OSError) as e:
            memops.mmap_fd(f"/proc/self/fd/{fd}", 1 << 16)
        assert e.value.errno == errno.EACCES
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
        addr, size = memops.mmap_fd(f"/proc/self/fd/{fd}", 1 << 16)
        memops.munmap(addr, size)
    finally:
        os.close(fd)


@pytest.mark.parametrize("op", [Op.READ, Op.WRITE])
@pytest.mark.parametrize("transport", ["auto", "cma"])
def test_metadata_widening_a_same_host_owners_regions_moves_nothing_outside_them(owner, transport, op):
    """Anyone can fetch a same-host owner's metadata; widened to cover the
    owner's unregistered guard zones and handed to a victim under another
    name (say through ``kv_transfer_params``), it made the victim's shm and
    cma paths, which ask the owner nothing, READ and WRITE those guards.  The
    owner's epoch page now vouches for its real tables: the victim takes the
    owner's server, which refuses the rows.  Honest metadata keeps the
    direct paths."""
    from kvt.errors import RemoteRejected
    from owner import GUARD
    lo = owner.base - GUARD
    forged = msgspec.structs.replace(owner.md, name="evil", regions={
        "DRAM": np.array([[lo, GUARD + REGION + GUARD, 0]], np.uint64).tobytes()})
    local = np.full(GUARD, 0x66, np.uint8)
    with HostBackend("victim", {"timeout": 5, "transport": transport}) as b:
        b.register(local)
        honest = b.add_remote(encode(msgspec.structs.replace(owner.md, name="honest")))
        assert b._peers[honest].same_host, "honest metadata of a same-host owner lost the direct paths"
        name = b.add_remote(encode(forged))
        lp, rp = b.prep(None, Descs([(local.ctypes.data, GUARD, 0)])), b.prep(name, Descs([(lo, GUARD, 0)]))
        state = _settle(b, b.transfer(op, lp, None, rp, None))
        assert state.failed and isinstance(state.cause, RemoteRejected), state
    assert (local == 0x66).all(), "a READ brought the owner's unregistered memory"
    assert owner.ask("check")[0], "a WRITE landed outside what the owner registered"
