"""kvt.memcopy: the native copy engine and its pure-Python fallback move the
same bytes, for scattered, uniform, merging and thread-split batches."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from threading import get_native_id as threading_native_id

import numpy as np
import pytest

from kvt import memcopy

ENGINES = ["python"] + (["native"] if memcopy._native is not None else [])
_ALWAYS_SPLIT = max(memcopy.SPLIT_BYTES, memcopy.WAKE_WORTH)  # split even when no request came just before


def _run(engine: str, dst, src, lengths, threads: int = 1, split: int = 0) -> None:
    if engine == "native":
        memcopy._native.copy(dst, src, lengths, threads, split)
    else:
        memcopy._copy_python(dst, src, lengths)


def test_native_engine_is_in_use_unless_disabled():
    """A build that silently lost the extension would pass every other test on the fallback."""
    if os.environ.get("KVT_NATIVE", "1") == "0":
        assert memcopy.ENGINE == "python" and "KVT_NATIVE=0" in memcopy.ENGINE_REASON
    else:
        assert memcopy.ENGINE == "native", memcopy.ENGINE_REASON


def _arena(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("block", [1, 100, 4096, 65536])
def test_scattered_blocks_land_where_the_rows_say(engine, block):
    nblocks = 64
    src, dst = _arena(nblocks * block, 1), np.zeros(nblocks * block, np.uint8)
    order = np.random.default_rng(2).permutation(nblocks)
    s = np.uint64(src.ctypes.data) + order.astype(np.uint64) * np.uint64(block)
    d = np.uint64(dst.ctypes.data) + np.arange(nblocks, dtype=np.uint64) * np.uint64(block)
    _run(engine, d, s, np.full(nblocks, block, np.uint64))
    assert np.array_equal(dst.reshape(nblocks, block), src.reshape(nblocks, block)[order])


@pytest.mark.parametrize("engine", ENGINES)
def test_uneven_lengths_and_contiguous_runs(engine):
    rng = np.random.default_rng(3)
    lengths = rng.integers(0, 40000, 300).astype(np.uint64)
    total = int(lengths.sum())
    src, dst = _arena(total, 4), np.zeros(total, np.uint8)
    offs = np.concatenate(([0], np.cumsum(lengths[:-1]))).astype(np.uint64)
    # the first half contiguous on both sides (merged into one run), the second reversed
    half = len(lengths) // 2
    order = np.concatenate([np.arange(half), np.arange(len(lengths) - 1, half - 1, -1)])
    d = np.uint64(dst.ctypes.data) + offs[order]
    s = np.uint64(src.ctypes.data) + offs[order]
    _run(engine, d, s, lengths[order])
    assert np.array_equal(dst, src)


@pytest.mark.skipif("native" not in ENGINES, reason="native engine not built")
@pytest.mark.parametrize("threads", [2, 3, 4])
def test_thread_split_copies_every_byte_once(threads):
    lengths = np.array([1, 300000, 5, 4096 * 33 + 7, 1 << 20, 12345], np.uint64)
    total = int(lengths.sum())
    src, dst = _arena(total, 5), np.zeros(total, np.uint8)
    offs = np.concatenate(([0], np.cumsum(lengths[:-1]))).astype(np.uint64)
    rev = np.arange(len(lengths))[::-1].copy()  # not contiguous: no merging
    d = np.uint64(dst.ctypes.data) + offs[rev]
    s = np.uint64(src.ctypes.data) + offs[rev]
    assert memcopy._native.copy(d, s, lengths[rev], threads, 0) == total
    assert np.array_equal(dst, src)


@pytest.mark.parametrize("engine", ENGINES)
def test_uniform_length_and_strided_columns(engine):
    """One int for uniform blocks; address columns of a row array need no copy."""
    src, dst = _arena(8 * 512, 6), np.zeros(8 * 512, np.uint8)
    rows = np.zeros((8, 3), np.uint64)
    rows[:, 0] = np.uint64(dst.ctypes.data) + np.arange(8, dtype=np.uint64)[::-1] * np.uint64(512)
    rows[:, 1] = np.uint64(src.ctypes.data) + np.arange(8, dtype=np.uint64) * np.uint64(512)
    _run(engine, rows[:, 0], rows[:, 1], 512)
    assert np.array_equal(dst.reshape(8, 512), src.reshape(8, 512)[::-1])


@pytest.mark.skipif("native" not in ENGINES, reason="native engine not built")
def test_native_rejects_wrong_arrays():
    a = np.zeros(4, np.uint64)
    with pytest.raises(TypeError, match="uint64"):
        memcopy._native.copy(np.zeros(4, np.float64), a, 0)
    with pytest.raises(TypeError, match="uint64"):
        memcopy._native.copy(np.zeros((2, 2), np.uint64), a, 0)
    with pytest.raises(ValueError, match="rows"):
        memcopy._native.copy(a, np.zeros(3, np.uint64), 0)
    with pytest.raises(ValueError, match="rows"):
        memcopy._native.copy(a, a, np.zeros(3, np.uint64))
    with pytest.raises(OverflowError):
        memcopy._native.copy(a, a, np.array([2**63, 2**63, 0, 0], np.uint64))
    assert memcopy._native.copy(a[:0], a[:0], 5) == 0


def test_gather_then_scatter_round_trips():
    src = _arena(10000, 7)
    base = np.uint64(src.ctypes.data)
    rows = np.array([[base + 10, 100], [base + 5000, 3000], [base, 7]], np.uint64)
    packed = memcopy.gather(rows)
    assert np.array_equal(packed, np.concatenate([src[10:110], src[5000:8000], src[:7]]))
    out = np.zeros(10000, np.uint8)
    obase = np.uint64(out.ctypes.data)
    memcopy.scatter(np.array([[obase + 10, 100], [obase + 5000, 3000], [obase, 7]], np.uint64), packed)
    assert np.array_equal(out[5000:8000], src[5000:8000]) and np.array_equal(out[:7], src[:7])
    with pytest.raises(BufferError):
        memcopy.scatter(rows, packed[:-1])
    buf = np.full(4000, 0xEE, np.uint8)  # a caller's staging buffer: filled from its start, the rest untouched
    assert np.array_equal(memcopy.gather(rows, buf), packed) and (buf[len(packed):] == 0xEE).all()
    for bad in (np.zeros(len(packed) - 1, np.uint8), np.zeros(4000, np.uint16), np.zeros((2, 4000), np.uint8)):
        with pytest.raises(BufferError):
            memcopy.gather(rows, bad)


# -- copy_indexed: a whole same-host request in one call -----------------------

def _indexed(engine: str, *args, **kw) -> int:
    if engine == "native":
        return memcopy._native.copy_indexed(*args, **kw)
    names = ("src_lengths", "max_bytes", "epoch", "seen", "pidfd", "lock", "alive", "tid")
    return memcopy._copy_indexed_python(*args[:5], *(kw.get(n, d) for n, d in
                                                     zip(names, (None, (1 << 64) - 1, 0, 0, -1, -1, 0, 0))))


def _tables(nblocks: int = 16, block: int = 256):
    src, dst = _arena(nblocks * block, 8), np.zeros(nblocks * block, np.uint8)
    steps = np.arange(nblocks, dtype=np.uint64) * np.uint64(block)
    return src, dst, np.uint64(src.ctypes.data) + steps, np.uint64(dst.ctypes.data) + steps


@pytest.mark.parametrize("engine", ENGINES)
def test_indexed_rows_come_from_the_tables(engine):
    src, dst, s, d = _tables()
    di, si = np.array([0, 1, 2, 9], np.int64), np.array([15, 3, 4, 0], np.int64)
    assert _indexed(engine, d, di, s, si, 256) == 4 * 256
    got, want = dst.reshape(16, 256), src.reshape(16, 256)
    assert np.array_equal(got[di], want[si]) and not got[3:9].any()
    lengths = np.full(16, 256, np.uint64)  # per-row lengths, checked pairwise against the source's
    assert _indexed(engine, d, di[:1], s, si[:1], lengths, src_lengths=lengths) == 256


@pytest.mark.parametrize("threads", [1, 2, memcopy.BACKGROUND_THREADS])
@pytest.mark.parametrize("shape", ["scattered", "one-run"])
def test_indexed_split_across_threads_lands_every_byte(threads, shape):
    """A request over the split size, cut into pieces the ``threads`` claim
    (the host backend's worker passes ``BACKGROUND_THREADS``, one fewer than
    the CPUs): scattered blocks, or blocks that merge into one run of many pieces."""
    block = 64 << 10
    n = _ALWAYS_SPLIT // block + 8  # over the split size, alone too
    src, dst, s, d = _tables(n, block)
    di = np.arange(n, dtype=np.int64)
    si = np.random.default_rng(3).permutation(n).astype(np.int64) if shape == "scattered" else di
    assert memcopy.copy_indexed(d, di, s, si, block, threads=threads) == n * block
    assert np.array_equal(dst.reshape(n, block), src.reshape(n, block)[si])


@pytest.mark.skipif(memcopy._native is None, reason="the copy helpers are the native engine's")
@pytest.mark.parametrize("spin_us", [0, 100, 5000])
def test_back_to_back_split_copies_land_every_byte(spin_us):
    """Bursts of requests one right after another, as an engine posts layer
    by layer: under ``WAKE_WORTH`` only these are split, and helpers watch
    for the next request (``KVT_COPY_SPIN_US``), or park at once (0), or
    time out between bursts.  Short scattered rows are claimed a chunk's
    worth at a time; a long run is cut into chunks; each request lands whole
    and nothing else is touched."""
    block, n = 16 << 10, 2 * memcopy.SPLIT_BYTES // (16 << 10) + 3
    src, _, s, _ = _tables(n, block)
    outs = [_tables(n, block)[1::2] for _ in range(8)]  # (dst, its address table) per request of a burst
    rng = np.random.default_rng(7)
    memcopy._native.set_spin(spin_us * 1000)
    try:
        for burst in range(40):
            reqs = []
            for dst, d in outs:
                dst[:] = 0
                k = int(rng.integers(memcopy.SPLIT_BYTES // block, n + 1))  # at least the split size
                di = np.sort(rng.choice(n, k, replace=False)).astype(np.int64)
                si = di if len(reqs) % 3 == 0 else rng.permutation(n)[:k].astype(np.int64)  # a run, or scattered
                reqs.append((dst, d, di, si))
            got = [memcopy.copy_indexed(d, di, s, si, block, threads=2) for _, d, di, si in reqs]  # back to back
            for (dst, _, di, si), moved in zip(reqs, got):
                assert moved == len(di) * block
                rows = dst.reshape(n, block)
                assert np.array_equal(rows[di], src.reshape(n, block)[si]), f"burst {burst}"
                assert not np.delete(rows, di, axis=0).any(), f"burst {burst} wrote outside its rows"
            if burst % 10 == 9:
                time.sleep(0.01)  # past any spin: the helpers park, and are woken for the next burst
    finally:
        memcopy._native.set_spin(int(memcopy.SPIN_US * 1000))


def test_split_copies_from_many_threads_at_once_land_every_byte():
    """Split requests posted from several threads at once (the GIL is
    released for each copy): the parked helpers serve one at a time, the
    others drain their pieces alone; each lands whole."""
    block, n = 64 << 10, _ALWAYS_SPLIT // (64 << 10) + 4
    jobs = [_tables(n, block) for _ in range(4)]
    perm = np.random.default_rng(5).permutation(n).astype(np.int64)
    di = np.arange(n, dtype=np.int64)

    def run(job):
        src, dst, s, d = job
        for _ in range(5):
            dst[:] = 0
            assert memcopy.copy_indexed(d, di, s, perm, block, threads=3) == n * block
            assert np.array_equal(dst.reshape(n, block), src.reshape(n, block)[perm])

    with ThreadPoolExecutor(4) as ex:
        for f in [ex.submit(run, job) for job in jobs]:
            f.result(timeout=60)


def test_split_copies_work_in_a_forked_child():
    """A child forked while the parent's copy helpers exist (even mid-copy)
    has none of them: its split copies start their own and land every byte."""
    block, n = 64 << 10, _ALWAYS_SPLIT // (64 << 10) + 4
    src, dst, s, d = _tables(n, block)
    di = np.arange(n, dtype=np.int64)
    perm = np.random.default_rng(6).permutation(n).astype(np.int64)
    assert memcopy.copy_indexed(d, di, s, perm, block, threads=2) == n * block  # helpers started here
    busy = _tables(n, block)
    with ThreadPoolExecutor(1) as ex:
        other = ex.submit(lambda: [memcopy.copy_indexed(busy[3], di, busy[2], perm, block, threads=2)
                                   for _ in range(20)])
        pid = os.fork()
        if pid == 0:
            ok = False
            try:
                dst[:] = 0
                ok = memcopy.copy_indexed(d, di, s, perm, block, threads=2) == n * block and \
                    np.array_equal(dst.reshape(n, block), src.reshape(n, block)[perm])
                if memcopy.ENGINE == "native":  # the child started a helper of its own
                    ok = ok and len(os.listdir("/proc/self/task")) >= 2
            finally:
                os._exit(0 if ok else 1)
        other.result(timeout=60)
    deadline = time.monotonic() + 30
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0:
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the forked child's split copy did not finish within 30 s")
        time.sleep(0.01)
    assert os.waitstatus_to_exitcode(done[1]) == 0


def _affinity(tid: int) -> set[int]:
    """A thread's CPUs; empty if it ended meanwhile (another test's threads may)."""
    try:
        return os.sched_getaffinity(tid)
    except ProcessLookupError:
        return set()


def _last_cpu() -> int:
    """The CPU this thread last ran on (field 39 of its stat)."""
    with open("/proc/thread-self/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[36])


@pytest.mark.skipif("native" not in ENGINES, reason="native engine not built")
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to keep the helpers apart")
def test_a_split_copys_helpers_are_kept_off_the_callers_cpu():
    """A VM's scheduler can wake a helper onto the caller's own CPU (the idle
    one looks busy to it), and the split copy then runs at one thread's
    speed: the helpers may run on every CPU the caller may, but the caller's."""
    block, n = 64 << 10, _ALWAYS_SPLIT // (64 << 10) + 4
    src, dst, s, d = _tables(n, block)
    di = np.arange(n, dtype=np.int64)
    allowed, me = os.sched_getaffinity(0), threading_native_id()
    seen = []
    for _ in range(20):  # the caller may move between the copy and the look; once in place is proof
        assert memcopy.copy_indexed(d, di, s, di, block, threads=2) == n * block
        cpu = _last_cpu()
        masks = {t: m for t in map(int, os.listdir("/proc/self/task")) if t != me and (m := _affinity(t))}
        if any(m == allowed - {cpu} for m in masks.values()):
            return
        seen.append((cpu, sorted(map(sorted, masks.values()))))
    pytest.fail(f"no thread of this process is kept off the caller's CPU: (caller's CPU, masks) {seen[:3]}")


@pytest.mark.parametrize("engine", ENGINES)
def test_split_copy_of_one_long_odd_row(engine):
    """One row longer than the split size and no multiple of a page."""
    nbytes = _ALWAYS_SPLIT + (3 << 20) + 123
    src, dst = _arena(nbytes, 9), np.zeros(nbytes, np.uint8)
    one = lambda a: np.array([a.ctypes.data], np.uint64)  # noqa: E731
    if engine == "native":
        memcopy._native.copy(one(dst), one(src), nbytes, 2, _ALWAYS_SPLIT)
    else:
        memcopy._copy_python(one(dst), one(src), nbytes)
    assert np.array_equal(dst, src)


@pytest.mark.skipif(memcopy._native is None, reason="streaming stores are the native engine's")
@pytest.mark.parametrize("threads", [1, 2])
def test_streamed_copies_land_every_byte(threads):
    """Non-temporal stores (every request streamed here): rows of odd lengths at
    odd offsets on both sides land whole, and a row overlapping itself still
    copies like memmove."""
    rng = np.random.default_rng(11)
    lengths = rng.integers(1, 200_000, 64).astype(np.uint64)
    lengths[:4] = [1, 4095, 4096 + 63, _ALWAYS_SPLIT + 7 if threads > 1 else 3 << 20]  # the split one copies in pieces
    total = int(lengths.sum())
    src, dst = _arena(total + 64, 12), np.zeros(total + 64, np.uint8)
    offs = np.concatenate(([0], np.cumsum(lengths[:-1]))).astype(np.uint64)
    rev = np.arange(len(lengths))[::-1].copy()  # not contiguous: every row its own run
    d = np.uint64(dst.ctypes.data + 5) + offs[rev]
    s = np.uint64(src.ctypes.data + 9) + offs[rev]
    overlap = _arena(1 << 20, 13)
    want = overlap.copy()
    want[100:100 + 900_000] = overlap[:900_000]
    memcopy._native.set_stream(1)
    try:
        assert memcopy._native.copy(d, s, lengths[rev], threads, 0) == total
        o = np.uint64(overlap.ctypes.data)
        memcopy._native.copy(np.array([o + np.uint64(100)]), np.array([o]), 900_000)
    finally:
        memcopy._native.set_stream(memcopy.STREAM_BYTES)
    assert np.array_equal(dst[5:5 + total], src[9:9 + total])
    assert not dst[:5].any() and not dst[5 + total:].any()
    assert np.array_equal(overlap, want)


def test_background_copies_leave_the_posting_thread_a_cpu():
    assert 1 <= memcopy.BACKGROUND_THREADS <= memcopy.THREADS
    if (os.cpu_count() or 1) > 1 and memcopy.THREADS > 1:
        assert memcopy.BACKGROUND_THREADS < len(os.sched_getaffinity(0))


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("bad", ["past-end", "negative", "src-past-end", "pair-lengths", "counts"])
def test_indexed_refuses_before_any_byte_moves(engine, bad):
    """A bad request is refused whole: the good pairs before the bad one are not copied either."""
    src, dst, s, d = _tables()
    di, si = np.array([0, 1, 2], np.int64), np.array([3, 4, 5], np.int64)
    lengths, slen = 256, None
    if bad == "past-end":
        di[2] = 16
    elif bad == "negative":
        di[2] = -1
    elif bad == "src-past-end":
        si[2] = 1 << 40
    elif bad == "pair-lengths":
        lengths, slen = np.full(16, 256, np.uint64), np.full(16, 256, np.uint64)
        slen[5] = 128
    else:
        si = si[:2]
    with pytest.raises((IndexError, ValueError)):
        _indexed(engine, d, di, s, si, lengths, src_lengths=slen)
    assert not dst.any()


@pytest.mark.parametrize("engine", ENGINES)
def test_indexed_guards(engine):
    """A moved epoch word: nothing copied (STALE); too many bytes: nothing
    copied (TOO_BIG); an exited process's pidfd: copied but DEAD."""
    src, dst, s, d = _tables()
    one = np.array([0], np.int64)
    word = np.array([7], np.uint64)
    assert _indexed(engine, d, one, s, one, 256, epoch=word.ctypes.data, seen=6) == memcopy.STALE
    assert _indexed(engine, d, one, s, one, 256, max_bytes=255) == memcopy.TOO_BIG
    assert not dst.any()
    assert _indexed(engine, d, one, s, one, 256, epoch=word.ctypes.data, seen=7) == 256
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    fd = os.pidfd_open(pid)
    try:
        os.waitpid(pid, 0)
        assert _indexed(engine, d, one, s, one, 256, pidfd=fd) == memcopy.DEAD
    finally:
        os.close(fd)
    me = os.pidfd_open(os.getpid())
    try:
        assert _indexed(engine, d, one, s, one, 256, pidfd=me) == 256
        # a liveness word replaces the pidfd: it must hold the owner's keeper's id after the copy
        # (the kernel clears the id bits and sets OWNER_DIED when the keeper dies)
        live = np.array([4321], np.uint32)
        assert _indexed(engine, d, one, s, one, 256, alive=live.ctypes.data, tid=4321, pidfd=fd) == 256
        for word in (4322, 0x40000000, 0):
            live[0] = word
            assert _indexed(engine, d, one, s, one, 256, alive=live.ctypes.data, tid=4321, pidfd=me) == memcopy.DEAD
        live[0] = 0x80000000 | 4321  # FUTEX_WAITERS: not an id bit
        assert _indexed(engine, d, one, s, one, 256, alive=live.ctypes.data, tid=4321) == 256
    finally:
        os.close(me)


@pytest.mark.skipif(memcopy._native is None, reason="the call's two parsers are the native engine's")
def test_indexed_positional_call_means_what_the_keywords_say():
    """The host backend's call (all 15 arguments by position, exact ints)
    takes a parser of its own: every argument must land where the keyword
    call puts it, and whatever that parser declines (an out-of-range or
    non-int argument, an int subclass) must get the general parser's answer."""
    assert memcopy.copy_indexed is memcopy._native.copy_indexed
    src, dst, s, d = _tables()
    one, two = np.array([0], np.int64), np.array([1], np.int64)
    word = np.array([7], np.uint64)
    names = ("max_bytes", "epoch", "seen", "pidfd", "threads", "lock", "slot", "alive", "tid")
    base = dict(zip(names, ((1 << 64) - 1, word.ctypes.data, 7, -1, 1, -1, 0, 0, 0)))
    cases = [{}, {"seen": 6}, {"max_bytes": 255}, {"max_bytes": -1}, {"epoch": 0, "seen": 99},
             {"alive": word.ctypes.data, "tid": 7}, {"alive": word.ctypes.data, "tid": 8}]
    for change in cases:
        kw = {**base, **change}
        by_name = memcopy.copy_indexed(d, one, s, two, 256, None, **kw)
        by_position = memcopy.copy_indexed(d, one, s, two, 256, None, *(kw[n] for n in names))
        assert by_position == by_name, change
    assert [memcopy.copy_indexed(d, one, s, two, 256, None, *(base | c).values()) for c in cases] == \
        [256, memcopy.STALE, memcopy.TOO_BIG, 256, 256, 256, memcopy.DEAD]
    assert memcopy.copy_indexed(d, one, s, two, 256, None, *{**base, "threads": True}.values()) == 256
    for bad, exc in (({"pidfd": 1 << 40}, OverflowError), ({"threads": 1.0}, TypeError), ({"lock": "3"}, TypeError),
                     ({"seen": None}, TypeError)):
        with pytest.raises(exc):
            memcopy.copy_indexed(d, one, s, two, 256, None, *(base | bad).values())


@pytest.mark.skipif(memcopy._native is None, reason="guard slots need the native engine")
def test_indexed_counts_the_copy_in_its_guard_slot():
    """``slot``: raised before the epoch check and lowered after the last
    check, whatever the outcome; the pure-Python engine refuses one."""
    src, dst, s, d = _tables()
    one = np.array([0], np.int64)
    word, slot = np.array([7], np.uint64), np.array([5], np.uint64)  # 5: other copies under way
    for seen, want in ((7, 256), (6, memcopy.STALE)):
        assert memcopy.copy_indexed(d, one, s, one, 256, epoch=word.ctypes.data, seen=seen,
                                    slot=slot.ctypes.data) == want
        assert slot[0] == 5
    # held for the copy's duration: seen from another thread while the GIL is released
    size = 256 << 20
    big_src, big_dst = np.full(size, 9, np.uint8), np.zeros(size, np.uint8)
    bs, bd = np.array([big_src.ctypes.data], np.uint64), np.array([big_dst.ctypes.data], np.uint64)
    seen_raised = []
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(memcopy.copy_indexed, bd, one, bs, one, size, slot=slot.ctypes.data, threads=1)
        deadline = time.monotonic() + 30
        while not fut.done() and time.monotonic() < deadline:
            seen_raised.append(int(slot[0]))
        assert fut.result() == size
    assert 6 in seen_raised and slot[0] == 5
    with pytest.raises(ValueError, match="native"):  # the pure-Python engine
        memcopy._py_copy_indexed(d, one, s, one, 256, slot=slot.ctypes.data)


# probes the lock as the owner's drain does, until it finds it held (exit 0)
_DRAINER = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDONLY)
print("ready", flush=True)
while True:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        sys.exit(0)
    fcntl.flock(fd, fcntl.LOCK_UN)
    time.sleep(0.0005)
"""


@pytest.mark.parametrize("engine", ENGINES)
def test_indexed_holds_the_lock_shared_for_the_copy_alone(engine, tmp_path):
    """``lock``: the owner's drain (an exclusive ``flock``) waits for the
    copy; while the owner holds it, nothing is copied (STALE); after the
    call the lock is free again, whatever the outcome."""
    src, dst, s, d = _tables()
    one = np.array([0], np.int64)
    path = tmp_path / "epoch"
    path.write_bytes(b"")
    mine, owner = os.open(path, os.O_RDONLY), os.open(path, os.O_RDONLY)  # two open files: two lock holders
    try:
        fcntl.flock(owner, fcntl.LOCK_EX)
        assert _indexed(engine, d, one, s, one, 256, lock=mine) == memcopy.STALE
        assert not dst.any()
        fcntl.flock(owner, fcntl.LOCK_UN)
        word = np.array([7], np.uint64)
        for seen, want in ((7, 256), (6, memcopy.STALE)):
            assert _indexed(engine, d, one, s, one, 256, epoch=word.ctypes.data, seen=seen, lock=mine) == want
            fcntl.flock(owner, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released: this does not block
            fcntl.flock(owner, fcntl.LOCK_UN)
        # held for the copy's duration: a drain tried meanwhile, by another process (no GIL in
        # between), finds it taken
        size = 256 << 20
        big_src, big_dst = np.full(size, 9, np.uint8), np.zeros(size, np.uint8)
        bs, bd = np.array([big_src.ctypes.data], np.uint64), np.array([big_dst.ctypes.data], np.uint64)
        with subprocess.Popen([sys.executable, "-c", _DRAINER, str(path)], stdout=subprocess.PIPE) as drainer:
            try:
                assert drainer.stdout.readline() == b"ready\n"
                for _ in range(100):
                    if drainer.poll() is not None:
                        break
                    assert _indexed(engine, bd, one, bs, one, size, lock=mine) in (size, memcopy.STALE)
            finally:
                if drainer.poll() is None:
                    drainer.kill()
            assert drainer.wait(10) == 0, "an exclusive flock never found the copy's shared lock held"
    finally:
        os.close(mine)
        os.close(owner)
